"""The data layer: inputs, tokenisation cache, sample sources, global step plans, loaders, collation, loss.

- ``inputs``: local data paths (JSONL, JSON, parquet, Arrow, ``save_to_disk`` folders) read with ``datasets``.
- ``records``: rows (pre-tokenized, chat ``messages``, ``prompt``/``completion``, ``text``) -> tokens and labels.
- ``chat``: chat-template rendering and assistant-only masks.
- ``cache``: tokenise once into a memory-mapped Arrow cache keyed by data, tokenizer, template and options.
- ``samples``: ``SampleSource``s -- length columns for planning, samples fetched per micro-batch.
- ``sources``: ``TrainingArgs`` -> training/validation sources (the builder's one call), start-up summary.
- ``dataset``: ``Sample``, ``LoadStats``, ``DataFormatError`` (bad rows named by file and line/row).
- ``plan``: the global plan of an epoch (which samples each rank's micro-batches hold at every step).
- ``loader``: ``TrainBatches`` / ``EvalBatches``, one rank's view of the plan as collated tensors.
- ``collate``: padding-free (packed rows) and padded tensors.
- ``loss``: the token-sum loss the loop normalises by the step's global loss-token count.
- ``script_data``: a ``Trainer`` script's datasets and collator, made ready for the loop in place (never written).
"""

from trainbridge.data.collate import DUMMY_TOKEN_ID, collate_padded, collate_padding_free
from trainbridge.data.inputs import DataInputError
from trainbridge.data.loss import token_loss_sum
from trainbridge.data.plan import EpochPlan, MicroBatch, StepPlan, plan_epoch, steps_per_epoch
from trainbridge.data.samples import ArrowSamples, InMemorySamples, SampleSource
from trainbridge.data.sources import RunData, load_jsonl, load_run_data, open_dataset
from trainbridge.data.types import (
    IGNORE_INDEX,
    DataFormatError,
    LoadStats,
    OverlongPolicy,
    Sample,
    split_validation,
)

__all__ = [
    "DUMMY_TOKEN_ID",
    "IGNORE_INDEX",
    "ArrowSamples",
    "DataFormatError",
    "DataInputError",
    "EpochPlan",
    "InMemorySamples",
    "LoadStats",
    "MicroBatch",
    "OverlongPolicy",
    "RunData",
    "Sample",
    "SampleSource",
    "StepPlan",
    "collate_padded",
    "collate_padding_free",
    "load_jsonl",
    "load_run_data",
    "open_dataset",
    "plan_epoch",
    "split_validation",
    "steps_per_epoch",
    "token_loss_sum",
]
