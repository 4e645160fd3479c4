"""What a ``Trainer`` script hands over, made ready for the workers: datasets, the collator, the model.

- ``as_hf_dataset``: a ``datasets.Dataset``, a torch map-style ``Dataset`` of dicts or a list of dicts as
  one ``datasets.Dataset`` (tensors and numpy arrays as lists).
- ``as_item_dataset``: a dataset kept as the items its ``__getitem__`` returns (every column; tensors come
  back as tensors), for the model's-own-loss step (``uses_sample_batches``).
- ``column_items``: whether a dataset's items are dicts of columns at all; one whose items are anything
  else (tuples, lists, objects: Trainer hands any item to the collator) is never written: the instance's
  own ``get_train_dataloader()`` / ``evaluate()`` read it (``trainer.subclass``).
- a streaming ``train_dataset`` (an ``IterableDataset``) is never read here: it travels to the workers as
  ``RunPlan.train_stream`` (by value, when self-launched) and is iterated there
  (``check_stream_steps``: it needs ``max_steps``, as under Trainer).
- ``classify_collator``: whether our own batching reproduces the collator's result exactly (then it is
  not called: samples go through padding-free token-budget batching) or it must be called as written
  on the padded path.
- ``write_dataset``: the rows the workers train on, written into the run folder (``export_format``).
- ``write_model``: the model (``save_pretrained``, so resized embeddings travel) and tokenizer.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

TOKEN_COLUMNS = ("input_ids", "labels", "seq_lengths")
"""Columns of pre-tokenised rows the workers read (``attention_mask`` is implied by the lengths)."""

RAW_COLUMNS = ("text", "messages", "prompt", "completion")
"""Columns of untokenised rows, tokenised by the data layer in the workers."""


def as_hf_dataset(data: Any, what: str) -> Any:
    """``data`` as a ``datasets.Dataset``; ``what`` names the argument in errors."""
    import datasets

    if isinstance(data, datasets.Dataset):
        return data
    if isinstance(data, datasets.IterableDataset | torch.utils.data.IterableDataset):
        raise TypeError(
            f"{what}: an iterable dataset has no length and cannot be planned into token-budget steps; "
            "materialise it (datasets: .take(n) then Dataset.from_list / from_generator)"
        )
    if isinstance(data, Sequence) and not isinstance(data, str | bytes):
        rows = list(data)
    elif hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        rows = [data[i] for i in range(len(data))]
    else:
        raise TypeError(
            f"{what}: expected a datasets.Dataset, a map-style torch Dataset or a list of dicts, "
            f"got {type(data).__name__}"
        )
    for i, row in enumerate(rows):  # every item: a later one that is not a dict is named, not an AttributeError
        if not isinstance(row, Mapping):
            raise TypeError(f"{what}[{i}]: expected a dict of columns (input_ids...), got {type(row).__name__}")
    return datasets.Dataset.from_list([{k: _plain(v) for k, v in row.items()} for row in rows])


def column_items(data: Any) -> bool:
    """Whether ``data``'s items are dicts of columns, as the loop's own batching and the written rows need them:
    a ``datasets`` dataset always; a map-style dataset or list by its first item; a torch ``IterableDataset``
    by the first item of a fresh iterator; a dict of named sets when every set's are.  No data, an empty one or
    one of no known kind: True (the usual errors speak for it)."""
    import datasets

    if data is None or isinstance(data, datasets.Dataset | datasets.IterableDataset):
        return True
    if isinstance(data, Mapping):
        return all(column_items(part) for part in data.values())
    if isinstance(data, torch.utils.data.IterableDataset):
        first = next(iter(data), None)
    elif hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        first = data[0] if len(data) else None
    else:
        return True
    return first is None or isinstance(first, Mapping)


STREAM_NEEDS_MAX_STEPS = (
    "The train_dataset does not implement __len__, so the number of training steps cannot be inferred; "
    "max_steps has to be specified (TrainingArguments(max_steps=N), N > 0), as transformers.Trainer requires."
)


def check_stream_steps(train_dataset: Any, args: Any) -> None:
    """Trainer's check at construction: a streaming ``train_dataset`` (an ``IterableDataset``, no length)
    needs a positive ``max_steps`` (a ``ValueError`` otherwise, as Trainer raises)."""
    from trainbridge.data.stream_batches import is_stream

    max_steps = getattr(args, "max_steps", None)
    if is_stream(train_dataset) and (max_steps is None or max_steps <= 0):
        raise ValueError(STREAM_NEEDS_MAX_STEPS)


def uses_sample_batches(model: Any, choice: CollatorChoice) -> bool:
    """Whether the workers train on Trainer's sample batches and the model's own loss (``model_loss``): the
    model is not a causal LM, or the script's collator is not reproduced by the padding-free batching (it is
    then called on the items exactly as the dataset returns them)."""
    from trainbridge.modeling.load import is_causal_lm

    return not choice.reproduced or (model is not None and not is_causal_lm(model))


def dataset_transform(data: Any) -> dict[str, Any] | None:
    """The on-the-fly transform of a ``datasets.Dataset`` (``set_transform`` / ``with_transform``) as
    ``RunPlan.dataset_transforms`` holds it, else None."""
    import datasets

    if not isinstance(data, datasets.Dataset) or data.format.get("type") != "custom":
        return None
    return {
        "transform": data.format["format_kwargs"]["transform"],
        "columns": data.format.get("columns"),
        "output_all_columns": bool(data.format.get("output_all_columns", False)),
    }


def dataset_transforms(train: Any, evaluation: Any) -> dict[str, dict[str, Any]]:
    """``RunPlan.dataset_transforms`` of a job over ``train`` and ``evaluation`` (one dataset or a dict)."""
    named = evaluation.items() if isinstance(evaluation, Mapping) else [("", evaluation)]
    found = {"train": dataset_transform(train)}
    found.update({f"eval:{name}" if name else "eval": dataset_transform(part) for name, part in named})
    return {key: value for key, value in found.items() if value is not None}


def as_item_dataset(data: Any, what: str) -> Any:
    """``data`` as a ``datasets.Dataset`` whose rows are the items ``data[i]`` returns: a ``datasets.Dataset``
    as it is (all its columns); a torch map-style ``Dataset`` or list of dicts with the keys that held
    tensors formatted back to tensors (``with_format("torch")``, kept by ``save_to_disk``)."""
    import datasets

    if isinstance(data, datasets.Dataset):
        # an on-the-fly transform travels as RunPlan.dataset_transforms (dataset_transform): the rows as stored
        return data.with_format(None) if dataset_transform(data) is not None else data
    if isinstance(data, datasets.IterableDataset | torch.utils.data.IterableDataset):
        raise TypeError(
            f"{what}: an iterable dataset is not supported by the facade; materialise it "
            "(datasets: .take(n) then Dataset.from_list / from_generator)"
        )
    if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        raise TypeError(
            f"{what}: expected a datasets.Dataset, a map-style torch Dataset or a list of dicts, "
            f"got {type(data).__name__}"
        )
    items = [data[i] for i in range(len(data))]
    if not items:
        raise ValueError(f"{what}: the dataset is empty")
    if not all(isinstance(item, Mapping) for item in items):
        bad = next(item for item in items if not isinstance(item, Mapping))
        raise TypeError(f"{what}: every item must be a dict of columns (input_ids...), got {type(bad).__name__}")
    tensor_keys = sorted({k for item in items for k, v in item.items() if isinstance(v, torch.Tensor)})
    rows = datasets.Dataset.from_list([{k: _plain(v) for k, v in item.items()} for item in items])
    if tensor_keys:
        rows = rows.with_format("torch", columns=tensor_keys, output_all_columns=True)
    return rows


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


@dataclass(frozen=True)
class CollatorChoice:
    """What happens with the script's collator."""

    reproduced: bool
    """True: our batching gives the collator's result; it is not called."""
    labels_from_input_ids: bool = False
    """The collator derives labels from ``input_ids`` (a dataset ``labels`` column is ignored)."""
    description: str = ""


