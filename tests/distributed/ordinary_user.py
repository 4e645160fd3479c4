"""Run commands as an ordinary (non-root) user with umask 002 in that user's home, as a login user would.

CI runs as root, on a clone whose location is unknown: the clone, its ``.venv`` or the interpreter the venv
was made from (pyenv under ``/root``, say) may be below a folder another user cannot enter.  ``user_runtime``
gives the user the project as installed, at the same paths: when a folder on the way is closed to them, each
command runs in its own mount namespace where that folder is covered by an empty one holding only the way
through (the interpreter, the venv, the tree), bound from the original; nothing is copied and nothing
outlives the command.  Where no mount namespace can be made (no ``CAP_SYS_ADMIN``), the interpreter and the
venv are hard-linked (copied across file systems) into a root-owned folder anyone can read instead, with
the copy's ``pyvenv.cfg``, interpreter link, console scripts and editable-install path pointed at the copies
(each written as a new file: the links share their content with the originals) and ``src/`` copied beside.

As root the user (``USER_NAME``) is created when missing (``useradd``: a user-private group, as Debian
gives login users) and commands run through ``setpriv``; as anyone else they run as the current user in a
fresh home.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

USER_NAME = "trainbridge-user"
"""The ordinary user the tests create (as root) and run as."""
UMASK = 0o002
"""Debian's and Ubuntu's umask for login users (user-private groups): folders 0775, files 0664."""
SRC = Path(__file__).resolve().parents[2] / "src"
CREATE_LOCK = Path(tempfile.gettempdir()) / "trainbridge-test-useradd.lock"
"""Held (``flock``) while the user is looked up and created: root's file, in the shared temporary folder."""


@dataclass(frozen=True)
class User:
    """Who runs: ``uid``/``gid`` (None: the current process's), their ``home``."""

    name: str
    home: Path
    uid: int | None = None
    gid: int | None = None

    def command(self, argv: Sequence[str], mounts: str = "") -> list[str]:
        """``argv`` as this user (``setpriv`` when switching from root), after the shell commands ``mounts``
        in a mount namespace of its own.  ``setpriv`` still holds root's capabilities when it executes its
        command, so a shell in between finds the command as the user would."""
        if self.uid is None:
            return list(argv)
        switch = f'setpriv --reuid={self.uid} --regid={self.gid} --init-groups sh -c \'exec "$@"\' sh "$@"'
        if not mounts:
            return ["sh", "-c", f"exec {switch}", "sh", *argv]
        return [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            f"set -e\n{mounts}\nexec {switch}",
            "sh",
            *argv,
        ]


