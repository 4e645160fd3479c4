"""The launcher's data check: before any worker starts, the run's data reads and tokenises into its
cache in the parent (a bad row fails here, named by file and line; the workers then find the cache
built), and a launch whose inputs have not changed since a check passed skips it.

The check needs the run's tokenizer, and loading one imports transformers: 2-4 s of a tiny job's
start-up on the shared 2-core machine, more than the rest of the parent's work together
(``docs/benchmarks.md``, start-up section).  A check that passed leaves a note in the data cache,
``<data cache>/preflight/<key>.json``, whose key hashes everything the check's outcome depends on:

- the data files, validation and named evaluation sets included (path, size and modification time of
  each, as the tokenisation cache keys them);
- the tokenizer folder's files (name, size, modification time: what ``from_pretrained`` reads);
- the tokenisation options (``DataOptions.key``: length limit, overlong policy, columns, chat
  template and its text, system prompt, which turns train);
- the trainbridge and transformers versions.

The note names the tokenised cache folders the check produced; a later launch with the same key
whose folders are all still there passes without loading the tokenizer.  Anything else (a changed
file, option or version, a cleared cache, a tokenizer given by hub id rather than a local folder)
runs the full check.  The workers still compute the cache key from the real tokenizer: were a
tokenizer to change in a way no file shows, they would tokenise anew rather than read a stale cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

from trainbridge.core.config import TrainingArgs
from trainbridge.launch.errors import PreflightError

NOTE_FOLDER = "preflight"
"""Folder of the data cache holding the notes of passed checks."""


def check_data(args: TrainingArgs, items: bool = False) -> None:
    """Read (and on a cache miss tokenise) the data with the run's tokenizer, unless a note says the same
    inputs passed before; ``items``: the run's loss trains on the dataset's items (``trains_on_items``), so the
    files only need to open as them.  Raises ``PreflightError`` naming the problem (bad rows by file and line)."""
    note = _note_path(args)
    if note is not None and _note_holds(note):
        return
    from trainbridge.data.sources import load_run_data  # imported here: the data layer pulls in torch
    from trainbridge.modeling.load import load_tokenizer

    try:
        tokenizer = load_tokenizer(args, items=items)
    except Exception as exc:
        raise PreflightError(
            f"tokenizer: cannot load one from {args.resolved_tokenizer_path}: {type(exc).__name__}: {exc}"
        ) from exc
    if items:  # the files are the dataset's items (data.rows), not token rows
        _check_items(args, tokenizer)
        return
    try:
        data = load_run_data(args, tokenizer)
    except ValueError as exc:  # DataFormatError, DataInputError, no usable sample
        raise PreflightError(f"data: {exc}") from exc
    if note is not None:
        _write_note(note, [stats.cache for stats in data.stats if stats.cache])


def _check_items(args: TrainingArgs, tokenizer: Any) -> None:
    """``model_loss``: every data path opens as the dataset's items (``data.rows.open_rows``)."""
    from trainbridge.data.rows import open_rows

    paths = [args.data_path, args.val_data_path, *args.eval_data_paths.values()]
    with tempfile.TemporaryDirectory(prefix="trainbridge-rows-check-") as scratch:  # the rows are not kept
        for path in (p for p in paths if p is not None):
            try:
                open_rows(path, tokenizer, args.max_seq_len, scratch=Path(scratch))
            except ValueError as exc:  # DataInputError: unreadable or empty
                raise PreflightError(f"data: {exc}") from exc


def _note_path(args: TrainingArgs) -> Path | None:
    """Where the note of this run's inputs lives; None when they cannot be fingerprinted."""
    from trainbridge.data.inputs import default_cache_dir, fingerprint
    from trainbridge.data.sources import data_options

    tokenizer_dir = args.resolved_tokenizer_path
    if not tokenizer_dir.is_dir():
        return None  # a hub id: nothing on disk tells whether it changed
    try:
        inputs: dict[str, Any] = {
            "trainbridge": metadata.version("trainbridge"),
            "transformers": metadata.version("transformers"),
            "data": fingerprint(args.data_path) if args.data_path is not None else None,
            "val_data": fingerprint(args.val_data_path) if args.val_data_path is not None else None,
            "eval_data": {name: fingerprint(path) for name, path in sorted(args.eval_data_paths.items())},
            "tokenizer": sorted(
                (p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in tokenizer_dir.iterdir() if p.is_file()
            ),
            "options": data_options(args).key(),
        }
    except (OSError, ValueError, metadata.PackageNotFoundError):
        return None  # an unreadable input: the full check names it
    key = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:32]
    return (args.data_cache_dir or default_cache_dir()) / NOTE_FOLDER / f"{key}.json"


def _note_holds(note: Path) -> bool:
    """The note is this user's and every cache folder it names is still complete and trusted (a note or an
    entry another user could have written in a shared cache is not believed)."""
    from trainbridge.data.cache import entry_problem

    try:
        info = note.lstat()
        if info.st_uid != os.geteuid() or info.st_mode & 0o022 or not note.is_file() or note.is_symlink():
            return False
        caches = json.loads(note.read_text())["caches"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return bool(caches) and all(
        isinstance(c, str) and (Path(c) / "meta.json").is_file() and entry_problem(Path(c)) is None for c in caches
    )


def _write_note(note: Path, caches: list[str]) -> None:
    """Write the note atomically; a data cache that cannot be written only costs the next launch the check."""
    scratch: str | None = None
    try:
        note.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=note.parent, prefix=f".{note.stem}-", delete=False) as handle:
            scratch = handle.name
            json.dump({"caches": caches}, handle)
        os.replace(scratch, note)
    except OSError:
        if scratch is not None:
            Path(scratch).unlink(missing_ok=True)
