"""Callbacks the loop installs: the schedule, best-checkpoint tracking, metrics file, progress, a metric-driven
learning-rate schedule's step, control from another shell (``trainbridge control``), saving on SIGTERM
(``save_on_interrupt``), emptying the device cache (``torch_empty_cache_steps``) and watching activations
for inf/nan (``debug_underflow_overflow``)."""

from trainbridge.callbacks.best_checkpoint import BestCheckpointTracker
from trainbridge.callbacks.device_cache import EmptyDeviceCache
from trainbridge.callbacks.external_control import ExternalControl
from trainbridge.callbacks.interrupt import SaveOnInterrupt
from trainbridge.callbacks.metric_schedule import MetricScheduleStepper
from trainbridge.callbacks.metrics_file import MetricsFileCallback
from trainbridge.callbacks.progress import ProgressBarCallback
from trainbridge.callbacks.schedule import ScheduleCallback
from trainbridge.callbacks.underflow_overflow import UnderflowOverflow

__all__ = [
    "BestCheckpointTracker",
    "EmptyDeviceCache",
    "ExternalControl",
    "MetricScheduleStepper",
    "MetricsFileCallback",
    "ProgressBarCallback",
    "SaveOnInterrupt",
    "ScheduleCallback",
    "UnderflowOverflow",
]
