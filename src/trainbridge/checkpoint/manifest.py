"""Checkpoints you can trust: a manifest of every file's size and SHA-256, and the run's fingerprint.

Rank 0 writes ``manifest.json`` after every rank's files are in the temporary folder and before the
``COMPLETE`` marker; hashing reads each file once and fsyncs it on the way.  At resume,
``verify_checkpoint`` re-checks sizes and checksums: a truncated ``model.safetensors`` or an emptied
optimizer file is named instead of failing deep inside a loader.  A checkpoint without a manifest, or
with files its manifest does not list, is refused unless the user allows it (``resume_allow_unverified``).

The **fingerprint** (``run_fingerprint``) records what the checkpoint belongs to: the model's
architecture and configuration (hashed), the base model folder and the training data (path, size and
a hash of its first MiB).  ``fingerprint_mismatches`` lists what differs from the current run.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainbridge.checkpoint.durability import fsync_dir, fsync_file, write_durably
from trainbridge.checkpoint.layout import COMPLETE_MARKER, MANIFEST_FILE
from trainbridge.core.private_files import PRIVATE_FILE_MODE

UNVERIFIED_FIX = "set resume_allow_unverified=True to use it anyway, if you trust who wrote it"
_CHUNK = 8 * 2**20
_IGNORED_CONFIG_KEYS = {
    "_name_or_path",
    "transformers_version",
    "torch_dtype",
    "dtype",
    "use_cache",
    "_commit_hash",
    "_attn_implementation_autoset",
    "attn_implementation",
}


def _sha256(path: Path, fsync: bool = False) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
        if fsync:
            os.fsync(handle.fileno())
    return digest.hexdigest()


def _files(folder: Path) -> list[Path]:
    manifest = folder / MANIFEST_FILE
    return sorted(p for p in folder.rglob("*") if p.is_file() and p != manifest)


def write_manifest(
    folder: Path, fingerprint: Mapping[str, Any] | None = None, checksums: bool = True, mode: int = PRIVATE_FILE_MODE
) -> dict[str, Any]:
    """Hash (unless ``checksums`` is off) and fsync every file in ``folder``, then write ``manifest.json``
    durably (a file of ``mode``)."""
    files: dict[str, dict[str, Any]] = {}
    for path in _files(folder):
        entry: dict[str, Any] = {"size": path.stat().st_size}
        if checksums:
            entry["sha256"] = _sha256(path, fsync=True)
        else:
            fsync_file(path)
        files[path.relative_to(folder).as_posix()] = entry
    for sub in sorted({p.parent for p in _files(folder)} | {folder}):
        fsync_dir(sub)
    manifest = {"version": 1, "files": files, "fingerprint": dict(fingerprint or {})}
    write_durably(folder / MANIFEST_FILE, json.dumps(manifest, indent=1, sort_keys=True), mode)
    return manifest


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest of a checkpoint, or None when it has none."""
    path = Path(folder) / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    return data if isinstance(data, dict) else None


def verify_checkpoint(folder: Path, checksums: bool = True, allow_unverified: bool = False) -> list[str]:
    """What is wrong with a checkpoint's files (empty when it verifies).  Missing, resized or changed
    files are named, and, unless ``allow_unverified`` (``resume_allow_unverified``), a missing manifest,
    files the manifest does not list and symbolic links: nothing would vouch for them."""
    folder = Path(folder)
    try:
        manifest = read_manifest(folder)
    except ValueError as exc:
        return [str(exc)]
    if manifest is None:
        return (
            []
            if allow_unverified
            else [f"it has no {MANIFEST_FILE}, so nothing vouches for its files ({UNVERIFIED_FIX})"]
        )
    problems = []
    if not allow_unverified:
        listed = set(manifest.get("files", {}))
        for path in sorted(folder.rglob("*")):
            name = path.relative_to(folder).as_posix()
            if path.is_symlink():
                problems.append(f"{name} is a symbolic link ({UNVERIFIED_FIX})")
            elif path.is_file() and name not in listed and name not in (MANIFEST_FILE, COMPLETE_MARKER):
                problems.append(f"{name} is not listed in its {MANIFEST_FILE} ({UNVERIFIED_FIX})")
    for name, expected in sorted(manifest.get("files", {}).items()):
        path = Path(folder) / name
        if not path.is_file():
            problems.append(f"{name} is missing")
            continue
        size = path.stat().st_size
        if size != expected.get("size"):
            problems.append(f"{name} has {size} bytes, the manifest recorded {expected.get('size')}")
        elif checksums and expected.get("sha256") and _sha256(path) != expected["sha256"]:
            problems.append(f"{name} does not match its recorded SHA-256")
    return problems


