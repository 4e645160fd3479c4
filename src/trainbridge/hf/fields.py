"""The one table linking ``transformers.TrainingArguments`` fields to ``TrainingArgs`` fields.

Each row names a ``TrainingArguments`` field, the ``TrainingArgs`` field it corresponds to one to one (None
when there is none: it follows from several, or from none), and which way it travels:

- ``to_hf``: ``build_training_arguments`` sets it from the run (``hf.arguments.OWNED_FIELDS``: the fields
  the callbacks' ``args`` take from trainbridge even in a copy of the user's own ``TrainingArguments``);
- ``from_hf``: ``training_args_from_hf`` carries it over (``hf.porting.CARRIED_OVER``; every other field
  set to a non-default value is warned about).

``differs`` says how a carried-over field's effect differs from Trainer's, where it does
(``trainer.field_table``, docs/trainer_fields.md).  The values' conversions (steps from ratios,
``effective_batch_size`` from the per-device batch...) live with the code that applies them; which field
goes where is said here only.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FieldLink:
    """One ``TrainingArguments`` field and its ``TrainingArgs`` counterpart (see the module doc)."""

    hf: str
    ours: str | None
    to_hf: bool = True
    from_hf: bool = True
    reads: str | None = None
    """How the ``TrainingArgs`` side reads where it is one value of a field (``mixed_precision: bf16``)."""
    differs: str | None = None
    """How the run differs from Trainer's for this field, where it does (docs/trainer_fields.md says it)."""


def _same(*names: str, to_hf: bool = True) -> tuple[FieldLink, ...]:
    return tuple(FieldLink(name, name, to_hf=to_hf) for name in names)


