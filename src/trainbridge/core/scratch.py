"""Temporary folders owned by a process: named after it, removed when it ends, swept once it is gone.

``owned_folder(prefix)`` makes a fresh private (0700) folder ``{tmp}/{prefix}{pid}_{start time}-XXXXXXXX``
(``process_token``: the start time makes a reused pid another process).  It is removed when this process
exits through its exit handlers (a normal end, an uncaught error, ``launch.process_exit.exit_now``; not
by a child forked from it, which inherits the handler);
a process that could not run them (SIGKILL, a default SIGTERM, ``os._exit``) leaves its folder, which the
next ``owned_folder`` of the same prefix by this user removes (``remove_stale_folders``).  Links, other
users' folders and folders of a live process are left alone.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import psutil


def process_token(pid: int | None = None) -> str:
    """``pid:create_time`` of ``pid`` (default: this process)."""
    process = psutil.Process(pid or os.getpid())
    return f"{process.pid}:{process.create_time():.3f}"


def token_alive(token: str) -> bool:
    """Whether the process named by a ``process_token`` still runs (a reused pid is not alive)."""
    pid_text, _, created = token.partition(":")
    try:
        process = psutil.Process(int(pid_text))
        return process.status() != psutil.STATUS_ZOMBIE and f"{process.create_time():.3f}" == created
    except (psutil.NoSuchProcess, ValueError):
        return False
    except psutil.AccessDenied:
        return True


def owned_folder(prefix: str, *, remove_at_exit: bool = True) -> Path:
    """A fresh private folder named after this process (see the module docstring); first removes this
    user's folders of ``prefix`` whose process is gone.  ``remove_at_exit``: also remove it when this
    process exits (the caller may remove it earlier, e.g. in a ``finally``)."""
    remove_stale_folders(prefix)
    folder = Path(tempfile.mkdtemp(prefix=f"{prefix}{process_token().replace(':', '_')}-"))
    if remove_at_exit:
        atexit.register(_remove_if_owner, folder, os.getpid())
    return folder


def _remove_if_owner(folder: Path, owner: int) -> None:
    """Exit handler: remove ``folder`` unless this is a forked child of its owner (which inherited the
    handler; the folder is still its parent's)."""
    if os.getpid() == owner:
        shutil.rmtree(folder, ignore_errors=True)


def remove_stale_folders(prefix: str, where: str | Path | None = None) -> list[Path]:
    """Remove the folders ``{prefix}{pid}_{start}-*`` in ``where`` (default: the temporary directory) that
    belong to this user and whose process no longer runs; returns them."""
    removed: list[Path] = []
    try:
        entries = list(os.scandir(where or tempfile.gettempdir()))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(prefix) or not entry.is_dir(follow_symlinks=False):
            continue
        token = entry.name[len(prefix) :].rpartition("-")[0].replace("_", ":")
        pid, _, started = token.partition(":")
        try:
            info = entry.stat(follow_symlinks=False)
            float(started)
        except (OSError, ValueError):
            continue
        if not pid.isdigit() or info.st_uid != os.geteuid() or token_alive(token):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(Path(entry.path))
    return removed
