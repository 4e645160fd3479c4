"""The batch shape of a job ported from ``transformers.TrainingArguments``: ``TrainingArgs``' batch fields.

Trainer's ``per_device_train_batch_size`` x ``gradient_accumulation_steps`` x world size is the step's
``effective_batch_size``; the token budget fits ``per_device_train_batch_size`` rows of the longest sample.
A job on the datasets' items (Trainer's sample batches) also takes its evaluation batch,
``remove_unused_columns`` and ``label_names``; one on prepared token rows takes the evaluation batch only
(Trainer's validation batches: its ``eval_loss`` and per-batch metrics).
"""

from __future__ import annotations

from typing import Any

from transformers import TrainingArguments

DEFAULT_MAX_SEQ_LEN = 512
"""``max_seq_len`` of a ported run whose rows are not tokenised yet and whose arguments name no length."""


def batch_fields(hf: TrainingArguments, world_size: int, longest: int | None, items: bool) -> dict[str, Any]:
    """``TrainingArgs``' batch fields of ``hf`` on ``world_size`` ranks (``longest``: the longest prepared row,
    if known; ``items``: the job trains on the datasets' items); a ``ValueError`` naming a field that is not a
    positive integer."""
    per_device = int(hf.per_device_train_batch_size)
    accumulation = int(hf.gradient_accumulation_steps)
    for name, value in (("per_device_train_batch_size", per_device), ("gradient_accumulation_steps", accumulation)):
        if value < 1:  # before: a pydantic dump naming our effective_batch_size / per_device_batch_size
            raise ValueError(f"{type(hf).__name__}.{name}={value}: must be a positive integer (1 or more)")
    max_len = getattr(hf, "max_length", None) or getattr(hf, "max_seq_length", None)  # trl's configs
    max_seq_len = int(longest or max_len or DEFAULT_MAX_SEQ_LEN)
    fields: dict[str, Any] = {
        "effective_batch_size": per_device * accumulation * world_size,
        "per_device_batch_size": per_device,  # Trainer's sample batches: accumulation follows
        "max_seq_len": max_seq_len,
        "max_batch_len": max(per_device * max_seq_len, max_seq_len),
    }
    eval_batch = getattr(hf, "per_device_eval_batch_size", None)
    if eval_batch:
        fields["per_device_eval_batch_size"] = int(eval_batch)
    if items:
        fields["remove_unused_columns"] = bool(getattr(hf, "remove_unused_columns", True))
        label_names = getattr(hf, "label_names", None)
        if label_names:
            fields["label_names"] = list(label_names)
    return fields
