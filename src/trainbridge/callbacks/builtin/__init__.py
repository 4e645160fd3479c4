"""Callbacks the loop always installs: the schedule, best-checkpoint tracking, metrics file, progress."""

from trainbridge.callbacks.builtin.best_checkpoint import BestCheckpointTracker
from trainbridge.callbacks.builtin.metrics_file import MetricsFileCallback
from trainbridge.callbacks.builtin.progress import ProgressBarCallback
from trainbridge.callbacks.builtin.schedule import ScheduleCallback

__all__ = ["BestCheckpointTracker", "MetricsFileCallback", "ProgressBarCallback", "ScheduleCallback"]
