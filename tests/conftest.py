"""Fixtures shared by every test tier."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# One compute thread per test process unless the caller chose: CI runs two pytest-xdist workers on two cores,
# the tiny models gain nothing from intra-op threads, and idle OpenMP threads spin (a unit test used twice
# the CPU time with torch's default of one thread per core).  Each rank of a 2-rank run gets 1 on two cores
# anyway (the launchers' share of the cores).  Set before anything imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# DeepSpeed JIT-compiles its CPU shared-memory comm op (``deepspeed_shm_comm``, two C++ files, ~25 s of both
# cores) in every process that starts its comm backend, unless torch's extension cache holds a build made by
# the same command.  The command names the venv's paths, so venvs sharing ``~/.cache/torch_extensions`` (the
# worktrees of one machine) rebuild it whenever another venv built it last.  One cache per venv: CI (a fresh
# venv) builds it once either way.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama and its character tokenizer saved once per session (``demos.tiny_model``); read-only."""
    from trainbridge.demos.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "model")


@pytest.fixture
def run_files(tmp_path: Path) -> dict[str, Path]:
    """What a ``TrainingArgs`` needs to validate, under ``tmp_path``: ``model/`` (a tiny Llama's
    ``config.json``, validated, never loaded, and the tiny tokenizer the launcher's preflight reads the
    data with), ``train.jsonl`` and ``val.jsonl`` (one pre-tokenised
    line each) and ``out`` (not created)."""
    from transformers import LlamaConfig

    from trainbridge.demos.tiny_model import build_tokenizer

    model = tmp_path / "model"
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    config.save_pretrained(model)
    build_tokenizer(model)
    train = tmp_path / "train.jsonl"
    train.write_text('{"input_ids": [1, 2, 3]}\n')
    val = tmp_path / "val.jsonl"
    val.write_text('{"input_ids": [2, 3, 4]}\n')
    return {"model": model, "train": train, "val": val, "out": tmp_path / "out"}
