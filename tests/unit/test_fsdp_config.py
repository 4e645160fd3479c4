"""A Trainer script's ``fsdp="full_shard auto_wrap"`` with an ``fsdp_config`` (as ``TrainingArguments``
normalises it) reaches the FSDP2 engine's fields: resharding (``shard_grad_op`` keeps parameters gathered), CPU
offload (``offload`` / ``cpu_offload``), the classes wrapped (``transformer_layer_cls_to_wrap``, ``NO_WRAP``),
activation checkpointing; ``SIZE_BASED_WRAP`` and a class the model lacks are refused by name.  Training with
the recipe on 2 ranks: tests/distributed/test_script_kinds.py (compat_full)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import transformers
from transformers import LlamaConfig, TrainingArguments

from trainbridge.hf.porting import training_args_from_hf
from trainbridge.parallel.fsdp import fsdp_unit_groups


def _ported(tmp_path: Path, fsdp: str, fsdp_config: dict[str, Any] | None = None) -> Any:
    hf = TrainingArguments(output_dir=str(tmp_path), fsdp=fsdp, fsdp_config=fsdp_config, report_to="none", use_cpu=True)
    LlamaConfig(hidden_size=16, num_attention_heads=2).save_pretrained(tmp_path / "model")
    return training_args_from_hf(hf, model_path=str(tmp_path / "model"))


def test_the_recipe_reaches_the_fsdp2_engine(tmp_path: Path) -> None:
    config = {"transformer_layer_cls_to_wrap": "LlamaDecoderLayer", "activation_checkpointing": True}
    args = _ported(tmp_path, "full_shard offload auto_wrap", {**config, "backward_prefetch": "backward_pre"})
    assert args.distributed_backend == "fsdp" and args.fsdp_reshard_after_forward and args.fsdp_cpu_offload
    assert args.fsdp_wrap_classes == ["LlamaDecoderLayer"] and args.gradient_checkpointing
    plain = _ported(tmp_path, "shard_grad_op auto_wrap")
    assert not plain.fsdp_reshard_after_forward and not plain.fsdp_cpu_offload and not plain.gradient_checkpointing
    assert plain.fsdp_wrap_classes is None  # the model's _no_split_modules
    assert _ported(tmp_path, "full_shard", {"auto_wrap_policy": "NO_WRAP"}).fsdp_wrap_classes == []
    with pytest.raises(ValueError, match=r"SIZE_BASED_WRAP.*transformer_layer_cls_to_wrap"):
        _ported(tmp_path, "full_shard auto_wrap", {"auto_wrap_policy": "SIZE_BASED_WRAP", "min_num_params": 100})


def test_the_wrapped_classes_are_the_units() -> None:
    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
    model = transformers.LlamaForCausalLM(config)

    def units(classes: list[str] | None) -> list[str]:
        return [type(m).__name__ for _, modules in fsdp_unit_groups(model, classes) for m in modules]

    layers = ["LlamaDecoderLayer", "LlamaDecoderLayer"]
    assert units(None) == units(["LlamaDecoderLayer"]) == ["Embedding", *layers, "LlamaRMSNorm", "Linear"]
    assert units([]) == ["Embedding", "LlamaRMSNorm", "Linear"]
    assert units(["LlamaMLP"]) == ["Embedding", "LlamaMLP", "LlamaMLP", "LlamaRMSNorm", "Linear"]
    with pytest.raises(ValueError, match=r"fsdp_wrap_classes=\['GPT2Block'\].*transformer_layer_cls_to_wrap"):
        fsdp_unit_groups(model, ["GPT2Block"])
