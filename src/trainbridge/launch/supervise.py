"""Supervising a torchrun agent from the process that started it: ``supervise``.

SIGINT/SIGTERM in this process are forwarded to the agent; on a signal or the timeout the agent gets
``SHUTDOWN_GRACE_S`` to stop its workers, then its whole process tree is killed, so nothing started here
outlives the call.  Light on purpose (no torch): a script re-executed under torchrun waits here
(``launch.script_launch``), as does ``run_training``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import psutil

from trainbridge.launch.errors import LaunchTimeoutError, TrainingInterruptedError

SHUTDOWN_GRACE_S = 45.0
"""After forwarding a signal (or on timeout), how long torchrun gets to stop its workers before the
whole process tree is killed (torchrun itself waits 30 s before SIGKILLing workers)."""

_POLL_INTERVAL_S = 0.2


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _descendants(process: subprocess.Popen[bytes]) -> list[psutil.Process]:
    """torchrun's process tree below it (workers run in their own sessions, so a group kill misses them)."""
    try:
        return psutil.Process(process.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _kill_tree(process: subprocess.Popen[bytes], known: list[psutil.Process]) -> None:
    """SIGKILL torchrun, its process group, everything below it and any of ``known`` still alive."""
    survivors = known + _descendants(process)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)
    for child in survivors:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            child.kill()  # psutil refuses to signal a pid that was reused by another process
    process.wait()


def _stop(process: subprocess.Popen[bytes], received: list[int], send: int | None) -> None:
    """Stop torchrun (``send`` it a signal unless the signal handler already forwarded one), give it
    ``SHUTDOWN_GRACE_S`` (a further signal in the parent cuts that short), then kill what is left."""
    workers = _descendants(process)
    if send is not None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(send)
    already = len(received)
    deadline = time.monotonic() + SHUTDOWN_GRACE_S
    while process.poll() is None and time.monotonic() < deadline and len(received) <= already:
        time.sleep(_POLL_INTERVAL_S)
    if process.poll() is None or any(worker.is_running() for worker in workers):
        _kill_tree(process, workers)


@contextlib.contextmanager
def _forwarded_signals(process: subprocess.Popen[bytes]) -> Iterator[list[int]]:
    """While torchrun runs, SIGINT/SIGTERM are recorded and forwarded to it (main thread only)."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def forward(signum: int, frame: Any) -> None:
        received.append(signum)
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signum)

    previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def supervise(process: subprocess.Popen[bytes], timeout_s: float | None) -> int:
    """Wait for torchrun; on a signal or the timeout, stop it (bounded) and raise."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with _forwarded_signals(process) as received:
        try:
            while True:
                try:
                    return process.wait(timeout=_POLL_INTERVAL_S)
                except subprocess.TimeoutExpired:
                    pass
                if received:
                    _stop(process, received, send=None)  # the handler already forwarded it
                    raise TrainingInterruptedError(received[0])
                if deadline is not None and time.monotonic() > deadline:
                    _stop(process, received, send=signal.SIGTERM)
                    raise LaunchTimeoutError(
                        f"training did not finish within timeout_s={timeout_s}; all workers were stopped"
                    )
        finally:
            if process.poll() is None:
                _kill_tree(process, [])
