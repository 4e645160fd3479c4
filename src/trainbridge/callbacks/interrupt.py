"""``SaveOnInterrupt``: on SIGTERM, checkpoint at the next step boundary, agreed across ranks, then stop.

Schedulers (SLURM, Kubernetes) send SIGTERM some time before they kill a job; torchrun passes it to
every worker and SIGKILLs them 30 s later.  With ``save_on_interrupt`` on, this callback replaces
the loop's "SIGTERM raises" handler from ``on_train_begin``: the first SIGTERM only sets a flag; at
the next ``on_step_end`` the rank asks for a save and a stop, which the step's agreement (the one
collective it already has) turns into the same decision on every rank, whichever rank got the signal
first.  The loop saves, stops, fires ``on_train_end`` and the worker exits normally.  A second
SIGTERM, or ``save_on_interrupt_timeout_s`` without reaching a step boundary, raises
``TrainingInterrupted`` as before (bounded time).
"""

from __future__ import annotations

import _thread
import logging
import signal
import threading
from typing import Any

from trainbridge.core.callback import Callback
from trainbridge.core.callback_errors import TrainingInterrupted
from trainbridge.core.context import TrainingContext

logger = logging.getLogger(__name__)


class SaveOnInterrupt(Callback):
    """Turns SIGTERM into an agreed save-and-stop at the next step boundary (``save_on_interrupt``)."""

    def __init__(self) -> None:
        self._received = threading.Event()
        self._requested = False
        self._timer: threading.Timer | None = None
        self._timeout_s = 25.0

    def on_train_begin(self, context: TrainingContext, **kwargs: Any) -> None:
        if not context.args.save_on_interrupt:
            return
        self._timeout_s = context.args.save_on_interrupt_timeout_s
        try:
            signal.signal(signal.SIGTERM, self._on_sigterm)  # the loop puts its caller's handler back at the end
        except ValueError:  # not the main thread: the loop's handler stays
            logger.warning("save_on_interrupt: not on the main thread, SIGTERM will stop without saving")

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self._received.is_set():
            raise TrainingInterrupted(
                f"received signal {signum} again, or no step boundary within "
                f"{self._timeout_s:g} s of the first; stopping without a checkpoint"
            )
        self._received.set()
        logger.warning(
            "received signal %d: a checkpoint will be written at the next step boundary, then "
            "training stops (save_on_interrupt)",
            signum,
        )
        # bounded: if no step boundary comes in time, deliver the signal again (which raises, above)
        self._timer = threading.Timer(self._timeout_s, _thread.interrupt_main, (signal.SIGTERM,))
        self._timer.daemon = True
        self._timer.start()

    def on_step_end(self, context: TrainingContext, **kwargs: Any) -> None:
        if self._received.is_set() and not self._requested:
            self._requested = True
            reason = "SIGTERM received (save_on_interrupt)"
            context.request_save(reason)
            context.request_stop_training(reason)

    def on_save(self, context: TrainingContext, **kwargs: Any) -> None:
        if self._requested and self._timer is not None:
            self._timer.cancel()  # the checkpoint is written; the run now ends normally

    def on_train_end(self, context: TrainingContext, **kwargs: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def on_exception(self, context: TrainingContext, **kwargs: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()