def classify_collator(collator: Any) -> CollatorChoice:
    """Whether trainbridge's own batching reproduces ``collator`` exactly (see module doc)."""
    import transformers

    if collator is None:
        return CollatorChoice(True, description="no data_collator")
    if collator is transformers.default_data_collator or isinstance(collator, transformers.DefaultDataCollator):
        return CollatorChoice(True, description="default_data_collator")
    if isinstance(collator, transformers.DataCollatorForLanguageModeling) and type(collator) in (
        transformers.DataCollatorForLanguageModeling,
    ):
        if collator.mlm:
            return CollatorChoice(False, description="DataCollatorForLanguageModeling(mlm=True)")
        return CollatorChoice(
            True, labels_from_input_ids=True, description="DataCollatorForLanguageModeling(mlm=False)"
        )
    for name in ("DataCollatorWithPadding", "DataCollatorForSeq2Seq", "DataCollatorWithFlattening"):
        cls = getattr(transformers, name, None)
        if cls is not None and type(collator) is cls:
            return CollatorChoice(True, description=name)
    return CollatorChoice(False, description=type(collator).__qualname__)


def prepare_rows(dataset: Any, choice: CollatorChoice, pad_token_id: int | None) -> tuple[Any, int | None]:
    """``(rows, longest)``: the columns the workers read and the longest pre-tokenised row (None for raw rows).

    Pre-tokenised rows keep ``input_ids`` and ``labels``; a collator that derives labels from the inputs
    (``DataCollatorForLanguageModeling``) gets labels ``input_ids`` with the pad token at -100, as it
    computes them.  Untokenised rows keep their raw columns for the data layer.
    """
    columns = set(dataset.column_names)
    if "input_ids" not in columns:
        keep = [c for c in dataset.column_names if c in RAW_COLUMNS]
        if not keep:
            raise ValueError(
                f"dataset has columns {dataset.column_names}: expected pre-tokenised 'input_ids' (+ 'labels') "
                f"or untokenised {', '.join(RAW_COLUMNS)}"
            )
        return dataset.select_columns(keep), None
    keep = [c for c in TOKEN_COLUMNS if c in columns and not (c == "labels" and choice.labels_from_input_ids)]
    rows = dataset.select_columns(keep)
    if choice.labels_from_input_ids and pad_token_id is not None:

        def _labels(batch: dict[str, list[list[int]]]) -> dict[str, list[list[int]]]:
            return {"labels": [[-100 if t == pad_token_id else t for t in ids] for ids in batch["input_ids"]]}

        rows = rows.map(_labels, batched=True, desc="labels as DataCollatorForLanguageModeling makes them")
    lengths = [len(ids) for ids in rows["input_ids"]]
    return rows, max(lengths, default=0)


