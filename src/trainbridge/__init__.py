"""trainbridge: a distributed fine-tuning loop whose callbacks — native and Hugging Face — agree across ranks.

```python
from trainbridge import run_training, TrainingArgs, TorchrunArgs, Callback
result = run_training(TrainingArgs(...), TorchrunArgs(nproc_per_node=2))
```

Every public name is imported on first use (PEP 562), so ``import trainbridge`` (and the ``trainbridge``
command's ``--help``) does not pay for torch; ``from trainbridge import X`` works as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainbridge.core.callback import Callback, FunctionCallback, rank_zero_only
    from trainbridge.core.config import CallbackSpec, TorchrunArgs, TrainingArgs
    from trainbridge.core.context import TrainingContext
    from trainbridge.core.control import AgreedControl, ControlFlag
    from trainbridge.core.events import EVENT_MAP, Event
    from trainbridge.core.instructlab_names import DeepSpeedOptions, LoraOptions
    from trainbridge.launch.launcher import (
        LaunchError,
        LaunchTimeoutError,
        PreflightError,
        TrainingInterruptedError,
        WorkerFailedError,
        run_training,
    )
    from trainbridge.launch.transport import CallbackTransportError, register_by_value
    from trainbridge.loop.result import RunResult
    from trainbridge.trainer import Trainer
    from trainbridge.trl import SFTTrainer

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "Callback": "trainbridge.core.callback",
    "FunctionCallback": "trainbridge.core.callback",
    "rank_zero_only": "trainbridge.core.callback",
    "CallbackSpec": "trainbridge.core.config",
    "TorchrunArgs": "trainbridge.core.config",
    "TrainingArgs": "trainbridge.core.config",
    "LoraOptions": "trainbridge.core.instructlab_names",  # instructlab-training's, translated to peft_config
    "DeepSpeedOptions": "trainbridge.core.instructlab_names",
    "TrainingContext": "trainbridge.core.context",
    "AgreedControl": "trainbridge.core.control",
    "ControlFlag": "trainbridge.core.control",
    "EVENT_MAP": "trainbridge.core.events",
    "Event": "trainbridge.core.events",
    "RunResult": "trainbridge.loop.result",
    "Trainer": "trainbridge.trainer",  # transformers.Trainer's API on our loop
    "SFTTrainer": "trainbridge.trl",  # trl's SFTTrainer on our loop
    "run_training": "trainbridge.launch.launcher",
    "WorkerFailedError": "trainbridge.launch.launcher",
    "LaunchError": "trainbridge.launch.launcher",
    "PreflightError": "trainbridge.launch.launcher",
    "LaunchTimeoutError": "trainbridge.launch.launcher",
    "TrainingInterruptedError": "trainbridge.launch.launcher",
    "RunFolderLockedError": "trainbridge.launch.launcher",
    "CallbackTransportError": "trainbridge.launch.transport",
    "register_by_value": "trainbridge.launch.transport",
}

__all__ = [
    "EVENT_MAP",
    "AgreedControl",
    "Callback",
    "CallbackSpec",
    "CallbackTransportError",
    "ControlFlag",
    "DeepSpeedOptions",
    "Event",
    "FunctionCallback",
    "LaunchError",
    "LaunchTimeoutError",
    "LoraOptions",
    "PreflightError",
    "RunFolderLockedError",
    "RunResult",
    "SFTTrainer",
    "TorchrunArgs",
    "Trainer",
    "TrainingArgs",
    "TrainingContext",
    "TrainingInterruptedError",
    "WorkerFailedError",
    "rank_zero_only",
    "register_by_value",
    "run_training",
]


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trainbridge' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
