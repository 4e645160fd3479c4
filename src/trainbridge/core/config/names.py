"""The names a config field accepts from a fixed set: learning-rate schedules, optimizers, data columns."""

from __future__ import annotations

from typing import Literal

SchedulerName = Literal[
    "constant",
    "constant_with_warmup",
    "linear",
    "cosine",
    "cosine_with_min_lr",
    "cosine_with_restarts",
    "polynomial",
    "inverse_sqrt",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
]
"""``transformers.SchedulerType`` values the loop can step (all but the metric-driven ``reduce_lr_on_plateau``
and ``greedy``)."""
OptimizerName = Literal[
    "adamw_torch",
    "adamw_torch_fused",
    "adafactor",
    "sgd",
    "adamw_8bit",
    "adamw_bnb_8bit",
    "paged_adamw_8bit",
    "paged_adamw_32bit",
    "lion_8bit",
    "lion_32bit",
    "paged_lion_8bit",
    "paged_lion_32bit",
    "schedule_free_adamw",
    "schedule_free_radam",
    "schedule_free_sgd",
]
"""Trainer's ``optim`` names trainbridge builds (``parallel.optim``)."""
DataColumn = Literal[
    "input_ids", "labels", "attention_mask", "seq_lengths", "messages", "tools", "prompt", "completion", "text"
]
"""The column names data rows are read from (``TrainingArgs.data_columns`` maps other names onto them)."""
