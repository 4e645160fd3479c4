"""``CallbackErrorReport`` (what the callback manager records about a callback that raised) and
``TrainingInterrupted`` (a worker was told to stop by a signal)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


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


class TrainingInterrupted(BaseException):
    """The worker received SIGTERM (torchrun shutting the job down, or a scheduler pre-empting it).

    A ``BaseException``, like ``KeyboardInterrupt``: the signal can arrive while a callback runs, and
    callback isolation (``except Exception``) must not swallow it."""
