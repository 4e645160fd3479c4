"""Control a running job from another shell: ``trainbridge control RUN_DIR save|stop|evaluate|log``.

The command drops a request file into the run-files folder's ``control/`` (``RUN_DIR/control/``, or
``RUN_DIR/trainbridge/control/`` for a ported ``TrainingArguments``' run: ``core.run_dir``; written to a
temporary name, then renamed, so it is never read half-written).  ``ExternalControl`` runs on every rank
but only rank 0 looks: at each ``on_step_end`` (at most every ``POLL_INTERVAL_S``) it takes the requests it
finds (deleting them) and makes the matching control request, which the step's agreement — the one collective the
step already has — turns into the same decision on every rank.  A file needs no open port.

Only the run's owner can ask: rank 0 creates ``control/`` with mode 0700 at ``on_train_begin``; a
``control/`` that is a link or belongs to another user is not read; a request file owned by another user
is ignored (logged and removed).  Nothing follows a link (``O_NOFOLLOW``), only files named like a
request (``REQUEST_NAME``) are read or deleted, and a malformed one is reported and removed, never fatal.
Requests left from an earlier run are discarded at ``on_train_begin``.  While it takes requests, rank 0
keeps ``control/listening.json`` (``LISTENER_FILE``: its host, pid and process start), so that
``trainbridge control`` finds a live run that holds no launcher lock (a script under torchrun, a ``Trainer``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import stat
import time
from pathlib import Path
from typing import Any

import psutil

from trainbridge.core.callback import Callback
from trainbridge.core.context import TrainingContext
from trainbridge.core.private_files import PRIVATE_DIR_MODE, make_run_folder, open_in, replace_text

logger = logging.getLogger(__name__)

CONTROL_DIR_NAME = "control"
"""Folder inside the run-files folder (``TrainingArgs.resolved_run_files_dir``) where requests are dropped."""
ACTIONS = ("save", "stop", "evaluate", "log")
"""What can be asked from outside."""
POLL_INTERVAL_S = 1.0
"""Rank 0 looks for requests at a step end at most this often."""
REQUEST_NAME = re.compile(r"^[0-9]+-[0-9]+-(save|stop|evaluate|log)\.json$")
"""The names of request files (``{time_ns}-{pid}-{action}.json``); nothing else in ``control/`` is touched."""

LISTENER_FILE = "listening.json"
"""Rank 0's marker in ``control/`` while its run takes requests (removed at the run's end)."""

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_MAX_REQUEST_BYTES = 4096


class ControlFolderError(OSError):
    """``control/`` cannot be used safely (a link, another user's, not a folder)."""


def write_request(run_dir: Path, action: str) -> Path:
    """Drop a request for ``action`` into ``run_dir/control/`` atomically (no link followed; the folder is
    created 0700 when missing); returns the file."""
    if action not in ACTIONS:
        raise ValueError(f"action {action!r} is not one of {', '.join(ACTIONS)}")
    run_dir = Path(run_dir)
    name = f"{time.time_ns()}-{os.getpid()}-{action}"
    record = json.dumps({"action": action, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()})
    tmp = Path(CONTROL_DIR_NAME) / f".{name}.tmp"
    fd = open_in(run_dir, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(record)
    folder = _open_folder(run_dir)
    try:
        os.rename(tmp.name, f"{name}.json", src_dir_fd=folder, dst_dir_fd=folder)
    finally:
        os.close(folder)
    return run_dir / CONTROL_DIR_NAME / f"{name}.json"


def _open_folder(run_dir: Path) -> int:
    """A descriptor of ``run_dir/control/``: not a link, a folder of this user (``ControlFolderError``)."""
    path = Path(run_dir) / CONTROL_DIR_NAME
    try:
        fd = os.open(path, os.O_RDONLY | _DIRECTORY | _NOFOLLOW)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ControlFolderError(f"{path} is a link or not a folder; it is not used ({exc.strerror})") from None
    info = os.fstat(fd)
    if info.st_uid != os.geteuid():
        os.close(fd)
        raise ControlFolderError(f"{path} belongs to uid {info.st_uid}, not to this run's user; it is not used")
    return fd


def prepare_folder(run_dir: Path, share_with_group: bool = False) -> None:
    """Create ``run_dir/control/`` with mode 0700 (or make an existing one of this user 0700); ``run_dir`` (the
    run-files folder) is created as the run folder is, if missing."""
    make_run_folder(run_dir, share_with_group)
    path = Path(run_dir) / CONTROL_DIR_NAME
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, PRIVATE_DIR_MODE)
    fd = _open_folder(run_dir)
    try:
        if stat.S_IMODE(os.fstat(fd).st_mode) != PRIVATE_DIR_MODE:
            os.fchmod(fd, PRIVATE_DIR_MODE)
    finally:
        os.close(fd)


def _read_request(folder: int, name: str, where: Path) -> str | None:
    """The action of request file ``name`` (None, with a warning, when it is not a request of this user)."""
    try:
        fd = os.open(name, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0), dir_fd=folder)
    except OSError as exc:
        logger.warning(
            "control request %s ignored: cannot be opened without following a link (%s)", where, exc.strerror
        )
        return None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if info.st_uid != os.geteuid():
            logger.warning("control request %s ignored: written by uid %d, not by this run's user", where, info.st_uid)
            return None
        if not stat.S_ISREG(info.st_mode):
            logger.warning("control request %s ignored: not a regular file", where)
            return None
        raw = handle.read(_MAX_REQUEST_BYTES + 1)
    try:
        data = json.loads(raw) if len(raw) <= _MAX_REQUEST_BYTES else None
    except ValueError:
        data = None
    action = data.get("action") if isinstance(data, dict) else None
    if action not in ACTIONS:
        logger.warning(
            "control request %s ignored: not a request written by `trainbridge control` (expected a "
            'JSON object with "action" one of %s)',
            where,
            ", ".join(ACTIONS),
        )
        return None
    return str(action)


