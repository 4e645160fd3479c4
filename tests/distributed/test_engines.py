"""Real two-process runs of every ``TrainingEngine`` backend (gloo on CPU, via torchrun).

Each run (``scripts/engine_worker.py``) trains a tiny Llama for a few steps and compares it with a
single-process reference that runs all ranks' micro-batches itself, then saves a checkpoint with
``CheckpointManager`` and resumes from it.  The worker only records; the assertions are here.  Every
configuration runs in one launch (``engine_runs``), one after another in the same processes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1200)]  # the set-up runs every engine (engine_runs)

WORKER = Path(__file__).parent / "scripts" / "engine_worker.py"
# DeepSpeed JIT-compiles its CPU comm extension on first use (cached afterwards): allow for that.
RUN_TIMEOUT_S = 300
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Llama saved with ``save_pretrained`` and a placeholder data file (TrainingArgs needs one)."""
    root = tmp_path_factory.mktemp("engines")
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "model")
    data = root / "data.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    return root / "model", data


ENGINES: dict[str, dict[str, Any]] = {
    "ddp": {"backend": "ddp"},
    "fsdp-every": {"backend": "fsdp"},
    "fsdp-last": {"backend": "fsdp", "fsdp_gradient_sync": "last_micro_batch"},
    **(
        {
            "deepspeed-2": {"backend": "deepspeed", "zero_stage": 2},
            "deepspeed-bf16": {"backend": "deepspeed", "zero_stage": 2, "mixed_precision": "bf16"},
            "deepspeed-3": {"backend": "deepspeed", "zero_stage": 3},  # last: ZeRO-3 sets process-wide state
        }
        if HAS_DEEPSPEED
        else {}
    ),
}
"""Every engine configuration the tests below check, by name."""


@pytest.fixture(scope="module")
def engine_runs(tiny_model: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every configuration of ``ENGINES`` run once, one after another in the same two torchrun processes (one
    launch instead of one per configuration; each starts from a fresh model); the folder of each's results."""
    root = tmp_path_factory.mktemp("engine-runs")
    run_engine_worker(tiny_model, {name: root / name for name in ENGINES})
    return {name: root / name for name in ENGINES}


def results_of(engine_runs: dict[str, Path], name: str) -> list[dict[str, Any]]:
    """Both ranks' findings for the configuration ``name``."""
    return [json.loads((engine_runs[name] / f"result_{rank}.json").read_text()) for rank in (0, 1)]


def run_engine_worker(tiny_model: tuple[Path, Path], out_dirs: dict[str, Path]) -> None:
    """``torchrun --standalone --nproc_per_node=2 engine_worker.py SPECS``: the configurations ``ENGINES`` names
    in ``out_dirs``, each writing its findings in its folder."""
    model_dir, data_file = tiny_model
    specs = []
    for name, out_dir in out_dirs.items():
        out_dir.mkdir(parents=True, exist_ok=True)
        spec = {"zero_stage": 2, "mixed_precision": "no", "fsdp_gradient_sync": "every_micro_batch", **ENGINES[name]}
        specs.append({**spec, "model_dir": str(model_dir), "data_file": str(data_file), "out_dir": str(out_dir)})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(WORKER),
        json.dumps(specs),
    ]
    timeout = RUN_TIMEOUT_S * len(specs)
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(
            f"engine worker ({', '.join(out_dirs)}) hung for {timeout}s; output tail:\n{str(exc.stdout)[-3000:]}"
            f"\n{str(exc.stderr)[-3000:]}"
        )
    names = ", ".join(out_dirs)
    assert proc.returncode == 0, f"engine worker ({names}) failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}"


def assert_trained_like_reference(
    results: list[dict[str, Any]], describe_prefix: str, weight_tolerance: float = 1e-4, norm_rel: float = 1e-5
) -> None:
    """What every backend must show: it is what was configured, it learns, it matches the single-process
    reference, the ranks agree, and save/resume reproduces the next step."""
    rank0, rank1 = results
    for result in results:
        assert result["describe"].startswith(describe_prefix), result["describe"]
        assert result["verify_catches_fallback"], "verify() accepted an unwrapped module"
        assert result["losses"][-1] < result["losses"][0], result["losses"]
        assert result["grad_norms"] == pytest.approx(result["reference_grad_norms"], rel=norm_rel)
        assert result["max_diff_vs_reference"] < weight_tolerance
        assert result["training_state"] == {"global_step": 3, "rank_count": 2}
        assert result["resumed_lr_matches"]
        assert result["resume_max_diff"] == 0.0
        # HF-layout weights exported in bf16 from fp32 training: resume is exact all the same
        assert result["bf16_resume_max_diff"] == 0.0
        # the same written with dcp.async_save while the next step trained, published after it
        assert result["async_resume_max_diff"] == 0.0
        assert result["latest"].endswith("checkpoint-3")
        assert result["rotated_away"] == ["checkpoint-3"]
        assert result["after_rotation"] == ["checkpoint-4"]
    assert rank0["losses"] == rank1["losses"]
    assert rank0["grad_norms"] == rank1["grad_norms"], "ranks measured different gradient norms"
    assert rank0["weights_sha"] == rank1["weights_sha"], "ranks ended with different full weights"
    assert rank0["from_pretrained_max_diff"] == 0.0
    assert rank1["full_state_on_other_rank"] is False
    assert rank0["bf16_export_dtypes"] == ["torch.bfloat16"]
    files = set(rank0["checkpoint_files"])
    assert {
        "COMPLETE",
        "config.json",
        "model.safetensors",
        "training_state.json",
        "scheduler.pt",
        "rng_state_0.pth",
        "rng_state_1.pth",
        "note.txt",
    } <= files


