"""``SFTTrainer`` against a real ``trl.SFTTrainer`` on one tiny model and data (in place, 1 rank): with
``packing=True`` (``bfd``) a step trains trl's bins (the same steps per epoch and epoch values at each log),
and evaluations are trl's ``evaluate``, logging trl's ``eval_entropy``, ``eval_mean_token_accuracy`` and
``eval_num_tokens`` values.  ``learning_rate=1e-12`` keeps the weights, so both evaluate the same model whatever
order they train the bins in; ``eval_num_tokens`` (the tokens trained so far) is compared where it does not
depend on the order: before training and at the end of the epoch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")
import datasets
import trl
from trl import SFTConfig

import trainbridge
from tests.unit.test_trl_sft_trainer import _fresh_accelerate_state  # noqa: F401  (autouse: trl's state reset)

ROWS = [{"text": f"{a}+{b}={a + b}" + "!" * (a % 5)} for a in range(9) for b in range(3)]
"""27 texts of 8 to 11 tokens: ``bfd`` packs them into 12 bins of up to 24 tokens (6 steps of 2 bins)."""

EVAL_ROWS = [{"text": f"{a}*{b}:-{a * b}" + "s-" * (b % 4)} for a in range(4) for b in range(4)]
"""Characters the tiny model's untrained head often predicts, so some tokens are hits."""


def _config(out: Path, **extra: Any) -> SFTConfig:
    return SFTConfig(
        output_dir=str(out),
        report_to="none",
        bf16=False,
        use_cpu=True,
        disable_tqdm=True,
        model_init_kwargs={"dtype": "float32"},
        max_length=24,
        packing=True,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=3,
        num_train_epochs=1,
        learning_rate=1e-12,  # below float32 resolution of the weights: the model stays as it is
        logging_steps=2,
        eval_strategy="steps",
        eval_steps=3,
        eval_on_start=True,
        save_strategy="no",
        seed=3,
        **extra,
    )


def _run(cls: Any, tiny_llama: Path, config: SFTConfig) -> tuple[Any, list[dict[str, Any]], int]:
    trainer = cls(
        model=str(tiny_llama),
        args=config,
        train_dataset=datasets.Dataset.from_list(ROWS),
        eval_dataset=datasets.Dataset.from_list(EVAL_ROWS),
    )
    bins = len(trainer.train_dataset)
    result = trainer.train()
    return result, trainer.state.log_history, bins


def test_packed_steps_and_eval_metrics_are_trls(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    theirs, trl_logs, trl_bins = _run(trl.SFTTrainer, tiny_llama, _config(tmp_path / "trl"))
    config = _config(tmp_path / "ours")
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)  # in place, as under torchrun
    trls_evaluate, evaluated = trl.SFTTrainer.evaluate, []

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        evaluated.append(self.state.global_step)
        return trls_evaluate(self, *args, **kwargs)

    monkeypatch.setattr(trl.SFTTrainer, "evaluate", counted)
    ours, logs, bins = _run(trainbridge.SFTTrainer, tiny_llama, config)

    assert bins == trl_bins < len(ROWS)  # several sequences a bin
    assert ours.global_step == theirs.global_step == -(-bins // 2)  # trl's steps: 2 bins a step
    train_rows = [(row["step"], row["epoch"]) for row in logs if "loss" in row]
    assert train_rows == [(row["step"], row["epoch"]) for row in trl_logs if "loss" in row]
    evals = [row for row in logs if "eval_loss" in row]
    trl_evals = [row for row in trl_logs if "eval_loss" in row]
    assert [row["step"] for row in evals] == [row["step"] for row in trl_evals] == evaluated  # trl's evaluate
    assert len(evals) >= 3 and trl_evals[0]["eval_mean_token_accuracy"] > 0
    for row, trl_row in zip(evals, trl_evals, strict=True):
        assert set(row) >= {"eval_entropy", "eval_mean_token_accuracy", "eval_num_tokens"}
        assert row["epoch"] == pytest.approx(trl_row["epoch"])
        assert row["eval_entropy"] == pytest.approx(trl_row["eval_entropy"], rel=1e-5)
        assert row["eval_mean_token_accuracy"] == pytest.approx(trl_row["eval_mean_token_accuracy"], rel=1e-6)
    assert evals[0]["eval_num_tokens"] == trl_evals[0]["eval_num_tokens"] == 0  # eval_on_start
    assert evals[-1]["eval_num_tokens"] == trl_evals[-1]["eval_num_tokens"] > 0  # the whole epoch
