"""A run's own loss on Trainer's sample batches: ``RunPlan.loss``: ``LossFunction`` (a ``compute_loss``
function) called on each micro-batch, with the real model and batch.

Batches and item counting are ``model_loss.ModelLoss``'s.  As Trainer's ``training_step``, the function gets
``num_items_in_batch`` (the step's items over every rank, or None when the model counts none) and its loss is
taken as the mean over those items -- multiplied back into a sum for the loop -- else as a per-batch mean.
Evaluation calls it with ``return_outputs=True`` and takes the outputs for ``compute_metrics``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from trainbridge.core.distributed import DistributedEnv
from trainbridge.step.base import EvalOutput
from trainbridge.step.model_loss import NUM_ITEMS_KEY, ItemBatches, ModelLoss, predictions_of

if TYPE_CHECKING:
    from trainbridge.step.generated import Generation


class CustomLoss(ModelLoss):
    """``ModelLoss`` whose loss is the script's ``compute_loss`` (see the module docstring)."""

    name = "the script's compute_loss (sample batches)"

    def __init__(
        self,
        train_batches: ItemBatches,
        model: Any,
        env: DistributedEnv,
        compute_loss: Callable[..., Any],
        label_names: Sequence[str] | None = None,
        generation: Generation | None = None,
    ) -> None:
        super().__init__(train_batches, model, env, label_names, generation)
        self.compute_loss = compute_loss

    def micro_loss(self, model: torch.nn.Module, batch: dict[str, Any], units: float) -> torch.Tensor:
        inputs = dict(batch)
        count = inputs.pop(NUM_ITEMS_KEY, None)
        loss = self.compute_loss(model, inputs, return_outputs=False, num_items_in_batch=count)
        return loss * count if count is not None else loss

    def eval_loss(
        self, model: torch.nn.Module, batch: dict[str, Any], cpu_batch: dict[str, Any], outputs: bool, rows: int = 0
    ) -> EvalOutput:
        has_labels = all(batch.get(name) is not None for name in self.label_names)
        labels = tuple(batch.get(name) for name in self.label_names)
        loss, result = self.compute_loss(model, dict(batch), return_outputs=True, num_items_in_batch=None)
        loss = loss.detach().float() if has_labels and loss is not None else torch.zeros(())
        units = float(rows) if has_labels else 0.0
        if not outputs:
            return EvalOutput(loss * rows, units)
        return EvalOutput(
            loss * rows,
            units,
            predictions_of(result, self.ignore_keys),
            (labels[0] if len(labels) == 1 else labels) if has_labels else None,
        )
