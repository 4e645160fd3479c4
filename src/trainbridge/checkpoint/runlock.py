"""One run per run folder: a lock on ``ckpt_output_dir`` that any exit releases and a dead holder cannot keep.

The lock is a folder ``ckpt_output_dir/.trainbridge-lock/`` with one JSON file per holder (a launcher
process): its run id, job key, host, pid, process start time and command line.  The file's mtime is
a heartbeat (``RunLock.heartbeat``, refreshed every ``HEARTBEAT_S`` by the launcher).

* A holder is **stale** when its host is this host and its pid no longer runs with the recorded start
  time (a crash or SIGKILL), or, on another host, when its heartbeat is older than ``STALE_AFTER_S``.
  Stale holders are removed with a warning.
* Holders of the **same job** share the lock: the launchers of one multi-node job (same rendezvous
  endpoint and id, or the same static master address and port) start into the same folder.
* Any other live holder makes ``acquire`` raise ``RunFolderBusy`` naming it, before anything is launched.
  Two runs starting at the same moment both write their file, then both look again: the later one
  (by start time, then host and pid) withdraws.

``release`` removes this holder's file (and the folder when it is the last one); it runs on any normal
exit, exception or signal; after a SIGKILL the stale check frees the folder for the next run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

logger = logging.getLogger(__name__)

LOCK_DIR_NAME = ".trainbridge-lock"
"""The lock folder inside ``ckpt_output_dir``."""
RUN_ID_ENV = "TRAINBRIDGE_RUN_ID"
"""The run id of the launch, passed to the workers (temporary checkpoint folders carry it)."""
HEARTBEAT_S = 10.0
"""How often a holder refreshes its file's mtime."""
STALE_AFTER_S = 120.0
"""A holder on another host whose heartbeat is older than this is considered dead."""


class RunFolderBusy(RuntimeError):
    """Another live run holds ``ckpt_output_dir``."""


@dataclass(frozen=True)
class Holder:
    """One lock holder, as written in its file."""

    run_id: str
    job: str
    host: str
    pid: int
    started: float
    process_start: float
    command: str
    path: Path

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on {self.host} (run {self.run_id}, started {when}: {self.command})"

    def is_alive(self, now: float | None = None) -> bool:
        """Same host: the pid runs with the recorded start time.  Other host: a recent heartbeat."""
        if self.host == socket.gethostname():
            try:
                return abs(psutil.Process(self.pid).create_time() - self.process_start) < 1.0
            except psutil.NoSuchProcess:
                return False
            except psutil.AccessDenied:
                return True
        try:
            age = (now or time.time()) - self.path.stat().st_mtime
        except OSError:
            return False
        return age < STALE_AFTER_S


def _read_holder(path: Path) -> Holder | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return Holder(str(data["run_id"]), str(data["job"]), str(data["host"]), int(data["pid"]),
                      float(data["started"]), float(data["process_start"]), str(data.get("command", "")), path)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def holders(output_dir: Path) -> list[Holder]:
    """Every holder file in ``output_dir``'s lock folder (live or not)."""
    folder = Path(output_dir) / LOCK_DIR_NAME
    if not folder.is_dir():
        return []
    found = [_read_holder(p) for p in sorted(folder.glob("*.json"))]
    return [h for h in found if h is not None]


def live_holders(output_dir: Path) -> list[Holder]:
    """The holders that are alive now."""
    return [h for h in holders(output_dir) if h.is_alive()]


class RunLock:
    """The lock one launcher holds on one run folder (a context manager)."""

    def __init__(self, output_dir: Path, job: str | None = None, run_id: str | None = None) -> None:
        self.output_dir = Path(output_dir)
        self.run_id = run_id or uuid.uuid4().hex[:12]
        self.job = job or f"single:{self.run_id}"
        self.folder = self.output_dir / LOCK_DIR_NAME
        self.path = self.folder / f"{socket.gethostname()}-{os.getpid()}-{self.run_id}.json"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> RunLock:
        """Take the lock or raise ``RunFolderBusy`` naming the live holder."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self._reap_stale()
        self._raise_if_taken(before_writing=True)
        process = psutil.Process()
        record = {
            "run_id": self.run_id, "job": self.job, "host": socket.gethostname(), "pid": os.getpid(),
            "started": time.time(), "process_start": process.create_time(),
            "command": " ".join(sys.argv)[:300],
        }
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(self.path)
        try:
            self._raise_if_taken(before_writing=False)
        except RunFolderBusy:
            self.path.unlink(missing_ok=True)
            raise
        self._thread = threading.Thread(target=self._beat, name="trainbridge-runlock", daemon=True)
        self._thread.start()
        return self

    def _reap_stale(self) -> None:
        for holder in holders(self.output_dir):
            if not holder.is_alive():
                logger.warning("removing the stale lock of a run that is gone: %s", holder.describe())
                holder.path.unlink(missing_ok=True)

    def _raise_if_taken(self, before_writing: bool) -> None:
        others = [h for h in live_holders(self.output_dir) if h.job != self.job and h.path != self.path]
        if not others:
            return
        if not before_writing:
            mine = _read_holder(self.path)
            key = (mine.started, mine.host, mine.pid) if mine else (float("inf"), "", 0)
            # both wrote at the same moment: only the later one withdraws
            if all(key < (h.started, h.host, h.pid) for h in others):
                return
        first = min(others, key=lambda h: h.started)
        raise RunFolderBusy(
            f"ckpt_output_dir {str(self.output_dir)!r} is in use by another run: {first.describe()}. "
            f"Wait for it to finish, stop it, or choose another ckpt_output_dir (a lock left by a crashed "
            f"run is removed automatically; its file is {first.path})"
        )

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        """Give the lock up (idempotent)."""
        self._stop.set()
        self.path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.folder.rmdir()  # only when no other holder of the same job is left

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def process_is_alive(host: str, pid: int) -> bool:
    """Whether ``pid`` on ``host`` may still run (True when ``host`` is another machine: unknown)."""
    if host != socket.gethostname():
        return True
    return psutil.pid_exists(pid)
