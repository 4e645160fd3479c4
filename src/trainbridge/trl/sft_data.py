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
  ``max_length`` bins and attends within each sequence (its ``seq_lengths``).  Each bin is one sample
  here too, of several sequences (``data.types.Sample.seq_lengths``): the planner counts bins as trl's
  ``per_device_train_batch_size`` does, and a padding-free row lays each bin's sequences out as trl's
  padding-free collator does (``position_ids`` restarting, attention within each sequence).
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
    columns = ["input_ids", "labels"]
    if packing and config.packing_strategy != "wrapped":
        columns.append("seq_lengths")  # a bin's sequences: one multi-sequence sample
    return prepared.select_columns(columns)


def sft_data_settings(config: Any, longest: int) -> dict[str, Any]:
    """``TrainingArgs`` data fields for rows from ``prepare_sft_dataset``: every row is already truncated as
    trl does, so ``max_seq_len`` is ``max_length`` (or the longest row without one) and nothing is dropped;
    batches are padding-free."""
    max_length = config.max_length if config.max_length is not None else longest
    return {"max_seq_len": max(max_length, longest, 1), "overlong_policy": "error", "packing": "auto"}
