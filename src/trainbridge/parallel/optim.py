"""The optimizer and learning-rate schedule every engine steps: Trainer's optimizers in two groups, HF's schedules.

``decay_parameter_names`` applies transformers' rule (no weight decay on biases and norm weights);
``parameter_groups`` splits the trainable parameters by it; ``build_optimizer`` is ``args.optim`` (Trainer's
names: torch AdamW by default) over those groups and ``build_scheduler`` is ``transformers.get_scheduler``
for ``args.lr_scheduler``.
"""

from __future__ import annotations

import math
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
    """``args.optim`` over ``model``'s trainable parameters in two groups (``parameter_groups``), with
    ``args.learning_rate``, the Adam betas/epsilon where the optimizer takes them, and ``args.optim_args``.

    ``adamw_torch`` uses torch's fused AdamW kernel (several times faster than the per-parameter loop on
    CPU; Trainer's default too) when ``allow_fused`` and every parameter is a floating-point tensor on CPU
    or CUDA: plain parameters, or FSDP2's DTensor shards (DTensor dispatches ``_fused_adamw_``
    shard-locally); ``adamw_torch_fused`` asks for it.  The others follow Trainer's
    ``get_optimizer_cls_and_kwargs``: transformers' Adafactor with a fixed learning rate, torch SGD,
    bitsandbytes' AdamW / Lion (8-bit or 32-bit state, paged), the ``schedulefree`` optimizers (put in
    training mode).  ``factory`` (the script's, ``RunPlan.optimizer_factory``) builds it instead, given the
    groups, this default and ``total_steps`` (the run's optimizer steps).
    """
    groups = parameter_groups(model, args, decay_names)
    if factory is not None:  # the script's own optimizer

        def default() -> torch.optim.Optimizer:
            return build_optimizer(model, args, decay_names, allow_fused)

        return cast(torch.optim.Optimizer, factory.optimizer(model, groups, default, total_steps))
    name, extra = args.optim, dict[str, Any](args.optim_args)
    lr, betas, eps = args.learning_rate, (args.adam_beta1, args.adam_beta2), args.adam_epsilon
    if name in ("adamw_torch", "adamw_torch_fused"):
        fused = allow_fused and _fused_allowed(groups)
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused or None, **extra)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, **extra)
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(groups, lr=lr, **{"scale_parameter": False, "relative_step": False, **extra})
    if name.startswith("schedule_free_"):
        return _schedule_free(name, groups, lr, betas, eps, args.warmup_steps, extra)
    bnb = require_package("bitsandbytes", name, "'trainbridge[qlora]' (bitsandbytes)")
    bits = 32 if name.endswith("32bit") else 8
    paged = name.startswith("paged_")
    if "lion" in name:
        return bnb.optim.Lion(groups, lr=lr, betas=betas, optim_bits=bits, is_paged=paged, **extra)
    return bnb.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, optim_bits=bits, is_paged=paged, **extra)


def _fused_allowed(groups: list[dict[str, Any]]) -> bool:
    from torch.distributed.tensor import DTensor

    return all(
        (type(p) is nn.Parameter or isinstance(p, DTensor))
        and p.is_floating_point()
        and p.device.type in ("cpu", "cuda")
        for group in groups
        for p in group["params"]
    )


def _schedule_free(
    name: str,
    groups: list[dict[str, Any]],
    lr: float,
    betas: tuple[float, float],
    eps: float,
    warmup_steps: int,
    extra: dict[str, Any],
) -> torch.optim.Optimizer:
    """``schedulefree``'s AdamW / RAdam / SGD (its own warm-up), switched to training mode."""
    schedulefree = require_package("schedulefree", name, "schedulefree")
    if name == "schedule_free_sgd":
        optimizer = schedulefree.SGDScheduleFree(groups, lr=lr, warmup_steps=warmup_steps, **extra)
    elif name == "schedule_free_radam":
        optimizer = schedulefree.RAdamScheduleFree(groups, lr=lr, betas=betas, eps=eps, **extra)
    else:
        optimizer = schedulefree.AdamWScheduleFree(
            groups, lr=lr, betas=betas, eps=eps, warmup_steps=warmup_steps, **extra
        )
    optimizer.train()
    return cast(torch.optim.Optimizer, optimizer)


def require_package(package: str, optim: str, install: str) -> Any:
    """``import package``; an ``ImportError`` naming ``optim`` and what to install otherwise."""
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError as exc:
        raise ImportError(f"optim={optim!r} needs {package}: pip install {install} (import failed: {exc})") from exc


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
