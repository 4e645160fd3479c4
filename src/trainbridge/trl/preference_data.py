"""trl's DPO data preparation, run by trl itself (for the step's tests), and the reference model's log-probs.

``prepare_preference_dataset`` runs trl's own ``DPOTrainer._prepare_dataset``: the prompt extracted
from implicit-prompt rows, EOS added to plain-text completions, conversational rows through the chat
template, ``prompt_ids``/``chosen_ids``/``rejected_ids`` split where the tokenised prompt and
prompt + completion diverge, and rows whose prompt alone fills ``max_length`` (``keep_start``) dropped.
``pack_pairs`` (``sequence_logps``) then applies trl's per-sequence ``max_length`` truncation.

``reference_stats`` scores packed pairs with the reference: a separate frozen model, or, when the policy
is a PEFT model and no reference model is given, the policy with its adapter disabled (trl's rule; an
adapter named ``ref`` is used instead when the model has one).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from types import SimpleNamespace
from typing import Any

import torch

from trainbridge.trl.sequence_logps import PackedPairs, SequenceStats, sequence_stats


def prepare_preference_dataset(dataset: Any, tokenizer: Any, config: Any, name: str = "train") -> Any:
    """``dataset`` as trl's ``DPOTrainer`` prepares it: ``prompt_ids``, ``chosen_ids``, ``rejected_ids``
    (and precomputed ``ref_chosen_logps``/``ref_rejected_logps`` when the rows carry them)."""
    from trl import DPOTrainer

    sample = next(iter(dataset))
    if "image" in sample or "images" in sample:
        raise ValueError(f"{name}: vision preference rows (image/images) are not supported; use trl's DPOTrainer")
    prepare = DPOTrainer._prepare_dataset
    prepared = prepare(SimpleNamespace(_tokenizer=tokenizer), dataset, tokenizer, config, name)  # type: ignore[arg-type]
    keep = [
        c
        for c in ("prompt_ids", "chosen_ids", "rejected_ids", "ref_chosen_logps", "ref_rejected_logps")
        if c in prepared.column_names
    ]
    return prepared.select_columns(keep)


def _reference_context(policy: torch.nn.Module) -> AbstractContextManager[Any]:
    """The PEFT policy as its own reference: adapter disabled, or the ``ref`` adapter active."""
    from contextlib import contextmanager

    peft_model: Any = policy
    while not hasattr(peft_model, "peft_config") and hasattr(peft_model, "module"):
        peft_model = peft_model.module  # DDP / DeepSpeed wrappers
    if not hasattr(peft_model, "disable_adapter"):
        raise ValueError(
            "reference model: none given and the policy is not a PEFT model; pass ref_model (a frozen "
            "copy of the initial model), or precompute_ref_log_probs=True"
        )
    if "ref" not in peft_model.peft_config:
        return peft_model.disable_adapter()

    @contextmanager
    def ref_adapter() -> Any:
        previous = peft_model.active_adapter
        peft_model.set_adapter("ref")
        try:
            yield
        finally:
            peft_model.set_adapter(previous)

    return ref_adapter()


def reference_stats(
    policy: torch.nn.Module, ref_model: torch.nn.Module | None, packed: PackedPairs, ld_alpha: float | None = None
) -> SequenceStats:
    """The reference's per-sequence sums for ``packed`` (see the module doc), without gradient."""
    context = nullcontext() if ref_model is not None else _reference_context(policy)
    with torch.no_grad(), context:
        return sequence_stats(ref_model if ref_model is not None else policy, packed, ld_alpha)
