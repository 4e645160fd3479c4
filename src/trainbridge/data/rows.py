"""Data files as the dataset's items, unchanged, for the model's-own-loss step (``step.model_loss``).

``open_rows`` reads a data path (JSONL, JSON, parquet, Arrow, a ``save_to_disk`` folder) with ``datasets``;
each row is one item, its columns as they are (labels, pixel values, decoder inputs...).  Rows with a
``text`` column and no ``input_ids`` are tokenised (truncated to ``max_seq_len``), the other columns kept.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from trainbridge.data.inputs import DataInputError, input_kind, read_input
from trainbridge.data.types import validation_indices


def open_rows(path: Path, tokenizer: Any, max_seq_len: int) -> Any:
    """The rows of ``path`` as a ``datasets.Dataset`` (see the module docstring)."""
    from datasets import load_dataset

    scratch = tempfile.mkdtemp(prefix="trainbridge-rows-")
    if input_kind(path) == "jsonl":
        try:
            dataset = load_dataset("json", data_files=str(path), split="train", cache_dir=scratch)
        except Exception as exc:
            raise DataInputError(f"{path}: cannot read it as JSON lines: {type(exc).__name__}: {exc}") from exc
    else:
        dataset = read_input(path, Path(scratch)).dataset
    if len(dataset) == 0:
        raise DataInputError(f"{path}: no rows")
    if "input_ids" not in dataset.column_names and "text" in dataset.column_names and tokenizer is not None:
        dataset = dataset.map(
            lambda rows: tokenizer(rows["text"], truncation=True, max_length=max_seq_len),
            batched=True,
            remove_columns=["text"],
            desc=f"tokenising {Path(path).name}",
        )
    return dataset


def split_rows(dataset: Any, fraction: float, seed: int) -> tuple[Any, Any]:
    """``(training rows, held-out rows)``: ``validation_split`` by index, as the token data is split."""
    train, held = validation_indices(len(dataset), fraction, seed)
    return dataset.select(train), dataset.select(held)
