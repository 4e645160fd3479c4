"""Folders and files on a shared machine: who could have changed them, and writes that follow no link.

``folder_problem`` is an ssh ``StrictModes``-style check: the folder is owned by this user (or root)
and nobody else can write it, and no parent up to ``/`` lets another user rename it away (a parent
writable by others needs the sticky bit, as ``/tmp`` has).  Writable by its group is accepted when the
group is the user's private group (no other member), as Debian's OpenSSH accepts it: a login user's
umask 002 makes every folder so.  It returns a one-line reason, or None.

``open_in`` opens a file below a folder one component at a time with ``O_NOFOLLOW``, so a symbolic link
planted anywhere below the folder is refused (``ELOOP``/``ENOTDIR``) instead of followed, and creates
what is missing with the given modes, whatever the umask.
"""

from __future__ import annotations

import contextlib
import errno
import grp
import os
import pwd
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
GROUP_DIR_MODE = 0o750
"""A run folder shared with its group (readable, not writable, by the group)."""
GROUP_FILE_MODE = 0o640

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def modes(share_with_group: bool) -> tuple[int, int]:
    """``(folder mode, file mode)`` for run-folder content: private, or readable by the group."""
    return (GROUP_DIR_MODE, GROUP_FILE_MODE) if share_with_group else (PRIVATE_DIR_MODE, PRIVATE_FILE_MODE)


def _owner_problem(path: Path, info: os.stat_result, uid: int) -> str | None:
    if info.st_uid not in (uid, 0):
        return f"{path} is owned by uid {info.st_uid}, not by you (uid {uid})"
    return None


def group_members(gid: int) -> set[str] | None:
    """The names of every member of group ``gid``: the users whose primary group it is and its listed
    members (``/etc/passwd`` and ``/etc/group``, or the system's name service); None when it has no entry."""
    try:
        group = grp.getgrgid(gid)
    except KeyError:
        return None
    return {entry.pw_name for entry in pwd.getpwall() if entry.pw_gid == gid} | set(group.gr_mem)


def private_group(gid: int, uid: int) -> bool:
    """True when group ``gid`` is ``uid``'s own (a user-private group, as Debian and Ubuntu give each login
    user): its only member is that user (or root), who may be in it as primary group or listed.  As Debian's
    OpenSSH decides for ``StrictModes``; a group with no member (a setgid program's) is not private."""
    members = group_members(gid)
    if not members:
        return False
    trusted = {0, uid}
    for name in members:
        try:
            if pwd.getpwnam(name).pw_uid not in trusted:
                return False
        except KeyError:
            return False
    return True


def _group_name(gid: int) -> str:
    try:
        return repr(grp.getgrgid(gid).gr_name)
    except KeyError:
        return f"gid {gid}"


def _writers(info: os.stat_result, uid: int, trust_group: bool) -> str | None:
    """Who besides its owner (and root) can write a folder with ``info``; None: nobody else."""
    found = []
    if info.st_mode & 0o020 and not trust_group and not private_group(info.st_gid, uid):
        members = sorted(group_members(info.st_gid) or ())
        listed = ", ".join(members[:5]) + (", ..." if len(members) > 5 else "")
        found.append(f"its group {_group_name(info.st_gid)} (members: {listed or 'none'}; not yours alone)")
    if info.st_mode & 0o002:
        found.append("others")
    return " and ".join(found) or None


def folder_problem(path: str | Path, uid: int | None = None, trust_group: bool = False) -> str | None:
    """Why another user could have put or could change what is in ``path`` (None: nobody but you or root).

    ``path`` itself: owned by ``uid`` (default: this process's) or root, not writable by others, and
    writable by its group only when the group is ``uid``'s private group (``private_group``).  Each parent:
    owned by ``uid`` or root, and writable by others (or a group not private) only with the sticky bit.
    ``trust_group``: writable by any group is accepted (a group project folder whose members are trusted).
    A symbolic link in the path is judged by what it points to (its target's folders).
    """
    uid = os.geteuid() if uid is None else uid
    target = Path(os.path.realpath(path))
    info = os.stat(target)
    if not stat.S_ISDIR(info.st_mode):
        return f"{target} is not a folder"
    problem = _owner_problem(target, info, uid)
    if problem:
        return problem
    who = _writers(info, uid, trust_group)
    if who:
        return f"{target} is writable by {who} (mode {stat.S_IMODE(info.st_mode):04o})"
    for parent in target.parents:
        info = os.stat(parent)
        if info.st_uid not in (uid, 0) and info.st_mode & 0o200:
            return f"{parent}, a parent of {target}, is owned by uid {info.st_uid}, who could replace what is inside"
        who = None if info.st_mode & stat.S_ISVTX else _writers(info, uid, trust_group)
        if who:
            return (
                f"{parent}, a parent of {target}, is writable by {who} without the sticky bit "
                f"(mode {stat.S_IMODE(info.st_mode):04o}): they could replace what is inside"
            )
    return None


def _refuse_link(exc: OSError, path: Path) -> OSError:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
        return OSError(
            exc.errno,
            f"{path}: a symbolic link (or not a folder) where a file or folder was expected; refusing to follow it",
            str(path),
        )
    return exc


