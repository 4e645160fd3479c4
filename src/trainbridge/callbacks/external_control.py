"""Control a running job from another shell: ``trainbridge control RUN_DIR save|stop|evaluate|log``.

The command drops a request file into ``RUN_DIR/control/`` (written to a temporary name, then renamed,
so it is never read half-written).  ``ExternalControl`` runs on every rank but only rank 0 looks:
at each ``on_step_end`` (at most every ``POLL_INTERVAL_S``) it takes the requests it finds (deleting
them) and makes the matching control request, which the step's agreement — the one collective the
step already has — turns into the same decision on every rank.  A file needs no open port.

Requests left from an earlier run are discarded at ``on_train_begin``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from trainbridge.core.callback import Callback
from trainbridge.core.context import TrainingContext

logger = logging.getLogger(__name__)

CONTROL_DIR_NAME = "control"
"""Folder inside the run folder (``ckpt_output_dir``) where requests are dropped."""
ACTIONS = ("save", "stop", "evaluate", "log")
"""What can be asked from outside."""
POLL_INTERVAL_S = 1.0
"""Rank 0 looks for requests at a step end at most this often."""


def write_request(run_dir: Path, action: str) -> Path:
    """Drop a request for ``action`` into ``run_dir/control/`` atomically; returns the file."""
    if action not in ACTIONS:
        raise ValueError(f"action {action!r} is not one of {', '.join(ACTIONS)}")
    folder = Path(run_dir) / CONTROL_DIR_NAME
    folder.mkdir(exist_ok=True)
    name = f"{time.time_ns()}-{os.getpid()}-{action}"
    tmp = folder / f".{name}.tmp"
    tmp.write_text(json.dumps({"action": action, "host": socket.gethostname(), "pid": os.getpid(),
                               "time": time.time()}))
    final = folder / f"{name}.json"
    tmp.rename(final)
    return final


def take_requests(run_dir: Path) -> list[str]:
    """Read and delete every pending request in ``run_dir/control/``, oldest first."""
    folder = Path(run_dir) / CONTROL_DIR_NAME
    try:
        names = sorted(entry.name for entry in os.scandir(folder) if entry.name.endswith(".json"))
    except OSError:
        return []
    actions = []
    for name in names:
        path = folder / name
        try:
            action = json.loads(path.read_text()).get("action")
            path.unlink()
        except (OSError, ValueError):
            continue
        if action in ACTIONS:
            actions.append(str(action))
    return actions


class ExternalControl(Callback):
    """Rank 0 turns request files into control requests; the agreement makes every rank act."""

    def __init__(self) -> None:
        self._next_poll = 0.0

    def on_train_begin(self, context: TrainingContext, **kwargs: Any) -> None:
        if context.is_world_process_zero:
            stale = take_requests(context.args.ckpt_output_dir)
            if stale:
                logger.warning("discarding control requests left from an earlier run: %s", ", ".join(stale))

    def on_step_end(self, context: TrainingContext, **kwargs: Any) -> None:
        if not context.is_world_process_zero:
            return
        now = time.monotonic()
        if now < self._next_poll:
            return
        self._next_poll = now + POLL_INTERVAL_S
        for action in take_requests(context.args.ckpt_output_dir):
            reason = f"trainbridge control {action} (from another shell)"
            logger.warning("%s at step %d", reason, context.global_step)
            if action == "save":
                context.request_save(reason)
            elif action == "stop":
                context.request_stop_training(reason)
            elif action == "log":
                context.request_log(reason)
            elif context.eval_dataloader is not None:
                context.request_evaluate(reason)
            else:
                logger.warning("trainbridge control evaluate ignored: the run has no validation data")
