"""Callbacks the loop installs: the schedule, best-checkpoint tracking, metrics file, progress, a metric-driven
learning-rate schedule's step, control from another shell (``trainbridge control``) and saving on SIGTERM
(``save_on_interrupt``)."""

from trainbridge.callbacks.best_checkpoint import BestCheckpointTracker
from trainbridge.callbacks.external_control import ExternalControl
from trainbridge.callbacks.interrupt import SaveOnInterrupt
from trainbridge.callbacks.metric_schedule import MetricScheduleStepper
from trainbridge.callbacks.metrics_file import MetricsFileCallback
from trainbridge.callbacks.progress import ProgressBarCallback
from trainbridge.callbacks.schedule import ScheduleCallback

__all__ = [
    "BestCheckpointTracker",
    "ExternalControl",
    "MetricScheduleStepper",
    "MetricsFileCallback",
    "ProgressBarCallback",
    "SaveOnInterrupt",
    "ScheduleCallback",
]
