"""``MetricScheduleStepper``: a metric-driven learning-rate schedule steps on each evaluation, as Trainer does.

``reduce_lr_on_plateau`` (torch's ``ReduceLROnPlateau``) and ``greedy`` (transformers' ``GreedyLR``) are not
stepped per optimizer step (``TrainingEngine.scheduler_step`` skips them); after each evaluation's
``on_evaluate`` (user callbacks first, as Trainer steps it after ``evaluate()`` returns) this steps them with
``metric_for_best_model`` (``eval_loss`` by default).  Evaluation metrics are the same on every rank, so every
rank's schedule takes the same step.
"""

from __future__ import annotations

from typing import Any

from trainbridge.core.callback import Callback
from trainbridge.core.context import TrainingContext


class MetricScheduleStepper(Callback):
    """Steps ``context.lr_scheduler`` with the evaluation metric when it is a metric-driven schedule."""

    def on_evaluate(self, context: TrainingContext, **kwargs: Any) -> None:
        import torch
        from transformers.optimization import GreedyLR

        scheduler = context.lr_scheduler
        if not isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau | GreedyLR):
            return
        metrics = kwargs.get("metrics") or {}
        name = context.args.best_metric_name
        owner = context.args.best_metric_eval_set(context.eval_set_names)
        if owner is not None and f"eval_{owner}_loss" not in metrics:
            return  # another named validation set's evaluation
        if name not in metrics:
            raise KeyError(
                f"metric_for_best_model={name!r}: the learning-rate schedule {type(scheduler).__name__} steps on it, "
                f"but the evaluation metrics are {sorted(metrics)}; set metric_for_best_model to one of them"
            )
        scheduler.step(float(metrics[name]))
