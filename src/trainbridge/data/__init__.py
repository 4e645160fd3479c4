"""The data layer: samples, global token-budget step plans, per-rank loaders, micro-batch tensors, loss.

- ``dataset``: JSONL files -> ``Sample``s (malformed lines named by file:line).
- ``plan``: the global plan of an epoch (which samples each rank's micro-batches hold at every step).
- ``loader``: ``TrainBatches`` / ``EvalBatches``, one rank's view of the plan as collated tensors.
- ``collate``: padding-free (packed rows) and padded tensors.
- ``loss``: the token-sum loss the loop normalises by the step's global loss-token count.
"""

from trainbridge.data.collate import DUMMY_TOKEN_ID, collate_padded, collate_padding_free
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
from trainbridge.data.plan import EpochPlan, MicroBatch, StepPlan, plan_epoch, steps_per_epoch

__all__ = [
    "DUMMY_TOKEN_ID",
    "IGNORE_INDEX",
    "DataFormatError",
    "EpochPlan",
    "LoadStats",
    "MicroBatch",
    "OverlongPolicy",
    "Sample",
    "StepPlan",
    "collate_padded",
    "collate_padding_free",
    "load_jsonl",
    "plan_epoch",
    "split_validation",
    "steps_per_epoch",
    "token_loss_sum",
]
