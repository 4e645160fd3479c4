"""instructlab-training's ``TrainingArgs`` field names that trainbridge spells differently.

An instructlab configuration (its README's ``TrainingArgs(...)``, a saved config dict) ports with its
import changed: a field with an exact equivalent here is translated (``random_seed`` -> ``seed``,
``lora=LoraOptions(...)`` -> ``peft_config``...) with one ``InstructlabNameWarning`` naming ours, a field that
has no meaning here (``data_output_dir``: no separate data-processing step; ``deepspeed_options``) is dropped
with a warning, and a field that needs a decision (``fsdp_options``, ``mock_data``...) fails, the error saying
what to write instead.  ``trainbridge.instructlab`` exports these names with ``LoraOptions`` and ``DeepSpeedOptions``,
so ``from instructlab.training import ...`` ports by changing the module name.  Where instructlab's
field and ours are both given, ours must be left out (an error says so).  ``run_training`` also takes
instructlab's argument order and keyword ``torch_args``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict


class InstructlabNameWarning(UserWarning):
    """An instructlab-training field name was translated to trainbridge's (or dropped as meaningless here)."""


class LoraOptions(BaseModel):
    """instructlab-training's ``LoraOptions`` (``TrainingArgs(lora=LoraOptions(...))``), which becomes
    ``peft_config`` (a ``peft.LoraConfig``); ``rank=0`` trains the full model, as instructlab does."""

    model_config = ConfigDict(extra="forbid")

    rank: int = 4
    """LoRA rank ``r``; 0: no adapter (full fine-tuning)."""
    alpha: int = 32
    """``lora_alpha``."""
    dropout: float = 0.1
    """``lora_dropout``."""
    target_modules: list[str] | None = None
    """Modules to adapt; None: every ``*_proj`` linear layer (instructlab's default)."""
    quantize_data_type: str | None = None
    """instructlab's ``nf4`` (QLoRA); here set ``model_kwargs`` quantization keywords instead."""


class DeepSpeedOptions(BaseModel):
    """instructlab-training's ``DeepSpeedOptions``: accepted so its configs validate; its settings (optimizer
    CPU offload, DeepSpeed-format saves) have no equivalent here and are ignored with a warning.  DeepSpeed
    itself is chosen with ``distributed_backend='deepspeed'`` (``deepspeed_zero_stage``)."""

    model_config = ConfigDict(extra="ignore")

    cpu_offload_optimizer: bool | None = False
    """Offload the optimizer to CPU (not supported here: refused when True)."""
    cpu_offload_optimizer_ratio: float = 1
    """Share of the optimizer offloaded (ignored)."""
    cpu_offload_optimizer_pin_memory: bool | None = False
    """Pin offloaded memory (ignored)."""
    save_samples: int | None = None
    """DeepSpeed-format checkpoints every N samples (ignored: checkpoints follow ``save_samples``/``save_steps``)."""


def _packing(value: Any) -> dict[str, Any]:
    return {"packing": "padding_free" if value else "padded"}


def _lora(value: Any) -> dict[str, Any]:
    options = (
        value
        if isinstance(value, LoraOptions)
        else LoraOptions.model_validate(value.model_dump() if isinstance(value, BaseModel) else value)
    )
    if options.quantize_data_type not in (None, "none", "None"):
        raise ValueError(
            f"lora.quantize_data_type={options.quantize_data_type!r}: set model_kwargs="
            "{'quantization_config': {...}} (bitsandbytes 4-bit) with the LoRA instead"
        )
    if options.rank <= 0:
        return {}
    return {
        "peft_config": {
            "peft_type": "LORA",
            "r": options.rank,
            "lora_alpha": options.alpha,
            "lora_dropout": options.dropout,
            "target_modules": options.target_modules or r".*_proj",
        }
    }


