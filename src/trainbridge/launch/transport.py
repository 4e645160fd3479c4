"""Carrying the validated ``TrainingArgs`` and the run's ``RunPlan`` (its code: callbacks, functions, the
model's ``model_init``) from the parent to the workers.

Callbacks are live objects in the parent process; the torchrun workers are new processes.  The whole
``(args, plan)`` travels as one cloudpickle payload file:

- instances keep their constructor arguments and attributes; lambdas, closures and classes defined
  in ``__main__`` (a script or a notebook) are pickled *by value*, so the workers need not import them;
- importable classes and functions (``transformers.EarlyStoppingCallback``, your package) are pickled
  *by reference* and imported in the worker;
- a module the workers cannot import (a notebook-local module, a module built at runtime) can be
  sent by value with ``register_by_value(module)`` before calling ``run_training``.

The file is written with mode 0600 inside a private (0700) directory and authenticated with
HMAC-SHA256 under a fresh random key that reaches the workers through the environment
(``TRAINBRIDGE_PAYLOAD_KEY``), never through a command line.  ``read_payload`` verifies the MAC
before unpickling, so a tampered or foreign file is never unpickled.

The folders the parent imports user code from (its ``sys.path`` beyond the installation) travel in the
signed part of the payload, not in ``PYTHONPATH``: the worker appends them to its ``sys.path`` after
site-packages before unpickling, so a file in such a folder can name a class but never shadow an
installed package, and nothing there runs at interpreter start (``sitecustomize``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import pickle
import secrets
import stat
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import cloudpickle

from trainbridge.core.config import RunPlan, TrainingArgs
from trainbridge.core.scratch import owned_folder, remove_stale_folders

PAYLOAD_KEY_ENV = "TRAINBRIDGE_PAYLOAD_KEY"
"""Environment variable that carries the payload's HMAC key (hex) to the workers."""

PAYLOAD_FILE_NAME = "training_args.payload"
"""Name of the payload file inside the directory given to ``write_payload``."""

PAYLOAD_DIR_PREFIX = "trainbridge-"
"""A launch's private folder in the temporary directory: ``trainbridge-{pid}_{start time}-XXXXXX``."""

_MAGIC = b"TRAINBRIDGE-PAYLOAD-2\n"
_MAC_SIZE = hashlib.sha256().digest_size

# Type names (as pickle reports them) of objects that cannot cross a process boundary, and what
# they mean for a user reading the error.
_UNPICKLABLE_KINDS: dict[str, str] = {
    "_thread.lock": "holds a thread lock",
    "_thread.RLock": "holds a thread lock",
    "_thread._local": "holds thread-local storage",
    "TextIOWrapper": "holds an open file handle",
    "BufferedReader": "holds an open file handle",
    "BufferedWriter": "holds an open file handle",
    "BufferedRandom": "holds an open file handle",
    "FileIO": "holds an open file handle",
    "Cannot pickle files": "holds an open file handle",
    "socket": "holds a socket",
    "generator": "holds a generator",
    "SSLContext": "holds an SSL context",
    "Thread": "holds a thread",
    "ProcessGroup": "holds a torch process group",
}


class CallbackTransportError(ValueError):
    """A callback or event function cannot be sent to the workers (raised in the parent, before launch)."""


class PayloadIntegrityError(ValueError):
    """A payload file failed authentication (tampered, truncated, foreign, or the wrong key); it was not unpickled."""


def register_by_value(module: ModuleType) -> None:
    """Send everything defined in ``module`` by value instead of by import path.

    Use it for a module the workers cannot import (a notebook-local module, a file outside the
    workers' ``sys.path``, a module created at runtime).  Classes defined in ``__main__`` are already
    sent by value.  A thin pass-through to ``cloudpickle.register_pickle_by_value``.
    """
    cloudpickle.register_pickle_by_value(module)


