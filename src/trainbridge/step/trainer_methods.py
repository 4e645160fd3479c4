"""A Trainer subclass's own step: its ``training_step`` runs each micro-batch and its ``prediction_step``
each validation batch, in the workers, with the real model and batches (``RunPlan.loss``: ``InstanceStep``,
set by the facade for a subclass overriding ``training_step``, ``prediction_step`` or ``compute_loss``, or
given a ``compute_loss_func``).

Batches and item counting are ``model_loss.ModelLoss``'s (Trainer's sample batches; the step's items over
every rank when the model accepts loss kwargs or there is a ``compute_loss_func``, as Trainer counts them).
Each micro-batch calls ``methods.training_step(model, inputs, num_items_in_batch, backward)``: Trainer's
``training_step`` (or the override), whose ``accelerator.backward(loss)`` backpropagates ``loss`` exactly
(the loss Trainer backpropagates, scaled by accumulation or items and ranks, is the loop's ``loss_sum x
scale``), so the gradients are Trainer's.  The value it returns is what Trainer adds to its logged loss;
the loop's loss sum is that value divided by ``scale``, so the logged loss is Trainer's too.

Evaluation calls ``methods.prediction_step(model, inputs, prediction_loss_only, num_items_in_batch)``, with
the batch's items over every rank counted as in training (Trainer's ``prediction_step`` counts them); its
``(loss, logits, labels)`` give the batch's loss (weighted by the batch's rows, as Trainer's ``eval_loss``)
and what ``compute_metrics`` gets; with ``predict_with_generate`` (the ``generation`` seam) the predictions are
generated ids and the loss the model's own, as ``Seq2SeqTrainer.prediction_step`` gives them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import torch

from trainbridge.core.config.loss import TrainerMethods
from trainbridge.core.distributed import DistributedEnv
from trainbridge.data.loader_batches import OPAQUE_BATCH
from trainbridge.step.base import EvalOutput
from trainbridge.step.model_loss import NUM_ITEMS_KEY, ItemBatches, ModelLoss
from trainbridge.step.step_totals import across_ranks, uncounted

if TYPE_CHECKING:
    from trainbridge.step.generated import Generation


class TrainerMethodsStep(ModelLoss):
    """``ModelLoss``'s batches, stepped by the script's ``training_step`` (see the module docstring)."""

    name = "the script's Trainer training_step / prediction_step (sample batches)"

    def __init__(
        self,
        train_batches: ItemBatches,
        model: Any,
        env: DistributedEnv,
        methods: TrainerMethods,
        label_names: Sequence[str] | None = None,
        generation: Generation | None = None,
    ) -> None:
        super().__init__(train_batches, model, env, label_names, generation)
        self.methods = methods
        self.counts_items = self.counts_items or bool(methods.counts_items)
        self.totals = across_ranks if methods.counts_step else uncounted

    def micro_step(
        self,
        model: torch.nn.Module,
        batch: dict[str, Any],
        units: float,
        scale: float,
        forward: Callable[[], AbstractContextManager[Any]],
        backward: Callable[[torch.Tensor], None],
    ) -> torch.Tensor:
        inputs: Any = dict(batch)
        count = inputs.pop(NUM_ITEMS_KEY, None)
        if OPAQUE_BATCH in inputs:  # the loader's batch as it gave it (trl's GRPO: a list of raw rows)
            inputs = inputs[OPAQUE_BATCH]

        def backward_as_trainer(loss: torch.Tensor) -> None:
            # the loop backpropagates loss_sum x scale: hand it loss / scale (the same gradients, exactly)
            backward(loss / scale)

        with forward():  # as accelerate autocasts the model's forward under Trainer, whoever calls it
            accumulation = self.train_batches.accumulation
            reported = self.methods.training_step(model, inputs, count, backward_as_trainer, accumulation)
        if not isinstance(reported, torch.Tensor):
            reported = torch.as_tensor(float(reported))
        return reported.detach().reshape(()).to(torch.float64) / scale

    def micro_loss(self, model: torch.nn.Module, batch: dict[str, Any], units: float) -> torch.Tensor:
        raise TypeError(
            "TrainerMethodsStep runs the script's training_step, which backpropagates itself: use micro_step"
        )

    def eval_loss(
        self, model: torch.nn.Module, batch: dict[str, Any], cpu_batch: dict[str, Any], outputs: bool, rows: int = 0
    ) -> EvalOutput:
        count = None
        if self.counts_items and isinstance(batch.get("labels"), torch.Tensor):
            # Trainer.prediction_step counts the batch's items over every rank, as in training
            (items,) = self.env.sum_floats([float(self._items(batch))])  # collective: every rank, every batch
            count = torch.tensor(items)
        loss, logits, labels = self.methods.prediction_step(model, dict(batch), not outputs, count)
        if loss is None:
            loss_sum, units = torch.zeros((), device=_device(batch)), 0.0
        else:
            loss_sum, units = loss.detach().float().mean() * rows, float(rows)
        if not outputs:
            return EvalOutput(loss_sum, units)
        return EvalOutput(loss_sum, units, logits, labels, inputs_aligned=not self.encoder_decoder)


def _device(batch: dict[str, Any]) -> torch.device:
    return next((v.device for v in batch.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