FIELD_LINKS: tuple[FieldLink, ...] = (
    FieldLink("output_dir", "ckpt_output_dir"),
    FieldLink("do_train", None, from_hf=False),
    FieldLink("num_train_epochs", "num_epochs", differs="a fraction is rounded up to whole epochs (warned)"),
    *_same("max_steps", "learning_rate"),
    FieldLink("lr_scheduler_type", "lr_scheduler"),
    *_same("warmup_steps", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon"),
    *_same("optim", "optim_args"),  # optim_args: "k=v,..." in TrainingArguments, a dict here
    *_same("max_grad_norm"),
    FieldLink("per_device_train_batch_size", None, from_hf=False),  # from effective_batch_size
    FieldLink("gradient_accumulation_steps", None, from_hf=False),  # 1: micro-batches follow the token budget
    *_same("seed", "data_seed"),
    FieldLink("bf16", "mixed_precision", reads="mixed_precision: bf16"),
    FieldLink("fp16", "mixed_precision", reads="mixed_precision: fp16"),
    FieldLink("use_cpu", "device", reads="device: cpu"),
    *_same(
        "logging_strategy",
        "logging_steps",
        "logging_first_step",
        "eval_strategy",
        "eval_steps",
        "eval_delay",
        "eval_on_start",
        "save_strategy",
        "save_steps",
        "save_total_limit",
        "metric_for_best_model",
        "greater_is_better",
        "load_best_model_at_end",
    ),
    FieldLink("restore_callback_states_from_checkpoint", "restore_callback_states"),
    *_same("resume_from_checkpoint", "report_to", "run_name", "disable_tqdm"),
    FieldLink("ddp_timeout", "collective_timeout_s"),
    FieldLink("local_rank", None, from_hf=False),  # this process's rank
    *_same("include_num_input_tokens_seen", "logging_dir"),
    # read by the port only: the callbacks' args keep the user's values (or TrainingArguments' defaults)
    *_same(
        "lr_scheduler_kwargs",
        "gradient_checkpointing",
        "gradient_checkpointing_kwargs",
        "include_for_metrics",
        "optim_target_modules",
        "ddp_find_unused_parameters",
        "ddp_bucket_cap_mb",
        "ddp_broadcast_buffers",
        "ddp_static_graph",
        to_hf=False,
    ),
    FieldLink("activation_checkpointing", None, to_hf=False, reads="gradient_checkpointing"),  # transformers >= 5
    FieldLink("activation_checkpointing_kwargs", None, to_hf=False, reads="gradient_checkpointing_kwargs"),
    *_same(
        "full_determinism",
        "torch_empty_cache_steps",
        "average_tokens_across_devices",
        "save_only_model",
        "ignore_data_skip",
        "dataloader_num_workers",
        "dataloader_prefetch_factor",
        "dataloader_persistent_workers",
        "dataloader_multiprocessing_context",
        "dataloader_in_order",
        "remove_unused_columns",
        to_hf=False,
    ),
    FieldLink(
        "train_sampling_strategy",
        "train_sampling_strategy",
        to_hf=False,
        differs="Trainer's samplers' orders on its sample batches (data.sample_order; group_by_length draws each "
        "epoch's order from the global generator as Trainer's sampler, and a resume inside the epoch draws it "
        "again from the state kept in the checkpoint); under it the validation batches are Trainer's length-grouped "
        "ones (eval_loss as Trainer's) and compute_metrics gets the predictions in their order; the "
        "padding-free token batches take each step's samples in a random order (in order under sequential) and "
        "pack them by length themselves (longest first, no padding to save): group_by_length and batch_rebalance "
        "add nothing there",
    ),
    *_same("length_column_name", to_hf=False),
    FieldLink(
        "enable_jit_checkpoint",
        "save_on_interrupt",
        to_hf=False,
        differs="the checkpoint is written at the next step boundary, agreed across ranks (Trainer's: after 3 s, "
        "by the signalled rank), then training stops",
    ),
    FieldLink("debug", "debug_underflow_overflow", to_hf=False, reads="debug_underflow_overflow: underflow_overflow"),
    FieldLink("torch_compile", "compile", to_hf=False),
    FieldLink("torch_compile_backend", "compile_backend", to_hf=False),
    FieldLink("torch_compile_mode", "compile_mode", to_hf=False),
    FieldLink(
        "fsdp",
        None,
        to_hf=False,
        reads="distributed_backend: fsdp",
        differs="trainbridge's FSDP2 engine (distributed_backend='fsdp') with fsdp_config's resharding, CPU "
        "offload, wrapped classes and activation checkpointing (fsdp_reshard_after_forward, fsdp_cpu_offload, "
        "fsdp_wrap_classes); its embeddings and output layer are units of their own",
    ),
    FieldLink(
        "deepspeed",
        None,
        to_hf=False,
        reads="distributed_backend: deepspeed",
        differs="trainbridge's DeepSpeed engine with the JSON's ZeRO section (offload too), precision, optimizer and "
        "scheduler, 'auto' filled as Trainer fills it (deepspeed_config); the batch keys are the loop's",
    ),
    # fields of trl's configs, not TrainingArguments
    FieldLink("max_length", None, to_hf=False),  # max_seq_len
    FieldLink("model_init_kwargs", None, to_hf=False),  # the facade's from_pretrained kwargs
)

OWNED_FIELDS: tuple[str, ...] = tuple(link.hf for link in FIELD_LINKS if link.to_hf)
"""The ``TrainingArguments`` fields that describe what trainbridge runs (``training_argument_fields``)."""

CARRIED_OVER: frozenset[str] = frozenset(link.hf for link in FIELD_LINKS if link.from_hf)
"""The ``TrainingArguments`` fields ``training_args_from_hf`` carries over to ``TrainingArgs``."""

RENAMED: dict[str, str] = {
    link.hf: link.reads or link.ours
    for link in FIELD_LINKS
    if link.from_hf and link.ours is not None and link.ours != link.hf
}
"""``TrainingArguments`` fields carried over under another ``TrainingArgs`` name (or value)."""
