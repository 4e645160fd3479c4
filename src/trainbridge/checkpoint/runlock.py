"""One run per run folder: a lock on ``ckpt_output_dir`` that any exit releases and a dead holder cannot keep.

The lock is a private (0700) folder ``ckpt_output_dir/.trainbridge-lock/`` with one JSON file (0600) per
holder (a launcher process): its run id, job key, host, pid, process start time and command line.  The
holder keeps an exclusive ``flock`` on its file while it lives, and the file's mtime is a heartbeat
(refreshed every ``HEARTBEAT_S``).  Nothing here follows a symbolic link.

* A holder is **stale** when its file is not this user's (planted), when on this host nobody holds its
  ``flock`` (the launcher is gone: crash, SIGKILL; or the file names a process that is no trainbridge
  launcher, pid 1 say), or, on another host, when its heartbeat is older than ``STALE_AFTER_S``.
  Stale holders are removed with a warning that says why.
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
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from trainbridge.core.private_files import PRIVATE_DIR_MODE, PRIVATE_FILE_MODE

logger = logging.getLogger(__name__)

LOCK_DIR_NAME = ".trainbridge-lock"
"""The lock folder inside ``ckpt_output_dir``."""
RUN_ID_ENV = "TRAINBRIDGE_RUN_ID"
"""The run id of the launch, passed to the workers (temporary checkpoint folders carry it)."""
HEARTBEAT_S = 10.0
"""How often a holder refreshes its file's mtime."""
STALE_AFTER_S = 120.0
"""A holder on another host whose heartbeat is older than this is considered dead."""

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


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
    owner: int = -1
    """The uid owning the holder file (a file of another user is never a live holder)."""

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on {self.host} (run {self.run_id}, started {when}: {self.command})"

    def is_alive(self, now: float | None = None) -> bool:
        """Same host: its launcher holds the file's ``flock``.  Other host: a recent heartbeat."""
        return self.stale_reason(now) is None

    def stale_reason(self, now: float | None = None) -> str | None:
        """Why this holder is not a live run (None when it is)."""
        if self.owner != os.geteuid():
            return f"its file belongs to uid {self.owner}, not to you"
        if self.host == socket.gethostname():
            held = _flock_held(self.path)
            if held is None:  # no flock here (some network file systems): the pid and its start time
                held = _same_process(self.pid, self.process_start)
            gone = f"no trainbridge launcher of yours holds it (pid {self.pid}: gone or another program)"
            return None if held else gone
        try:
            age = (now or time.time()) - os.stat(self.path, follow_symlinks=False).st_mtime
        except OSError:
            return "its file is gone"
        return None if age < STALE_AFTER_S else f"no heartbeat from {self.host} for {age:.0f} s"


def _flock_held(path: Path) -> bool | None:
    """Whether a process holds the exclusive ``flock`` of ``path`` (None: cannot tell here)."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError as exc:
        return None if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL) else True
    finally:
        os.close(fd)
    return False


def _same_process(pid: int, process_start: float) -> bool:
    try:
        process = psutil.Process(pid)
        return abs(process.create_time() - process_start) < 1.0 and process.uids().real == os.getuid()
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return False


def _read_holder(path: Path) -> Holder | None:
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        raw = handle.read(65536) if stat.S_ISREG(info.st_mode) else b""
    try:
        data: dict[str, Any] = json.loads(raw)
        return Holder(
            str(data["run_id"]),
            str(data["job"]),
            str(data["host"]),
            int(data["pid"]),
            float(data["started"]),
            float(data["process_start"]),
            str(data.get("command", "")),
            path,
            info.st_uid,
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return Holder("?", "?", "?", 0, 0.0, 0.0, "an unreadable lock file", path, info.st_uid)


def holders(output_dir: Path) -> list[Holder]:
    """Every holder file in ``output_dir``'s lock folder (live or not)."""
    folder = Path(output_dir) / LOCK_DIR_NAME
    if folder.is_symlink() or not folder.is_dir():
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
        self._fd: int | None = None

    def _make_folder(self) -> None:
        """The lock folder, 0700, this user's, not a link (``RunFolderBusy`` saying what is wrong)."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(self.folder, PRIVATE_DIR_MODE)
        info = os.lstat(self.folder)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            what = "is not a folder (a link?)" if not stat.S_ISDIR(info.st_mode) else f"belongs to uid {info.st_uid}"
            raise RunFolderBusy(
                f"the run folder's lock {self.folder} {what}; remove it (a trainbridge lock is a "
                "folder of your own) or choose another ckpt_output_dir"
            )
        if stat.S_IMODE(info.st_mode) != PRIVATE_DIR_MODE:
            os.chmod(self.folder, PRIVATE_DIR_MODE)

    def acquire(self) -> RunLock:
        """Take the lock or raise ``RunFolderBusy`` naming the live holder."""
        self._make_folder()
        self._reap_stale()
        self._raise_if_taken(before_writing=True)
        process = psutil.Process()
        record = {
            "run_id": self.run_id,
            "job": self.job,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": time.time(),
            "process_start": process.create_time(),
            "command": " ".join(sys.argv)[:300],
        }
        tmp = self.path.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, PRIVATE_FILE_MODE)
        os.fchmod(fd, PRIVATE_FILE_MODE)
        os.write(fd, json.dumps(record).encode("utf-8"))
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while this launcher lives
        self._fd = fd
        tmp.replace(self.path)
        try:
            self._raise_if_taken(before_writing=False)
        except RunFolderBusy:
            self._close()
            self.path.unlink(missing_ok=True)
            raise
        self._thread = threading.Thread(target=self._beat, name="trainbridge-runlock", daemon=True)
        self._thread.start()
        return self

    def _reap_stale(self) -> None:
        for holder in holders(self.output_dir):
            reason = holder.stale_reason()
            if reason is not None:
                logger.warning("taking over the stale lock %s (%s): %s", holder.path.name, holder.describe(), reason)
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
            with contextlib.suppress(OSError, TypeError):
                os.utime(self._fd)  # type: ignore[arg-type]

    def _close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def release(self) -> None:
        """Give the lock up (idempotent)."""
        self._stop.set()
        self.path.unlink(missing_ok=True)
        self._close()
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