def ordinary_user() -> User:
    """The user to run as: as root ``USER_NAME`` (created when missing), else the current user."""
    if os.geteuid() != 0:
        home = Path(tempfile.mkdtemp(prefix="trainbridge-home-"))
        return User(name=os.environ.get("USER", "me"), home=home)
    import fcntl
    import pwd

    # one creator at a time: pytest-xdist workers, or another test run on the same machine, may get here at once
    # (``useradd`` of a name being added fails; so does one racing for /etc/passwd's lock)
    with open(os.open(CREATE_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            entry = pwd.getpwnam(USER_NAME)
        except KeyError:
            subprocess.run(["useradd", "--create-home", "--user-group", USER_NAME], check=True, capture_output=True)
            entry = pwd.getpwnam(USER_NAME)
        home = Path(entry.pw_dir)
        if not home.is_dir():
            home.mkdir(mode=0o700, parents=True)
            os.chown(home, entry.pw_uid, entry.pw_gid)
    return User(name=USER_NAME, home=home, uid=entry.pw_uid, gid=entry.pw_gid)


@dataclass(frozen=True)
class Runtime:
    """What the user runs: ``bindir`` (the venv's ``bin``: ``python``, ``trainbridge``, ``torchrun``), the
    environment it needs (a copied interpreter's shared library, which its ``RUNPATH`` names where it was),
    and the shell commands that open the way to it in the command's mount namespace (``_mounts``)."""

    bindir: Path
    env: dict[str, str] = field(default_factory=dict)
    mounts: str = ""


def _runs_as(user: User, runtime: Runtime, code: str, *args: str) -> bool:
    python = runtime.bindir / "python"
    probe = subprocess.run(
        user.command([str(python), "-c", code, *args], runtime.mounts),
        capture_output=True,
        env={"PATH": "/usr/bin:/bin", **runtime.env},
        cwd="/",
    )
    return probe.returncode == 0


def _can_enter(folder: Path, uid: int, gids: set[int]) -> bool:
    info = folder.stat()
    if info.st_uid == uid:
        return bool(info.st_mode & 0o100)
    if info.st_gid in gids:
        return bool(info.st_mode & 0o010)
    return bool(info.st_mode & 0o001)


def _mounts(user: User, needed: list[Path], stage: Path) -> str:
    """Shell commands (run as root in the command's own mount namespace) covering each folder on the way to
    ``needed`` that ``user`` cannot enter with an empty one (tmpfs, 0755) holding only the way through,
    bound from the original, which ``stage`` (a private tmpfs) keeps reachable."""
    import pwd

    assert user.uid is not None and user.gid is not None
    gids = set(os.getgrouplist(pwd.getpwuid(user.uid).pw_name, user.gid))
    through: dict[Path, set[str]] = {}
    for path in needed:
        path = Path(os.path.realpath(path))
        for parent in reversed(path.parents):
            if not _can_enter(parent, user.uid, gids):
                child = path.relative_to(parent).parts[0]
                through.setdefault(parent, set()).add(child)
    if not through:
        return ""
    q = shlex.quote
    lines = [f"mount -t tmpfs -o mode=0700 tmpfs {q(str(stage))}"]
    for index, folder in enumerate(sorted(through, key=lambda f: len(f.parts))):  # outermost first
        kept = stage / str(index)
        lines += [f"mkdir {q(str(kept))}", f"mount --bind {q(str(folder))} {q(str(kept))}"]
        lines.append(f"mount -t tmpfs -o mode=0755 tmpfs {q(str(folder))}")
        for child in sorted(through[folder]):
            lines += [
                f"mkdir {q(str(folder / child))}",
                f"mount --bind {q(str(kept / child))} {q(str(folder / child))}",
            ]
    return "\n".join(lines)


def _link_copy(source: Path, target: Path) -> None:
    """``target`` as a copy of ``source`` sharing its files' content (hard links), or a copy when they are on
    different file systems."""
    if subprocess.run(["cp", "-al", str(source), str(target)], capture_output=True).returncode != 0:
        shutil.rmtree(target, ignore_errors=True)
        subprocess.run(["cp", "-a", str(source), str(target)], check=True)


def _rewrite(path: Path, text: str) -> None:
    """Replace ``path`` by a new file (never write into a hard link shared with the original)."""
    mode = path.stat().st_mode & 0o7777 if path.exists() else 0o644
    path.unlink(missing_ok=True)
    path.write_text(text)
    path.chmod(mode)


def _point_venv(venv: Path, old_venv: Path, python: Path, src: Path) -> None:
    """Point a copied venv at its interpreter ``python``, its own scripts and the tree's ``src`` copy."""
    config = venv / "pyvenv.cfg"
    lines = []
    for line in config.read_text().splitlines():
        key = line.partition("=")[0].strip()
        if key == "home":
            line = f"home = {python.parent}"
        elif key == "executable":
            line = f"executable = {python}"
        lines.append(line)
    _rewrite(config, "\n".join(lines) + "\n")
    bindir = venv / "bin"
    for name in ("python", "python3", f"python{sys.version_info.major}.{sys.version_info.minor}"):
        link = bindir / name
        if link.is_symlink() and Path(os.readlink(link)).is_absolute():
            link.unlink()
            link.symlink_to(python)
    old_shebang = f"#!{old_venv}/bin/"
    for script in bindir.iterdir():
        if script.is_symlink() or not script.is_file():
            continue
        with open(script, "rb") as handle:
            if not handle.read(len(old_shebang)).startswith(old_shebang.encode()):
                continue
        _rewrite(script, script.read_text().replace(old_shebang, f"#!{venv}/bin/", 1))
    purelib = Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"])
    for pth in purelib.glob("__editable__*trainbridge*.pth"):
        _rewrite(pth, f"{src}\n")


def _copied_runtime(user: User, copies: Path) -> Runtime:
    """The interpreter (unless the user can run it), the venv and ``src`` copied into ``copies``."""
    venv, base = Path(sys.prefix), Path(sys.base_prefix)
    interpreter = Path(os.path.realpath(sys.executable))
    copies.chmod(0o755)
    env = {}
    python = interpreter
    if not _runs_as(user, Runtime(interpreter.parent), "pass"):
        _link_copy(base, copies / "python")
        python = copies / "python" / interpreter.relative_to(base)
        env["LD_LIBRARY_PATH"] = str(copies / "python" / "lib")
    _link_copy(venv, copies / "venv")
    shutil.copytree(SRC, copies / "src", ignore=shutil.ignore_patterns("__pycache__"))
    _point_venv(copies / "venv", venv, python, copies / "src")
    return Runtime(copies / "venv" / "bin", env)


@contextlib.contextmanager
def user_runtime(user: User) -> Iterator[Runtime]:
    """The project's venv as ``user`` can run it (see the module's docstring)."""
    if sys.prefix == sys.base_prefix:
        raise RuntimeError("run the tests from the project's virtual environment")
    same_tree = "import sys, trainbridge; assert trainbridge.__file__.startswith(sys.argv[1])"
    runtime = Runtime(Path(sys.prefix) / "bin")
    if user.uid is None or _runs_as(user, runtime, same_tree, str(SRC)):
        yield runtime
        return
    where = "/var/tmp" if Path("/var/tmp").is_dir() else None
    scratch = Path(tempfile.mkdtemp(prefix="trainbridge-user-runtime-", dir=where))
    try:
        needed = [Path(sys.base_prefix), Path(sys.prefix), Path(sys.executable), SRC]
        runtime = Runtime(Path(sys.prefix) / "bin", mounts=_mounts(user, needed, scratch))
        if not _runs_as(user, runtime, same_tree, str(SRC)):  # no mount namespace here: copies instead
            runtime = _copied_runtime(user, scratch)
        yield runtime
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def run_as(
    user: User,
    argv: Sequence[str],
    runtime: Runtime,
    cwd: Path,
    env: dict[str, str] | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess[str]:
    """``argv`` as ``user`` with umask 002 in ``cwd``, the runtime's ``bin`` first on the ``PATH``; output
    captured."""
    environment = {
        "HOME": str(user.home),
        "USER": user.name,
        "LOGNAME": user.name,
        "PATH": f"{runtime.bindir}:/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        **runtime.env,
        **(env or {}),
    }
    return subprocess.run(
        user.command(argv, runtime.mounts),
        cwd=cwd,
        env=environment,
        umask=UMASK,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