def _deepspeed_options(value: Any) -> dict[str, Any]:
    options = (
        value
        if isinstance(value, DeepSpeedOptions)
        else DeepSpeedOptions.model_validate(value.model_dump() if isinstance(value, BaseModel) else value)
    )
    if options.cpu_offload_optimizer:
        raise ValueError(
            "deepspeed_options.cpu_offload_optimizer=True: optimizer CPU offload is not supported; "
            "use distributed_backend='fsdp' or deepspeed_zero_stage=3 to shard the optimizer state"
        )
    return {}


TRANSLATED: dict[str, Callable[[Any], dict[str, Any]]] = {
    "random_seed": lambda v: {"seed": v},
    "num_warmup_steps": lambda v: {"warmup_steps": v},
    "is_padding_free": _packing,
    "keep_last_checkpoint_only": lambda v: {"save_total_limit": 1} if v else {},
    "data_output_dir": lambda v: {},  # tokenised by the workers into the data cache: no processing step
    "process_data": lambda v: {},
    "lora": _lora,
    "deepspeed_options": _deepspeed_options,
}
"""instructlab field -> the trainbridge fields it becomes ({} : dropped, it has no meaning here)."""

INSTRUCTLAB_FIELDS: dict[str, str] = {
    "random_seed": "seed=<int>",
    "num_warmup_steps": "warmup_steps=<int>",
    "is_padding_free": "packing='padding_free' (True) or packing='padded' (False); 'auto' picks for the model",
    "keep_last_checkpoint_only": "save_total_limit=1",
    "data_output_dir": "nothing: data is tokenised by the workers (no separate processing step); remove it",
    "process_data": "nothing: data is tokenised by the workers; remove it",
    "lora": "peft_config=peft.LoraConfig(r=..., lora_alpha=..., lora_dropout=..., target_modules=[...])",
    "fsdp_options": "distributed_backend='fsdp' (FSDP2; sharding follows the model's decoder layers)",
    "deepspeed_options": "nothing: its settings have no equivalent; choose DeepSpeed with "
    "distributed_backend='deepspeed' and deepspeed_zero_stage=1|2|3",
    "disable_flash_attn": "model_kwargs={'attn_implementation': 'sdpa'} (or 'eager')",
    "accelerate_full_state_at_epoch": "checkpoint_at_epoch=True (every checkpoint holds the full training state)",
    "chat_tmpl_path": "tokenizer_path=<folder whose tokenizer carries the chat template>",
    "use_dolomite": "nothing: models are loaded with transformers; remove it",
    "use_liger": "nothing: the loss is computed by trainbridge (token-level cross entropy); remove it",
    "mock_data": "nothing: give a data_path; remove it",
    "mock_data_len": "nothing: give a data_path; remove it",
}
"""instructlab field -> what to set in ``trainbridge.TrainingArgs`` instead (the warning's or error's text)."""


def translate_instructlab_names(data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with instructlab's names translated (see the module doc); raises ``ValueError`` naming our
    equivalents for the names that cannot be translated, or when a translated field is also given as ours."""
    out = dict(data)
    untranslatable = [name for name in out if name in INSTRUCTLAB_FIELDS and name not in TRANSLATED]
    if untranslatable:
        hints = "; ".join(f"{name}: use {INSTRUCTLAB_FIELDS[name]}" for name in untranslatable)
        raise ValueError(f"instructlab field name(s) {untranslatable} are not TrainingArgs fields here. {hints}")
    for name in [n for n in out if n in TRANSLATED]:
        fields = TRANSLATED[name](out.pop(name))
        clash = sorted(f for f in fields if f in out)
        if clash:
            raise ValueError(
                f"{name} (instructlab's name) and {', '.join(clash)} (trainbridge's) are both given; "
                f"keep only {', '.join(clash)}"
            )
        out.update(fields)
        hint = INSTRUCTLAB_FIELDS[name]
        message = (
            f"{name} is instructlab-training's name: use {hint}"
            if fields
            else f"{name} (instructlab-training) is ignored here: {hint.removeprefix('nothing: ')}"
        )
        warnings.warn(message, InstructlabNameWarning, stacklevel=2)
    return out