def describe(obj: Any) -> str:
    """Short human name of a callback or function: its qualified name and module."""
    is_named = isinstance(obj, type) or (callable(obj) and hasattr(obj, "__qualname__"))
    target = obj if is_named else type(obj)
    module = getattr(target, "__module__", None) or "?"
    qualname = getattr(target, "__qualname__", None) or type(target).__name__
    return f"{module}.{qualname}"


def _explain(exc: BaseException) -> str:
    """Turn a pickling error into a reason a user understands (keeping pickle's own words)."""
    text = f"{type(exc).__name__}: {exc}"
    for kind, meaning in _UNPICKLABLE_KINDS.items():
        if kind in str(exc):
            return f"{meaning} ({text})"
    return text


def _unpicklable_attribute(obj: Any, depth: int = 3) -> str | None:
    """Dotted path of the first attribute of ``obj`` that cannot be pickled, ``depth`` levels down."""
    if depth == 0:
        return None
    try:
        attributes = vars(obj)
    except TypeError:
        return None
    for name, value in attributes.items():
        try:
            cloudpickle.dumps(value)
        except Exception:
            inner = _unpicklable_attribute(value, depth - 1)
            return f"{name}.{inner}" if inner else name
    return None


def _unpicklable_part(obj: Any) -> str | None:
    """Where in ``obj`` pickling fails: ``captured variable 'x'`` (closures) or ``attribute 'a.b'``."""
    closure = getattr(obj, "__closure__", None)
    code = getattr(obj, "__code__", None)
    if closure and code is not None:
        for name, cell in zip(code.co_freevars, closure):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            try:
                cloudpickle.dumps(value)
            except Exception:
                return f"captured variable {name!r}"
    attribute = _unpicklable_attribute(obj)
    return f"attribute {attribute!r}" if attribute else None


def _round_trip(obj: Any) -> None:
    """``loads(dumps(obj))``; raises whatever pickling raises."""
    pickle.loads(cloudpickle.dumps(obj))


def _check_one(obj: Any, label: str) -> None:
    try:
        _round_trip(obj)
    except Exception as exc:
        part = None if isinstance(obj, type) else _unpicklable_part(obj)
        where = f"{part} " if part else ""
        raise CallbackTransportError(
            f"{label} ({describe(obj)}) cannot be sent to the workers: {where}{_explain(exc)}. "
            "Callbacks are pickled (cloudpickle) in the parent and rebuilt in every worker; create "
            "such resources lazily in on_train_begin (or pass a CallbackSpec) instead of holding them."
        ) from exc


def check_transportable(args: TrainingArgs, plan: RunPlan) -> None:
    """Check, in the parent, that every callback and event function survives the trip to the workers.

    Each callback and each event function is serialised and deserialised on its own, so the error
    names the culprit (``callbacks[1] (mypkg.MyCallback): attribute 'lock' holds a thread lock``);
    then the whole ``(args, plan)`` payload is checked.  Raises ``CallbackTransportError``.
    """
    for index, callback in enumerate(plan.callbacks):
        _check_one(callback, f"callbacks[{index}]")
    for event, functions in plan.event_functions.items():
        for index, function in enumerate(functions):
            _check_one(function, f"event function {event.value}[{index}]")
    if plan.model_init is not None:
        _check_one(plan.model_init, "model_init")
    try:
        _round_trip((args, plan))
    except Exception as exc:
        raise CallbackTransportError(f"TrainingArgs cannot be sent to the workers: {_explain(exc)}") from exc


def make_payload_folder() -> Path:
    """A fresh private (0700) folder for this launch's payload and torchrun's files, named after this
    launcher (``core.scratch.owned_folder``; its caller removes it); first removes such folders left by this
    user's launchers that are gone (SIGKILLed, so their ``finally`` never ran)."""
    return owned_folder(PAYLOAD_DIR_PREFIX, remove_at_exit=False)


