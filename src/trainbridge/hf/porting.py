"""``training_args_from_hf``: port an existing ``transformers.TrainingArguments`` to ``TrainingArgs``.

Fields with a trainbridge equivalent are carried over (schedules, steps, best-model settings, optimiser
and scheduler settings, seed, precision, integrations).  Every other field that is set to a value other
than its default raises one ``HFPortingWarning`` saying why it has no meaning here (and what to use
instead, where something does the job).  Things that must be said explicitly (model and data paths,
``effective_batch_size``...) are passed as keyword arguments and win over anything carried over.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Collection
from enum import Enum
from pathlib import Path
from typing import Any, NamedTuple

from transformers import TrainingArguments

from trainbridge.core.config import TrainingArgs
from trainbridge.core.run_dir import OWN_FILES_DIR
from trainbridge.hf.arguments import defaults_of
from trainbridge.hf.fields import CARRIED_OVER, RENAMED


class HFPortingWarning(UserWarning):
    """A ``TrainingArguments`` field set to a non-default value is ignored by ``training_args_from_hf``."""


class Unwarned(NamedTuple):
    """Why a field set to a non-default value is not warned about; ``same`` where the run does what Trainer
    does with it (nothing, or what Trainer's own ``__init__`` or the callbacks reading ``args`` do)."""

    why: str
    same: bool = False


_BY_SCRIPTS = Unwarned("Trainer does not read it either (example scripts do)", same=True)
_NOT_PUSHED = Unwarned("nothing is pushed to a hub (push_to_hub is warned about)")
_TRACKIO = Unwarned("read from args by transformers' trackio callback (report_to), as under Trainer", same=True)
_FULL_EVAL = Unwarned(
    "Trainer's own evaluate() and predict() (the facade's) cast the model outside train(); inside train() Trainer "
    "does not cast it either",
    same=True,
)
_LOGGING = Unwarned("Trainer's own __init__ (the facade's) sets transformers' logging verbosity from it", same=True)
_EVALUATION = Unwarned(
    "Trainer's own evaluate() reads it at each evaluation on Trainer's sample batches; the padding-free token "
    "batches' evaluation calls compute_metrics as Trainer does (loop.predictions)",
    same=True,
)

# Fields never warned about: bookkeeping, values TrainingArguments normalises itself, and fields whose
# meaning is covered by another warning.
NOT_WARNED: dict[str, Unwarned] = {
    "do_train": _BY_SCRIPTS,
    "do_eval": _BY_SCRIPTS,
    "do_predict": _BY_SCRIPTS,
    "local_rank": Unwarned("set by the launcher (LOCAL_RANK), as under Trainer", same=True),
    "accelerator_config": Unwarned("not read: the loop's engines are trainbridge's, not accelerate's"),
    "dataloader_pin_memory": Unwarned("not read: the loop's batches are not pinned"),
    "log_level": _LOGGING,
    "log_level_replica": _LOGGING,
    "log_on_each_node": _LOGGING,
    "logging_nan_inf_filter": Unwarned("not read: a non-finite loss is handled as nonfinite_policy says"),
    "skip_memory_metrics": Unwarned(
        "Trainer's own memory tracker (the facade's _memory_tracker) adds its init_mem_* / train_mem_* deltas to "
        "train()'s metrics",
        same=True,
    ),
    "hub_token": _NOT_PUSHED,
    "hub_private_repo": _NOT_PUSHED,
    "hub_model_id": _NOT_PUSHED,
    "hub_strategy": _NOT_PUSHED,
    "hub_always_push": _NOT_PUSHED,
    "hub_revision": _NOT_PUSHED,
    "project": _TRACKIO,
    "trackio_space_id": _TRACKIO,
    "trackio_bucket_id": _TRACKIO,
    "trackio_static_space_id": _TRACKIO,
    "fsdp_config": Unwarned(
        "read with fsdp: reshard_after_forward, cpu_offload, transformer_layer_cls_to_wrap / NO_WRAP and "
        "activation_checkpointing on the FSDP2 engine (fsdp_reshard_after_forward, fsdp_cpu_offload, "
        "fsdp_wrap_classes, gradient_checkpointing); SIZE_BASED_WRAP is refused; the FSDP1 keys have no meaning "
        "under FSDP2"
    ),
    "batch_eval_metrics": _EVALUATION,
    "eval_do_concat_batches": _EVALUATION,
    "prediction_loss_only": _EVALUATION,
    "eval_use_gather_object": Unwarned(
        "Trainer's own evaluate() (its gather_function) reads it on Trainer's sample batches; the padding-free "
        "token batches' evaluation gathers every rank's rows as objects (all_gather_object) whatever its value and "
        "hands compute_metrics stacked arrays, as Trainer's tensor gather does"
    ),
    "eval_accumulation_steps": Unwarned(
        "Trainer's own evaluate() reads it on Trainer's sample batches; the token batches' evaluation keeps "
        "each batch's predictions on the CPU, what it saves memory for",
        same=True,
    ),
    "bf16_full_eval": _FULL_EVAL,
    "fp16_full_eval": _FULL_EVAL,
    "use_cache": Unwarned("Trainer's own __init__ (the facade's) sets model.config.use_cache from it", same=True),
    "auto_find_batch_size": Unwarned(
        "Trainer's own search (find_executable_batch_size: on an out-of-memory error the run starts again with "
        "int(0.9 x) the items per micro-batch, max_batch_len following on the token path; a resume starts from "
        "the checkpoint's train_batch_size). On several ranks with DDP an error in a training forward or its loss "
        "is agreed before the backward (one small all-reduce per micro-batch), so every rank retries with the "
        "same size where Trainer's per-process search leaves the others waiting; one elsewhere (backward, "
        "optimizer step, FSDP2/DeepSpeed forward) ends the run with an error naming it (hf.batch_size_search)"
    ),
    "dataloader_drop_last": Unwarned(
        "read from the script's TrainingArguments: the short batch is dropped (loop.build)", same=True
    ),
}

# Why a field has no meaning here, for the fields users set most.
EXPLANATIONS: dict[str, str] = {
    "per_device_train_batch_size": (
        "trainbridge batches by token budget: set effective_batch_size (samples per optimizer step, all "
        "ranks together; Trainer's is per_device_train_batch_size x gradient_accumulation_steps x world "
        "size) and max_batch_len (tokens per micro-batch on one rank)"
    ),
    "gradient_accumulation_steps": (
        "gradient accumulation follows from effective_batch_size and max_batch_len (as many micro-batches "
        "as the token budget needs)"
    ),
    "per_device_eval_batch_size": "validation micro-batches are filled up to max_batch_len tokens",
    "deepspeed": "use distributed_backend='deepspeed' and deepspeed_zero_stage",
    "fsdp": "use distributed_backend='fsdp' (FSDP2)",
    "push_to_hub": "trainbridge never pushes to a hub",
    "label_smoothing_factor": "the loss is plain token-level cross-entropy",
    "save_on_each_node": "rank 0 writes checkpoints to ckpt_output_dir",
    "tf32": "CUDA workers always allow TF32 matmuls and convolutions",
    "parallelism_config": (
        "tensor, context and sequence parallelism (accelerate's ParallelismConfig) are not applied: the engines "
        "are data parallel (DDP, FSDP2, DeepSpeed)"
    ),
    "liger_kernel_config": "it configures use_liger_kernel's model patches, which are not applied",
    "ddp_backend": "the process group's backend follows the device: nccl on CUDA, gloo on CPU",
    "use_liger_kernel": (
        "Liger's model patches are not applied (loss_implementation='liger' is its fused cross entropy on the "
        "token path)"
    ),
}


# A field is not warned about when the caller passed its replacement, not None (the value was mapped already).
REPLACED_BY: dict[str, tuple[str, ...]] = {
    "per_device_train_batch_size": ("effective_batch_size",),
    "gradient_accumulation_steps": ("effective_batch_size",),
    "per_device_eval_batch_size": ("per_device_eval_batch_size", "max_batch_len"),
    "include_for_metrics": ("include_for_metrics",),
    "label_names": ("label_names",),  # Trainer's sample batches read it
    "deepspeed": ("distributed_backend",),
    "fsdp": ("distributed_backend",),
    "predict_with_generate": ("predict_with_generate",),
    "generation_max_length": ("generation_kwargs",),
    "generation_num_beams": ("generation_kwargs",),
    "generation_config": ("generation_kwargs",),
}


def trainer_field_hint(name: str) -> str | None:
    """For a config error: which ``TrainingArgs`` field a ``TrainingArguments`` name typed from habit is
    (or why it has none); None when ``name`` is not a ``TrainingArguments`` field."""
    if name not in _FIELDS:
        return None
    prefix = f"{name} is transformers.TrainingArguments' name"
    if name in RENAMED:
        return f"{prefix}; here it is {RENAMED[name]}."
    if name in EXPLANATIONS:
        return f"{prefix}; here {EXPLANATIONS[name]}."
    return f"{prefix}; {ignored_reason(name)}."


def ignored_reason(name: str) -> str:
    """Why a non-default ``name`` is ignored: the warning's words."""
    return EXPLANATIONS.get(name, "it has no equivalent in trainbridge.TrainingArgs")


def training_args_from_hf(
    hf_args: TrainingArguments, *, honoured: Collection[str] = (), **required: Any
) -> TrainingArgs:
    """``TrainingArgs`` carrying over ``hf_args``'s schedules and settings; ``required`` (``model_path``,
    ``data_path``, ``effective_batch_size``... any ``TrainingArgs`` field) is added and wins.  Hugging Face
    callbacks see ``hf_args`` itself when the run gets it: ``run_training(args, torchrun_args, hf_args=hf_args)``.
    ``honoured``: the fields a callback of the caller's applies (not warned about).

    Warns (``HFPortingWarning``, once per field) about every non-default field with no meaning here.
    Raises ``ValueError`` for step ratios (``logging_steps=0.1``...) when ``max_steps`` is not set.
    """
    data = _carried_over(hf_args)
    cls = type(hf_args).__name__
    for name in _ignored_non_default_fields(hf_args):
        if any(required.get(replacement) is not None for replacement in REPLACED_BY.get(name, ())):
            continue
        if name in honoured:
            continue  # the caller's seams apply it (the facade's NEFTune callback)
        value = getattr(hf_args, name)
        reason = ignored_reason(name)
        if name not in _FIELDS:
            reason = (
                f"{cls} is not TrainingArguments: trainbridge runs its own loop, so this {cls} field has no "
                f"effect (Hugging Face callbacks still read it from args)"
            )
        warnings.warn(f"{cls}.{name}={_plain(value)!r} is ignored: {reason}", HFPortingWarning, stacklevel=2)
    data.update(required)
    return TrainingArgs.model_validate(data)


def _carried_over(hf: TrainingArguments) -> dict[str, Any]:
    """The TrainingArgs fields that follow from ``hf``."""
    max_steps = hf.max_steps if hf.max_steps > 0 else None
    scheduler, optim = _plain(hf.lr_scheduler_type), _plain(hf.optim)  # every SchedulerType / OptimizerNames
    if hf.num_train_epochs != math.ceil(hf.num_train_epochs):
        warnings.warn(
            f"TrainingArguments.num_train_epochs={hf.num_train_epochs} is rounded up to whole epochs; "
            "use max_steps to stop mid-epoch",
            HFPortingWarning,
            stacklevel=3,
        )
    data: dict[str, Any] = {
        "ckpt_output_dir": Path(hf.output_dir or "trainer_output"),
        "run_files_dir": Path(hf.output_dir or "trainer_output") / OWN_FILES_DIR,  # output_dir: Trainer's files
        "num_epochs": max(1, math.ceil(hf.num_train_epochs)),
        "max_steps": max_steps,
        "learning_rate": hf.learning_rate,
        "lr_scheduler": scheduler,
        **_warmup(hf.warmup_steps, max_steps),
        "lr_scheduler_kwargs": _scheduler_kwargs(hf.lr_scheduler_kwargs),
        "weight_decay": hf.weight_decay,
        "adam_beta1": hf.adam_beta1,
        "adam_beta2": hf.adam_beta2,
        "adam_epsilon": hf.adam_epsilon,
        "optim": optim,
        "optim_args": parse_optim_args(hf.optim_args),
        "optim_target_modules": hf.optim_target_modules,
        "max_grad_norm": hf.max_grad_norm if hf.max_grad_norm and hf.max_grad_norm > 0 else None,
        "seed": hf.seed,
        "mixed_precision": "bf16" if hf.bf16 else "fp16" if hf.fp16 else "no",
        "logging_strategy": _plain(hf.logging_strategy),
        "logging_steps": _absolute_steps("logging_steps", hf.logging_steps, max_steps),
        "logging_first_step": hf.logging_first_step,
        "eval_strategy": _plain(hf.eval_strategy),
        "eval_delay": float(hf.eval_delay or 0.0),
        "eval_on_start": hf.eval_on_start,
        "save_strategy": _plain(hf.save_strategy),
        "save_total_limit": hf.save_total_limit,
        "metric_for_best_model": hf.metric_for_best_model,
        "greater_is_better": hf.greater_is_better,
        "load_best_model_at_end": hf.load_best_model_at_end,
        "report_to": [name for name in _as_list(hf.report_to) if name != "none"],
        "run_name": hf.run_name,
        "disable_tqdm": bool(hf.disable_tqdm),
        # Trainer writes no checkpoint of its own at the end, and restores callback states only on request
        "save_final_checkpoint": False,
        "restore_callback_states": hf.restore_callback_states_from_checkpoint,
        "include_num_input_tokens_seen": hf.include_num_input_tokens_seen,
        # DDP as Trainer configures it (None: Trainer's rule, see parallel.ddp)
        "ddp_find_unused_parameters": hf.ddp_find_unused_parameters,
        "ddp_bucket_cap_mb": hf.ddp_bucket_cap_mb,
        "ddp_broadcast_buffers": hf.ddp_broadcast_buffers,
        "ddp_static_graph": hf.ddp_static_graph,
        # Trainer sets torch_compile when a backend or mode is given, and the backend to inductor
        "data_seed": hf.data_seed,
        "full_determinism": hf.full_determinism,
        "torch_empty_cache_steps": getattr(hf, "torch_empty_cache_steps", None),
        "average_tokens_across_devices": getattr(hf, "average_tokens_across_devices", True),
        "save_only_model": hf.save_only_model,
        "ignore_data_skip": hf.ignore_data_skip,
        "save_on_interrupt": getattr(hf, "enable_jit_checkpoint", False),  # Trainer's JIT checkpoint (SIGTERM)
        # Trainer resumes from any checkpoint it can load: another model or data is warned about, not refused
        "resume_allow_mismatch": True,
        "dataloader_num_workers": hf.dataloader_num_workers,
        "dataloader_prefetch_factor": hf.dataloader_prefetch_factor,
        "dataloader_persistent_workers": hf.dataloader_persistent_workers,
        "dataloader_multiprocessing_context": hf.dataloader_multiprocessing_context,
        "dataloader_in_order": hf.dataloader_in_order,
        "train_sampling_strategy": _plain(getattr(hf, "train_sampling_strategy", "random")),
        "length_column_name": getattr(hf, "length_column_name", "length"),
        "debug_underflow_overflow": "underflow_overflow" in [_plain(option) for option in hf.debug or ()],
        # Trainer's sample batches keep the forward's columns; the token step is left where more would reach
        # the model (trainer.facade's _columns_past_the_token_step)
        "remove_unused_columns": hf.remove_unused_columns,
        "compile": hf.torch_compile,
        "compile_backend": hf.torch_compile_backend or "inductor",
        "compile_mode": hf.torch_compile_mode,
    }
    # activation_checkpointing (gradient_checkpointing before transformers 5) and its kwargs
    checkpointing = getattr(hf, "activation_checkpointing", None) or getattr(hf, "gradient_checkpointing", False)
    if checkpointing:
        data["gradient_checkpointing"] = True
        kwargs = getattr(hf, "activation_checkpointing_kwargs", None) or getattr(
            hf, "gradient_checkpointing_kwargs", None
        )
        if kwargs:
            data["gradient_checkpointing_kwargs"] = dict(kwargs)
    if hf.fp16:  # overflowed steps are skipped by the scaler and training goes on, as under Trainer
        data["nonfinite_policy"] = "warn"
    if hf.use_cpu:
        data["device"] = "cpu"
    data.update(_backend(hf))
    max_length = getattr(hf, "max_length", None)  # trl's SFTConfig and other subclasses
    if isinstance(max_length, int) and max_length > 0:
        data["max_seq_len"] = max_length
    if getattr(hf, "include_for_metrics", None):
        data["include_for_metrics"] = [m for m in hf.include_for_metrics if m in ("inputs", "loss")]
    if hf.eval_steps is not None:
        data["eval_steps"] = _absolute_steps("eval_steps", hf.eval_steps, max_steps)
    if data["save_strategy"] == "steps":
        data["save_steps"] = _absolute_steps("save_steps", hf.save_steps, max_steps)
    if hf.resume_from_checkpoint is not None:
        data["resume_from_checkpoint"] = hf.resume_from_checkpoint
    if hf.ddp_timeout != _default(TrainingArguments, "ddp_timeout"):
        data["collective_timeout_s"] = float(hf.ddp_timeout)
    logging_dir = vars(hf).get("logging_dir")  # a TrainingArguments field before transformers 5
    if logging_dir:
        data["logging_dir"] = Path(logging_dir)
    return data


def _warmup(value: float, max_steps: int | None) -> dict[str, Any]:
    """``warmup_steps``, or ``warmup_ratio`` for a ratio (``< 1``) when ``max_steps`` is not known yet."""
    if 0 < value < 1 and max_steps is None:
        return {"warmup_steps": 0, "warmup_ratio": float(value)}
    return {"warmup_steps": _absolute_steps("warmup_steps", value, max_steps, allow_zero=True)}


def _scheduler_kwargs(value: dict[str, Any] | str | None) -> dict[str, Any]:
    """``lr_scheduler_kwargs`` as a dict (TrainingArguments also accepts a JSON string)."""
    if not value:
        return {}
    if isinstance(value, str):
        import json

        parsed = json.loads(value)
        if not isinstance(parsed, dict):
            raise ValueError(f"TrainingArguments.lr_scheduler_kwargs={value!r}: expected a JSON object")
        return parsed
    return dict(value)


def _backend(hf: TrainingArguments) -> dict[str, Any]:
    """``distributed_backend`` (and the ZeRO stage) from ``fsdp`` / ``deepspeed``."""
    if hf.deepspeed:
        config: Any = hf.deepspeed
        if isinstance(config, str | Path) and Path(config).is_file():
            import json

            config = json.loads(Path(config).read_text())
        stage = config.get("zero_optimization", {}).get("stage") if isinstance(config, dict) else None
        out: dict[str, Any] = {"distributed_backend": "deepspeed"}
        filled = getattr(hf, "hf_deepspeed_config", None)  # Trainer's integration filled its "auto" from hf
        out["deepspeed_config"] = filled.config if filled is not None else config
        if stage in (1, 2, 3):
            out["deepspeed_zero_stage"] = stage
        elif stage is not None:
            raise ValueError(f"TrainingArguments.deepspeed: ZeRO stage {stage!r} is not supported (1, 2 or 3)")
        return out
    if hf.fsdp:
        loaded = hf.fsdp_config if isinstance(hf.fsdp_config, dict) else {}  # TrainingArguments read a path's JSON
        return {"distributed_backend": "fsdp", **_fsdp_settings(loaded)}
    return {}


def _fsdp_settings(config: dict[str, Any]) -> dict[str, Any]:
    """Trainer's ``fsdp_config`` (``fsdp``'s words already in it, as ``TrainingArguments`` normalises them) on
    the FSDP2 engine: resharding, CPU offload, the classes wrapped, activation checkpointing."""
    policy = config.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP")
    if policy == "SIZE_BASED_WRAP":
        raise ValueError(
            "TrainingArguments.fsdp_config auto_wrap_policy='SIZE_BASED_WRAP': trainbridge's FSDP2 shards by "
            "class; set transformer_layer_cls_to_wrap, or leave it to the model's _no_split_modules"
        )
    out: dict[str, Any] = {
        "fsdp_reshard_after_forward": _true(config.get("reshard_after_forward", True)),
        "fsdp_cpu_offload": _true(config.get("cpu_offload", False)),
    }
    if policy == "NO_WRAP":
        out["fsdp_wrap_classes"] = []
    elif config.get("transformer_layer_cls_to_wrap"):
        out["fsdp_wrap_classes"] = list(config["transformer_layer_cls_to_wrap"])
    if _true(config.get("activation_checkpointing", False)):
        out["gradient_checkpointing"] = True
    return out


def _true(value: Any) -> bool:
    """An ``fsdp_config`` flag (a bool, or a string as a JSON file or FSDP1's strategies give it)."""
    return str(value).lower() in ("true", "1", "full_shard", "hybrid_shard")


def _absolute_steps(name: str, value: float, max_steps: int | None, allow_zero: bool = False) -> int:
    """Trainer's ``TrainerState.compute_steps``: a value below 1 is a ratio of ``max_steps``."""
    if value >= 1 or (allow_zero and value == 0):
        if value != int(value):
            raise ValueError(f"TrainingArguments.{name}={value}: must be a whole number of steps when >= 1")
        return int(value)
    if max_steps is None:
        raise ValueError(
            f"TrainingArguments.{name}={value} is a ratio of max_steps, but max_steps is not set; give {name} in steps"
        )
    return max(1, math.ceil(max_steps * value))


_FIELDS = {f.name: f for f in dataclasses.fields(TrainingArguments) if f.init}


def _default(cls: type, name: str) -> Any:
    """The dataclass default of field ``name`` of ``cls`` (a subclass's own default where it changes it)."""
    field = {f.name: f for f in dataclasses.fields(cls)}[name]
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _ignored_non_default_fields(hf: TrainingArguments) -> list[str]:
    """Fields of ``hf``'s class (subclass fields included) neither carried over nor exempt whose value
    differs from that class's default (as a default-built instance holds it, ``defaults_of``)."""
    names = []
    built = defaults_of(type(hf))
    for field in dataclasses.fields(type(hf)):
        name = field.name
        if not field.init or name in CARRIED_OVER or name in NOT_WARNED:
            continue
        default = built[name] if name in built else _default(type(hf), name)
        value, default = _plain(getattr(hf, name)), _plain(default)
        if value == default or (not value and not default):
            continue
        names.append(name)
    return names


def _as_list(value: str | list[str] | None) -> list[str]:
    """``report_to`` as a list (TrainingArguments normalises it to one; typed more loosely)."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def parse_optim_args(text: str | None) -> dict[str, Any]:
    """Trainer's ``optim_args`` (``"momentum=0.9,nesterov=True"``) as keyword arguments, values read as Python
    literals where they are one (numbers, booleans, tuples), else kept as text."""
    import ast

    out: dict[str, Any] = {}
    for item in (text or "").replace(" ", "").split(","):
        if not item:
            continue
        key, _, value = item.partition("=")
        try:
            out[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[key] = value
    return out


def _plain(value: Any) -> Any:
    """Enums (and lists of them) as their values, for comparison and messages."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value
