"""Local data inputs, read with ``datasets`` (Arrow, memory-mapped).

``data_path`` may be:

* a JSONL file (``.jsonl``, or ``.json`` holding one object per line): read line by line as raw text
  (``datasets``' ``text`` builder), so each record is parsed by ``records.RowEncoder`` and a bad line is
  named ``file:line`` (Arrow's JSON reader would fail the whole file, and would fill missing keys of
  nested objects such as tool-call arguments with nulls);
* a JSON file holding an array of objects;
* a parquet file, an Arrow file (``.arrow``, as ``Dataset.save_to_disk``/``datasets`` caches write them);
* a folder written by ``Dataset.save_to_disk`` (``DatasetDict`` folders: name the split's subfolder).

``fingerprint`` describes the input cheaply for the tokenisation cache key (see its docstring for what
it does and does not notice).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from datasets import Dataset

SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")


class DataInputError(ValueError):
    """A data path cannot be read as a dataset; the message names the path and what to do."""


@dataclass(frozen=True)
class RawInput:
    """The rows of one input: a ``datasets.Dataset`` and whether its rows are raw JSONL lines."""

    dataset: Dataset
    jsonl: bool


def input_kind(path: Path) -> str:
    """``jsonl``, ``json``, ``parquet``, ``arrow`` or ``disk`` (a ``save_to_disk`` folder); raises otherwise."""
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
            raise DataInputError(
                f"{path} is a DatasetDict folder with splits {splits}; give the split's "
                f"folder, e.g. {path / (splits[0] if splits else 'train')}"
            )
        if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
            return "disk"
        raise DataInputError(
            f"{path} is a folder but not one written by Dataset.save_to_disk (no state.json / dataset_info.json)"
        )
    if not path.is_file():
        raise DataInputError(f"data path {path} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".json":
        return "json" if _first_char(path) == "[" else "jsonl"
    if suffix in SUFFIXES:
        return suffix[1:]
    return "jsonl"  # today's behaviour: any other file is JSON Lines


def _first_char(path: Path) -> str:
    with path.open("rb") as handle:
        while chunk := handle.read(4096):
            stripped = chunk.lstrip()
            if stripped:
                return chr(stripped[0])
    return ""


SAMPLE_BLOCKS = 16
"""Blocks of each input file hashed into its fingerprint (evenly spaced, first and last included)."""

SAMPLE_BLOCK_BYTES = 64 * 1024
"""Size of each hashed block: at most 1 MiB of every file is read, however large it is."""


def fingerprint(path: Path) -> list[tuple[str, int, int, str]]:
    """``(absolute path, size, mtime_ns, sample hash)`` of the input's files (all files of a folder, sorted).

    Cost is bounded, whatever the size of the data: a stat and ``SAMPLE_BLOCKS`` blocks of
    ``SAMPLE_BLOCK_BYTES`` per file (the start-up of a cached run must not read gigabytes to find its
    cache).  The trade-off: any change of size or modification time, and any change inside a hashed
    block, makes a new key; an edit that keeps the size, restores the modification time (``touch -r``,
    ``cp -p``, ``rsync -t``) and falls between the hashed blocks is not noticed -- change the file's
    name or clear the cache folder after such an edit.  Hashing every byte would notice it, at ~1 s per
    GB on every start-up.
    """
    path = path.resolve()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    out = []
    for file in files:
        status = file.stat()
        out.append((str(file), status.st_size, status.st_mtime_ns, _sample_hash(file, status.st_size)))
    return out


def _sample_hash(file: Path, size: int) -> str:
    """sha256 of ``SAMPLE_BLOCKS`` evenly spaced blocks of ``file`` (all of it when it is small)."""
    digest = hashlib.sha256()
    with file.open("rb") as handle:
        if size <= SAMPLE_BLOCKS * SAMPLE_BLOCK_BYTES:
            digest.update(handle.read())
        else:
            last = size - SAMPLE_BLOCK_BYTES
            for k in range(SAMPLE_BLOCKS):
                handle.seek(last * k // (SAMPLE_BLOCKS - 1))
                digest.update(handle.read(SAMPLE_BLOCK_BYTES))
    return digest.hexdigest()


def read_input(path: Path, scratch: Path) -> RawInput:
    """Open ``path`` as a ``datasets.Dataset``; conversions (JSONL/JSON/parquet to Arrow) go to ``scratch``."""
    from datasets import Dataset, load_dataset, load_from_disk

    kind = input_kind(path)
    try:
        if kind == "disk":
            loaded = load_from_disk(str(path))
            if not isinstance(loaded, Dataset):
                raise DataInputError(f"{path} holds a {type(loaded).__name__}; give one split's folder")
            return RawInput(loaded, jsonl=False)
        if kind == "arrow":
            return RawInput(Dataset.from_file(str(path)), jsonl=False)
        if kind == "jsonl":
            if path.stat().st_size == 0:
                return RawInput(Dataset.from_dict({"text": []}), jsonl=True)
            dataset = load_dataset("text", data_files=str(path), split="train", cache_dir=str(scratch))
            return RawInput(dataset, jsonl=True)
        builder = "json" if kind == "json" else "parquet"
        dataset = load_dataset(builder, data_files=str(path), split="train", cache_dir=str(scratch))
        return RawInput(dataset, jsonl=False)
    except DataInputError:
        raise
    except Exception as exc:
        bad_text = _first_non_utf8_line(path) if kind in ("jsonl", "json") else None
        if bad_text is not None:
            raise DataInputError(f"{path}:{bad_text}; save the file as UTF-8") from exc
        raise DataInputError(f"{path}: cannot read it as {kind} data: {type(exc).__name__}: {_cause(exc)}") from exc


def _first_non_utf8_line(path: Path) -> str | None:
    """``"<line>: not UTF-8 text (...)"`` for the first line of ``path`` that does not decode, else None."""
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                return f"{number}: not UTF-8 text (byte {raw[exc.start]:#04x} at column {exc.start + 1})"
    return None


def _cause(exc: BaseException) -> str:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return str(exc)


def default_cache_dir() -> Path:
    """``$TRAINBRIDGE_DATA_CACHE``, else ``$XDG_CACHE_HOME/trainbridge/data`` (``~/.cache/trainbridge/data``)."""
    if os.environ.get("TRAINBRIDGE_DATA_CACHE"):
        return Path(os.environ["TRAINBRIDGE_DATA_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "trainbridge" / "data"


def describe_columns(dataset: Any) -> list[str]:
    """Column names of a dataset, for messages."""
    return list(getattr(dataset, "column_names", []) or [])
