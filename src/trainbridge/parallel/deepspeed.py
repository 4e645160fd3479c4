"""``DeepSpeedEngine``: DeepSpeed ZeRO (stage 1, 2 or 3) around our AdamW, or as a script's DeepSpeed JSON says.

DeepSpeed owns the step: it clips inside it (``gradient_clipping`` from ``max_grad_norm``) and reports
the pre-clip norm after it; the loop's loss is already normalised (``backward(scale_wrt_gas=False)``)
and the engine marks the accumulation boundary per micro-batch.  Its checkpoint is its own format (the
ZeRO partitions with the fp32 master weights and optimizer state: ``native_checkpoint``).

DeepSpeed is optional (``pip install trainbridge[deepspeed]``).  On CPU the builder sets
``DS_ACCELERATOR=cpu`` before importing it (DeepSpeed picks its accelerator once, at first import) and
DeepSpeed joins the gloo group ``DistributedEnv`` started.  Its ``bf16`` mode is DeepSpeed's own: bf16
parameters with fp32 master weights in the optimizer (as the Hugging Face Trainer configures it).

A Trainer script's DeepSpeed JSON (``TrainingArgs.deepspeed_config``) is honoured as Trainer's integration
honours it: its ZeRO section (stage, CPU offload of parameters and optimizer, buckets), precision, and its
``optimizer`` / ``scheduler`` when it names them (DeepSpeed builds them; its scheduler is stepped by
``engine.step()``); without an optimizer there, ours runs inside ZeRO.  ``"auto"`` is filled as Trainer fills it.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from trainbridge.parallel.engine import TrainingEngine, load_into
from trainbridge.parallel.optim import build_optimizer, build_scheduler, parameter_groups

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from trainbridge.core.config import TrainingArgs
    from trainbridge.core.config.plan import OptimizerFactory
    from trainbridge.core.distributed import DistributedEnv


class DeepSpeedEngine(TrainingEngine):
    """DeepSpeed ZeRO (stage 1/2/3) around our torch AdamW; the engine owns the step and the clipping."""

    kind = "deepspeed"
    native_checkpoint = True

    def __init__(self, *args: Any, zero_stage: int, engine_steps_scheduler: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.zero_stage = zero_stage
        self.engine_steps_scheduler = engine_steps_scheduler
        """The scheduler is the DeepSpeed JSON's: ``engine.step()`` steps it (``scheduler_step`` does not)."""

    def scheduler_step(self) -> None:
        """Ours: after each optimizer step; the JSON's scheduler: already stepped by ``engine.step()``."""
        if not self.engine_steps_scheduler:
            super().scheduler_step()

    def micro_batch(self, is_last: bool) -> AbstractContextManager[None]:
        """Mark the gradient-accumulation boundary: reduction and step happen after the last micro-batch."""
        self.module.set_gradient_accumulation_boundary(is_last)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """``engine.backward(loss, scale_wrt_gas=False)``: the loop's loss is already normalised."""
        self.module.backward(loss, scale_wrt_gas=False)

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor | None:
        """None: DeepSpeed measures the norm and clips inside its step (``gradient_clipping``, set from
        ``args.max_grad_norm`` at build time; a different ``max_norm`` here is an error); read the norm
        from ``reported_grad_norm`` after ``optimizer_step`` (as transformers' Trainer does), not
        recomputed."""
        configured = self.args.max_grad_norm
        if max_norm != configured:
            raise ValueError(
                f"deepspeed clips inside its step with gradient_clipping={configured} (args.max_grad_norm); "
                f"clip_grad_norm was called with max_norm={max_norm}"
            )
        return None

    def reported_grad_norm(self) -> torch.Tensor | float | None:
        """``engine.get_global_grad_norm()``: the pre-clip norm DeepSpeed computed in its last step."""
        norm = self.module.get_global_grad_norm()
        return norm.detach() if isinstance(norm, torch.Tensor) else norm

    def optimizer_step(self) -> None:
        """``engine.step()`` at the boundary: clip, optimizer step, and DeepSpeed's own ``zero_grad``."""
        self.module.step()

    def zero_grad(self) -> None:
        """Nothing to do: DeepSpeed's ``step()`` already cleared the gradients."""

    def _wrapper_handles_precision(self) -> bool:
        return True

    def full_model_state_dict(self, names: set[str] | None = None) -> dict[str, torch.Tensor] | None:
        """ZeRO-3: gathered layer by layer (collective; only the parameters of ``names`` when given);
        ZeRO-1/2: the replicated module weights on rank 0."""
        if self.zero_stage == 3 and names is not None:
            import deepspeed

            out: dict[str, torch.Tensor] = {}
            for name, param in self.unwrapped.named_parameters(remove_duplicate=False):
                if name in names:
                    with deepspeed.zero.GatheredParameters([param]):  # collective per parameter
                        if self.env.is_world_process_zero:
                            out[name] = param.detach().to("cpu", copy=True)
            return out if self.env.is_world_process_zero else None
        if self.zero_stage == 3:
            state = self.module._zero3_consolidated_16bit_state_dict()
            return {k: v.detach().to("cpu", copy=True) for k, v in state.items()} if state is not None else None
        return super().full_model_state_dict(names)

    def load_model_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Copy ``state`` into the module (ZeRO-3: per layer, gathered and re-partitioned; a subset of the
        weights when not ``strict``), then refresh the optimizer's fp32 master partitions from it."""
        if self.zero_stage == 3:
            import deepspeed

            expected = set(self.unwrapped.state_dict().keys())
            missing, unexpected = expected - set(state), set(state) - expected
            if (missing and strict) or unexpected:
                raise KeyError(f"state dict mismatch: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
            for prefix, submodule in self.unwrapped.named_modules():
                params = {
                    name: param
                    for name, param in submodule.named_parameters(recurse=False)
                    if (f"{prefix}.{name}" if prefix else name) in state
                }
                if not params:
                    continue
                with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0), torch.no_grad():
                    if self.env.is_world_process_zero:
                        for name, param in params.items():
                            param.copy_(state[f"{prefix}.{name}" if prefix else name])
        else:
            load_into(self.unwrapped, state, strict)
        self.module.optimizer.refresh_fp32_params()

    def save_native_state(self, folder: Path) -> None:
        """``engine.save_checkpoint`` into ``folder`` (its parent as DeepSpeed's save dir, its name as the
        tag): each rank writes its ZeRO partition, the fp32 master weights and optimizer state included."""
        self.module.save_checkpoint(str(folder.parent), tag=folder.name, save_latest=False)

    def load_native_state(self, folder: Path) -> None:
        """``engine.load_checkpoint`` of the ZeRO partitions (module + optimizer) ``save_native_state``
        wrote into ``folder``; the LR scheduler is ours (``scheduler_state_dict``), not DeepSpeed's."""
        loaded, _ = self.module.load_checkpoint(
            str(folder.parent), tag=folder.name, load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if loaded is None:
            raise RuntimeError(f"rank {self.env.rank}: DeepSpeed could not load its state from {folder}")

    def describe(self) -> str:
        """E.g. ``deepspeed ZeRO-2 world=2 device=cpu``."""
        precision = ", bf16" if self.precision == "bf16" else ""
        optimizer = type(getattr(self.module.optimizer, "optimizer", self.module.optimizer)).__name__
        return f"deepspeed ZeRO-{self.zero_stage} {self._where()}{precision}, {optimizer}"

    def _verify_wrapper(self) -> None:
        from deepspeed import DeepSpeedEngine as DSEngine

        if not isinstance(self.module, DSEngine):
            raise RuntimeError(
                f"rank {self.env.rank}: deepspeed configured but the model is {type(self.module).__name__}"
            )
        stage = self.module.zero_optimization_stage()
        if stage != self.zero_stage:
            raise RuntimeError(f"rank {self.env.rank}: DeepSpeed runs ZeRO stage {stage}, configured {self.zero_stage}")
        if self.module.dp_world_size != self.env.world_size:
            raise RuntimeError(
                f"rank {self.env.rank}: DeepSpeed data-parallel size {self.module.dp_world_size} != "
                f"world_size {self.env.world_size}"
            )


DEEPSPEED_BUCKET_ELEMENTS = 200_000_000
"""Elements per ZeRO reduce / all-gather bucket (DeepSpeed's default is 5e8; 2e8 is what large-model
recipes use to bound the bucket memory, 2 x 400 MB in bf16)."""


def deepspeed_config(
    args: TrainingArgs, env: DistributedEnv, model: nn.Module | None = None, total_steps: int = 0
) -> dict[str, Any]:
    """The DeepSpeed config: ``args.deepspeed_config`` (the script's JSON) over ours (``own_config``), its
    ``"auto"`` values left by Trainer's ``trainer_config_process`` filled here as its ``trainer_config_finalize``
    fills them (from ``model``'s hidden size and ``total_steps``); the batch keys are always ours.  Without
    ``model`` (accelerate's plugin, before the engine) the model's keys may stay ``"auto"``."""
    ours = own_config(args, env)
    if not args.deepspeed_config:
        return ours
    config: dict[str, Any] = copy.deepcopy(dict(args.deepspeed_config))
    config["zero_optimization"] = {**ours["zero_optimization"], **dict(config.get("zero_optimization") or {})}
    config["zero_optimization"]["stage"] = args.deepspeed_zero_stage
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size"):
        config[key] = ours[key]  # one micro-batch per call, the boundary set by the engine (see the module doc)
    for key in ("gradient_clipping", "steps_per_print", "wall_clock_breakdown"):
        config.setdefault(key, ours[key])
    if "optimizer" not in config:  # ours (Trainer's optimizer) inside ZeRO, as Trainer's integration allows
        config["zero_allow_untested_optimizer"] = True
    _fill_auto(config, args, model, total_steps)
    return config


def _fill_auto(config: dict[str, Any], args: TrainingArgs, model: nn.Module | None, total_steps: int) -> None:
    """The ``"auto"`` values Trainer fills once the model and the step count are known
    (``HfTrainerDeepSpeedConfig.trainer_config_finalize``); any other ``"auto"`` left is an error naming it."""
    zero = config["zero_optimization"]
    hidden = _hidden_size(model)
    if hidden is not None:
        for key, value in (
            ("reduce_bucket_size", hidden * hidden),
            ("stage3_prefetch_bucket_size", int(0.9 * hidden * hidden)),
            ("stage3_param_persistence_threshold", 10 * hidden),
        ):
            if zero.get(key) == "auto":
                zero[key] = value
    params = (config.get("scheduler") or {}).get("params") or {}
    warmup = args.warmup_steps or math.ceil(args.warmup_ratio * total_steps)
    for key, value in (("total_num_steps", total_steps), ("warmup_num_steps", warmup)):
        if params.get(key) == "auto":
            params[key] = value
    left = sorted(_auto_keys(config))
    if left and model is not None:  # without the model (accelerate's plugin state): what can be filled
        raise ValueError(
            f"deepspeed_config: {left} are 'auto' and nothing fills them (Trainer fills the batch, optimizer, "
            "scheduler, precision and hidden-size keys); set them to values in the DeepSpeed JSON"
        )


def _hidden_size(model: nn.Module | None) -> int | None:
    """The model's (or its text model's) hidden size, the largest of ``hidden_sizes``, as Trainer reads it."""
    config = getattr(model, "config", None)
    for source in (config, getattr(config, "text_config", None)):
        if getattr(source, "hidden_size", None) is not None:
            return int(source.hidden_size)  # type: ignore[union-attr]
        if getattr(source, "hidden_sizes", None):
            return int(max(source.hidden_sizes))  # type: ignore[union-attr]
    return None


def _auto_keys(config: Any, prefix: str = "") -> list[str]:
    if isinstance(config, dict):
        return [key for name, value in config.items() for key in _auto_keys(value, f"{prefix}{name}.")]
    return [prefix.rstrip(".")] if config == "auto" else []


def own_config(args: TrainingArgs, env: DistributedEnv) -> dict[str, Any]:
    """trainbridge's DeepSpeed config: one sample per micro-batch, the boundary set by the engine per step
    (so ``gradient_accumulation_steps`` is 1), clipping from ``max_grad_norm``, bf16 if configured;
    ZeRO with contiguous gradients and bounded buckets, and on CUDA communication overlapped with the
    backward (``overlap_comm``)."""
    zero: dict[str, Any] = {
        "stage": args.deepspeed_zero_stage,
        "contiguous_gradients": True,
        "reduce_bucket_size": DEEPSPEED_BUCKET_ELEMENTS,
        "allgather_bucket_size": DEEPSPEED_BUCKET_ELEMENTS,
        "overlap_comm": env.device.type == "cuda",
    }
    if args.deepspeed_zero_stage == 3:
        zero["stage3_prefetch_bucket_size"] = DEEPSPEED_BUCKET_ELEMENTS
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": env.world_size,
        "gradient_clipping": args.max_grad_norm or 0.0,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }
    precision = args.mixed_precision_for(env.device.type)
    if precision in ("bf16", "fp16"):  # fp16: DeepSpeed's dynamic loss scaling (its own checkpointed state)
        config[precision] = {"enabled": True}
    return config