@contextlib.contextmanager
def _walk(root: Path, parts: tuple[str, ...], dir_mode: int) -> Iterator[int]:
    """A descriptor of ``root/parts...`` (created with ``dir_mode`` when missing), no link followed below ``root``."""
    fd = os.open(root, os.O_RDONLY | _DIRECTORY | _CLOEXEC)
    try:
        here = root
        for part in parts:
            here = here / part
            try:
                os.mkdir(part, dir_mode, dir_fd=fd)
                created = True
            except FileExistsError:
                created = False
            try:
                child = os.open(part, os.O_RDONLY | _DIRECTORY | _NOFOLLOW | _CLOEXEC, dir_fd=fd)
            except OSError as exc:
                raise _refuse_link(exc, here) from None
            os.close(fd)
            fd = child
            if created:
                os.fchmod(fd, dir_mode)  # the mode asked for, whatever the umask
        yield fd
    finally:
        os.close(fd)


def open_in(
    root: str | Path,
    relative: str | Path,
    flags: int,
    file_mode: int = PRIVATE_FILE_MODE,
    dir_mode: int = PRIVATE_DIR_MODE,
) -> int:
    """``os.open`` of ``root/relative`` following no symbolic link below ``root``; missing folders are
    created with ``dir_mode`` and a created file gets ``file_mode`` (whatever the umask)."""
    root, relative = Path(root), Path(relative)
    if relative.is_absolute() or ".." in relative.parts:
        raise ValueError(f"{relative} must be a plain path inside {root}")
    with _walk(root, relative.parts[:-1], dir_mode) as parent:
        try:
            fd = os.open(relative.name, flags | _NOFOLLOW | _CLOEXEC, file_mode, dir_fd=parent)
        except OSError as exc:
            raise _refuse_link(exc, root / relative) from None
    if flags & os.O_CREAT and os.fstat(fd).st_uid == os.geteuid():
        os.fchmod(fd, file_mode)  # the mode asked for, whatever the umask (or an older file's mode)
    return fd


def append_text(
    root: str | Path,
    relative: str | Path,
    text: str,
    file_mode: int = PRIVATE_FILE_MODE,
    dir_mode: int = PRIVATE_DIR_MODE,
) -> None:
    """Append ``text`` to ``root/relative`` (created when missing), following no link below ``root``."""
    fd = open_in(root, relative, os.O_WRONLY | os.O_APPEND | os.O_CREAT, file_mode, dir_mode)
    with os.fdopen(fd, "a", encoding="utf-8") as handle:
        handle.write(text)


def replace_text(
    root: str | Path,
    relative: str | Path,
    text: str,
    file_mode: int = PRIVATE_FILE_MODE,
    dir_mode: int = PRIVATE_DIR_MODE,
) -> None:
    """Write ``root/relative`` atomically (a new temporary file renamed over it), following no link: a link
    at the temporary name is removed, never written through; one at the final name is replaced."""
    relative = Path(relative)
    tmp = relative.with_name(f".{relative.name}.{os.getpid()}.tmp")
    with _walk(Path(root), relative.parts[:-1], dir_mode) as parent:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp.name, dir_fd=parent)
        fd = open_in(root, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, file_mode, dir_mode)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp.name, relative.name, src_dir_fd=parent, dst_dir_fd=parent)


def make_run_folder(path: str | Path, share_with_group: bool = False) -> list[Path]:
    """Create ``path`` and its missing parents with the run folder's mode (0700, or 0750 shared with the
    group), whatever the umask; returns the folders this call created, outermost first."""
    path = Path(path)
    dir_mode = modes(share_with_group)[0]
    missing = []
    here = path
    while not here.exists() and here != here.parent:
        missing.append(here)
        here = here.parent
    created = []
    for folder in reversed(missing):
        try:
            os.mkdir(folder, dir_mode)
        except FileExistsError:
            continue
        os.chmod(folder, dir_mode)
        created.append(folder)
    return created


def make_output_folder(path: str | Path, field: str) -> None:
    """``make_run_folder(path)`` for a config's output folder (``field``: the config field naming it); an
    ``NotADirectoryError`` naming the field, the value and the fix when ``path`` cannot be one (a file...)."""
    try:
        make_run_folder(path)
        if not Path(path).is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "it is a file, not a folder")
    except OSError as error:
        raise NotADirectoryError(
            f"{field}={str(path)!r}: cannot be used as the output folder ({error.strerror or error}); choose "
            f"another {field.rsplit('.', 1)[-1]}"
        ) from error


def make_private(folder: str | Path, share_with_group: bool = False) -> None:
    """Every folder and file under ``folder`` (itself included) private: 0700 and 0600, or readable by the
    group with ``share_with_group`` (0750 and 0640), whatever the umask or the writer (DCP, DeepSpeed,
    ``save_pretrained``, matplotlib) chose.  Symbolic links are left as they are, never followed."""
    folder = Path(folder)
    dir_mode, file_mode = modes(share_with_group)
    for path in [folder, *folder.rglob("*")]:
        if path.is_symlink():
            continue
        path.chmod(dir_mode if path.is_dir() else file_mode)


def open_private(path: str | Path, mode: str = "a", share_with_group: bool = False) -> IO[Any]:
    """``open(path, mode)`` ("a", "w", "ab" or "wb") with a created file and its missing folders private (or
    readable by the group), whatever the umask; a symbolic link at ``path`` is refused, never followed."""
    path = Path(path)
    dir_mode, file_mode = modes(share_with_group)
    make_run_folder(path.parent, share_with_group)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if "a" in mode else os.O_TRUNC)
    fd = open_in(path.parent, path.name, flags, file_mode, dir_mode)
    if "b" in mode:
        return os.fdopen(fd, mode)
    return os.fdopen(fd, mode, encoding="utf-8")
