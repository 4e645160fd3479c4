"""``TrainMemoryMetrics``: Trainer's ``skip_memory_metrics=False`` under ``trainbridge.Trainer``.

The facade's ``train()`` starts the instance's own ``TrainerMemoryTracker`` (``Trainer._memory_tracker``,
which Trainer's constructor ran over ``__init__``); this callback, first among the script's, stops it at the
final log and adds its deltas (``init_mem_cpu_alloc_delta``, ``train_mem_cpu_peaked_delta``, ``*_gpu_*`` on an
accelerator...) to that row, as ``Trainer.train`` does before ``self.log(metrics)``: every ``on_log``, the
history and ``train()``'s metrics carry them.
"""

from __future__ import annotations

from typing import Any

from trainbridge.core.callback import Callback
from trainbridge.core.context import TrainingContext

TRAIN_STAGE = "train"
"""The tracker's stage of ``train()`` (``TrainerMemoryTracker.stages``)."""


class TrainMemoryMetrics(Callback):
    """Stops a started ``TrainerMemoryTracker`` at the final log and adds its metrics (see the module doc)."""

    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker

    def on_log(self, context: TrainingContext, **kwargs: Any) -> None:
        logs = kwargs["logs"]
        if "train_runtime" in logs and self.tracker.cur_stage == TRAIN_STAGE:
            self.tracker.stop(TRAIN_STAGE)
            self.tracker.update_metrics(TRAIN_STAGE, logs)

    def on_exception(self, context: TrainingContext, **kwargs: Any) -> None:
        if self.tracker.cur_stage == TRAIN_STAGE:  # its peak thread ends; a later evaluate() tracks its own
            self.tracker.stop(TRAIN_STAGE)


def memory_metrics(trainer: Any) -> list[Callback]:
    """``[TrainMemoryMetrics]`` for a ``transformers.Trainer`` whose arguments ask for memory metrics, else
    nothing."""
    tracker = getattr(trainer, "_memory_tracker", None)
    if tracker is None or tracker.skip_memory_metrics:
        return []
    return [TrainMemoryMetrics(tracker)]
