"""trainbridge: a distributed fine-tuning loop whose callbacks — native and Hugging Face — agree across ranks.

```python
from trainbridge import run_training, TrainingArgs, TorchrunArgs, Callback
result = run_training(TrainingArgs(...), TorchrunArgs(nproc_per_node=2))
```
"""

from trainbridge.core.callback import Callback, FunctionCallback, rank_zero_only
from trainbridge.core.config import CallbackSpec, TorchrunArgs, TrainingArgs
from trainbridge.core.context import TrainingContext
from trainbridge.core.control import AgreedControl, ControlFlag
from trainbridge.core.events import EVENT_MAP, Event
from trainbridge.loop.result import RunResult

__all__ = [
    "EVENT_MAP",
    "AgreedControl",
    "Callback",
    "CallbackSpec",
    "CallbackTransportError",
    "ControlFlag",
    "Event",
    "FunctionCallback",
    "LaunchError",
    "LaunchTimeoutError",
    "PreflightError",
    "RunFolderLockedError",
    "RunResult",
    "TorchrunArgs",
    "TrainingArgs",
    "TrainingContext",
    "TrainingInterruptedError",
    "WorkerFailedError",
    "rank_zero_only",
    "register_by_value",
    "run_training",
]

__version__ = "0.1.0"

_LAUNCHER_NAMES = ("run_training", "WorkerFailedError", "LaunchError", "PreflightError", "LaunchTimeoutError",
                   "TrainingInterruptedError", "RunFolderLockedError")


def __getattr__(name: str) -> object:
    # The launcher (subprocess, torchrun) is imported on first use, so workers and the
    # callback layer never pay for it.
    if name in _LAUNCHER_NAMES:
        from trainbridge.launch import launcher

        return getattr(launcher, name)
    if name in ("CallbackTransportError", "register_by_value"):
        from trainbridge.launch import transport

        return getattr(transport, name)
    raise AttributeError(f"module 'trainbridge' has no attribute {name!r}")
