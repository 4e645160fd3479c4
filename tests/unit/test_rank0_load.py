"""FSDP2's rank-0 load (``fsdp_load_on_rank0``): when it applies, and the meta skeleton the other ranks build.

The broadcast itself (identical parameters, buffers, tied weights and a step's loss on 2 gloo ranks) is
checked in ``tests/distributed/test_engines.py::test_fsdp_engine_shards_parameters``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.run_inputs import split_run
from trainbridge.core.config import ModelKwargs, TrainingArgs
from trainbridge.demos.tiny_model import build_tiny_llama
from trainbridge.modeling.load import build_skeleton, load_base_model, load_model, loads_on_rank0_only


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(
        tmp_path_factory.mktemp("rank0") / "model", hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64
    )


def args_for(model_dir: Path, tmp_path: Path, **overrides: object) -> TrainingArgs:
    data = tmp_path / "data.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    settings: dict[str, object] = {"distributed_backend": "fsdp", **overrides}
    return split_run(model_path=model_dir, data_path=data, ckpt_output_dir=tmp_path / "out", device="cpu", **settings)  # type: ignore[arg-type]


def test_rank0_load_applies_to_plain_fsdp_models_only(model_dir: Path, tmp_path: Path) -> None:
    assert loads_on_rank0_only(args_for(model_dir, tmp_path), world_size=2)
    assert not loads_on_rank0_only(args_for(model_dir, tmp_path), world_size=1)
    assert not loads_on_rank0_only(args_for(model_dir, tmp_path, fsdp_load_on_rank0=False), world_size=2)
    assert not loads_on_rank0_only(args_for(model_dir, tmp_path, distributed_backend="ddp"), world_size=2)
    assert not loads_on_rank0_only(args_for(model_dir, tmp_path), world_size=2, model_init=lambda: None)
    extra = args_for(model_dir, tmp_path, model_kwargs=ModelKwargs(rope_theta=500.0))  # type: ignore[call-arg]
    assert not loads_on_rank0_only(extra, world_size=2)
    pytest.importorskip("peft")
    from peft import LoraConfig

    lora = args_for(model_dir, tmp_path, peft_config=LoraConfig(r=2, target_modules=["q_proj"]))
    assert not loads_on_rank0_only(lora, world_size=2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "auto"])
def test_skeleton_has_the_loaded_models_tensors_on_meta(model_dir: Path, dtype: str) -> None:
    kwargs = ModelKwargs(dtype=dtype)  # type: ignore[arg-type]
    skeleton, loaded = build_skeleton(model_dir, kwargs), load_base_model(model_dir, kwargs)
    layout = {k: (v.shape, v.dtype) for k, v in skeleton.state_dict().items()}
    assert layout == {k: (v.shape, v.dtype) for k, v in loaded.state_dict().items()}
    assert all(p.is_meta for p in skeleton.parameters())
    assert all(b.is_meta for b in skeleton.buffers())
    assert type(skeleton) is type(loaded)
    assert skeleton.config._attn_implementation == loaded.config._attn_implementation
    assert skeleton.generation_config == loaded.generation_config
    assert skeleton.training == loaded.training


def test_load_model_builds_the_skeleton_with_gradient_checkpointing(model_dir: Path, tmp_path: Path) -> None:
    model = load_model(args_for(model_dir, tmp_path, gradient_checkpointing=True), skeleton=True)
    assert all(p.device == torch.device("meta") for p in model.parameters())
    assert model.is_gradient_checkpointing
