"""The data layer: JSONL samples, global token-budget step plans, micro-batch tensors, token-sum loss."""

from trainbridge.data.batching import EpochPlan, MicroBatch, StepPlan, plan_epoch, steps_per_epoch
from trainbridge.data.collate import (
    DUMMY_TOKEN_ID,
    PACKED_ROW_TOKENS,
    VARLEN_SDPA,
    collate_padded,
    collate_padding_free,
    model_supports_padding_free,
    packed_row_tokens,
)
from trainbridge.data.dataset import (
    IGNORE_INDEX,
    DataFormatError,
    LoadStats,
    OverlongPolicy,
    Sample,
    load_jsonl,
    split_validation,
)
from trainbridge.data.loss import token_loss_sum
from trainbridge.data.varlen_attention import enable_varlen_sdpa

__all__ = [
    "DUMMY_TOKEN_ID",
    "IGNORE_INDEX",
    "PACKED_ROW_TOKENS",
    "VARLEN_SDPA",
    "DataFormatError",
    "EpochPlan",
    "LoadStats",
    "MicroBatch",
    "OverlongPolicy",
    "Sample",
    "StepPlan",
    "collate_padded",
    "collate_padding_free",
    "enable_varlen_sdpa",
    "load_jsonl",
    "model_supports_padding_free",
    "packed_row_tokens",
    "plan_epoch",
    "split_validation",
    "steps_per_epoch",
    "token_loss_sum",
]
