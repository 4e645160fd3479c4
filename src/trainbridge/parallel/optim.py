"""The optimizer and learning-rate schedule every engine steps: AdamW in two groups, HF's schedules.

``decay_parameter_names`` applies transformers' rule (no weight decay on biases and norm weights);
``parameter_groups`` splits the trainable parameters by it; ``build_optimizer`` is torch AdamW over those
groups and ``build_scheduler`` is ``transformers.get_scheduler`` for ``args.lr_scheduler``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import get_scheduler
from transformers.trainer_pt_utils import get_parameter_names

if TYPE_CHECKING:
    from trainbridge.core.config import TrainingArgs

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
    model: nn.Module, args: TrainingArgs, decay_names: set[str], allow_fused: bool = True
) -> torch.optim.AdamW:
    """torch AdamW over ``model``'s trainable parameters: one group with ``weight_decay``, one without.

    Uses torch's fused AdamW kernel (several times faster than the per-parameter loop on CPU; Trainer's
    default too) when ``allow_fused`` and every parameter is a floating-point tensor on CPU or CUDA:
    plain parameters, or FSDP2's DTensor shards (DTensor dispatches ``_fused_adamw_`` shard-locally).
    """
    from torch.distributed.tensor import DTensor

    groups = parameter_groups(model, args, decay_names)
    fused = allow_fused and all(
        (type(p) is nn.Parameter or isinstance(p, DTensor))
        and p.is_floating_point() and p.device.type in ("cpu", "cuda")
        for group in groups for p in group["params"]
    )
    return torch.optim.AdamW(
        groups,
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        fused=fused or None,
    )


def build_scheduler(optimizer: torch.optim.Optimizer, args: TrainingArgs, total_steps: int) -> Any:
    """``transformers.get_scheduler(args.lr_scheduler)`` with ``warmup_steps`` over ``total_steps``."""
    return get_scheduler(
        args.lr_scheduler,
        optimizer=optimizer,
        num_warmup_steps=args.warmup_steps or math.ceil(args.warmup_ratio * total_steps),
        num_training_steps=total_steps,
        scheduler_specific_kwargs=args.lr_scheduler_kwargs or None,
    )
