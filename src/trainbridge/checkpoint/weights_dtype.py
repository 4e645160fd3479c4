"""The dtype of the Hugging Face-layout weights a run writes (``TrainingArgs.checkpoint_weights_dtype``).

One place decides it, for checkpoints and the merged export alike.  ``auto`` is the dtype the model
folder's ``config.json`` records, i.e. what the original checkpoint was (``from_pretrained`` overwrites
the live ``config.dtype`` with the dtype it loaded in, so the file is read), when that is a floating
dtype; otherwise the parameters' own dtype.  A run whose model comes from ``model_init`` has no folder:
its parameters' dtype.

Casting weights down for export loses precision; ``CheckpointManager`` then keeps the parameters
themselves in the checkpoint's sharded state so that resume stays exact (``exports_lossy``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from trainbridge.core.config import peft_adapter_base

if TYPE_CHECKING:
    from torch import nn

    from trainbridge.core.config import TrainingArgs

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parameters_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first floating-point parameter (float32 for a model without one)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def recorded_dtype(model_folder: Path | None) -> torch.dtype | None:
    """The floating dtype ``config.json`` in ``model_folder`` records (``dtype``, or the older
    ``torch_dtype``); for a PEFT adapter folder, its base model's.  None when there is none."""
    if model_folder is None:
        return None
    try:
        folder = peft_adapter_base(Path(model_folder)) or Path(model_folder)
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("dtype") or config.get("torch_dtype")
    return _DTYPES.get(str(name).removeprefix("torch.")) if name else None


def checkpoint_weights_dtype(args: TrainingArgs, model: nn.Module) -> torch.dtype:
    """The dtype of the HF-layout weights this run writes (see the module docstring)."""
    if args.checkpoint_weights_dtype != "auto":
        return _DTYPES[args.checkpoint_weights_dtype]
    return recorded_dtype(args.model_path) or parameters_dtype(model)


def cast_for_export(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``state`` with every floating-point tensor in ``dtype`` (integer buffers as they are)."""
    return {k: v.to(dtype) if v.is_floating_point() and v.dtype != dtype else v for k, v in state.items()}


def exports_lossy(model: nn.Module, dtype: torch.dtype | None) -> bool:
    """Whether writing ``model``'s weights in ``dtype`` loses precision: some floating parameter's dtype is
    not exactly representable in it (fp32 in bf16, bf16 in fp16; bf16 in fp32 is exact).  None means the
    parameters' own dtype."""
    return dtype is not None and any(
        p.is_floating_point() and torch.promote_types(p.dtype, dtype) != dtype for p in model.parameters()
    )