def write_dataset(rows: Any, folder: Path) -> Path:
    """Write ``rows`` into ``folder`` with ``Dataset.save_to_disk`` (Arrow); returns the ``data_path``.

    The data layer (``trainbridge.data.inputs``) memory-maps the folder in every worker: rows are not
    pickled and not held in Python lists per rank.  When the folder already holds the same rows (same
    Arrow bytes) it is left untouched, so a later ``train(resume_from_checkpoint=...)`` sees the same data
    (checkpoints record a fingerprint of the training data) and the tokenisation cache is reused.
    """
    import hashlib
    import shutil

    folder.parent.mkdir(parents=True, exist_ok=True)
    fresh = folder.with_name(folder.name + ".writing")
    shutil.rmtree(fresh, ignore_errors=True)
    rows.save_to_disk(str(fresh))
    digest = hashlib.sha256()
    for arrow in sorted(fresh.glob("*.arrow")):
        with arrow.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
    marker = folder.with_name(folder.name + ".sha256")
    if folder.is_dir() and marker.is_file() and marker.read_text() == digest.hexdigest():
        shutil.rmtree(fresh)
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    fresh.rename(folder)
    marker.write_text(digest.hexdigest())
    return folder


def tokenizer_beside(model: Any) -> Any:
    """``AutoTokenizer`` of the local folder ``model`` was loaded from (a PEFT model: its base), or None."""
    from transformers import AutoTokenizer

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    source = getattr(base, "name_or_path", None) or getattr(getattr(base, "config", None), "_name_or_path", None)
    if not source or not Path(source).is_dir():
        return None
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError):
        return None
