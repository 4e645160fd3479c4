"""A Trainer subclass's ``compute_loss`` (and ``compute_loss_func``) run in the workers, on the real model
and batches.

``subclass_loss(trainer)`` is the ``TrainingArgs.compute_loss`` of a facade job: a picklable ``SubclassLoss``
holding the script's Trainer class (sent by value when the script defines it, as callbacks travel) and what
a typical override reads.  In each worker it builds, once, an instance of that class without running its
``__init__`` and calls its ``compute_loss(model, inputs, return_outputs=..., num_items_in_batch=...)``.  The
instance has ``args`` (the script's ``TrainingArguments``), ``model`` (the unwrapped model), ``state``,
``processing_class``, ``compute_loss_func``, ``label_smoother``, ``model_accepts_loss_kwargs`` and
``accelerator`` (``gather``, ``unwrap_model``, ``is_main_process``, ``num_processes``, ``device``).

``default_compute_loss`` is ``Trainer.compute_loss`` (what ``super().compute_loss`` runs): the forward with
``num_items_in_batch`` when the model accepts loss kwargs, ``compute_loss_func(outputs, labels,
num_items_in_batch)`` or the label smoother on the popped labels, else the forward's loss.  Unlike Trainer it
never multiplies by the world size: the loop itself normalises by the step's items over every rank.

Overrides of the methods in ``UNHONOURED`` are refused at construction (``unhonoured_overrides``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

UNHONOURED = (
    "training_step",
    "prediction_step",
    "evaluate",
    "evaluation_loop",
    "log",
    "create_optimizer_and_scheduler",
    "get_eval_dataloader",
    "get_test_dataloader",
    "_get_eval_sampler",
    "_save",
    "_save_checkpoint",
    "save_model",
    "_maybe_log_save_evaluate",
    "_inner_training_loop",
    "_prepare_inputs",
    "get_batch_samples",
    "compute_loss_context_manager",
    "_load_from_checkpoint",
    "_load_best_model",
    "_wrap_model",
)
"""Trainer methods that Trainer calls during training and trainbridge's loop does not: overriding one in a
script's subclass is refused at construction, naming it."""


def unhonoured_overrides(cls: type) -> list[str]:
    """The methods of ``UNHONOURED`` that a class of the script's (not trainbridge's own) defines."""
    found = []
    for klass in cls.__mro__:
        if klass.__module__.startswith("trainbridge.") or klass is object:
            break
        found += [name for name in UNHONOURED if name in vars(klass) and name not in found]
    return found


def overrides(cls: type, names: tuple[str, ...]) -> bool:
    """Whether a class of the script's (not trainbridge's own) defines one of ``names``."""
    for klass in cls.__mro__:
        if klass.__module__.startswith("trainbridge.") or klass is object:
            return False
        if any(name in vars(klass) for name in names):
            return True
    return False


def overrides_compute_loss(cls: type) -> bool:
    """Whether a class of the script's (not trainbridge's own) defines ``compute_loss``."""
    for klass in cls.__mro__:
        if klass.__module__.startswith("trainbridge.") or klass is object:
            return False
        if "compute_loss" in vars(klass):
            return True
    return False


class WorkerAccelerator:
    """``trainer.accelerator`` in a worker: what a loss override calls on it."""

    def __init__(self, model: Any) -> None:
        self._model = model

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


class SubclassLoss:
    """``TrainingArgs.compute_loss`` for a Trainer subclass or ``compute_loss_func`` (see the module doc)."""

    def __init__(self, trainer_cls: type, args: Any, processing_class: Any, compute_loss_func: Any) -> None:
        self.trainer_cls = trainer_cls
        self.args = args
        self.processing_class = processing_class
        self.compute_loss_func = compute_loss_func
        self._instance: Any = None

    @property
    def counts_items(self) -> bool:
        """Whether the step counts ``num_items_in_batch`` whatever the model: Trainer passes it to a
        ``compute_loss_func``, whose loss is then a mean over those items."""
        return self.compute_loss_func is not None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_instance": None}

    def trainer(self, model: Any) -> Any:
        """This worker's instance of the script's Trainer class (built once; ``__init__`` not run)."""
        if self._instance is None:
            from transformers import TrainerState
            from transformers.trainer_pt_utils import LabelSmoother

            instance: Any = object.__new__(self.trainer_cls)
            accelerator = WorkerAccelerator(model)
            smoothing = float(getattr(self.args, "label_smoothing_factor", 0.0) or 0.0)
            inner = accelerator.unwrap_model(model)
            from trainbridge.step.model_loss import accepts_loss_kwargs

            instance.__dict__.update(
                args=self.args,
                model=inner,
                state=TrainerState(),
                processing_class=self.processing_class,
                compute_loss_func=self.compute_loss_func,
                model_accepts_loss_kwargs=accepts_loss_kwargs(inner),
                label_smoother=LabelSmoother(epsilon=smoothing) if smoothing else None,
                _worker_accelerator=accelerator,
                _env=None,
                callbacks=[],
                model_init=None,
            )
            self._instance = instance
        return self._instance

    def __call__(
        self, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        return self.trainer(model).compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )


def subclass_loss(trainer: Any) -> SubclassLoss | None:
    """The ``compute_loss`` of ``trainer``'s jobs: a ``SubclassLoss`` when its class overrides ``compute_loss``
    or it has a ``compute_loss_func``, else None (the model's own loss, or the token step)."""
    if not overrides_compute_loss(type(trainer)) and trainer.compute_loss_func is None:
        return None
    return SubclassLoss(type(trainer), trainer.args, trainer.processing_class, trainer.compute_loss_func)


def default_compute_loss(
    trainer: Any, model: Any, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
) -> Any:
    """``Trainer.compute_loss`` on a worker-side instance (see the module doc)."""
    from trainbridge.step.model_loss import loss_of

    compute_loss_func = getattr(trainer, "compute_loss_func", None)
    smoother = getattr(trainer, "label_smoother", None)
    labels = (
        inputs.pop("labels") if (smoother is not None or compute_loss_func is not None) and "labels" in inputs else None
    )
    if getattr(trainer, "model_accepts_loss_kwargs", False) and num_items_in_batch is not None:
        inputs = {**inputs, "num_items_in_batch": num_items_in_batch}
    outputs = model(**inputs)
    if labels is not None and compute_loss_func is not None:
        loss = compute_loss_func(outputs, labels, num_items_in_batch=num_items_in_batch)
    elif labels is not None and smoother is not None:
        from trainbridge.modeling.load import is_causal_lm

        loss = smoother(outputs, labels, shift_labels=is_causal_lm(trainer.accelerator.unwrap_model(model)))
    else:
        loss = loss_of(outputs)
    return (loss, outputs) if return_outputs else loss
