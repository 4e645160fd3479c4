"""A Trainer script's DeepSpeed JSON (``TrainingArguments.deepspeed``) reaches the DeepSpeed engine's config as
Trainer's integration fills it: the port carries the JSON with ``"auto"`` filled from the arguments
(``HfTrainerDeepSpeedConfig.trainer_config_process``), ``parallel.deepspeed.deepspeed_config`` fills the rest as
``trainer_config_finalize`` (hidden size, step count) and keeps the loop's batch keys; an ``"auto"`` nothing fills
is refused by name.  Training with it on 2 ranks: tests/distributed/test_script_kinds.py (compat_full)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, TrainingArguments

from trainbridge.hf.porting import training_args_from_hf
from trainbridge.parallel.deepspeed import deepspeed_config

ZERO3_OFFLOAD: dict[str, Any] = {
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "zero_optimization": {
        "stage": 3,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True},
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
    },
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}


def _config(tmp_path: Path, json_config: dict[str, Any], model: Any, total_steps: int = 40) -> dict[str, Any]:
    hf = TrainingArguments(
        output_dir=str(tmp_path),
        deepspeed=json_config,
        learning_rate=3e-3,
        warmup_steps=4,
        weight_decay=0.01,
        per_device_train_batch_size=4,
        report_to="none",
        use_cpu=True,
    )
    LlamaConfig(hidden_size=48, num_attention_heads=4).save_pretrained(tmp_path / "model")
    args = training_args_from_hf(hf, model_path=str(tmp_path / "model"))
    env = SimpleNamespace(world_size=2, device=torch.device("cpu"))
    return deepspeed_config(args, env, model, total_steps)  # type: ignore[arg-type]


def test_the_json_reaches_the_engine_with_auto_filled_as_trainer_fills_it(tmp_path: Path) -> None:
    model = SimpleNamespace(config=LlamaConfig(hidden_size=48, num_attention_heads=4))
    config = _config(tmp_path, ZERO3_OFFLOAD, model)
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_param"]["device"] == zero["offload_optimizer"]["device"] == "cpu"
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"]) == (48 * 48, int(0.9 * 48 * 48))
    assert zero["stage3_param_persistence_threshold"] == 480
    assert config["optimizer"]["params"] == {"lr": 3e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
    assert config["scheduler"] == {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": 0,
            "warmup_max_lr": 3e-3,
            "warmup_num_steps": 4,
            "total_num_steps": 40,
        },
    }
    assert config["bf16"] == {"enabled": False} and config["gradient_clipping"] == 1.0
    # the loop's batch keys: one micro-batch per engine call, the boundary set per step
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (1, 1)
    assert config["train_batch_size"] == 2 and "zero_allow_untested_optimizer" not in config


def test_an_auto_nothing_fills_is_refused_by_name(tmp_path: Path) -> None:
    json_config = {"zero_optimization": {"stage": 2, "allgather_bucket_size": "auto"}}
    with pytest.raises(ValueError, match=r"zero_optimization\.allgather_bucket_size.*set them to values"):
        _config(tmp_path, json_config, SimpleNamespace(config=LlamaConfig(hidden_size=48, num_attention_heads=4)))
    # without the model (accelerate's plugin state, before the engine) nothing is refused yet
    assert _config(tmp_path, json_config, None)["zero_optimization"]["allgather_bucket_size"] == "auto"
