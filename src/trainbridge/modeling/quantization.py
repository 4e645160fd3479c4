"""Quantised (bitsandbytes 4-bit / 8-bit) base models: QLoRA.

A base model is quantised when ``model_kwargs`` carries a ``quantization_config``, or when its folder's
``config.json`` was saved quantised (a 4-bit model handed to the ``Trainer`` facade is written that way).
It is loaded on this rank's device (bitsandbytes quantises while loading; a quantised model is not moved
afterwards), then ``peft.prepare_model_for_kbit_training`` freezes it and upcasts its other weights to
fp32; gradient checkpointing and the LoRA adapter follow as for any model.  Only the adapter trains, so
only the adapter and its optimizer state are saved: the quantised base is read from its folder again on
resume.  How FSDP2 shards the packed weights: ``parallel.fsdp.packed_quantized_weights``.

bitsandbytes is imported only when one of these is used (``defer_bitsandbytes``): importing it prints
CPU-kernel warnings and costs start-up time in every run where it is merely installed.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.util
import json
import sys
from collections.abc import Iterator
from importlib.machinery import ModuleSpec
from pathlib import Path
from types import ModuleType
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


class _ImportedOnFirstUse(ModuleType):
    """Stands for ``bitsandbytes`` in a module that imports it at its top: the real import happens on the first
    attribute read, when that module's quantised-weight code actually runs."""

    def __getattr__(self, name: str) -> Any:
        return getattr(importlib.import_module("bitsandbytes"), name)


class _PeftHelpersLoader(importlib.abc.Loader):
    """Executes ``peft.helpers`` with bitsandbytes hidden (its ``try: import bitsandbytes`` takes the
    not-installed branch), then gives it ``_ImportedOnFirstUse`` as ``bnb``."""

    def __init__(self, real: importlib.abc.Loader):
        self.real = real

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.real.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.real  # tracebacks and inspect read the source through the real loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.real
        hidden = "bitsandbytes" not in sys.modules
        if hidden:
            sys.modules["bitsandbytes"] = None  # type: ignore[assignment]  # `import bitsandbytes` fails
        try:
            self.real.exec_module(module)
        finally:
            if hidden and sys.modules.get("bitsandbytes", 0) is None:
                del sys.modules["bitsandbytes"]
        if getattr(module, "bnb", 0) is None:
            module.bnb = _ImportedOnFirstUse("bitsandbytes")  # type: ignore[attr-defined]


class _DeferBitsandbytes(importlib.abc.MetaPathFinder):
    """Hands ``peft.helpers`` to ``_PeftHelpersLoader`` the first time it is imported, then steps aside."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> ModuleSpec | None:
        if fullname != "peft.helpers":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None and "bitsandbytes" not in sys.modules:
            spec.loader = _PeftHelpersLoader(spec.loader)
        return spec


def defer_bitsandbytes() -> None:
    """Keep bitsandbytes unimported until a feature uses it; call before transformers is imported (cheap: it
    imports nothing).

    transformers imports peft whenever peft is installed (``trainer_utils``, reached from its callbacks,
    ``optimization`` and ``Trainer``), and ``peft.helpers`` before peft 0.22 imports bitsandbytes at its top,
    only to dequantise weights in an analysis helper; bitsandbytes then prints CPU-kernel warnings on import.
    That one eager import is deferred (``_PeftHelpersLoader``).  Everything else imports bitsandbytes where it is
    used and finds it installed: transformers' quantizers (``quantization_config``), peft's k-bit adapter layers,
    our QLoRA loading (``require_bitsandbytes``) and 8-bit optimizers.  A no-op once peft is imported.
    """
    if "peft.helpers" in sys.modules or any(isinstance(f, _DeferBitsandbytes) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _DeferBitsandbytes())


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
