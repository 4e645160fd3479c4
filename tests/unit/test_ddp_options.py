"""DDP as Trainer configures it (issue 41): ``ddp_find_unused_parameters`` (Trainer's default: True unless
gradient checkpointing), ``ddp_bucket_cap_mb``, ``ddp_broadcast_buffers``, ``ddp_static_graph``, carried over
from ``TrainingArguments`` and turned into ``DistributedDataParallel``'s keyword arguments."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate.state import AcceleratorState
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

from trainbridge.core.config import TrainingArgs
from trainbridge.hf import training_args_from_hf
from trainbridge.parallel.ddp import ddp_options


@pytest.fixture
def tiny() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    return LlamaForCausalLM(config)


@pytest.fixture
def ported(tmp_path: Path, run_files: dict[str, Path]) -> Callable[..., TrainingArgs]:
    def port(**fields: Any) -> TrainingArgs:
        hf = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **fields)
        try:
            return training_args_from_hf(hf, model_path=run_files["model"], data_path=run_files["train"])
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)

    return port


def test_a_ported_script_gets_trainers_ddp_defaults(
    ported: Callable[..., TrainingArgs], tiny: LlamaForCausalLM
) -> None:
    # Trainer: find_unused_parameters=True unless gradient checkpointing (then False); the rest torch's
    options = ddp_options(tiny, ported())
    assert options["find_unused_parameters"] is True
    assert "bucket_cap_mb" not in options and "static_graph" not in options
    assert ddp_options(tiny, ported(gradient_checkpointing=True))["find_unused_parameters"] is False
    tiny.gradient_checkpointing_enable()  # the script's own call, as Trainer reads model.is_gradient_checkpointing
    assert ddp_options(tiny, ported())["find_unused_parameters"] is False


def test_a_ported_scripts_ddp_fields_reach_ddp(ported: Callable[..., TrainingArgs], tiny: LlamaForCausalLM) -> None:
    args = ported(
        ddp_find_unused_parameters=False,
        ddp_bucket_cap_mb=7,
        ddp_broadcast_buffers=True,
        ddp_static_graph=True,
        ddp_timeout=99,
    )
    assert ddp_options(tiny, args) == {
        "find_unused_parameters": False,
        "bucket_cap_mb": 7,
        "static_graph": True,
        "broadcast_buffers": True,
    }
    assert args.collective_timeout_s == 99


def test_native_runs_keep_the_lean_step_and_broadcast_buffers_training_updates(
    tiny: LlamaForCausalLM, run_files: dict[str, Path], tmp_path: Path
) -> None:
    args = TrainingArgs(model_path=run_files["model"], data_path=run_files["train"], ckpt_output_dir=tmp_path)
    # every parameter of a causal LM trains each step: no search; its constant buffers are not re-sent
    assert ddp_options(tiny, args) == {"find_unused_parameters": False, "forward_sync_buffers": False}
    # batch-norm running statistics change in training: torch's default broadcast, as under Trainer
    assert ddp_options(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), args) == {"find_unused_parameters": False}
    assert ddp_options(tiny, args.model_copy(update={"ddp_find_unused_parameters": None}))["find_unused_parameters"]


@pytest.mark.parametrize("max_norm", [1e3, 1.0, 0.6, 1e-3, 0.0])  # the norm is ~0.67
def test_cpu_clip_gives_torch_clip_grad_norm_s_values(max_norm: float) -> None:
    """``clip_cpu_grads`` skips the multiplication by a clip coefficient of exactly 1 (a norm below
    ``max_norm``): the norm and every gradient bit for bit as ``torch.nn.utils.clip_grad_norm_``'s, on both
    sides of the threshold; a NaN gradient clips as torch's does (NaN everywhere)."""
    from trainbridge.parallel.ddp import clip_cpu_grads

    torch.manual_seed(0)
    for poison in (False, True):
        ours, theirs = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)], []
        for p in ours:
            p.grad = torch.randn_like(p) * 0.1
            if poison:
                p.grad[0, 0] = float("nan")
            theirs.append(torch.nn.Parameter(p.detach().clone()))
            theirs[-1].grad = p.grad.clone()
        norm = clip_cpu_grads(ours, max_norm)
        expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm)
        assert torch.equal(norm, expected) or (poison and norm.isnan() and expected.isnan())
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a.grad, b.grad) or (poison and torch.equal(a.grad.isnan(), b.grad.isnan()))
