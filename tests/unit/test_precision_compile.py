"""Mixed precision and compilation as Trainer (issue 41 item 3): ``fp16=True`` trains under float16 autocast
with a ``torch.amp.GradScaler`` whose state is checkpointed and resumed; ``torch_compile`` /
``torch_compile_backend`` / ``torch_compile_mode`` compile the model.  All on CPU (CPU autocast takes
float16)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState
from pydantic import ValidationError
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, TrainingArguments

from tests.run_inputs import as_run
from trainbridge.core.distributed import DistributedEnv
from trainbridge.hf import training_args_from_hf
from trainbridge.launch.assembly import assemble_callbacks
from trainbridge.loop.loop import train
from trainbridge.parallel.build import build_engine


def test_fp16_trains_under_float16_autocast_with_a_grad_scaler(args_for, tiny_llama: Path) -> None:
    args = args_for(mixed_precision="fp16", nonfinite_policy="warn")
    engine = build_engine(AutoModelForCausalLM.from_pretrained(tiny_llama), args, DistributedEnv(), total_steps=4)
    assert isinstance(engine.grad_scaler, torch.amp.GradScaler)
    with engine.autocast():
        logits = engine.module(input_ids=torch.tensor([[1, 2, 3]])).logits
    assert logits.dtype == torch.float16
    # Trainer goes on past an overflowed (skipped) step; stopping at it would end every fp16 run
    with pytest.raises(ValidationError, match="nonfinite_policy: 'error' with mixed_precision='fp16'"):
        args_for(mixed_precision="fp16")


def test_fp16_checkpoints_the_scaler_and_resumes_it(args_for) -> None:
    def fp16(**more):
        return args_for(mixed_precision="fp16", nonfinite_policy="warn", max_steps=4, **more)

    straight_args = fp16(out="straight")
    straight, straight_dir = train(*as_run(straight_args), DistributedEnv(), []), straight_args.ckpt_output_dir
    saving = fp16(out="resumed", save_strategy="steps", save_steps=2, save_total_limit=None)
    train(*as_run(saving), DistributedEnv(), assemble_callbacks(*as_run(saving)))
    checkpoint = saving.ckpt_output_dir / "checkpoint-2"
    scaler = torch.load(checkpoint / "scaler.pt", weights_only=True)
    assert scaler["scale"] > 0 and "_growth_tracker" in scaler
    resumed = train(*as_run(fp16(out="resumed", resume_from_checkpoint=str(checkpoint))), DistributedEnv(), [])
    assert resumed.global_step == straight.global_step == 4
    # the resumed run's weights are the uninterrupted run's: optimizer, schedule and scaler resumed exactly
    final = [load_file(str(a / "checkpoint-4" / "model.safetensors")) for a in (straight_dir, saving.ckpt_output_dir)]
    for name, tensor in final[0].items():
        torch.testing.assert_close(final[1][name], tensor, rtol=0, atol=0)
    scalers = [
        torch.load(a / "checkpoint-4" / "scaler.pt", weights_only=True) for a in (straight_dir, saving.ckpt_output_dir)
    ]
    assert scalers[0] == scalers[1] and scalers[0]["_growth_tracker"] == 4  # counted on from checkpoint-2's


def test_trainers_fp16_and_torch_compile_are_ported(tmp_path: Path, run_files: dict[str, Path]) -> None:
    hf = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", fp16=True, torch_compile_mode="reduce-overhead"
    )
    try:
        args = training_args_from_hf(hf, model_path=run_files["model"], data_path=run_files["train"])
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert (args.mixed_precision, args.nonfinite_policy) == ("fp16", "warn")
    assert (args.compile, args.compile_backend, args.compile_mode) == (True, "inductor", "reduce-overhead")


def test_compile_takes_the_backend_and_mode(args_for, tiny_llama: Path, monkeypatch) -> None:
    seen: list[dict] = []
    real = torch.nn.Module.compile

    def record(self, *args, **kwargs):
        seen.append(kwargs)
        return real(self, *args, **{**kwargs, "backend": "eager", "mode": None})

    monkeypatch.setattr(torch.nn.Module, "compile", record)
    args = args_for(compile=True, compile_backend="inductor", compile_mode="max-autotune-no-cudagraphs", max_steps=1)
    result = train(*as_run(args), DistributedEnv(), [])
    assert result.global_step == 1 and seen
    assert all(k == {"backend": "inductor", "mode": "max-autotune-no-cudagraphs"} for k in seen)
