"""The optimizer and learning-rate schedule every engine steps: Trainer's optimizers in two groups, HF's schedules.

``decay_parameter_names`` applies transformers' rule (no weight decay on biases and norm weights);
``parameter_groups`` splits the trainable parameters by it; ``build_optimizer`` is ``args.optim`` built by
Trainer's ``get_optimizer_cls_and_kwargs`` over those groups and ``build_scheduler`` is
``transformers.get_scheduler`` for ``args.lr_scheduler``, as Trainer's ``create_scheduler`` calls it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from transformers import get_scheduler
from transformers.trainer_pt_utils import get_parameter_names

if TYPE_CHECKING:
    from trainbridge.core.config import TrainingArgs
    from trainbridge.core.config.plan import OptimizerFactory

# Same rule as transformers' Trainer.get_decay_parameter_names: no decay on biases and norm weights.
_NO_DECAY_NAME_PATTERNS = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


def decay_parameter_names(model: nn.Module) -> set[str]:
    """Names of the parameters that get weight decay (everything but biases and norm weights, like HF)."""
    return set(get_parameter_names(model, [nn.LayerNorm], _NO_DECAY_NAME_PATTERNS))


def parameter_groups(model: nn.Module, args: TrainingArgs, decay_names: set[str]) -> list[dict[str, Any]]:
    """``model``'s trainable parameters in two optimizer groups: with ``args.weight_decay`` (those in
    ``decay_names``) and without; an empty group is left out."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay_names], "weight_decay": args.weight_decay},
        {"params": [p for n, p in named if n not in decay_names], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def build_optimizer(
    model: nn.Module,
    args: TrainingArgs,
    decay_names: set[str],
    allow_fused: bool = True,
    total_steps: int = 0,
    factory: OptimizerFactory | None = None,
) -> torch.optim.Optimizer:
    """``args.optim`` as Trainer's ``create_optimizer`` builds it: the class and keyword arguments of
    ``Trainer.get_optimizer_cls_and_kwargs`` (every ``OptimizerNames`` value; ``optim_args`` read as Trainer
    reads them; ``optim_target_modules`` for GaLore / APOLLO) over ``model``'s trainable parameters in two
    groups (``parameter_groups``), or what the handler puts in their place (low-rank groups, LOMO's model,
    layer-wise optimizers, optimizer factories); bitsandbytes' 8-bit optimizers keep embeddings in 32 bits.

    One difference, for speed: torch's AdamW takes the fused kernel (several times faster than the
    per-parameter loop on CPU) when ``allow_fused`` and every parameter is a floating-point tensor on CPU or
    CUDA (plain parameters, or FSDP2's DTensor shards).  Schedule-free optimizers are put in training mode.
    ``factory`` (the script's, ``RunPlan.optimizer_factory``) builds it instead, given the groups, this
    default and ``total_steps`` (the run's optimizer steps).
    """
    groups = parameter_groups(model, args, decay_names)
    if factory is not None:  # the script's own optimizer

        def default() -> torch.optim.Optimizer:
            return build_optimizer(model, args, decay_names, allow_fused)

        return cast(torch.optim.Optimizer, factory.optimizer(model, groups, default, total_steps))
    from transformers import Trainer
    from transformers.trainer_optimizer import is_optimizer_factory

    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(cast(Any, trainer_optimizer_args(args)), cast(Any, model))
    if is_optimizer_factory(cls):
        return cast(torch.optim.Optimizer, cls()(model, **kwargs))
    params: Any = groups
    for replacement in ("params", "model", "optimizer_dict"):  # as Trainer.create_optimizer
        if replacement in kwargs:
            params = kwargs.pop(replacement)
    if cls is torch.optim.AdamW and "fused" not in kwargs and allow_fused and _fused_allowed(groups):
        kwargs["fused"] = True
    optimizer = cls(params, **kwargs)
    if "bitsandbytes" in str(cls) and kwargs.get("optim_bits") == 8:
        _embeddings_in_32_bits(model)
    if args.optim.startswith("schedule_free_"):
        optimizer.train()
    return cast(torch.optim.Optimizer, optimizer)


@dataclass(frozen=True)
class TrainerOptimizerArgs:
    """The ``TrainingArguments`` fields ``Trainer.get_optimizer_cls_and_kwargs`` reads, from ``TrainingArgs``
    (a real ``TrainingArguments`` would set up accelerate's process state in the worker)."""

    optim: str
    optim_args: str | None
    learning_rate: float
    adam_beta1: float
    adam_beta2: float
    adam_epsilon: float
    weight_decay: float
    warmup_steps: int
    optim_target_modules: list[str] | str | None
    gradient_accumulation_steps: int
    parallel_mode: Any


def trainer_optimizer_args(args: TrainingArgs) -> TrainerOptimizerArgs:
    """``args``' optimizer settings as Trainer's ``TrainingArguments`` spells them (``optim_args`` as
    ``"k=v,..."``)."""
    import torch.distributed as dist
    from transformers.training_args import ParallelMode

    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    return TrainerOptimizerArgs(
        optim=args.optim,
        optim_args=",".join(f"{k}={v}" for k, v in args.optim_args.items()) or None,
        learning_rate=args.learning_rate,
        adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2,
        adam_epsilon=args.adam_epsilon,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        optim_target_modules=args.optim_target_modules,
        gradient_accumulation_steps=1,
        parallel_mode=ParallelMode.DISTRIBUTED if distributed else ParallelMode.NOT_DISTRIBUTED,
    )


def _embeddings_in_32_bits(model: nn.Module) -> None:
    """Trainer's ``create_optimizer`` for bitsandbytes' 8-bit optimizers: embeddings keep 32-bit state."""
    import bitsandbytes

    manager = bitsandbytes.optim.GlobalOptimManager.get_instance()
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            manager.register_module_override(module, "weight", {"optim_bits": 32})


def _fused_allowed(groups: list[dict[str, Any]]) -> bool:
    from torch.distributed.tensor import DTensor

    return all(
        (type(p) is nn.Parameter or isinstance(p, DTensor))
        and p.is_floating_point()
        and p.device.type in ("cpu", "cuda")
        for group in groups
        for p in group["params"]
    )


def is_metric_schedule(scheduler: Any) -> bool:
    """Whether ``scheduler`` steps on the evaluation metric (``reduce_lr_on_plateau``, ``greedy``), not on
    every optimizer step: Trainer steps it after each evaluation."""
    from transformers.optimization import GreedyLR

    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau | GreedyLR)


def build_scheduler(
    optimizer: torch.optim.Optimizer, args: TrainingArgs, total_steps: int, factory: OptimizerFactory | None = None
) -> Any:
    """``transformers.get_scheduler(args.lr_scheduler)`` with ``warmup_steps`` over ``total_steps``, or the
    schedule of ``factory`` (the script's) where it gives one."""
    if factory is not None:
        scheduler = factory.scheduler(optimizer, total_steps, lambda chosen: build_scheduler(chosen, args, total_steps))
        if scheduler is not None:
            return scheduler
    return get_scheduler(
        args.lr_scheduler,
        optimizer=optimizer,
        num_warmup_steps=args.warmup_steps or math.ceil(args.warmup_ratio * total_steps),
        num_training_steps=total_steps,
        scheduler_specific_kwargs=args.lr_scheduler_kwargs or None,
    )
