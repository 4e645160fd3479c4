"""benchmarks/gpu.py imports on a CPU-only machine and sizes its model as documented (its CPU run is
``python benchmarks/gpu.py --smoke``, too slow for the unit suite)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"


def load_gpu_benchmark():
    spec = importlib.util.spec_from_file_location("gpu_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_one_b_model_size_and_cpu_refusal(capsys: pytest.CaptureFixture[str]) -> None:
    gpu = load_gpu_benchmark()
    parameters = sum(gpu._parameter_counts(gpu.SIZES["1b"]).values())
    assert 1.4e9 < parameters < 1.6e9  # Llama-3.2-1B's shape, untied output layer
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            gpu.main([])
        assert "--smoke" in capsys.readouterr().err


def test_summary_of_a_clock(tmp_path: Path) -> None:
    gpu = load_gpu_benchmark()
    options = gpu.Options(
        smoke=True,
        size="tiny",
        steps=6,
        batch_tokens=100,
        min_len=32,
        max_len=128,
        nproc=2,
        attn="sdpa",
        peak_tflops=1.0,
        workdir=str(tmp_path),
    )
    times = [0.0, 5.0, 6.0, 7.0, 8.0, 9.5]  # the first intervals are warm-up
    record = {"times": times, "syncs": [9, 9, 1, 1, 1, 2], "peak_memory_bytes": 2**30, "tokens_seen": 1200}
    (tmp_path / "gpu-clock-rank0.json").write_text(json.dumps(record))
    row = gpu.summarise("tb_ddp", tmp_path, options, parameters=1000)
    assert row["step_p50_s"] == 1.0 and row["step_p95_s"] == 1.5
    assert row["tokens_per_s_per_gpu"] == 1200 / 6 / 1.0 / 2
    assert row["peak_memory_gib"] == 1.0 and row["syncs_per_step"] == 1
    assert "tb_ddp" in gpu.report([row], options, "python benchmarks/gpu.py")
