"""The non-finite guard (``nonfinite_policy``): a NaN loss or gradient norm seen in the step's agreement."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.run_inputs import as_run, split_run
from trainbridge.callbacks import ScheduleCallback
from trainbridge.core.callback import Callback
from trainbridge.core.config import TrainingArgs
from trainbridge.core.context import TrainingContext
from trainbridge.core.distributed import DistributedEnv
from trainbridge.demos.tiny_model import write_arithmetic_dataset
from trainbridge.loop.loop import train
from trainbridge.step.finite import NonFiniteLossError


class NaNWeightsFrom(Callback):
    """Makes the model's weights NaN before step ``step`` runs (``global_step == step - 1``)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, context: TrainingContext, **kwargs: Any) -> None:
        if context.global_step == self.step - 1:
            with torch.no_grad():
                next(context.unwrapped_model.parameters()).fill_(float("nan"))


class NaNGradientsAt(Callback):
    """Makes one gradient NaN in step ``step`` only (the weights stay finite unless the update is applied)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_after_backward(self, context: TrainingContext, **kwargs: Any) -> None:
        if context.global_step == self.step - 1:
            param = next(p for p in context.unwrapped_model.parameters() if p.grad is not None)
            param.grad.fill_(float("nan"))


@pytest.fixture
def args_for(tmp_path: Path, tiny_llama: Path):
    train_file = write_arithmetic_dataset(tmp_path / "train.jsonl", 96, seed=1)

    def make(**overrides: Any) -> TrainingArgs:
        values: dict[str, Any] = dict(
            model_path=tiny_llama,
            data_path=train_file,
            ckpt_output_dir=tmp_path / "out",
            max_seq_len=32,
            max_batch_len=64,
            effective_batch_size=8,
            learning_rate=1e-3,
            lr_scheduler="constant",
            max_steps=12,
            logging_steps=1,
            save_strategy="steps",
            save_steps=2,
            save_total_limit=2,
            disable_tqdm=True,
            seed=7,
        )
        values.update(overrides)
        return split_run(**values)

    return make


def _finite(checkpoint: Path) -> bool:
    weights = load_file(str(checkpoint / "model.safetensors"))
    return all(bool(torch.isfinite(t).all()) for t in weights.values())


def test_nan_weights_from_step_7_stop_the_run_naming_step_7_and_the_last_checkpoint_stays_finite(args_for):
    args = args_for()
    with pytest.raises(NonFiniteLossError, match=r"^step 7: non-finite loss sum nan"):
        train(*as_run(args), DistributedEnv(), [ScheduleCallback(), NaNWeightsFrom(7)])
    out = args.ckpt_output_dir
    kept = sorted(p.name for p in out.glob("checkpoint-*"))
    assert kept == ["checkpoint-4", "checkpoint-6"]  # nothing saved at or after step 7, nothing rotated out
    assert all(_finite(out / name) for name in kept)


def test_skip_leaves_a_non_finite_step_unapplied_and_goes_on(args_for, caplog):
    args = args_for(nonfinite_policy="skip", save_strategy="no", save_final_checkpoint=True)
    with caplog.at_level(logging.WARNING, logger="trainbridge.step.finite"):
        result = train(*as_run(args), DistributedEnv(), [ScheduleCallback(), NaNGradientsAt(5)])
    assert result.global_step == 12
    assert any(
        r.getMessage().startswith("step 5: non-finite gradient norm nan; the update was not applied")
        for r in caplog.records
    )
    assert _finite(args.ckpt_output_dir / "checkpoint-12")
    assert result.train_loss is not None and result.train_loss == result.train_loss  # the NaN step left out


def test_warn_only_warns(args_for, caplog):
    args = args_for(nonfinite_policy="warn", save_strategy="no", save_final_checkpoint=False, max_steps=8)
    with caplog.at_level(logging.WARNING, logger="trainbridge.step.finite"):
        result = train(*as_run(args), DistributedEnv(), [ScheduleCallback(), NaNGradientsAt(5)])
    assert result.global_step == 8
    assert any(
        r.getMessage().startswith("step 5: non-finite gradient norm nan; training goes on") for r in caplog.records
    )


def test_skip_is_refused_with_deepspeed(args_for):
    with pytest.raises(ValueError, match="nonfinite_policy: 'skip' cannot be used with distributed_backend="):
        args_for(nonfinite_policy="skip", distributed_backend="deepspeed")
