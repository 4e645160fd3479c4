"""Callback errors: the failure policy (``CallbackErrorLedger``) and what it reports about a callback
that raised (``CallbackErrorReport``); ``TrainingInterrupted`` (a worker was told to stop by a signal)."""

from __future__ import annotations

import contextlib
import logging
import traceback
from collections.abc import Hashable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

logger = logging.getLogger("trainbridge.core.dispatch")

OWN_CAUSE_MARKER = " (this rank: "
"""In an error every rank raises for one agreed failure (a ``fatal`` callback error), the text that only
the rank where it happened adds, followed by its own reason: the launcher picks that rank as the root
cause (``launch.failures``)."""


class CallbackErrorReport(BaseModel):
    """Errors one callback raised under the ``isolate`` policy, on one rank."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    callback: str
    """Callback name."""
    rank: int
    """Rank where it failed."""
    event: str
    """Event of the first error."""
    count: int
    """How many times it raised."""
    disabled: bool
    """Whether it was switched off after too many consecutive errors."""
    first_error: str
    """The first error, ``Type: message``."""


@dataclass
class _ErrorRecord:
    name: str
    event: str
    first_error: str
    count: int = 0
    consecutive: int = 0
    disabled: bool = False


class CallbackErrorLedger:
    """The ``isolate`` / ``fatal`` failure policy for callbacks after train begin, in one place.

    The callback manager keeps one for the native callbacks it calls; ``HuggingFaceCallbacks`` keeps one
    for the ``TrainerCallback``s it calls, so each of those is isolated, counted and switched off on its
    own.  ``failed`` logs the first error of a callback with its traceback (later ones are counted) and
    says what to do: ``"abort"`` under ``fatal`` (the caller requests ``ControlFlag.ABORT``),
    ``"disable"`` when the callback just reached ``max_consecutive`` errors in a row, else ``"continue"``.
    """

    def __init__(self, policy: str = "isolate", max_consecutive: int = 3) -> None:
        self.policy = policy
        self.max_consecutive = max_consecutive
        self._records: dict[Hashable, _ErrorRecord] = {}

    def failed(
        self, key: Hashable, name: str, event: str, exc: BaseException, rank: int, fatal_allowed: bool = True
    ) -> str:
        """Record that callback ``key`` (called ``name``) raised ``exc`` in ``event``; returns the action."""
        aborting = self.policy == "fatal" and fatal_allowed
        record = self._records.get(key)
        if record is None:
            record = self._records[key] = _ErrorRecord(name, event, f"{type(exc).__name__}: {exc}")
            logger.error(
                "callback %s failed in %s on rank %d (%s):\n%s",
                name,
                event,
                rank,
                "callback_error_policy='fatal': the run stops"
                if aborting
                else "further errors are counted, not logged",
                "".join(traceback.format_exception(exc)),
            )
        record.count += 1
        record.consecutive += 1
        if aborting:
            return "abort"
        if record.consecutive >= self.max_consecutive and not record.disabled:
            record.disabled = True
            logger.error(
                "callback %s switched off on rank %d after %d consecutive errors", name, rank, record.consecutive
            )
            return "disable"
        return "continue"

    def succeeded(self, key: Hashable) -> None:
        """Callback ``key`` ran without error: its run of consecutive errors ends."""
        record = self._records.get(key)
        if record is not None:
            record.consecutive = 0

    def disabled(self, key: Hashable) -> bool:
        """Whether callback ``key`` has been switched off."""
        record = self._records.get(key)
        return record is not None and record.disabled

    def reports(self, rank: int) -> list[CallbackErrorReport]:
        """Every callback that raised on this rank (by key order when keys are positions)."""
        items = list(self._records.items())
        with contextlib.suppress(TypeError):  # registration order when keys are positions
            items.sort(key=lambda item: item[0])  # type: ignore[arg-type,return-value]
        return [
            CallbackErrorReport(
                callback=r.name, rank=rank, event=r.event, count=r.count, disabled=r.disabled, first_error=r.first_error
            )
            for _, r in items
        ]


class TrainingInterrupted(BaseException):
    """The worker received SIGTERM (torchrun shutting the job down, or a scheduler pre-empting it).

    A ``BaseException``, like ``KeyboardInterrupt``: the signal can arrive while a callback runs, and
    callback isolation (``except Exception``) must not swallow it."""
