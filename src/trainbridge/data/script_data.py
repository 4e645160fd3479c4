"""What a ``Trainer`` script hands over, made ready for the loop in place: datasets, the collator, the model.

- ``script_inputs``: ``RunPlan.script_data`` of a train job: the script's datasets as the loop reads them, never
  written anywhere.  On sample batches (``RowPreparation.items``: the model's own loss) each dataset is the
  script's object itself, indexed live (``dataset[i]`` at every micro-batch, each epoch, as Trainer's
  DataLoader does); on the padding-free token path, its rows as ``data.in_place.InPlaceRows`` (``prepare_rows``),
  tokenised once per node and cached by the dataset's fingerprint.
- ``as_hf_dataset``: a ``datasets.Dataset``, a torch map-style ``Dataset`` of dicts or a list of dicts as
  one ``datasets.Dataset`` (tensors and numpy arrays as lists), for the token path.
- ``column_items``: whether a dataset's items are dicts of columns at all; one whose items are anything
  else (tuples, lists, objects: Trainer hands any item to the collator) is not the loop's: the instance's
  own ``get_train_dataloader()`` / ``evaluate()`` read it (``trainbridge.trainer.subclass``).
- ``data_identity``: what the training data is, for the checkpoint fingerprint (resume on other data flagged).
- a streaming ``train_dataset`` (an ``IterableDataset``) is never read here: it is ``RunPlan.train_stream``
  (``check_stream_steps``: it needs ``max_steps``, as under Trainer).
- reading an item here to look at it leaves the random streams as they were (``peek``): Trainer reads none
  before its DataLoader, and a random transform per access draws when an item is read.
- ``classify_collator``: whether our own batching reproduces the collator's result exactly (then it is
  not called: samples go through padding-free token-budget batching) or it must be called as written
  on the padded path.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainbridge.core.config.plan import ScriptData
from trainbridge.core.random_state import rng_states_kept
from trainbridge.data.in_place import InPlaceRows
from trainbridge.data.stream_batches import is_stream

logger = logging.getLogger(__name__)


def peek(data: Any, index: int | None = 0) -> Any:
    """``data[index]`` (``index`` None: the first item of a fresh iterator, None when empty), the random
    streams left as they were (see the module doc)."""
    with rng_states_kept():
        return next(iter(data), None) if index is None else data[index]


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
        first = peek(data, None)
    elif hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        first = peek(data) if len(data) else None
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
    max_steps = getattr(args, "max_steps", None)
    if is_stream(train_dataset) and (max_steps is None or max_steps <= 0):
        raise ValueError(STREAM_NEEDS_MAX_STEPS)


PASS_THROUGH_COLLATORS = (
    "DefaultDataCollator",
    "DataCollatorWithPadding",
    "DataCollatorForLanguageModeling",
    "DataCollatorForSeq2Seq",
)
"""transformers' collators that hand on every column they get (strings aside): Trainer's batches then carry it."""
TOKEN_STEP_COLUMNS = frozenset({"input_ids", "labels", "attention_mask", "position_ids"})
"""What the padding-free token step hands the model."""


def columns_past_the_token_step(collator: Any, datasets: Sequence[Any], kept: Collection[str] | None) -> list[str]:
    """The columns of the pre-tokenised ``datasets`` that Trainer's batches hand the model and the token step
    does not: ``collator`` is one of transformers' own (it passes on every column but text), given the columns
    in ``kept`` (Trainer's signature columns under ``remove_unused_columns``; None: every column)."""
    import transformers

    own = collator is transformers.default_data_collator or any(
        type(collator) is getattr(transformers, name, None) for name in PASS_THROUGH_COLLATORS
    )
    past: list[str] = []
    for data in datasets if own else ():
        try:
            item = peek(data) if not isinstance(data, Mapping) and not is_stream(data) and len(data) else None
        except (IndexError, KeyError, TypeError, NotImplementedError):
            item = None
        if not isinstance(item, Mapping) or "input_ids" not in item:
            continue  # untokenised rows (the data layer tokenises them) or not a dataset of columns
        for name, value in item.items():
            text = isinstance(value, str) or (isinstance(value, list) and value and isinstance(value[0], str))
            if name not in TOKEN_STEP_COLUMNS and not text and (kept is None or name in kept) and name not in past:
                past.append(name)
    return past


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


def prepare_rows(dataset: Any, choice: CollatorChoice, pad_token_id: int | None) -> tuple[InPlaceRows, int | None]:
    """``(rows, longest)``: the columns the workers read and the longest pre-tokenised row (None for raw rows).

    Pre-tokenised rows keep ``input_ids`` and ``labels``; a collator that derives labels from the inputs
    (``DataCollatorForLanguageModeling``) gets labels ``input_ids`` with the pad token at -100, as it
    computes them (``InPlaceRows.labels_pad_id``: derived when the rows are tokenised, once per node).
    Untokenised rows keep their raw columns for the data layer.  Nothing here reads the rows but the lengths.
    """
    columns = set(dataset.column_names)
    if "input_ids" not in columns:
        keep = [c for c in dataset.column_names if c in RAW_COLUMNS]
        if not keep:
            raise ValueError(
                f"dataset has columns {dataset.column_names}: expected pre-tokenised 'input_ids' (+ 'labels') "
                f"or untokenised {', '.join(RAW_COLUMNS)}"
            )
        return InPlaceRows(dataset.select_columns(keep)), None
    keep = [c for c in TOKEN_COLUMNS if c in columns and not (c == "labels" and choice.labels_from_input_ids)]
    rows = dataset.select_columns(keep)
    derive = choice.labels_from_input_ids and pad_token_id is not None
    return InPlaceRows(rows, pad_token_id if derive else None), longest_row(rows)


def longest_row(rows: Any) -> int:
    """The most tokens in a row of ``rows``' ``input_ids`` (0 when empty), from the Arrow column's list
    lengths: no row is copied into Python."""
    import pyarrow.compute as pc

    if len(rows) == 0:
        return 0
    column = rows.with_format("arrow")["input_ids"]
    try:
        return int(pc.max(pc.list_value_length(column)).as_py() or 0)
    except (NotImplementedError, TypeError, ValueError):  # not an Arrow list column (e.g. a tensor feature)
        return max((len(ids) for ids in rows.with_format(None)["input_ids"]), default=0)


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


@dataclass(frozen=True)
class RowPreparation:
    """How the datasets' rows reach the loop (``script_inputs``)."""

    collator: CollatorChoice
    pad_token_id: int | None
    items: bool = False
    """The loop trains on the model's own loss over the datasets' items (``RowPreparation.items``): each
    dataset is the script's object, indexed live; else its rows are prepared for the token step."""


def is_dataset_dict(data: Any) -> bool:
    """A dict of named datasets (Trainer's ``eval_dataset={name: dataset}``; a ``DatasetDict`` too, as Trainer)."""
    return isinstance(data, Mapping)


def script_inputs(
    train: Any, evaluation: Any, processing_class: Any, rows: RowPreparation
) -> tuple[ScriptData, int | None]:
    """``(RunPlan.script_data, longest prepared row)`` of a train job over ``train`` and ``evaluation`` (one
    dataset, or a dict of named sets); longest: tokens, None for items or raw rows.  Not the loop's: a stream
    (``train_stream``) and a set whose items are not dicts of columns (the instance's own loader and
    ``evaluate`` read it)."""
    if train is None:
        raise ValueError("Trainer: training requires a train_dataset")
    own = not is_stream(train) and column_items(train)
    train_rows, longest = _loop_rows(train, "train_dataset", rows) if own else (None, None)
    eval_rows, named, lengths = None, {}, [longest or 0]
    if evaluation is not None and column_items(evaluation):
        if is_dataset_dict(evaluation):
            for name, part in evaluation.items():
                named[str(name)], part_longest = _loop_rows(part, f"eval_dataset[{name!r}]", rows)
                lengths.append(part_longest or 0)
        else:
            eval_rows, eval_longest = _loop_rows(evaluation, "eval_dataset", rows)
            lengths.append(eval_longest or 0)
    identity = data_identity(train) if own else None
    return ScriptData(train_rows, eval_rows, named, processing_class, identity), max(lengths) or None


def _loop_rows(data: Any, what: str, rows: RowPreparation) -> tuple[Any, int | None]:
    """``data`` as the loop reads it: the object itself (items), or its rows prepared in memory."""
    if not rows.items:
        return prepare_rows(as_hf_dataset(data, what), rows.collator, rows.pad_token_id)
    import datasets

    if isinstance(data, datasets.IterableDataset | torch.utils.data.IterableDataset):
        raise TypeError(
            f"{what}: an iterable dataset is not supported here; materialise it "
            "(datasets: .take(n) then Dataset.from_list / from_generator)"
        )
    if not (hasattr(data, "__getitem__") and hasattr(data, "__len__")):
        raise TypeError(
            f"{what}: expected a datasets.Dataset, a map-style torch Dataset or a list of dicts, "
            f"got {type(data).__name__}"
        )
    if len(data) == 0:
        raise ValueError(f"{what}: the dataset is empty")
    return data, None


IDENTITY_ITEMS = 3
"""Items (first, middle, last) whose contents identify a dataset that is not a ``datasets.Dataset``."""


def data_identity(data: Any) -> str:
    """What ``data`` is, for the checkpoint fingerprint (``ScriptData.identity``): a ``datasets.Dataset``'s
    fingerprint (its rows and every transformation), else its type, length and a digest of a few items (a
    dataset whose items differ at each fetch, a random augmentation: type and length only)."""
    import datasets

    if isinstance(data, datasets.Dataset):
        return f"datasets:{data._fingerprint}"
    count = len(data)
    digest = hashlib.sha256(f"{type(data).__module__}.{type(data).__qualname__}:{count}".encode())
    if count and _item_digest(peek(data)) == _item_digest(peek(data)):  # the same item at each fetch
        for index in sorted({0, count // 2, count - 1})[:IDENTITY_ITEMS]:
            digest.update(_item_digest(peek(data, index)).encode())
    return f"items:{digest.hexdigest()}"


def _item_digest(value: Any) -> str:
    """A stable digest of an item: tensors and arrays by dtype, shape and bytes; mappings by sorted key."""
    digest = hashlib.sha256()

    def feed(part: Any) -> None:
        if isinstance(part, torch.Tensor):
            flat = part.detach().cpu().contiguous().reshape(-1)
            digest.update(f"{part.dtype}{tuple(part.shape)}".encode())
            digest.update(flat.view(torch.uint8).numpy().tobytes())
        elif isinstance(part, np.ndarray):
            digest.update(f"{part.dtype}{part.shape}".encode())
            digest.update(np.ascontiguousarray(part).tobytes())
        elif isinstance(part, Mapping):
            for key in sorted(part, key=str):
                digest.update(str(key).encode())
                feed(part[key])
        elif isinstance(part, list | tuple):
            digest.update(f"[{len(part)}".encode())
            for item in part:
                feed(item)
        else:
            digest.update(repr(part).encode())

    feed(value)
    return digest.hexdigest()
