"""``trainbridge control RUN_DIR save|stop|evaluate|log``: ask a running job to act, from another shell.

The request is a file in the run's ``control/`` (``RUN_DIR/control/``, or ``RUN_DIR/trainbridge/control/`` for
a ``trainbridge.Trainer`` run: ``core.run_dir.run_files_in``; ``callbacks.external_control``), taken by rank 0
at the next step end and agreed across ranks like any callback request (only from the run's own user).  A
request is only written when a live run holds ``RUN_DIR`` (its launcher's lock, ``checkpoint.runlock``) or
its rank 0 is listening (``external_control.listening``: a run in place, a Trainer script), so none waits
to surprise a later run.
"""

from __future__ import annotations

from pathlib import Path

from trainbridge.callbacks.external_control import ACTIONS, CONTROL_DIR_NAME, listening, write_request
from trainbridge.checkpoint.runlock import live_holders
from trainbridge.core.run_dir import run_files_in


class ControlRequestError(RuntimeError):
    """The request could not be made (``trainbridge control`` exits 1 with this message)."""


class NoRunningJobError(ControlRequestError):
    """No live run holds the run folder: there is nobody to ask."""


def send_control(run_dir: Path, action: str) -> str:
    """Drop the request and return a one-line confirmation (``NoRunningJobError`` when no run is live)."""
    if action not in ACTIONS:
        raise ValueError(f"action {action!r} is not one of {', '.join(ACTIONS)}")
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise NoRunningJobError(f"{run_dir} is not a folder (give the run's ckpt_output_dir)")
    files = run_files_in(run_dir)  # the lock is the run folder's, the requests go with its own files
    running = [holder.describe() for holder in live_holders(run_dir)] or [who for who in [listening(files)] if who]
    if not running:
        raise NoRunningJobError(f"no running trainbridge job holds {run_dir}; nothing was requested")
    try:
        path = write_request(files, action)
    except OSError as exc:
        raise ControlRequestError(
            f"cannot write a request into {files / CONTROL_DIR_NAME}: {exc} (only the run's own user can control it)"
        ) from None
    return (
        f"asked {running[0]} to {action} at its next step end (request {path.name}; "
        "ExternalControl needs external_control=True, the default)"
    )