# ---------------------------------------------------------------------- fingerprint
def _data_fingerprint(path: Path | None) -> dict[str, Any] | None:
    if path is None:
        return None
    path = Path(path)
    if path.is_dir():  # a datasets folder: its file names and sizes
        entries = sorted((p.relative_to(path).as_posix(), p.stat().st_size) for p in path.rglob("*") if p.is_file())
        return {"path": str(path.resolve()), "sha256": hashlib.sha256(json.dumps(entries).encode()).hexdigest()}
    try:
        with open(path, "rb") as handle:
            head = handle.read(2**20)
        size = path.stat().st_size
    except OSError:
        return {"path": str(path.resolve())}
    return {"path": str(path.resolve()), "size": size, "head_sha256": hashlib.sha256(head).hexdigest()}


def _described(data: Mapping[str, Any]) -> str:
    """A fingerprint's data in a message: its path, with the identity of a dataset trained in place."""
    identity = data.get("identity")
    return f"{data.get('path')} {str(identity)[:24]}" if identity else str(data.get("path"))


def config_digest(config: Any) -> str:
    """A hash of a model configuration (``PretrainedConfig`` or dict), ignoring bookkeeping keys."""
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    clean = {k: v for k, v in data.items() if k not in _IGNORED_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(clean, sort_keys=True, default=str).encode()).hexdigest()


def run_fingerprint(
    model_path: Path | None, data_path: Path | None, config: Any, data_identity: str | None = None
) -> dict[str, Any]:
    """What a checkpoint of this run belongs to: architecture, config hash, base model (None for a
    ``model_init`` model), data: ``data_path``'s files, or ``data_identity`` for a script's dataset trained in
    place (``ScriptData.identity``)."""
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return {
        "model_type": data.get("model_type"),
        "architectures": data.get("architectures"),
        "config_sha256": config_digest(data),
        "base_model": str(Path(model_path).resolve()) if model_path is not None else None,
        "data": {"path": "train_dataset", "identity": data_identity} if data_identity else _data_fingerprint(data_path),
    }


def fingerprint_mismatches(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """Human-readable differences between a checkpoint's fingerprint and the current run's."""
    if not recorded:
        return []
    problems = []
    if recorded.get("model_type") != current.get("model_type") or recorded.get("architectures") != current.get(
        "architectures"
    ):
        problems.append(
            f"model architecture {recorded.get('model_type')}/{recorded.get('architectures')} "
            f"!= this run's {current.get('model_type')}/{current.get('architectures')}"
        )
    elif recorded.get("config_sha256") != current.get("config_sha256"):
        problems.append("model configuration differs (same architecture, other sizes or settings)")
    if recorded.get("base_model") != current.get("base_model"):
        problems.append(f"base model {recorded.get('base_model')} != this run's {current.get('base_model')}")
    data_change = _data_change(recorded, current)
    if data_change and not _in_place(current):
        problems.append(data_change)
    return problems


def in_place_data_note(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> str | None:
    """What differs between a checkpoint's in-place data (a script's dataset, ``ScriptData.identity``) and this
    run's, or None.  Said, never refused: Trainer does not check the data at resume, and an identity can differ
    for the same rows (a ``datasets`` fingerprint is random when a ``map`` function cannot be hashed)."""
    return _data_change(recorded, current) if _in_place(current) else None


def _in_place(fingerprint: Mapping[str, Any]) -> bool:
    return bool((fingerprint.get("data") or {}).get("identity"))


def _data_change(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> str | None:
    old_data, new_data = recorded.get("data"), current.get("data")
    if not (old_data and new_data and old_data != new_data):
        return None
    return f"training data differs (checkpoint: {_described(old_data)}, this run: {_described(new_data)})"
