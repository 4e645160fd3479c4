"""What ``Trainer.train()`` writes into its run folder, and the typed layout it returns.

The folder is ``output_dir/.trainbridge/`` (every path named in ``core.run_dir.FacadeDir``).  The writing
rank writes the datasets' rows (the loop's padding-free and sample batches read them memory-mapped) and the
tokenizer there; the ``RunLayout`` it returns (where each input is) travels to the other ranks by broadcast
and becomes the job's ``TrainingArgs`` (``trainer.job_args``).  The model is not written: the loop trains the
script's own object.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainbridge.core.private_files import make_run_folder
from trainbridge.core.run_dir import FacadeDir
from trainbridge.data.stream_batches import is_stream
from trainbridge.trainer import script_data


@dataclass(frozen=True)
class RunLayout:
    """Where a job's inputs are: the fields of its ``TrainingArgs`` that the run folder provides."""

    data_path: Path | None
    """The training rows (None: a streaming ``train_dataset``, iterated in the workers as ``train_stream``)."""
    tokenizer_path: Path | None = None
    val_data_path: Path | None = None
    eval_data_paths: dict[str, Path] = field(default_factory=dict)
    """Named validation sets (a dict ``eval_dataset``), each evaluated in turn."""
    longest: int | None = None
    """The longest row written (tokens), when the rows are tokenised already."""


@dataclass(frozen=True)
class RowPreparation:
    """How the datasets' rows are prepared for the workers (``script_data.prepare_rows``)."""

    collator: script_data.CollatorChoice
    pad_token_id: int | None
    items: bool = False
    """The workers train on the model's own loss over the datasets' items (``script_data.uses_sample_batches``):
    every column is written, tensors kept as tensors (``script_data.as_item_dataset``)."""


def write_tokenizer(folder: FacadeDir, tokenizer: Any) -> Path:
    """The ``tokenizer_path`` of the job: the instance's tokenizer (or processor), when it has one, written
    into ``folder`` (the model itself is the script's object, trained in place: ``job_args.LiveModel``)."""
    target = folder.tokenizer
    target.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(target)
    return target


def write_rows(dataset: Any, target: Path, what: str, rows: RowPreparation) -> tuple[Path, int | None]:
    """``dataset``'s rows written as Arrow into ``target`` -> ``(path, longest row)`` (None for items)."""
    if rows.items:
        return script_data.write_dataset(script_data.as_item_dataset(dataset, what), target), None
    prepared, longest = script_data.prepare_rows(
        script_data.as_hf_dataset(dataset, what), rows.collator, rows.pad_token_id
    )
    return script_data.write_dataset(prepared, target), longest


def is_dataset_dict(data: Any) -> bool:
    """A dict of named datasets (Trainer's ``eval_dataset={name: dataset}``; a ``DatasetDict`` too, as Trainer)."""
    return isinstance(data, Mapping)


def write_eval_sets(
    data: Any, folder: FacadeDir, rows: RowPreparation
) -> tuple[Path | None, dict[str, Path], int | None]:
    """Evaluation data written into ``folder``: one dataset -> ``(its path, {}, longest)``; a dict (Trainer's
    named sets), each into ``eval_data(i)`` -> ``(None, {set: path}, longest of all)``."""
    if not is_dataset_dict(data):
        path, longest = write_rows(data, folder.eval_data(), "eval_dataset", rows)
        return path, {}, longest
    paths, longest_of_all = {}, 0
    for i, (name, part) in enumerate(data.items()):
        paths[str(name)], longest = write_rows(part, folder.eval_data(i), f"eval_dataset[{name!r}]", rows)
        longest_of_all = max(longest_of_all, longest or 0)
    return None, paths, longest_of_all or None


def write_training_inputs(
    folder: FacadeDir, tokenizer: Any, rows: RowPreparation, train_dataset: Any, eval_dataset: Any
) -> RunLayout:
    """A train job's inputs: the tokenizer, ``train_dataset`` and ``eval_dataset`` (one dataset ->
    ``val_data_path``; a dict -> ``eval_data_paths``).  Not written: a stream (the job streams it) and a set
    whose items are not dicts of columns (the instance's own loader and ``evaluate`` read it:
    ``trainer.subclass``).  Clears the previous job's outputs first."""
    make_run_folder(folder.root)  # output_dir too, when missing: private whatever the umask
    tokenizer_path = write_tokenizer(folder, tokenizer)
    if train_dataset is None:
        raise ValueError("Trainer: training requires a train_dataset")
    data_path, longest = (
        (None, None)
        if is_stream(train_dataset) or not script_data.column_items(train_dataset)
        else write_rows(train_dataset, folder.train_data, "train_dataset", rows)
    )
    val_path, sets, eval_longest = (
        (None, {}, None)
        if eval_dataset is None or not script_data.column_items(eval_dataset)
        else write_eval_sets(eval_dataset, folder, rows)
    )
    return RunLayout(
        tokenizer_path=tokenizer_path,
        data_path=data_path,
        val_data_path=val_path,
        eval_data_paths=sets,
        longest=max(longest or 0, eval_longest or 0) or None,
    )