def _read_own_file(folder: int, name: str) -> bytes | None:
    """The bytes of regular file ``name`` of this user in ``folder`` (None: missing, a link, another user's)."""
    try:
        fd = os.open(name, os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0), dir_fd=folder)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if info.st_uid != os.geteuid() or not stat.S_ISREG(info.st_mode):
            return None
        return handle.read(_MAX_REQUEST_BYTES + 1)


def listening(run_dir: Path) -> str | None:
    """The live run whose rank 0 takes requests from ``run_dir/control/`` ("pid P on HOST"), None when none
    does (no marker, or its process is gone; one on another host counts as live: it cannot be checked)."""
    try:
        folder = _open_folder(run_dir)
    except OSError:
        return None
    try:
        raw = _read_own_file(folder, LISTENER_FILE)
    finally:
        os.close(folder)
    try:
        data = json.loads(raw or b"")
        host, pid, started = str(data["host"]), int(data["pid"]), float(data["process_start"])
    except (ValueError, KeyError, TypeError):
        return None
    if host == socket.gethostname():
        try:
            if abs(psutil.Process(pid).create_time() - started) >= 1.0:
                return None  # the pid was reused
        except psutil.Error:
            return None
    return f"pid {pid} on {host}"


def _mark_listening(run_dir: Path) -> None:
    me = psutil.Process()
    record = {"host": socket.gethostname(), "pid": me.pid, "process_start": me.create_time()}
    replace_text(run_dir, Path(CONTROL_DIR_NAME) / LISTENER_FILE, json.dumps(record))


def _unmark_listening(run_dir: Path) -> None:
    with contextlib.suppress(OSError):
        folder = _open_folder(run_dir)
        try:
            os.unlink(LISTENER_FILE, dir_fd=folder)
        finally:
            os.close(folder)


def take_requests(run_dir: Path) -> list[str]:
    """Read and delete every pending request in ``run_dir/control/``, oldest first (problems are logged)."""
    where = Path(run_dir) / CONTROL_DIR_NAME
    try:
        folder = _open_folder(run_dir)
    except FileNotFoundError:
        return []
    except ControlFolderError as exc:
        logger.warning("trainbridge control: %s", exc)
        return []
    actions = []
    try:
        names = sorted(name for name in os.listdir(folder) if REQUEST_NAME.match(name))
        for name in names:
            action = _read_request(folder, name, where / name)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=folder)
            if action is not None:
                actions.append(action)
    finally:
        os.close(folder)
    return actions


class ExternalControl(Callback):
    """Rank 0 turns request files into control requests; the agreement makes every rank act."""

    def __init__(self) -> None:
        self._next_poll = 0.0

    def on_train_begin(self, context: TrainingContext, **kwargs: Any) -> None:
        if context.is_world_process_zero:
            try:
                prepare_folder(context.args.resolved_run_files_dir, context.args.share_run_dir_with_group)
                _mark_listening(context.args.resolved_run_files_dir)
            except OSError as exc:
                logger.warning("trainbridge control will not reach this run: %s", exc)
            stale = take_requests(context.args.resolved_run_files_dir)
            if stale:
                logger.warning("discarding control requests left from an earlier run: %s", ", ".join(stale))

    def on_step_end(self, context: TrainingContext, **kwargs: Any) -> None:
        if not context.is_world_process_zero:
            return
        now = time.monotonic()
        if now < self._next_poll:
            return
        self._next_poll = now + POLL_INTERVAL_S
        for action in take_requests(context.args.resolved_run_files_dir):
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

    def close(self, context: TrainingContext) -> None:
        if context.is_world_process_zero:
            _unmark_listening(context.args.resolved_run_files_dir)
