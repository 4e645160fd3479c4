"""A user's collate function (e.g. a ``transformers`` data collator) on the padded path.

``collate_with(collator, samples, pad_token_id)`` hands the collator what a ``Trainer`` dataloader
hands it -- one feature dict per sample (``input_ids``, ``attention_mask`` and ``labels`` when the
sample's labels are its own, not a copy of ``input_ids``) -- and checks what comes back: a mapping with
``input_ids`` (and ``labels``; when there are none, they are ``input_ids`` with masked-out positions at
``-100``, the causal-LM default).  Tensors are returned as CPU ``int64``/the collator's dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from trainbridge.data.collate import collate_padded
from trainbridge.data.types import IGNORE_INDEX, Sample

BATCH_KEYS = ("input_ids", "attention_mask", "position_ids", "labels")
"""Keys of a collator's batch the loop uses (others are dropped)."""


def sample_features(sample: Sample) -> dict[str, list[int]]:
    """The feature dict a collator gets for ``sample``."""
    features = {"input_ids": list(sample.input_ids), "attention_mask": [1] * sample.length}
    if sample.labels != sample.input_ids:
        features["labels"] = list(sample.labels)
    return features


def collate_with(
    collator: Callable[[list[dict[str, Any]]], Any], samples: Sequence[Sample], pad_token_id: int
) -> dict[str, torch.Tensor]:
    """Collate ``samples`` with ``collator``; an empty (dummy) micro-batch uses ``collate_padded``."""
    if not samples:
        return collate_padded(samples, pad_token_id)
    batch = collator([sample_features(s) for s in samples])
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        raise TypeError(
            f"data_collator {type(collator).__name__} returned {type(batch).__name__} without 'input_ids'; "
            "it must return a dict of tensors with at least 'input_ids'"
        )
    out = {key: torch.as_tensor(batch[key]) for key in BATCH_KEYS if key in batch and batch[key] is not None}
    if "labels" not in out:
        labels = out["input_ids"].clone()
        if "attention_mask" in out:
            labels[out["attention_mask"] == 0] = IGNORE_INDEX
        out["labels"] = labels
    if out["input_ids"].shape[0] != len(samples):
        raise ValueError(
            f"data_collator {type(collator).__name__} returned {out['input_ids'].shape[0]} rows for "
            f"{len(samples)} samples; it must keep one row per sample, in order"
        )
    return out
