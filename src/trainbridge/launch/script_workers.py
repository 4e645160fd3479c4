"""The workers of a script run by ``launch.script_launch`` under torchrun (forked ones: ``launch.forked_workers``),
and what each worker sets up for itself.

- ``run_under_torchrun``: the script's command line under ``launch.agent`` (torchrun tied to this process by
  ``launch.lifeline``), ``--no-python``, so the interpreter's options are kept and nothing is added to the
  workers' ``sys.path``; returns the job's exit status after naming the first failing rank.
- ``become_worker``: in each worker, die with the launcher (``lifeline``), and leave the error of an
  uncaught exception where torchrun's failure report finds it (``TORCHELASTIC_ERROR_FILE``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, NoReturn

from trainbridge.core.nproc import threads_per_worker
from trainbridge.launch import lifeline
from trainbridge.launch.console import RANK_PREFIX_TEMPLATE, whole_lines
from trainbridge.launch.errors import LaunchError, TrainingInterruptedError, WorkerFailedError
from trainbridge.launch.process_exit import exit_now
from trainbridge.launch.script_launch import SCRIPT_LAUNCH_ENV
from trainbridge.launch.supervise import free_port, supervise

MASTER_ADDR = "127.0.0.1"
"""A script's job runs on this node: its rendezvous listens on the loopback address only."""

_AGENT_BOOT = (
    "import sys; sys.path[:] = [sys.argv.pop(1), *(p for p in sys.path if p not in ('', '.'))]; "  # never the cwd
    "from trainbridge.launch.agent import main; from trainbridge.launch.process_exit import exit_now; "
    "exit_now(main(sys.argv[1:]))"
)


def _package_root() -> str:
    return str(Path(__file__).resolve().parents[2])  # <root>/trainbridge/launch/script_workers.py


def agent_command(command: list[str], nproc: int, log_dir: Path, port: int) -> list[str]:
    """``launch.agent`` (torchrun) running ``command`` in ``nproc`` workers on this node."""
    tee = ["--tee", ",".join(f"{rank}:3" for rank in range(1, nproc))] if nproc > 1 else []
    return [
        sys.executable,
        "-c",
        _AGENT_BOOT,
        _package_root(),
        "--nnodes=1",
        f"--nproc-per-node={nproc}",
        f"--master-addr={MASTER_ADDR}",
        f"--master-port={port}",
        "--max-restarts=0",
        f"--log-dir={log_dir}",
        *tee,  # local rank 0 keeps the console (progress bars), the others are prefixed
        "--no-python",
        *command,
    ]


def worker_environment(nproc: int, how: str) -> dict[str, str]:
    """This process's environment plus what a launch adds (nothing on ``PYTHONPATH``)."""
    env = dict(os.environ)
    env[lifeline.LAUNCHER_ENV] = lifeline.launcher_token()
    env[SCRIPT_LAUNCH_ENV] = how
    env["PYTHONUNBUFFERED"] = "1"  # torchrun runs `python -u script.py`
    env.setdefault("OMP_NUM_THREADS", str(threads_per_worker(nproc)))
    env.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", RANK_PREFIX_TEMPLATE)
    return env


def run_under_torchrun(command: list[str], nproc: int) -> int:
    """Run ``command`` in ``nproc`` torchrun workers; the job's exit status (a failure named on stderr)."""
    from trainbridge.core.config import TorchrunArgs
    from trainbridge.launch.agent import FAILURES_FILE_ENV
    from trainbridge.launch.failures import worker_failure
    from trainbridge.launch.transport import make_payload_folder

    private = make_payload_folder()  # 0700, removed below; a SIGKILLed launcher's is removed by the next
    try:
        log_dir, failures, error_file = private / "torchrun-logs", private / "failures.json", private / "error.json"
        env = worker_environment(nproc, "torchrun")
        env[FAILURES_FILE_ENV] = str(failures)
        env["TORCHELASTIC_ERROR_FILE"] = str(error_file)
        sys.stdout.flush()
        sys.stderr.flush()
        process = subprocess.Popen(
            agent_command(command, nproc, log_dir, free_port(MASTER_ADDR)), env=env, start_new_session=True
        )
        try:
            returncode = supervise(process, None)
        except TrainingInterruptedError as interrupted:
            return report(interrupted)
        if returncode == 0:
            return 0
        return report(worker_failure(log_dir, error_file, TorchrunArgs(nproc_per_node=nproc), returncode, failures))
    finally:
        shutil.rmtree(private, ignore_errors=True)


def report(error: LaunchError) -> int:
    """Print the failure's first paragraph (the workers printed their own tracebacks); its exit status."""
    sys.stderr.write(f"trainbridge: {str(error).split(chr(10) * 2)[0]}\n")
    sys.stderr.flush()
    if isinstance(error, TrainingInterruptedError):
        return 128 + error.signum
    if isinstance(error, WorkerFailedError) and error.exit_code:
        return error.exit_code if error.exit_code > 0 else 128 - error.exit_code
    return 1


def exit_with(code: int) -> NoReturn:
    """Leave the launching process with the job's status: it never runs the rest of the script itself."""
    exit_now(code)


# ----------------------------------------------------------------------------- in each worker
def become_worker() -> None:
    """Die with the launcher, write whole lines (``console.whole_lines``), and record an uncaught exception for
    its failure report."""
    lifeline.install()
    whole_lines()
    previous = sys.excepthook
    sys.excepthook = _recording_excepthook(previous)


def _recording_excepthook(
    previous: Callable[[type[BaseException], BaseException, TracebackType | None], Any],
) -> Callable[[type[BaseException], BaseException, TracebackType | None], Any]:
    def hook(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
        if os.environ.get("TORCHELASTIC_ERROR_FILE") and isinstance(error, Exception):
            with contextlib.suppress(Exception):
                from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

                ErrorHandler().record_exception(error)
        previous(kind, error, trace)

    return hook