def _import_deepspeed(env: DistributedEnv) -> Any:
    if env.device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError as exc:
        raise ImportError(
            "distributed_backend='deepspeed' needs DeepSpeed: pip install 'trainbridge[deepspeed]' "
            f"(import failed: {exc})"
        ) from exc
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator().device_name()
    if accelerator != env.device.type:
        raise RuntimeError(
            f"rank {env.rank}: DeepSpeed's accelerator is {accelerator!r} but the run uses {env.device.type!r}; "
            f"set DS_ACCELERATOR={env.device.type} before deepspeed is first imported"
        )
    if env.device.type == "cpu":
        # DeepSpeed's CPU comm backend JIT-compiles its shared-memory all-reduce (``deepspeed_shm_comm``: two C++
        # files, 25-80 s on first use) when the op is marked compatible; only ``inference_all_reduce`` uses it,
        # training never does.  deepspeed.ops caches this dict for edits like this one.
        from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

        deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
    return deepspeed


def build_deepspeed(
    model: PreTrainedModel,
    args: TrainingArgs,
    env: DistributedEnv,
    total_steps: int,
    decay_names: set[str],
    factory: OptimizerFactory | None = None,
) -> DeepSpeedEngine:
    """``deepspeed.initialize`` over ``model`` on ``env.device`` with ``deepspeed_config``: the JSON's optimizer
    and scheduler when it names them, else AdamW (DeepSpeed's FusedAdam on CUDA) and the LR schedule, as
    Trainer's integration combines them."""
    deepspeed = _import_deepspeed(env)
    # Joins the process group DistributedEnv already started (gloo on CPU, NCCL on CUDA).
    deepspeed.init_distributed(dist_backend=env.backend, auto_mpi_discovery=False)
    cast(nn.Module, model).to(env.device)
    config = deepspeed_config(args, env, model, total_steps)
    optimizer, scheduler = None, None
    if "optimizer" not in config:  # ours inside ZeRO; with the JSON's, DeepSpeed builds it on the trainable ones
        optimizer = (
            _deepspeed_fused_adam(deepspeed, model, args, decay_names)
            if env.device.type == "cuda"
            else build_optimizer(model, args, decay_names, allow_fused=False, total_steps=total_steps, factory=factory)
        )
        if "scheduler" not in config:  # it drives the torch optimizer's param_groups, which ZeRO steps with
            scheduler = build_scheduler(optimizer, args, total_steps, factory)
    trainable = [p for p in cast(nn.Module, model).parameters() if p.requires_grad]
    ds_engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        model_parameters=None if optimizer is not None else trainable,
        config=config,
        dist_init_required=False,
    )
    engine_steps = "scheduler" in config  # the JSON's scheduler: built by DeepSpeed, stepped by engine.step()
    if engine_steps:
        scheduler = ds_scheduler
    elif scheduler is None:  # the JSON's optimizer without its scheduler: Trainer's schedule over it
        scheduler = build_scheduler(_basic_optimizer(ds_optimizer), args, total_steps)
    return DeepSpeedEngine(
        ds_engine,
        model,
        ds_optimizer,
        scheduler,
        args,
        env,
        zero_stage=args.deepspeed_zero_stage,
        engine_steps_scheduler=engine_steps,
    )


def _basic_optimizer(ds_optimizer: Any) -> Any:
    """The torch optimizer inside DeepSpeed's ZeRO optimizer (its ``param_groups`` are the live ones)."""
    return getattr(ds_optimizer, "optimizer", ds_optimizer)


def _deepspeed_fused_adam(deepspeed: Any, model: nn.Module, args: TrainingArgs, decay_names: set[str]) -> Any:
    """``deepspeed.ops.adam.FusedAdam`` in AdamW mode, with the same two parameter groups as
    ``build_optimizer`` (its CUDA multi-tensor kernel; what DeepSpeed's own configs pick on GPUs)."""
    from deepspeed.ops.adam import FusedAdam

    return FusedAdam(
        parameter_groups(model, args, decay_names),
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        adam_w_mode=True,
    )
