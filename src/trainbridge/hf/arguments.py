"""``build_training_arguments``: a real ``transformers.TrainingArguments`` describing this run.

Hugging Face callbacks receive ``args`` at every hook and read it (``args.logging_steps``,
``args.metric_for_best_model``, ``args.to_dict()`` for the run's parameters, ``args.world_size``...).
The object built here is a genuine ``TrainingArguments`` (``isinstance`` holds, ``to_dict()``,
``to_json_string()`` and ``to_sanitized_dict()`` work) whose fields say what this run does.

Device and distributed state without taking them over
-----------------------------------------------------
``TrainingArguments.__post_init__`` reads ``self.device``, which runs the cached property
``_setup_devices``: it resets accelerate's global ``AcceleratorState``/``PartialState`` and builds a new
``PartialState`` (which may call ``torch.distributed.init_process_group``, ``torch.cuda.set_device`` and
rewrite ``RANK``/``WORLD_SIZE`` in the environment).  Every device property (``device``, ``n_gpu``,
``world_size``, ``process_index``, ``local_process_index``, ``parallel_mode``, ``should_save``,
``should_log``) then reads ``self.distributed_state``.

trainbridge owns the process group (``trainbridge.core.distributed``), so this module *pre-seeds* the
instance before its dataclass ``__init__`` runs:

- ``_setup_devices`` is a ``functools.cached_property``, which stores its value in the instance
  ``__dict__`` under its own name and is not consulted when that entry exists.  Putting our device
  there means the original ``_setup_devices`` body never runs.
- ``distributed_state`` is set to a ``PartialState`` object holding *our* rank, local rank, world size,
  device and backend.  It is created with ``object.__new__`` and filled directly, so it is *not*
  accelerate's shared singleton (``PartialState._shared_state`` stays untouched) and its ``__init__``
  (the part that initialises things) never runs.  Its read-only API works on our values
  (``is_main_process``, ``wait_for_everyone()`` -> ``torch.distributed.barrier()`` on our group, ...).
- ``_n_gpu`` is 1 on CUDA and 0 on CPU, as ``_setup_devices`` would have set it for one process per GPU.

Nothing global changes: accelerate's state, the environment and the process group are exactly as
before the call.  (A copy made with ``dataclasses.replace`` runs ``__init__`` without the seed and so
sets up accelerate's own state; copy with ``copy.deepcopy`` instead.)

The user's own TrainingArguments (trl's ``SFTConfig``, ``DPOConfig``, ``GRPOConfig``...)
------------------------------------------------------------------------------------------
When ``RunPlan.hf_args`` holds the object the settings were ported from (``training_args_from_hf``
sets it), callbacks get a deep copy of *it*: an instance of the same class with every field, subclass
fields included (``args.ref_model_sync_steps``, ``args.max_length``...), as the script set them.  Only the
fields this run owns (``OWNED_FIELDS`` of ``hf.fields``: schedules, optimiser settings, batch shape, device, rank,
checkpointing and reporting; exactly what ``training_argument_fields`` derives from ``TrainingArgs``) are
set to trainbridge's value, and only where it differs from the original: the per-device batch size and
``gradient_accumulation_steps`` (see below), ``local_rank``, ``data_seed`` (the data order follows
``seed``), ``optim``, any ``TrainingArgs`` value given explicitly on top of the port, and values
the port normalises (step ratios become steps).  The device fields are seeded as below.  A subclass's
``__post_init__`` does not run again, so fields it derived from the user's values keep them.

Fields that differ from Trainer's meaning
-----------------------------------------
- ``per_device_train_batch_size`` is ``effective_batch_size // world_size`` (at least 1) -- except
  for the user's own ``TrainingArguments`` whose ``per_device_train_batch_size x
  gradient_accumulation_steps x world size`` is the run's effective batch: those two fields keep the
  user's values (they describe the same step).  trainbridge batches by token budget
  (``max_batch_len``), so the rows per micro-batch vary; this is the average number of samples per
  rank per optimizer step.
- ``gradient_accumulation_steps`` is 1: the number of micro-batches per optimizer step varies with the
  token budget; every ``on_substep_end`` still fires as under Trainer.
- ``save_steps`` is derived from ``save_samples`` when only that is set (samples per step =
  ``effective_batch_size``), and 0 ("never by step") when neither is set.
- ``deepspeed``/``fsdp`` stay unset even under those backends: setting them makes ``TrainingArguments``
  build accelerate plugins; the backend is recorded by ``trainbridge`` itself.
- transformers 5 removed ``logging_dir``; it is set only on versions that still have the field (the HF
  ``HuggingFaceCallbacks`` points ``TensorBoardCallback`` at ``TrainingArgs.logging_dir`` itself).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from typing import Any

import torch
from accelerate.state import PartialState
from accelerate.utils import DistributedType
from transformers import TrainingArguments

from trainbridge.core.config import TrainingArgs
from trainbridge.core.distributed import DistributedEnv
from trainbridge.hf.fields import OWNED_FIELDS

_TRAINING_ARGUMENT_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainingArguments) if f.init)


def build_training_arguments(args: TrainingArgs, env: DistributedEnv, original: Any = None) -> TrainingArguments:
    """A real ``TrainingArguments`` for this run, reporting ``env``'s rank, world size and device; with
    ``original`` (the script's own ``TrainingArguments``, ``RunPlan.hf_args``), that object brought up to date.

    Building it initialises nothing: no process group, no accelerate state, no CUDA device change (see
    the module docstring for how).
    """
    fields = training_argument_fields(args, env)
    hf_args = TrainingArguments.__new__(TrainingArguments)
    _seed_process_state(hf_args, env, args)
    hf_args.__init__(**fields)  # type: ignore[misc]
    if original is None:
        return hf_args
    return _onto_original(original, hf_args, env, args)


def _onto_original(
    original: TrainingArguments, run: TrainingArguments, env: DistributedEnv, args: TrainingArgs
) -> TrainingArguments:
    """A copy of the user's ``original`` (same class, every field) with each field this run owns set to
    the value of ``run`` where the two differ (see "The user's own TrainingArguments" above)."""
    hf_args = copy.deepcopy(original)
    _seed_process_state(hf_args, env, args)
    kept = _BATCH_FIELDS if _same_effective_batch(original, args, env) else ()
    for name in OWNED_FIELDS:
        if name in kept:
            continue
        if name in _TRAINING_ARGUMENT_FIELDS and getattr(hf_args, name) != getattr(run, name):
            setattr(hf_args, name, getattr(run, name))
    return hf_args


_BATCH_FIELDS = ("per_device_train_batch_size", "gradient_accumulation_steps")
"""The fields that say how the optimizer step's samples split over ranks and micro-batches."""


def _same_effective_batch(original: TrainingArguments, args: TrainingArgs, env: DistributedEnv) -> bool:
    """Whether the user's ``per_device_train_batch_size x gradient_accumulation_steps x world size`` is
    the run's ``effective_batch_size``: then their two fields describe this run (a ported script keeps
    ``per_device_train_batch_size=2``, ``gradient_accumulation_steps=16`` as Trainer records them, e.g.
    in ``trainer_state.json``'s ``train_batch_size``), and they are kept."""
    per_device = getattr(original, "per_device_train_batch_size", None)
    accumulation = getattr(original, "gradient_accumulation_steps", None)
    if not isinstance(per_device, int) or not isinstance(accumulation, int):
        return False
    return per_device * accumulation * env.world_size == args.effective_batch_size


def training_argument_fields(args: TrainingArgs, env: DistributedEnv) -> dict[str, Any]:
    """The ``TrainingArguments`` keyword arguments that describe ``args`` run on ``env``."""
    save_strategy: str = args.save_strategy
    save_steps = args.save_steps
    if save_steps is None and args.save_samples:
        save_steps = math.ceil(args.save_samples / args.effective_batch_size)
    elif save_steps is None:
        # Under save_strategy='steps' without steps nothing is saved on a step schedule: 0 keeps
        # DefaultFlowCallback from asking.  Otherwise the value is unused and shows as TrainingArguments'
        # own default, as state.save_steps does under Trainer.
        save_steps = 0 if args.save_strategy == "steps" else 500
    fields: dict[str, Any] = {
        "output_dir": str(args.ckpt_output_dir),
        "do_train": True,
        "num_train_epochs": args.num_epochs,
        "max_steps": args.max_steps if args.max_steps is not None else -1,
        "learning_rate": args.learning_rate,
        "lr_scheduler_type": args.lr_scheduler,
        "warmup_steps": args.warmup_steps,
        "weight_decay": args.weight_decay,
        "adam_beta1": args.adam_beta1,
        "adam_beta2": args.adam_beta2,
        "adam_epsilon": args.adam_epsilon,
        "optim": args.optim,
        "optim_args": ",".join(f"{k}={v}" for k, v in args.optim_args.items()) or None,
        "max_grad_norm": args.max_grad_norm if args.max_grad_norm is not None else 0.0,
        "per_device_train_batch_size": max(1, args.effective_batch_size // env.world_size),
        "gradient_accumulation_steps": 1,
        "seed": args.seed,
        "data_seed": args.data_seed,
        "bf16": args.mixed_precision_for(env.device.type) == "bf16",  # "auto": what the engines run
        "fp16": args.mixed_precision == "fp16",
        "use_cpu": env.device.type == "cpu",
        "logging_strategy": args.logging_strategy,
        "logging_steps": args.logging_steps,
        "logging_first_step": args.logging_first_step,
        "eval_strategy": args.eval_strategy,
        "eval_steps": args.eval_steps,
        "eval_delay": args.eval_delay,
        "eval_on_start": args.eval_on_start,
        "save_strategy": save_strategy,
        "save_steps": save_steps,
        "save_total_limit": args.save_total_limit,
        "metric_for_best_model": args.metric_for_best_model,
        "greater_is_better": args.greater_is_better,
        "load_best_model_at_end": args.load_best_model_at_end,
        "restore_callback_states_from_checkpoint": args.restore_callback_states,
        "resume_from_checkpoint": (
            str(args.resume_from_checkpoint) if args.resume_from_checkpoint is not None else None
        ),
        "report_to": list(args.report_to) or "none",
        "run_name": args.run_name,
        "disable_tqdm": args.disable_tqdm,
        "ddp_timeout": math.ceil(args.collective_timeout_s),
        "local_rank": env.local_rank,
        "include_num_input_tokens_seen": args.include_num_input_tokens_seen,
    }
    if "logging_dir" in _TRAINING_ARGUMENT_FIELDS:  # transformers < 5
        fields["logging_dir"] = str(args.resolved_logging_dir)
    return fields


_DEFAULTS: dict[type, dict[str, Any]] = {}


def defaults_of(cls: type[TrainingArguments]) -> dict[str, Any]:
    """Every init field of ``cls`` as a default-constructed instance holds it, after ``__post_init__``
    (which changes some: trl's configs turn ``gradient_checkpointing`` into ``activation_checkpointing``,
    derive ``generation_batch_size``...).  Built once per class without device set-up; ``{}`` if ``cls``
    cannot be built from its defaults alone."""
    if cls in _DEFAULTS:
        return _DEFAULTS[cls]
    instance = cls.__new__(cls)
    _seed_process_state(instance, DistributedEnv(), None)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            instance.__init__(output_dir="trainer_output", use_cpu=True)  # type: ignore[misc]
    except Exception:
        values: dict[str, Any] = {}
    else:
        values = {f.name: getattr(instance, f.name) for f in dataclasses.fields(cls) if f.init}
    _DEFAULTS[cls] = values
    return values


def process_state_for(env: DistributedEnv, args: TrainingArgs | None = None) -> PartialState:
    """An accelerate ``PartialState`` holding ``env``'s rank, world size and device.

    It is a standalone object (not accelerate's shared singleton) and its ``__init__`` never runs, so
    creating it initialises nothing.
    """
    state = PartialState.__new__(PartialState)
    if env.world_size == 1:
        distributed_type = DistributedType.NO
    elif args is not None and args.distributed_backend == "deepspeed":
        distributed_type = DistributedType.DEEPSPEED
    elif env.device.type == "cuda":
        distributed_type = DistributedType.MULTI_GPU
    else:
        distributed_type = DistributedType.MULTI_CPU
    state.__dict__.update(
        _cpu=env.device.type == "cpu",
        backend=env.backend,
        device=env.device,
        debug=False,
        distributed_type=distributed_type,
        num_processes=env.world_size,
        process_index=env.rank,
        local_process_index=env.local_rank,
        fork_launched=False,
    )
    return state


def _seed_process_state(hf_args: TrainingArguments, env: DistributedEnv, args: TrainingArgs | None) -> None:
    """Pre-fill the device cache of a not-yet-initialised ``TrainingArguments`` (module docstring)."""
    hf_args.__dict__["_setup_devices"] = torch.device(env.device)
    hf_args.__dict__["distributed_state"] = process_state_for(env, args)
    hf_args.__dict__["_n_gpu"] = 1 if env.device.type == "cuda" else 0
