"""benchmarks/gpu.py imports on a CPU-only machine and sizes its model as documented (its CPU run is
``python benchmarks/gpu.py --smoke``, too slow for the unit suite)."""

from __future__ import annotations

import importlib.util
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
