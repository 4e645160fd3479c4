"""trl's SFT data preparation, run by trl itself, as rows our padding-free batching takes.

``prepare_sft_dataset`` runs trl's own ``SFTTrainer._prepare_dataset`` (on a stand-in holding what
``SFTTrainer.__init__`` would have set), so ``formatting_func``, ``dataset_text_field``, the text,
prompt/completion and conversational (``messages``) formats, ``completion_only_loss``,
``assistant_only_loss`` (trl's training chat template with ``{% generation %}`` markers), the EOS
handling and ``max_length``/``truncation_mode`` give exactly trl's ``input_ids``/``labels``.  Packing
then maps to samples:

- ``packing=False``: one sample per example; batches are padding-free token budgets (trl pads, or
  flattens with ``padding_free=True``: the same loss either way).
- ``packing_strategy="bfd"`` / ``"bfd_split"``: trl packs whole (truncated / split) sequences into
  ``max_length`` bins and attends within each sequence (its ``seq_lengths``).  Our padding-free batches
  do the same without the bins: the packed rows are split back into their sequences.
- ``packing_strategy="wrapped"``: trl cuts the token stream into ``max_length`` blocks attended as
  one sequence; each block is one sample here too.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

PACKING_STRATEGIES = ("bfd", "bfd_split", "wrapped")


def _stand_in(dataset: Any, tokenizer: Any, config: Any) -> SimpleNamespace:
    """What trl's ``SFTTrainer.__init__`` sets that ``_prepare_dataset`` reads."""
    from trl.chat_template_utils import get_training_chat_template
    from trl.data_utils import is_conversational

    sample = next(iter(dataset))
    if config.assistant_only_loss and not is_conversational(sample):
        raise ValueError(
            "assistant_only_loss: True needs a conversational dataset ('messages', or "
            "'prompt'/'completion' as messages); this one is not"
        )
    chat_template = None
    template = getattr(tokenizer, "chat_template", None)
    if config.assistant_only_loss and not (isinstance(template, str) and "{% generation %}" in template):
        chat_template = get_training_chat_template(tokenizer)
    completion_only = config.completion_only_loss
    if completion_only is None:
        completion_only = "prompt" in sample and "completion" in sample
    return SimpleNamespace(
        _tokenizer=tokenizer, chat_template=chat_template, completion_only_loss=completion_only, padding_free=False
    )


def prepare_sft_dataset(
    dataset: Any,
    tokenizer: Any,
    config: Any,
    formatting_func: Any = None,
    name: str = "train",
    packing: bool | None = None,
) -> Any:
    """``dataset`` (a ``datasets.Dataset``) prepared as trl's ``SFTTrainer`` prepares it, as
    ``input_ids``/``labels`` rows, one per sample (see the module doc).  ``config``: trl's ``SFTConfig``;
    ``packing``: the packing of this split (``eval_packing`` for evaluation sets), default ``config.packing``."""
    from trl import SFTTrainer

    packing = config.packing if packing is None else packing
    if packing and config.packing_strategy not in PACKING_STRATEGIES:
        raise ValueError(f"packing_strategy: {config.packing_strategy!r}; use one of {list(PACKING_STRATEGIES)}")
    stand_in = _stand_in(dataset, tokenizer, config)
    prepare = SFTTrainer._prepare_dataset
    prepared = prepare(stand_in, dataset, tokenizer, config, packing, formatting_func, name)  # type: ignore[arg-type]
    if packing and config.packing_strategy != "wrapped":
        bins = len(prepared)
        prepared = prepared.map(_unpack, batched=True, remove_columns=prepared.column_names)
        if name == "train":
            _warn_bins_are_split(config, bins, len(prepared))
    return prepared.select_columns(["input_ids", "labels"])


def _warn_bins_are_split(config: Any, bins: int, sequences: int) -> None:
    """trl's ``per_device_train_batch_size`` counts ``bfd`` bins; here a batch counts the sequences the bins
    are split back into (a sample is one sequence), so an epoch has more steps than trl's: say how many."""
    import warnings

    from trainbridge.hf.porting import HFPortingWarning

    if sequences == bins:
        return
    per_device = round(config.per_device_train_batch_size * sequences / bins)
    warnings.warn(
        f"SFTConfig.packing_strategy={config.packing_strategy!r}: trl packs the {sequences} training sequences "
        f"into {bins} bins of max_length tokens and its per_device_train_batch_size counts bins; trainbridge "
        f"trains the sequences padding-free and counts sequences, so an epoch has about {sequences / bins:.1f}x "
        f"trl's steps.  For about trl's sequences per step, set per_device_train_batch_size={per_device}.",
        HFPortingWarning,
        stacklevel=3,
    )


def _unpack(rows: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """Split trl's packed rows back into their sequences (``seq_lengths``)."""
    input_ids, labels = [], []
    for ids, row_labels, lengths in zip(rows["input_ids"], rows["labels"], rows["seq_lengths"], strict=True):
        start = 0
        for length in lengths:
            input_ids.append(ids[start : start + length])
            labels.append(row_labels[start : start + length])
            start += length
    return {"input_ids": input_ids, "labels": labels}


def sft_data_settings(config: Any, longest: int) -> dict[str, Any]:
    """``TrainingArgs`` data fields for rows from ``prepare_sft_dataset``: every row is already truncated as
    trl does, so ``max_seq_len`` is ``max_length`` (or the longest row without one) and nothing is dropped;
    batches are padding-free."""
    max_length = config.max_length if config.max_length is not None else longest
    return {"max_seq_len": max(max_length, longest, 1), "overlong_policy": "error", "packing": "auto"}
