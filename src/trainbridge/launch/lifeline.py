"""No process outlives its launcher: parent-death signals and a liveness watchdog.

The launcher (the process that called ``run_training``) starts the torchrun agent
(``trainbridge.launch.agent``), which starts the workers.  Each link of that chain is tied to the one
above it twice:

* ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (Linux): the kernel kills the process the moment its parent
  dies, even when the parent was SIGKILLed and could run no clean-up;
* a watchdog thread polls the launcher named in ``TRAINBRIDGE_LAUNCHER`` (``pid:start-time``, so a
  reused pid does not count as alive) and kills its own process group and itself when the launcher is
  gone: the portable fallback, and the cover for a parent that died before ``prctl`` ran.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading
import time

import psutil

from trainbridge.core.scratch import process_token, token_alive

logger = logging.getLogger(__name__)

LAUNCHER_ENV = "TRAINBRIDGE_LAUNCHER"
"""``pid:create_time`` of the launcher process, set by ``run_training`` for torchrun and its workers."""

WATCH_INTERVAL_S = 0.5
"""How often the watchdog checks that the launcher is alive."""

_PR_SET_PDEATHSIG = 1


launcher_token = process_token
"""``pid:create_time`` of a process (default: this one), the value of ``TRAINBRIDGE_LAUNCHER``."""

is_alive = token_alive
"""Whether the process named by a ``launcher_token`` still runs (a reused pid is not alive)."""


def set_parent_death_signal(signum: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``signum`` to this process when its parent dies (Linux only).

    Returns False where ``prctl`` is not available.  A parent that died before the call is the
    watchdog's to notice (``start_watchdog``).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    return True


def _kill_own_group_and_exit(reason: str) -> None:
    with contextlib.suppress(Exception):
        sys.stderr.write(f"trainbridge: {reason}; stopping pid {os.getpid()} and its children\n")
        sys.stderr.flush()
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
    os._exit(137)


def start_watchdog(token: str | None = None, interval_s: float = WATCH_INTERVAL_S) -> threading.Thread | None:
    """Start a daemon thread that ends this process (and its children) once the launcher is gone.

    ``token`` defaults to ``TRAINBRIDGE_LAUNCHER``; without one there is nothing to watch (None).
    """
    token = token or os.environ.get(LAUNCHER_ENV)
    if not token:
        return None

    def watch() -> None:
        while is_alive(token):
            time.sleep(interval_s)
        _kill_own_group_and_exit(f"launcher {token.partition(':')[0]} is gone")

    thread = threading.Thread(target=watch, name="trainbridge-lifeline", daemon=True)
    thread.start()
    return thread


def install() -> None:
    """Both ties for this process: die with the parent, and with the launcher (no-op outside a launch)."""
    if os.environ.get(LAUNCHER_ENV):
        set_parent_death_signal(signal.SIGKILL)
        start_watchdog()
