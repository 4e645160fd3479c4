"""The names a config field accepts from a fixed set: learning-rate schedules, optimizers, data columns."""

from __future__ import annotations

from typing import Literal

SchedulerName = Literal[
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "reduce_lr_on_plateau",
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
    "greedy",
]
"""``transformers.SchedulerType``'s values (``transformers.get_scheduler`` builds each); ``reduce_lr_on_plateau``
and ``greedy`` step on the evaluation metric, as under Trainer (``callbacks.metric_schedule``)."""
OptimizerName = Literal[
    "adamw_torch",
    "adamw_torch_fused",
    "adamw_torch_xla",
    "adamw_torch_npu_fused",
    "adafactor",
    "adamw_anyprecision",
    "adamw_torch_4bit",
    "adamw_torch_8bit",
    "ademamix",
    "sgd",
    "adagrad",
    "adamw_bnb_8bit",
    "adamw_8bit",
    "ademamix_8bit",
    "lion_8bit",
    "lion_32bit",
    "paged_adamw_32bit",
    "paged_adamw_8bit",
    "paged_ademamix_32bit",
    "paged_ademamix_8bit",
    "paged_lion_32bit",
    "paged_lion_8bit",
    "rmsprop",
    "rmsprop_bnb",
    "rmsprop_bnb_8bit",
    "rmsprop_bnb_32bit",
    "galore_adamw",
    "galore_adamw_8bit",
    "galore_adafactor",
    "galore_adamw_layerwise",
    "galore_adamw_8bit_layerwise",
    "galore_adafactor_layerwise",
    "lomo",
    "adalomo",
    "grokadamw",
    "schedule_free_radam",
    "schedule_free_adamw",
    "schedule_free_sgd",
    "apollo_adamw",
    "apollo_adamw_layerwise",
    "stable_adamw",
]
"""``transformers.training_args.OptimizerNames``' values: Trainer's ``optim`` names, each built by Trainer's
``get_optimizer_cls_and_kwargs`` (``parallel.optim``) when its package is installed."""
DataColumn = Literal[
    "input_ids", "labels", "attention_mask", "seq_lengths", "messages", "tools", "prompt", "completion", "text"
]
"""The column names data rows are read from (``TrainingArgs.data_columns`` maps other names onto them)."""
