"""Tokenise once, share, reuse: the Arrow cache of a tokenised data file.

``open_tokenized(path, tokenizer, options)`` returns the file's samples as a memory-mapped
``ArrowSamples``.  The cache folder is ``<cache_dir>/<key>``, where the key hashes the input's
fingerprint (path, size and modification time of its files), the tokenizer (its full serialisation and
special tokens), the chat template, and every option that changes the result (``DataOptions.key``).

* Hit: the folder exists -> its Arrow files and its sample index are memory-mapped (``pyarrow``,
  ``numpy``; nothing is tokenised, no column is read, and ``datasets`` is not even imported).  Opening
  costs the same for a thousand samples or a million: the index (``index.npy``: table row, length and
  loss tokens of every kept sample, int64) and the counts by fate (``meta.json``) were written when the
  cache was built, so start-up neither scans rows nor counts kept and dropped samples; the pages are the
  page cache's, shared by every rank on the machine.
* Miss: the first process to take the key's file lock (in ``lock_folder``, this user's own) builds it --
  ``datasets.map`` over the rows with ``num_proc`` processes (``records.RowEncoder``) into a temporary
  folder, renamed into place when complete, so a crash never leaves a half cache -- and the others wait
  for the lock, then map it.
  The launcher's preflight builds it in the parent before any worker starts; workers then all hit.

Bad rows fail the build (``DataFormatError``: the first bad row by file and line/row, counts by reason,
a few more examples); no cache is written for a file with bad rows.

A cache folder may be shared (``data_cache_dir``), so an entry is used only when ``entry_problem`` finds
nothing: the folder and its files are yours (or root's), writable by nobody else, and no link.  Entries are
written private (0700/0600).  Another user's entry under the key is passed over for ``<key>-uid<uid>``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import stat
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trainbridge.core.private_files import make_run_folder
from trainbridge.data.inputs import DataInputError, describe_columns, fingerprint, read_input
from trainbridge.data.records import (
    KNOWN_COLUMNS,
    STATUS_BLANK,
    STATUS_ERROR,
    STATUS_NO_LOSS,
    STATUS_OK,
    STATUS_OVERLONG,
    DataOptions,
    RowEncoder,
    output_features,
)
from trainbridge.data.samples import ArrowSamples
from trainbridge.data.types import DataFormatError, LoadStats

if TYPE_CHECKING:
    import pyarrow as pa
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

CACHE_FORMAT = 3
"""Bumped whenever the cached columns or their meaning change (part of the key)."""

MAX_EXAMPLES = 5
"""Bad rows quoted in a ``DataFormatError`` beyond the first."""

INDEX_FILE = "index.npy"
"""The cache's sample index: a ``(3, samples)`` int64 array -- table row, length, loss tokens -- of the
kept samples, in file order."""

PROGRESS_MIN_ROWS = 50_000
"""Tokenising fewer rows shows no progress bar."""

MAP_BATCH_SIZE = 4096
"""Rows per ``datasets.map`` batch -- one template/tokenizer call each -- and per record batch of the
cache: opening a cache walks every record batch's header, and each header read maps a few pages of the
file into the process (~60 KB), so 4096-row batches keep that to ~15 MB for a million samples
(``datasets``' default of 1000 rows made it ~150 MB, and as many reads from a cold disk)."""

ROWS_PER_PROCESS = 20_000
"""Tokenisation uses at most one process per this many rows (starting processes costs more than small
files take)."""


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase | None) -> str | None:
    """A hash of everything in the tokenizer that changes token ids: its serialisation and special tokens."""
    if tokenizer is None:
        return None
    digest = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        digest.update(backend.to_str().encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(json.dumps({k: str(v) for k, v in tokenizer.special_tokens_map.items()}, sort_keys=True).encode())
    digest.update(str(tokenizer.eos_token_id).encode())
    return digest.hexdigest()


def cache_key(
    path: Path, tokenizer: PreTrainedTokenizerBase | None, chat_template: str | None, options: DataOptions
) -> str:
    """The cache key of ``path`` tokenised with ``tokenizer``/``chat_template`` under ``options``."""
    payload = {
        "format": CACHE_FORMAT,
        "input": fingerprint(path),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "chat_template": chat_template,
        "options": options.key(),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:32]


def open_tokenized(
    path: Path,
    tokenizer: PreTrainedTokenizerBase | None,
    options: DataOptions,
    chat_template: str | None,
    cache_dir: Path,
) -> tuple[ArrowSamples, LoadStats]:
    """The samples of ``path``, from the cache (built first if missing, under a file lock)."""

    def build(target: Path) -> None:
        _build(path, tokenizer, options, chat_template, target)

    return open_entry(cache_key(path, tokenizer, chat_template, options), cache_dir, build)


def open_entry(key: str, cache_dir: Path, build: Callable[[Path], None]) -> tuple[ArrowSamples, LoadStats]:
    """The samples of cache entry ``key`` in ``cache_dir``, memory-mapped: on a miss the first process to take
    the key's lock calls ``build(target)`` (which writes the entry, ``write_entry``); the others wait, then
    map it.  An untrusted entry under the key (``entry_problem``) is passed over for ``<key>-uid<uid>``."""
    started = time.perf_counter()
    target = cache_dir / key
    if os.path.lexists(target) and entry_problem(target) is not None:  # e.g. planted by another user
        logger.warning(
            "data cache: not using %s (%s); using %s-uid%d", target, entry_problem(target), key, os.geteuid()
        )
        key = f"{key}-uid{os.geteuid()}"
        target = cache_dir / key
    hit = (target / "meta.json").is_file()
    if not hit:
        from filelock import FileLock

        make_run_folder(cache_dir)  # a missing cache folder is created private (0700), whatever the umask
        with FileLock(str(lock_folder(cache_dir) / f"{key}.lock"), mode=0o600):
            hit = (target / "meta.json").is_file()  # another process built it while this one waited
            if not hit:
                build(target)
    problem = entry_problem(target)
    if problem is not None:
        raise DataInputError(
            f"data cache entry {target} is not trusted: {problem}; remove it, or set "
            "data_cache_dir (TRAINBRIDGE_DATA_CACHE) to a folder only you can write"
        )
    samples, stats = _load(target)
    stats.cache_hit = hit
    stats.seconds = time.perf_counter() - started
    return samples, stats


def lock_folder(cache_dir: Path) -> Path:
    """The folder of this user's build locks in ``cache_dir``: ``.locks-uid<uid>/``, created 0700.  In a shared
    cache another user could plant a link where a lock file goes (the lock library opens it, and an older
    one truncates what it points to); nobody else can put anything in this folder.  One that is a link, not
    a folder, another user's, or open to others fails naming it."""
    folder = cache_dir / f".locks-uid{os.geteuid()}"
    with contextlib.suppress(FileExistsError):
        os.mkdir(folder, 0o700)
    info = folder.lstat()
    problem = None
    if not stat.S_ISDIR(info.st_mode):
        problem = "is a symbolic link or not a folder"
    elif info.st_uid != os.geteuid():
        problem = f"is owned by uid {info.st_uid}, not by you (uid {os.geteuid()})"
    elif info.st_mode & 0o077:
        problem = f"is open to others (mode {stat.S_IMODE(info.st_mode):04o})"
    if problem:
        raise DataInputError(
            f"data cache lock folder {folder} {problem}; remove it, or set data_cache_dir "
            "(TRAINBRIDGE_DATA_CACHE) to a folder only you can write"
        )
    return folder


# ---------------------------------------------------------------------------------------------- build
def _build(
    path: Path, tokenizer: PreTrainedTokenizerBase | None, options: DataOptions, chat_template: str | None, target: Path
) -> None:
    def rows(scratch: Path) -> tuple[Any, bool]:
        with _quiet_progress(True):
            raw = read_input(path, scratch / "raw")
        return raw.dataset, raw.jsonl

    write_entry(rows, path, tokenizer, options, chat_template, target)


def write_entry(
    rows: Callable[[Path], tuple[Any, bool]],
    source: Path,
    tokenizer: PreTrainedTokenizerBase | None,
    options: DataOptions,
    chat_template: str | None,
    target: Path,
) -> None:
    """Tokenise ``rows(scratch)`` -- ``(datasets.Dataset, jsonl)``, read into ``scratch/raw`` if it writes
    anything -- into the cache entry ``target``: built in a private scratch folder beside it, renamed into
    place when complete (a crash never leaves a half entry); ``source`` names the rows in errors."""
    scratch = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(mode=0o700, parents=True)  # private while it is written, whatever the umask
    try:
        dataset, jsonl = rows(scratch)
        num_proc = max(1, min(options.num_proc, len(dataset) // ROWS_PER_PROCESS))
        result = _encode(
            dataset,
            source,
            jsonl,
            tokenizer,
            options,
            chat_template,
            num_proc=num_proc if num_proc > 1 else None,
            cache_file_name=str(scratch / "data.arrow"),
            load_from_cache_file=False,
            new_fingerprint=target.name,
        )
        files = [Path(entry["filename"]).name for entry in result.cache_files]
        table = _open_table(scratch, files)  # as _load will see it: the index's rows are this table's
        index, stats = _index(source, jsonl, table, options)
        np.save(scratch / INDEX_FILE, index)
        meta = {
            "format": CACHE_FORMAT,
            "source": str(source),
            "files": files,
            "stats": asdict(stats),
            "options": options.key(),
        }
        (scratch / "meta.json").write_text(json.dumps(meta, indent=1))
        del result, table, dataset
        shutil.rmtree(scratch / "raw", ignore_errors=True)
        for entry in scratch.iterdir():
            entry.chmod(0o700 if entry.is_dir() else 0o600)
        scratch.chmod(0o700)
        os.replace(scratch, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def tokenize_in_memory(
    dataset: Any,
    name: str,
    tokenizer: PreTrainedTokenizerBase | None,
    options: DataOptions,
    chat_template: str | None,
) -> tuple[ArrowSamples, LoadStats]:
    """The samples of a ``datasets.Dataset`` a script holds (``RunPlan.script_data``, in place), tokenised as a
    file's rows are, in memory: nothing is written (``keep_in_memory``), no cache entry; ``name`` names the rows
    in errors and the summary.  One process (a script's rows are usually tokenised already)."""
    started = time.perf_counter()
    source = Path(name)
    result = _encode(dataset.with_format(None), source, False, tokenizer, options, chat_template, keep_in_memory=True)
    table = result.data.table
    index, stats = _index(source, False, table, options)
    stats.seconds = time.perf_counter() - started
    return ArrowSamples(table, index[0], index[1], index[2]), stats


def _encode(
    dataset: Any,
    source: Path,
    jsonl: bool,
    tokenizer: PreTrainedTokenizerBase | None,
    options: DataOptions,
    chat_template: str | None,
    **where: Any,
) -> Any:
    """``dataset``'s rows encoded (``records.RowEncoder``) into the cache's columns; ``where``: ``map``'s
    keywords saying where the result goes (a cache file, or memory) and with how many processes."""
    if not jsonl:
        dataset = dataset.select_columns(_input_columns(source, describe_columns(dataset), options))
    encoder = RowEncoder(str(source), jsonl, tokenizer, options, chat_template)
    with _quiet_progress(len(dataset) < PROGRESS_MIN_ROWS):
        return dataset.map(
            encoder,
            batched=True,
            batch_size=MAP_BATCH_SIZE,
            writer_batch_size=MAP_BATCH_SIZE,
            with_indices=True,
            remove_columns=dataset.column_names,
            features=output_features(),
            desc=f"tokenizing {source.name}",
            **where,
        )


def _index(source: Path, jsonl: bool, table: pa.Table, options: DataOptions) -> tuple[np.ndarray, LoadStats]:
    """``(index, stats)`` of an encoded table: the kept samples' table row, length and loss tokens; bad rows
    raise ``DataFormatError``, no usable sample a ``ValueError``."""
    status = _column(table, "status")
    _raise_bad_rows(source, jsonl, table, status)
    stats = _stats(source, table, status)
    if stats.samples == 0:
        raise ValueError(
            f"no usable samples in {source}: {stats.lines} lines, {stats.dropped_overlong} dropped as longer "
            f"than max_seq_len={options.max_seq_len}, {stats.empty_skipped} without loss tokens"
        )
    rows = np.flatnonzero(status == STATUS_OK)
    index = np.stack([rows, _column(table, "length")[rows], _column(table, "loss_tokens")[rows]]).astype(np.int64)
    return index, stats


def entry_problem(entry: Path) -> str | None:
    """Why the cache entry ``entry`` cannot be trusted (None: it and its files are this user's or root's,
    writable by nobody else, and none is a link, so nobody else can have written them)."""
    uid = os.geteuid()
    try:
        items = [entry, *sorted(entry.iterdir())] if not entry.is_symlink() else [entry]
        for item in items:
            info = item.lstat()
            if stat.S_ISLNK(info.st_mode):
                return f"{item} is a symbolic link"
            if info.st_uid not in (uid, 0):
                return f"{item} is owned by uid {info.st_uid}, not by you (uid {uid})"
            if info.st_mode & 0o022:
                return f"{item} is writable by others (mode {stat.S_IMODE(info.st_mode):04o})"
    except OSError as exc:
        return f"{entry} cannot be read ({exc.strerror or exc})"
    return None


@contextmanager
def _quiet_progress(quiet: bool) -> Iterator[None]:
    """``datasets``' progress bars off (when ``quiet``) for the block, then as they were."""
    from datasets.utils import logging as datasets_logging

    was = datasets_logging.is_progress_bar_enabled()
    if quiet:
        datasets_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            datasets_logging.enable_progress_bar()


def _input_columns(path: Path, columns: list[str], options: DataOptions) -> list[str]:
    """The dataset's columns rows are read from; raises ``DataFormatError`` when none is usable."""
    mapped = dict(options.columns)
    for ours, theirs in options.columns:
        if theirs not in columns:
            raise DataFormatError(
                path,
                None,
                f"data_columns maps {ours!r} to column {theirs!r}, which {path.name} "
                f"does not have (its columns: {columns})",
            )
    wanted = [mapped.get(name, name) for name in KNOWN_COLUMNS]
    selected = [c for c in columns if c in wanted]
    if not any(c in selected for c in (mapped.get(n, n) for n in ("input_ids", "messages", "prompt", "text"))):
        raise DataFormatError(
            path,
            None,
            f"no usable column: expected 'input_ids', 'messages', 'prompt'+'completion' or 'text', "
            f"found {columns}; map other names with data_columns, "
            f"e.g. data_columns: {{messages: {columns[0] if columns else 'conversations'}}}",
        )
    return selected


def _raise_bad_rows(path: Path, jsonl: bool, table: pa.Table, status: np.ndarray) -> None:
    bad = np.flatnonzero(status == STATUS_ERROR)
    if not len(bad):
        return
    import pyarrow as pa

    reasons = Counter(table.column("reason").take(pa.array(bad)).to_pylist())
    errors = table.column("error").take(pa.array(bad[: MAX_EXAMPLES + 1])).to_pylist()
    first = int(bad[0])
    problem = errors[0].split(": ", 1)[1]
    raise DataFormatError(
        path,
        first + 1 if jsonl else None,
        problem,
        row=None if jsonl else first,
        counts=dict(reasons),
        examples=errors[1:],
    )


def _stats(path: Path, table: pa.Table, status: np.ndarray) -> LoadStats:
    counts = np.bincount(status.astype(np.int64), minlength=5)
    ok = status == STATUS_OK
    truncated = _column(table, "truncated")
    return LoadStats(
        path=str(path),
        lines=int(len(status) - counts[STATUS_BLANK]),
        samples=int(counts[STATUS_OK]),
        dropped_overlong=int(counts[STATUS_OVERLONG]),
        truncated=int(np.count_nonzero(truncated)),
        empty_skipped=int(counts[STATUS_NO_LOSS]),
        tokens=int(_column(table, "length")[ok].sum()),
    )


# ---------------------------------------------------------------------------------------------- load
def _open_table(folder: Path, files: list[str]) -> pa.Table:
    """The cache's Arrow files as one table, memory-mapped (zero copy: nothing is read until used)."""
    import pyarrow as pa

    tables = [pa.ipc.open_stream(pa.memory_map(str(folder / name))).read_all() for name in files]
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


def _column(table: pa.Table, name: str) -> np.ndarray:
    """A scalar column as one numpy array (chunk by chunk; build time only)."""
    chunks = [chunk.to_numpy(zero_copy_only=False) for chunk in table.column(name).chunks]
    return np.concatenate(chunks) if chunks else np.zeros(0)


def _load(target: Path) -> tuple[ArrowSamples, LoadStats]:
    """Memory-map the cache's Arrow files and its sample index; the counts come from ``meta.json``."""
    meta: dict[str, Any] = json.loads((target / "meta.json").read_text())
    table = _open_table(target, meta["files"])
    index = np.load(target / INDEX_FILE, mmap_mode="r")
    stats = LoadStats(**meta["stats"])
    stats.cache = str(target)
    return ArrowSamples(table, index[0], index[1], index[2]), stats
