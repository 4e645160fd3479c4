"""Bytes on disk before a checkpoint is called complete, and a clear message when the disk is full."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from trainbridge.core.private_files import PRIVATE_FILE_MODE

_DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_DISK_FULL_TEXT = ("no space left on device", "disk quota exceeded", "storagefull")


def fsync_file(path: Path) -> None:
    """Flush ``path``'s data to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (new names, renames) to stable storage (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_durably(path: Path, text: str, mode: int = PRIVATE_FILE_MODE) -> None:
    """Write ``text`` to ``path`` (a new file of ``mode``, whatever the umask; a symbolic link there is
    refused, not followed) and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), mode)
    os.fchmod(fd, mode)
    with open(fd, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def is_disk_full(error: BaseException | None) -> bool:
    """Whether ``error`` (or an error it was raised from) means the disk or quota is full.

    Also recognises errors that are not ``OSError`` but carry the OS message (safetensors' Rust
    ``IoError(... StorageFull ...)``)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _DISK_FULL_ERRNOS:
            return True
        if any(text in str(error).lower() for text in _DISK_FULL_TEXT):
            return True
        error = error.__cause__ or error.__context__
    return False


def mount_point(path: Path) -> Path:
    """The mount point of the filesystem holding ``path`` (its nearest existing ancestor)."""
    path = Path(path).resolve()
    while not path.exists():
        path = path.parent
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def disk_full_message(folder: Path, checkpoint: Path, previous: Path | None) -> str:
    """What to tell the user when a checkpoint did not fit."""
    mount = mount_point(folder)
    try:
        usage = shutil.disk_usage(mount)
        space = f"{usage.free / 2**20:.0f} MiB free of {usage.total / 2**30:.1f} GiB"
    except OSError:
        space = "free space unknown"
    kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint existed"
    return (
        f"disk full: the filesystem at {mount} ({space}) has no room for checkpoint {checkpoint.name} in "
        f"{folder}; {kept} and the partial one was removed. Free space, lower save_total_limit, or point "
        f"ckpt_output_dir at a larger disk"
    )