def remove_stale_payload_folders(where: str | Path | None = None) -> list[Path]:
    """Remove the payload folders in ``where`` (default: the temporary directory) that belong to this
    user and whose launcher no longer runs; returns them.  Links, other users' folders and folders of a
    live launcher are left alone."""
    return remove_stale_folders(PAYLOAD_DIR_PREFIX, where)


def _mac(key: str, body: bytes) -> bytes:
    return hmac.new(key.encode("utf-8"), body, hashlib.sha256).digest()


def _sealed(body: bytes, key: str) -> bytes:
    """``body`` with the magic header and its HMAC-SHA256 under ``key`` in front."""
    return _MAGIC + _mac(key, body) + body


def _opened(path: str | Path, data: bytes, key: str, key_source: str) -> bytes:
    """The body of a file ``_sealed`` wrote, after its MAC is checked (in constant time) against ``key``;
    ``PayloadIntegrityError`` otherwise (nothing is unpickled).  ``key_source`` names where the key came from."""
    header = len(_MAGIC) + _MAC_SIZE
    if len(data) < header or not data.startswith(_MAGIC):
        raise PayloadIntegrityError(f"{path}: not a trainbridge payload file")
    mac, body = data[len(_MAGIC) : header], data[header:]
    if not key or not hmac.compare_digest(mac, _mac(key, body)):
        raise PayloadIntegrityError(
            f"{path}: payload authentication failed (the file was modified or the key "
            f"in {key_source} is not the one it was written with); refusing to unpickle it"
        )
    return body


def write_payload(
    args: TrainingArgs, plan: RunPlan, directory: str | Path, import_path: Sequence[str] = ()
) -> tuple[Path, str]:
    """Write ``(args, plan)`` as an authenticated payload file in ``directory``; return ``(path, hex_key)``.

    ``import_path``: folders the worker appends to ``sys.path`` (after site-packages) before unpickling,
    signed with the rest.  ``directory`` must be private to the current user (no group/other permissions, e.g. from
    ``tempfile.mkdtemp``).  The file is created exclusively with mode 0600.  The key is a fresh
    ``secrets.token_hex(32)``; hand it to the workers via the ``TRAINBRIDGE_PAYLOAD_KEY`` environment
    variable, never on a command line.
    """
    directory = Path(directory)
    mode = stat.S_IMODE(directory.stat().st_mode)
    if mode & 0o077:
        raise PermissionError(f"payload directory {str(directory)!r} has mode {mode:04o}; it must be private (0700)")
    header = json.dumps({"import_path": [str(p) for p in import_path]}).encode("utf-8")
    body = len(header).to_bytes(4, "big") + header + cloudpickle.dumps((args, plan))
    key = secrets.token_hex(32)
    path = directory / PAYLOAD_FILE_NAME
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(_sealed(body, key))
    return path, key


def read_payload(path: str | Path, key: str) -> tuple[TrainingArgs, RunPlan]:
    """Verify and load the ``(args, plan)`` of a payload written by ``write_payload``.

    The HMAC is checked with ``hmac.compare_digest`` *before* anything is unpickled; the signed import
    folders are then appended to ``sys.path``.  A file that was
    changed, truncated, written by someone else or checked with the wrong key raises
    ``PayloadIntegrityError``.
    """
    body = _opened(path, Path(path).read_bytes(), key, PAYLOAD_KEY_ENV)
    size = int.from_bytes(body[:4], "big")
    header = json.loads(body[4 : 4 + size])
    for entry in header["import_path"]:
        if entry not in sys.path:
            sys.path.append(entry)  # after site-packages: a user folder never shadows an installed module
    loaded = pickle.loads(body[4 + size :])
    if not (
        isinstance(loaded, tuple)
        and len(loaded) == 2
        and isinstance(loaded[0], TrainingArgs)
        and isinstance(loaded[1], RunPlan)
    ):
        raise PayloadIntegrityError(f"{path}: payload holds a {type(loaded).__name__}, not (TrainingArgs, RunPlan)")
    return loaded[0], loaded[1]
