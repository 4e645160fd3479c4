"""Callbacks the fault tests send to real workers (importable there: the repo root is on their path)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from trainbridge import Callback
from trainbridge.callbacks.external_control import POLL_INTERVAL_S


class KillOnce(Callback):
    """``kill -9`` of this worker at ``step`` on ``rank``, once per run folder (a marker file remembers)."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_step_end(self, context, **kwargs):
        marker = context.args.ckpt_output_dir / "killed-once"
        if context.rank == self.rank and context.global_step == self.step and not marker.exists():
            marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)


class ExitZero(Callback):
    """``sys.exit(0)`` on ``rank`` at ``step``, as a careless callback might."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_step_end(self, context, **kwargs):
        if context.rank == self.rank and context.global_step == self.step:
            sys.exit(0)


class SlowSteps(Callback):
    """Writes each rank's pid, then makes every step slow (an endless run to kill)."""

    def on_step_end(self, context, **kwargs):
        (context.args.ckpt_output_dir / f"pid-rank{context.rank}").write_text(str(os.getpid()))
        time.sleep(0.3)


class ControlThenTerminate(Callback):
    """Rank 0 runs ``trainbridge control OUT save`` at step 2; rank 1 SIGTERMs the launcher at step 6.

    Both happen at a known step whatever the machine's speed.  This callback runs before the built-in
    ``ExternalControl`` and ``SaveOnInterrupt`` (user callbacks come first in dispatch order), so:
    rank 0 then waits ``POLL_INTERVAL_S``, which makes ``ExternalControl``'s poll due in this same
    ``on_step_end``; rank 1 waits until the SIGTERM has reached it, so ``SaveOnInterrupt`` asks in this
    same ``on_step_end``.  The step's agreement turns each into a checkpoint of that step.
    """

    def on_step_end(self, context, **kwargs):
        out = context.args.ckpt_output_dir
        if context.rank == 0 and context.global_step == 2:
            subprocess.run([sys.executable, "-m", "trainbridge", "control", str(out), "save"], check=True, timeout=60)
            time.sleep(POLL_INTERVAL_S)
        if context.rank == 1 and context.global_step == 6:
            received = threading.Event()
            handler = signal.getsignal(signal.SIGTERM)

            def note_then_handle(signum, frame):
                received.set()
                handler(signum, frame)

            signal.signal(signal.SIGTERM, note_then_handle)
            (out / "terminated-at").write_text("6")
            launcher_pid = int(os.environ["TRAINBRIDGE_LAUNCHER"].partition(":")[0])
            os.kill(launcher_pid, signal.SIGTERM)
            while not received.wait(0.1):  # the handler runs on this thread, between waits
                pass
            signal.signal(signal.SIGTERM, handler)
