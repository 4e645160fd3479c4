"""Stand-ins for the Trainer attributes a script reads in its own process: ``trainer.accelerator`` (printing,
the main process, waiting for every rank) and ``trainer.callback_handler``."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainbridge.trainer.facade import Trainer


class ScriptAccelerator:
    """``trainer.accelerator`` for scripts that use it to print or to ask for the main process."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer

    @property
    def is_main_process(self) -> bool:
        return self._trainer.is_world_process_zero()

    @property
    def is_local_main_process(self) -> bool:
        return self._trainer.is_local_process_zero()

    @property
    def num_processes(self) -> int:
        env = self._trainer._env
        return env.world_size if env is not None else int(os.environ.get("WORLD_SIZE", "1"))

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_local_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        if self._trainer._env is not None:
            self._trainer._env.barrier()


class CallbackList:
    """``trainer.callback_handler``: the script's callbacks as ``.callbacks`` (the loop dispatches the events)."""

    def __init__(self, callbacks: list[Any]) -> None:
        self.callbacks = callbacks
