"""What ``super()`` runs in a worker: ``transformers.Trainer``'s ``compute_loss``, ``training_step`` and
``prediction_step`` on a worker-side instance of the script's Trainer class (``trainer.subclass``), and its
``accelerator``.

- ``default_compute_loss``: the forward (with ``num_items_in_batch`` when the model accepts loss kwargs),
  ``compute_loss_func(outputs, labels, num_items_in_batch)`` or the label smoother on the popped labels, else
  the forward's loss; multiplied by the world size when it was normalised by the step's items over every rank
  (Trainer's ``average_tokens_across_devices``), so the engines' average over ranks gives the mean.
- ``default_training_step``: ``compute_loss``, divided by the accumulation steps unless already normalised
  by the step's items (``loss_is_scaled_for_ga``), ``accelerator.backward(loss)``; returns the detached loss.
- ``default_prediction_step``: labels taken first (``label_names``), ``compute_loss(return_outputs=True)``
  without gradients with the batch's items over every rank (counted by ``step.trainer_methods`` when the
  training step counts them, as Trainer 5), or the bare forward without labels; the outputs other than the
  loss and ``ignore_keys`` are the logits.

``WorkerAccelerator.backward`` backpropagates through the loop (``step.trainer_methods``): the gradients are
those of the loss handed to it, as ``Accelerator.backward``'s.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from trainbridge.step.model_loss import inference_ignore_keys, loss_of


class WorkerAccelerator:
    """``trainer.accelerator`` in a worker: what Trainer's methods and a typical override call on it."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self.backward_fn: Callable[[torch.Tensor], None] | None = None
        """The current micro-batch's backward (set by ``ScriptTrainer.training_step``)."""

    @property
    def num_processes(self) -> int:
        return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1

    @property
    def process_index(self) -> int:
        return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return int(os.environ.get("LOCAL_RANK", "0")) == 0

    @property
    def device(self) -> torch.device:
        return next(self._model.parameters()).device

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backpropagate ``loss`` as ``Accelerator.backward`` (within a training step: the loop's backward, with
        its gradient synchronisation and events)."""
        if self.backward_fn is None:
            raise RuntimeError("accelerator.backward is called from training_step, inside train()")
        self.backward_fn(loss)

    def unwrap_model(self, model: Any, keep_fp32_wrapper: bool = True) -> Any:
        """The model inside DDP / DeepSpeed / torch.compile wrappers."""
        while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
            model = model.module
        return getattr(model, "_orig_mod", model)

    def gather(self, tensor: Any) -> Any:
        """Every rank's ``tensor`` concatenated along the first dimension (a scalar becomes one row), in rank
        order (collective), as ``Accelerator.gather``."""
        if isinstance(tensor, Mapping):
            return {k: self.gather(v) for k, v in tensor.items()}
        if isinstance(tensor, list | tuple):
            return type(tensor)(self.gather(v) for v in tensor)
        rows = tensor.reshape(1) if tensor.dim() == 0 else tensor
        if self.num_processes == 1:
            return rows
        parts = [torch.empty_like(rows) for _ in range(self.num_processes)]
        torch.distributed.all_gather(parts, rows.contiguous())
        return torch.cat(parts)

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_local_main_process:
            print(*args, **kwargs)


def default_compute_loss(
    trainer: Any, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
) -> Any:
    """``Trainer.compute_loss`` on a worker-side instance (see the module doc)."""
    compute_loss_func = getattr(trainer, "compute_loss_func", None)
    smoother = getattr(trainer, "label_smoother", None)
    labels = (
        inputs.pop("labels") if (smoother is not None or compute_loss_func is not None) and "labels" in inputs else None
    )
    accepts = bool(getattr(trainer, "model_accepts_loss_kwargs", False))
    if accepts and num_items_in_batch is not None:
        inputs = {**inputs, "num_items_in_batch": num_items_in_batch}
    outputs = model(**inputs)
    if compute_loss_func is not None:
        loss = compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
    elif labels is not None and smoother is not None:
        from trainbridge.modeling.load import is_causal_lm

        shift = is_causal_lm(trainer.accelerator.unwrap_model(model))
        loss = smoother(outputs, labels, shift_labels=shift, num_items_in_batch=num_items_in_batch)
    else:
        loss = loss_of(outputs)
    if (accepts or compute_loss_func is not None) and num_items_in_batch is not None:
        loss = loss * trainer.accelerator.num_processes  # the items are the whole step's, every rank's
    return (loss, outputs) if return_outputs else loss


def default_training_step(trainer: Any, model: Any, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Any:
    """``Trainer.training_step`` on a worker-side instance (see the module doc)."""
    model.train()
    loss = trainer.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is None:
        scaled = (getattr(trainer, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None) or getattr(
            trainer, "compute_loss_func", None
        ) is not None
    if not scaled:
        loss = loss / trainer.current_gradient_accumulation_steps
    trainer.accelerator.backward(loss)
    return loss.detach()


def default_prediction_step(
    trainer: Any, model: Any, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys: list[str] | None = None
) -> tuple[Any, Any, Any]:
    """``Trainer.prediction_step`` on a worker-side instance (see the module doc)."""
    label_names = list(getattr(trainer, "label_names", None) or [])
    has_labels = bool(label_names) and all(inputs.get(k) is not None for k in label_names)
    return_loss = inputs.get("return_loss")
    if return_loss is None:
        return_loss = bool(getattr(trainer, "can_return_loss", False))
    loss_without_labels = not label_names and return_loss
    if ignore_keys is None:
        ignore_keys = inference_ignore_keys(getattr(trainer.model, "config", None))
    labels: Any = None
    if has_labels or loss_without_labels:
        values = tuple(_detach(inputs.get(name)) for name in label_names)
        labels = values[0] if len(values) == 1 else values
    with torch.no_grad():
        if has_labels or loss_without_labels:
            items = trainer.__dict__.get("_eval_num_items")  # the batch's items over every rank, as Trainer counts
            loss, outputs = trainer.compute_loss(model, inputs, return_outputs=True, num_items_in_batch=items)
            loss = loss.detach().mean()
            dropped = [*ignore_keys, "loss"]
        else:
            loss, outputs, dropped = None, model(**inputs), list(ignore_keys)
    if prediction_loss_only:
        return loss, None, None
    if isinstance(outputs, Mapping):
        logits = tuple(_detach(v) for k, v in outputs.items() if k not in dropped)
    else:
        logits = tuple(_detach(v) for v in (outputs[1:] if "loss" in dropped else outputs))
    return loss, logits[0] if len(logits) == 1 else logits, labels


def _detach(value: Any) -> Any:
    """``nested_detach``: tensors detached, inside tuples and lists too."""
    if isinstance(value, list | tuple):
        return type(value)(_detach(v) for v in value)
    return value.detach() if isinstance(value, torch.Tensor) else value
