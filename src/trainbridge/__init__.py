"""trainbridge: a distributed fine-tuning loop whose callbacks — native and Hugging Face — agree across ranks.

```python
from trainbridge import run_training, TrainingArgs, TorchrunArgs, Callback
result = run_training(TrainingArgs(...), TorchrunArgs(nproc_per_node=2))
```

Every public name is imported on first use (PEP 562), so ``import trainbridge`` (and the ``trainbridge``
command's ``--help``) does not pay for torch.  instructlab-training's names are in ``trainbridge.instructlab``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the same names for type checkers and IDEs (a test checks it matches _EXPORTS)
    from trainbridge.core.callback import Callback as Callback
    from trainbridge.core.callback import FunctionCallback as FunctionCallback
    from trainbridge.core.callback import rank_zero_only as rank_zero_only
    from trainbridge.core.config import CallbackSpec as CallbackSpec
    from trainbridge.core.config import TorchrunArgs as TorchrunArgs
    from trainbridge.core.config import TrainingArgs as TrainingArgs
    from trainbridge.core.context import TrainingContext as TrainingContext
    from trainbridge.core.events import Event as Event
    from trainbridge.launch.errors import LaunchError as LaunchError
    from trainbridge.launch.errors import PreflightError as PreflightError
    from trainbridge.launch.errors import TrainingInterruptedError as TrainingInterruptedError
    from trainbridge.launch.errors import WorkerFailedError as WorkerFailedError
    from trainbridge.launch.launcher import run_training as run_training
    from trainbridge.launch.transport import register_by_value as register_by_value
    from trainbridge.loop.result import RunResult as RunResult
    from trainbridge.trainer import Trainer as Trainer
    from trainbridge.trainer.seq2seq import Seq2SeqTrainer as Seq2SeqTrainer
    from trainbridge.trl import CPOTrainer as CPOTrainer
    from trainbridge.trl import DPOTrainer as DPOTrainer
    from trainbridge.trl import GRPOTrainer as GRPOTrainer
    from trainbridge.trl import KTOTrainer as KTOTrainer
    from trainbridge.trl import ORPOTrainer as ORPOTrainer
    from trainbridge.trl import RewardTrainer as RewardTrainer
    from trainbridge.trl import RLOOTrainer as RLOOTrainer
    from trainbridge.trl import SFTTrainer as SFTTrainer

    __version__: str

_EXPORTS: dict[str, str] = {
    # launching a run and what it returns
    "run_training": "trainbridge.launch.launcher",
    "TrainingArgs": "trainbridge.core.config",
    "TorchrunArgs": "trainbridge.core.config",
    "RunResult": "trainbridge.loop.result",
    # transformers.Trainer's (and trl's SFTTrainer's) API on the same loop
    "Trainer": "trainbridge.trainer",
    "SFTTrainer": "trainbridge.trl",  # trl's SFTTrainer on the same loop
    "Seq2SeqTrainer": "trainbridge.trainer.seq2seq",  # transformers' Seq2SeqTrainer (predict_with_generate)
    "DPOTrainer": "trainbridge.trl",  # trl's DPOTrainer on the same loop
    "ORPOTrainer": "trainbridge.trl",  # trl.experimental's ORPOTrainer on the same loop
    "CPOTrainer": "trainbridge.trl",  # trl.experimental's CPOTrainer (SimPO, AlphaPO) on the same loop
    "KTOTrainer": "trainbridge.trl",  # trl's KTOTrainer on the same loop
    "GRPOTrainer": "trainbridge.trl",  # trl's GRPOTrainer, trained by the same loop
    "RLOOTrainer": "trainbridge.trl",  # trl's RLOOTrainer, trained by the same loop
    "RewardTrainer": "trainbridge.trl",  # trl's RewardTrainer, trained by the same loop
    # writing callbacks
    "Callback": "trainbridge.core.callback",
    "FunctionCallback": "trainbridge.core.callback",
    "rank_zero_only": "trainbridge.core.callback",
    "CallbackSpec": "trainbridge.core.config",
    "TrainingContext": "trainbridge.core.context",
    "Event": "trainbridge.core.events",
    "register_by_value": "trainbridge.launch.transport",
    # what run_training raises (the subclasses are in trainbridge.launch.errors)
    "LaunchError": "trainbridge.launch.errors",
    "PreflightError": "trainbridge.launch.errors",
    "WorkerFailedError": "trainbridge.launch.errors",
    "TrainingInterruptedError": "trainbridge.launch.errors",
}
"""Public name -> the module that defines it; ``__all__`` and the lazy look-up below are derived from it."""

_SCRIPT_NAMES = frozenset(
    {
        "Trainer",
        "Seq2SeqTrainer",
        "SFTTrainer",
        "DPOTrainer",
        "KTOTrainer",
        "ORPOTrainer",
        "CPOTrainer",
        "GRPOTrainer",
        "RLOOTrainer",
        "RewardTrainer",
    }
)
"""The Trainers: the first look-up of one is where ``python script.py`` starts its workers, as torchrun would
(``launch.script_launch.launch_script``: before anything of the script's training runs)."""

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> object:
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            value: object = version("trainbridge")
        except PackageNotFoundError:  # a source tree on sys.path that was never installed
            value = "0+unknown"
    elif name in _EXPORTS:
        if name in _SCRIPT_NAMES:
            from trainbridge.launch.script_launch import launch_script

            launch_script()
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module 'trainbridge' has no attribute {name!r}")
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
