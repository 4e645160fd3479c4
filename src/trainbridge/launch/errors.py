"""What ``run_training`` raises (also importable from ``trainbridge.launch.launcher`` and ``trainbridge``)."""

from __future__ import annotations

import signal
from collections.abc import Sequence
from pathlib import Path


class LaunchError(RuntimeError):
    """The run could not be launched or did not produce a result."""

    log_file: str | None = None
    """The run's launch log (torchrun's own report, every rank's error in full), when there is one."""

    def name_log_file(self, path: str | Path) -> None:
        """Record ``path`` as the launch log and say so at the end of the message."""
        self.log_file = str(path)
        self.args = (
            f"{self.args[0] if self.args else ''}\n\nFull log (torchrun's own report, every rank's error): {path}",
        )


class PreflightError(LaunchError):
    """A check before launch failed; no worker was started."""


class RunFolderLockedError(PreflightError):
    """Another live run holds the lock on ``ckpt_output_dir``; nothing was started."""


class WorkerFailedError(LaunchError):
    """A worker failed; torchrun stopped the others.  Names the rank that failed first and its real error
    (Python exception with traceback, or the signal / exit code that ended it), then what the other ranks
    reported as ``consequences``."""

    def __init__(
        self,
        rank: int | None,
        exit_code: int | None,
        message: str,
        *,
        traceback: str | None = None,
        local_rank: int | None = None,
        signal_name: str | None = None,
        consequences: Sequence[str] = (),
        restarts: int = 0,
    ) -> None:
        self.rank = rank
        self.exit_code = exit_code
        self.message = message
        self.traceback = traceback
        self.local_rank = local_rank
        self.signal_name = signal_name
        self.consequences = list(consequences)
        self.restarts = restarts
        if rank is not None:
            who = f"rank {rank}"
        elif local_rank is not None:
            who = f"local rank {local_rank} on this node"
        else:
            who = "a worker"
        code = f"exit code {exit_code}" if exit_code is not None else "exit code unknown"
        text = f"training failed on {who} ({code}): {message}"
        if traceback:
            text += f"\n\nTraceback on {who}:\n{traceback.rstrip()}"
        if self.consequences:
            text += "\n\nThen, as a consequence:\n" + "\n".join(f"  {line}" for line in self.consequences)
        if restarts:
            text += f"\n\n(after {restarts} restart{'s' if restarts != 1 else ''} of the job)"
        super().__init__(text)


class LaunchTimeoutError(LaunchError, TimeoutError):
    """The run exceeded ``timeout_s``; every worker was stopped."""


class TrainingInterruptedError(LaunchError):
    """The parent received SIGINT/SIGTERM; it was forwarded to torchrun and every worker was stopped."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"training interrupted by {signal.Signals(signum).name}; all workers were stopped")
