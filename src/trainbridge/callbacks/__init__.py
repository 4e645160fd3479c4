"""Callbacks the loop always installs: the schedule, best-checkpoint tracking, metrics file, progress."""

from trainbridge.callbacks.best_checkpoint import BestCheckpointTracker
from trainbridge.callbacks.metrics_file import MetricsFileCallback
from trainbridge.callbacks.progress import ProgressBarCallback
from trainbridge.callbacks.schedule import ScheduleCallback

__all__ = ["BestCheckpointTracker", "MetricsFileCallback", "ProgressBarCallback", "ScheduleCallback"]
