"""Data files as the dataset's items, unchanged, for the model's-own-loss step (``step.model_loss``).

``run_rows(args, tokenizer)`` is that step's one entry (and trl's steps'): the script's own datasets in place
(``RunPlan.script_data``, indexed live), else the rows of ``data_path``/``val_data_path``/``eval_data_paths``.

``open_rows`` reads a data path (JSONL, JSON, parquet, Arrow, a ``save_to_disk`` folder) with ``datasets``;
each row is one item, its columns as they are (labels, pixel values, decoder inputs...).  Rows with a
``text`` column and no ``input_ids`` are tokenised (truncated to ``max_seq_len``), the other columns kept.

The Arrow files ``datasets`` converts them to, memory-mapped by the rows, go to a scratch folder: the
caller's, or this process's one ``trainbridge-rows-*`` folder (``core.scratch.owned_folder``), removed when
the process ends (a worker's run, also when it fails) and swept by the next run when it was killed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainbridge.core.config import TrainingArgs
from trainbridge.core.config.plan import ScriptData
from trainbridge.core.scratch import owned_folder
from trainbridge.data.inputs import DataInputError, input_kind, read_input
from trainbridge.data.types import validation_indices

ROWS_SCRATCH_PREFIX = "trainbridge-rows-"
_process_scratch: list[Path] = []
"""This process's rows folder, once made."""


def process_rows_folder() -> Path:
    """This process's scratch folder for rows (made at the first call; removed at the process's exit)."""
    if not _process_scratch or not _process_scratch[0].is_dir():
        _process_scratch[:] = [owned_folder(ROWS_SCRATCH_PREFIX)]
    return _process_scratch[0]


def open_rows(path: Path, tokenizer: Any, max_seq_len: int, scratch: Path | None = None) -> Any:
    """The rows of ``path`` as a ``datasets.Dataset`` (see the module docstring); ``scratch``: where its
    Arrow files go, for as long as the rows are used (default: ``process_rows_folder()``)."""
    from datasets import load_dataset

    scratch = scratch if scratch is not None else process_rows_folder()
    if input_kind(path) == "jsonl":
        try:
            dataset = load_dataset("json", data_files=str(path), split="train", cache_dir=str(scratch))
        except Exception as exc:
            raise DataInputError(f"{path}: cannot read it as JSON lines: {type(exc).__name__}: {exc}") from exc
    else:
        dataset = read_input(path, scratch).dataset
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


def run_rows(
    args: TrainingArgs, tokenizer: Any, script: ScriptData | None = None, streaming: bool = False
) -> tuple[Any, Any, dict[str, Any]]:
    """``(training items, validation items, named validation sets)`` of a run (see the module doc): in place
    (``script``), the script's datasets; training None when ``streaming`` (a ``train_stream``);
    ``validation_split`` held out of the training rows."""
    data = script
    if data is not None:  # in place: the script's objects, each item fetched when a micro-batch needs it
        return data.train, data.eval, dict(data.named_eval)
    reading = args.data_path is not None and not streaming
    train = open_rows(args.data_path, tokenizer, args.max_seq_len) if reading and args.data_path else None
    val = open_rows(args.val_data_path, tokenizer, args.max_seq_len) if args.val_data_path is not None else None
    if args.validation_split > 0 and train is not None:
        train, val = split_rows(train, args.validation_split, args.seed)
    named = {name: open_rows(path, tokenizer, args.max_seq_len) for name, path in args.eval_data_paths.items()}
    return train, val, named