def test_ddp_engine(engine_runs: dict[str, Path]) -> None:
    results = results_of(engine_runs, "ddp")
    assert_trained_like_reference(results, "ddp (DistributedDataParallel) world=2 device=cpu")
    assert "optimizer.pt" in results[0]["checkpoint_files"]
    # DDP keeps the fp32 weights in dcp/ only beside a lower-precision export
    assert "dcp" in results[0]["bf16_checkpoint_files"] and "dcp" not in results[0]["checkpoint_files"]
    assert results[0]["model_state_in_dcp"] == {"plain": False, "bf16": True}
    assert all(r["async_background_write"] for r in results)


def test_fsdp_engine_shards_parameters(engine_runs: dict[str, Path]) -> None:
    """Default FSDP2: embeddings, each decoder layer and norm + lm_head as units (+ the root), gradients
    reduce-scattered on every micro-batch, fused AdamW on the DTensor shards; and the per-step mode
    (``fsdp_gradient_sync='last_micro_batch'``, the accumulation used before) gives the same weights."""
    results = results_of(engine_runs, "fsdp-every")
    assert_trained_like_reference(
        results, "fsdp2 (fully_shard) world=2 device=cpu, 5 sharded modules, reduce-scatter every micro-batch"
    )
    per_step = results_of(engine_runs, "fsdp-last")
    assert_trained_like_reference(
        per_step, "fsdp2 (fully_shard) world=2 device=cpu, 5 sharded modules, reduce-scatter per step"
    )
    every = torch.load(engine_runs["fsdp-every"] / "final_weights.pt")
    last = torch.load(engine_runs["fsdp-last"] / "final_weights.pt")
    assert every.keys() == last.keys()
    assert max((every[k] - last[k]).abs().max().item() for k in every) < 1e-6
    assert results[0]["grad_norms"] == pytest.approx(per_step[0]["grad_norms"], rel=1e-6)
    for result in results:
        assert result["optimizer_fused"]
        assert result["all_params_dtensor"]
        assert result["local_shard_fraction"] < 0.75, "a rank holds (almost) all parameters: not sharded"
        generated, asked = result["generated_new_tokens"]  # synced generation: each rank its own length
        assert generated == asked
    assert sum(r["local_shard_fraction"] for r in results) == pytest.approx(1.0)
    # the model's shards sit in dcp/ with the optimizer's and resume reads them (resume_max_diff above)
    assert "dcp" in results[0]["checkpoint_files"]
    for result in results:
        assert result["model_state_in_dcp"] == {"plain": True, "bf16": True}
        assert result["async_background_write"]
    # fsdp_load_on_rank0: rank 1 built a meta skeleton and got every weight and buffer from rank 0
    for result in results:
        untied, tied = result["from_rank0"]
        assert untied["skeleton_was_meta"] == (result["rank"] == 1)
        for found in (untied, tied):
            assert found["param_max_diff"] == 0.0, found
            assert found["buffer_max_diff"] == 0.0, found
            assert found["tied"] == found["tied_in_reference"]
        assert tied["tied"]
        assert tied["loss"] == tied["reference_loss"], tied
        assert tied["norm"] == tied["reference_norm"], tied
        assert tied["after_step_max_diff"] == 0.0, tied


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_deepspeed_engine(engine_runs: dict[str, Path], zero_stage: int) -> None:
    results = results_of(engine_runs, f"deepspeed-{zero_stage}")
    assert_trained_like_reference(results, f"deepspeed ZeRO-{zero_stage} world=2 device=cpu")
    for result in results:
        # The norm we report is the one DeepSpeed computed (and clipped with) inside its step, and it
        # matches the single-process reference (assert_trained_like_reference).
        assert result["deepspeed_reported_norm"] == pytest.approx(result["grad_norms"][-1], rel=1e-6)
    assert "deepspeed" in results[0]["checkpoint_files"]
    # DeepSpeed's own folder holds the fp32 masters: resume is exact from a bf16 export without dcp/
    assert results[0]["model_state_in_dcp"] == {"plain": False, "bf16": False}
    assert not any(r["async_background_write"] for r in results)  # DeepSpeed's folder: always synchronous
    assert "dcp" not in results[0]["bf16_checkpoint_files"]


@pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed")
def test_deepspeed_bf16_engine(engine_runs: dict[str, Path]) -> None:
    # DeepSpeed bf16 keeps bf16 weights (fp32 masters in the optimizer): close to the fp32 reference only.
    results = results_of(engine_runs, "deepspeed-bf16")
    assert_trained_like_reference(
        results, "deepspeed ZeRO-2 world=2 device=cpu, bf16", weight_tolerance=0.1, norm_rel=0.05
    )
