"""trl's ORPO/CPO data preparation, run by trl itself: pairs as full token sequences with their labels.

``prepare_reference_free_pairs`` runs what trl's ``ORPOTrainer``/``CPOTrainer`` do to a dataset in their
constructor: the prompt extracted from implicit-prompt rows, conversational rows through the chat
template, then the trainer's own ``tokenize_row`` (the prompt/answer split where the tokeniser merges
across it, BOS and EOS added when missing, completions cut so that prompt + completion fit
``max_length``).  What it keeps per pair is what trl's collator pads: ``chosen_input_ids``,
``chosen_labels``, ``rejected_input_ids``, ``rejected_labels`` (labels ``-100`` on the prompt).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

COLUMNS = ("chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels")


def prepare_reference_free_pairs(dataset: Any, tokenizer: Any, config: Any, trainer_cls: Any) -> Any:
    """``dataset`` as trl's ``trainer_cls`` (``trl.experimental.orpo.ORPOTrainer`` or
    ``trl.experimental.cpo.CPOTrainer``) prepares it for training, reduced to ``COLUMNS``."""
    from trl.data_utils import maybe_apply_chat_template, maybe_extract_prompt

    sample = next(iter(dataset))
    missing = [c for c in ("chosen", "rejected") if c not in sample]
    if missing:
        raise ValueError(
            f"train_dataset: rows need 'chosen' and 'rejected' (and 'prompt' unless implicit); missing {missing}"
        )
    if "image" in sample or "images" in sample:
        raise ValueError("train_dataset: vision preference rows (image/images) are not supported")
    max_length = config.max_length if config.max_length is not None else 512  # trl's fallback
    stand_in = SimpleNamespace(
        processing_class=tokenizer,
        is_encoder_decoder=False,
        max_length=max_length,
        max_completion_length=config.max_completion_length,
        padding_value=tokenizer.pad_token_id,
    )
    stand_in.build_tokenized_answer = functools.partial(trainer_cls.build_tokenized_answer, stand_in)
    dataset = dataset.map(maybe_extract_prompt, num_proc=config.dataset_num_proc)
    dataset = dataset.map(
        maybe_apply_chat_template, fn_kwargs={"processing_class": tokenizer}, num_proc=config.dataset_num_proc
    )
    tokenize_row = functools.partial(trainer_cls.tokenize_row, stand_in)
    dataset = dataset.map(tokenize_row, num_proc=config.dataset_num_proc)
    return dataset.select_columns(list(COLUMNS))
