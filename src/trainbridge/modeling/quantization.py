"""Quantised (bitsandbytes 4-bit / 8-bit) base models: QLoRA.

A base model is quantised when ``model_kwargs`` carries a ``quantization_config``, or when its folder's
``config.json`` was saved quantised (a 4-bit model handed to the ``Trainer`` facade is written that way).
It is loaded on this rank's device (bitsandbytes quantises while loading; a quantised model is not moved
afterwards), then ``peft.prepare_model_for_kbit_training`` freezes it and upcasts its other weights to
fp32; gradient checkpointing and the LoRA adapter follow as for any model.  Only the adapter trains, so
only the adapter and its optimizer state are saved: the quantised base is read from its folder again on
resume.  How FSDP2 shards the packed weights: ``parallel.fsdp.packed_quantized_weights``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

INSTALL_HINT = "pip install 'trainbridge[qlora]' (bitsandbytes)"
"""What to install for quantised base models and bitsandbytes optimizers."""


def require_bitsandbytes(what: str) -> Any:
    """``import bitsandbytes``; an ``ImportError`` naming ``what`` needs it and the package to install."""
    try:
        import bitsandbytes
    except ImportError as exc:
        raise ImportError(f"{what} needs bitsandbytes: {INSTALL_HINT} (import failed: {exc})") from exc
    return bitsandbytes


def saved_quantization(path: Path | str) -> dict[str, Any] | None:
    """The ``quantization_config`` a model folder's ``config.json`` was saved with (None when plain)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    try:
        found = json.loads(config.read_text()).get("quantization_config")
    except (OSError, ValueError):
        return None
    return found if isinstance(found, dict) and found else None


def is_quantized(model: Any) -> bool:
    """Whether ``model`` (or the base inside a ``PeftModel``) holds bitsandbytes 4-bit or 8-bit weights."""
    return any(type(p).__name__ in ("Params4bit", "Int8Params") for p in model.parameters())


def load_device(device: str) -> torch.device:
    """Where a quantised model is loaded (``from_pretrained(device_map={"": here})``): this rank's CUDA device
    (``DistributedEnv`` has made it current) or the CPU, as ``TrainingArgs.device`` resolves."""
    if device != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def prepare_for_training(model: nn.Module) -> nn.Module:
    """``peft.prepare_model_for_kbit_training``: freeze the quantised base and upcast its other weights to
    fp32.  Gradient checkpointing is left to the caller (``gradient_checkpointing_kwargs`` as configured)."""
    from peft import prepare_model_for_kbit_training

    prepared: nn.Module = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    for module in prepared.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            # bitsandbytes repacks a 4-bit weight for its CPU inference kernel on the first no-grad forward in
            # eval mode (a set-up probe, an evaluation): the weight turns into another uint8 layout, which
            # FSDP2 can no longer shard.  A model in training keeps the layout it was loaded with.
            module.support_avx512bf16_for_cpu = False  # type: ignore[assignment]
    return prepared


@contextlib.contextmanager
def state_dict_honoured(model: Any) -> Iterator[None]:
    """Inside it, ``model.save_pretrained(..., state_dict=...)`` writes the state dict it is given: for a
    quantised model transformers replaces it by the model's own (its quantizer's
    ``get_state_dict_and_metadata`` returns None for bitsandbytes), which for a PEFT-injected base holds
    the adapter layers' names and would load back as missing weights."""
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is None:
        yield
        return
    model.hf_quantizer = None
    try:
        yield
    finally:
        model.hf_quantizer = quantizer
