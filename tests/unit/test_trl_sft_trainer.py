"""``trainbridge.trl.SFTTrainer`` takes trl's arguments as they are and trains on the loop (in place, 1 rank)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")
import datasets
from trl import SFTConfig

from trainbridge import SFTTrainer
from trainbridge.hf.porting import HFPortingWarning

ROWS = [{"question": f"{a}+{b}", "answer": str(a + b)} for a in range(6) for b in range(4)]


def _in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)


def test_model_path_formatting_func_and_trl_collator(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = SFTConfig(
        output_dir=str(tmp_path / "out"),
        report_to="none",
        bf16=False,
        use_cpu=True,
        max_steps=3,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_steps=3,
        disable_tqdm=True,
        model_init_kwargs={"dtype": "float32"},
        max_length=12,
        packing=True,
    )
    _in_place(monkeypatch)
    trainer = SFTTrainer(
        model=str(tiny_llama),
        args=args,
        train_dataset=datasets.Dataset.from_list(ROWS),
        formatting_func=lambda row: f"{row['question']}={row['answer']}",
    )
    assert trainer.train_dataset.column_names == ["input_ids", "labels", "seq_lengths"]  # trl's bins
    assert type(trainer.data_collator).__module__ == "trl.trainer.sft_trainer"  # trl's own, built by trl
    assert trainer.run_plan().rows.collator.reproduced  # trl's collator: reproduced by padding-free batches, not called
    with warnings.catch_warnings():
        warnings.simplefilter("error", HFPortingWarning)  # max_length, model_init_kwargs, packing... are honoured
        out = trainer.train()
    assert out.global_step == 3 and out.training_loss > 0
    assert [row["step"] for row in trainer.state.log_history if "loss" in row] == [1, 2, 3]
    assert (tmp_path / "out" / "checkpoint-3" / "model.safetensors").is_file()


def test_tokenizer_comes_from_the_model(tiny_llama: Path, tmp_path: Path) -> None:
    args = SFTConfig(output_dir=str(tmp_path), report_to="none", bf16=False)
    trainer = SFTTrainer(
        model=str(tiny_llama), args=args, train_dataset=datasets.Dataset.from_list([{"text": "1+1=2"}])
    )
    eos = trainer.processing_class.eos_token_id
    assert trainer.train_dataset[0]["input_ids"][-1] == eos  # trl's preparation added the EOS token


def test_the_step_is_chosen_at_each_train_from_the_instance_as_it_is_then(tiny_llama: Path, tmp_path: Path) -> None:
    """Whose step trains is part of the plan each ``train()`` decides (``run_plan()``), nothing of it written on
    the instance at construction: the token step stands in for trl's, until a ``compute_loss_func`` set after
    construction (Trainer's ``compute_loss`` reads it at each call) makes it trl's own step on trl's loader."""
    from trainbridge.core.config.loss import InstanceStep, TokenLoss

    args = SFTConfig(output_dir=str(tmp_path), report_to="none", bf16=False, use_cpu=True)
    trainer = SFTTrainer(model=str(tiny_llama), args=args, train_dataset=_texts())
    assert not {"stands_in_for", "step_factory"} & set(vars(trainer))
    plan = trainer.run_plan()
    assert plan.loss == TokenLoss(metrics=True) and plan.rows.collator.reproduced and plan.train_loader is None
    trainer.compute_loss_func = lambda outputs, labels, num_items_in_batch=None: outputs.loss
    plan = trainer.run_plan()
    assert isinstance(plan.loss, InstanceStep) and not plan.rows.collator.reproduced and plan.train_loader


def test_quantization_config_is_refused_by_name(tiny_llama: Path, tmp_path: Path) -> None:
    from trainbridge.trainer.facade import UnsupportedTrainerFeatureError

    with pytest.raises(UnsupportedTrainerFeatureError, match="quantization_config"):
        SFTTrainer(
            model=str(tiny_llama),
            args=SFTConfig(output_dir=str(tmp_path), report_to="none", bf16=False),
            train_dataset=datasets.Dataset.from_list([{"text": "1+1=2"}]),
            quantization_config=object(),
        )


def _unused(*_: Any) -> None: ...


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """trl's trainer fills accelerate's process-wide state; leave none behind."""
    yield
    from accelerate.state import AcceleratorState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    PartialState._reset_state()


TEXTS = [{"text": f"{a}+{b}={a + b}" + "!" * (a % 4)} for a in range(4) for b in range(2)]
"""8 texts of different lengths: one step is every row, so neither side's order changes a value."""

TIMING = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "step_time"}
NOT_COMPARED = {*TIMING, "total_flos"}
"""Wall-clock values, and the FLOPs estimate (trl's counts its padded batches' positions, the loop has none)."""


def _full_batch_config(out: Path) -> SFTConfig:
    return SFTConfig(
        output_dir=str(out),
        report_to="none",
        bf16=False,
        use_cpu=True,
        disable_tqdm=True,
        model_init_kwargs={"dtype": "float32"},
        per_device_train_batch_size=len(TEXTS),
        num_train_epochs=3,
        learning_rate=5e-2,
        logging_steps=1,
        save_strategy="no",
    )


def test_sft_trainer_is_trls_class() -> None:
    import transformers
    import trl

    assert issubclass(SFTTrainer, trl.SFTTrainer) and issubclass(SFTTrainer, transformers.Trainer)


def test_the_fast_step_logs_trls_values(tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop's padding-free token step on trl's prepared rows gives trl's loss, gradient norm, entropy,
    mean_token_accuracy and num_tokens, step by step (3 steps of every row: the weights move)."""
    import trl

    logs = []
    for cls in (trl.SFTTrainer, SFTTrainer):
        config = _full_batch_config(tmp_path / cls.__module__)
        if cls is SFTTrainer:
            _in_place(monkeypatch)  # in place, as under torchrun (after the config: accelerate's state is trl's)
        trainer = cls(model=str(tiny_llama), args=config, train_dataset=_texts())
        if cls is SFTTrainer:
            assert trainer.run_plan().rows.collator.reproduced  # the fast step: trl's collator reproduced, not called
        trainer.train()
        logs.append([{k: v for k, v in row.items() if k not in NOT_COMPARED} for row in trainer.state.log_history])
    trl_log, log = logs
    assert [row["step"] for row in log] == [row["step"] for row in trl_log] == [1, 2, 3, 3]
    assert log[0].keys() >= {"loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens"}
    for row, trl_row in zip(log, trl_log, strict=True):
        assert row.keys() == trl_row.keys()
        for key, value in trl_row.items():
            assert row[key] == pytest.approx(value, rel=2e-4, abs=1e-6), key


def test_a_subclass_compute_loss_runs_per_micro_batch(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A script's subclass overriding ``compute_loss`` gets its own code run (through trl's ``training_step`` on
    trl's collated micro-batches), not the loop's fast step."""
    calls: list[int] = []

    class Counting(SFTTrainer):
        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None):  # type: ignore[no-untyped-def]
            calls.append(int(inputs["input_ids"].shape[0]))
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    config = _full_batch_config(tmp_path / "out")
    _in_place(monkeypatch)
    config.num_train_epochs, config.per_device_train_batch_size, config.gradient_accumulation_steps = 1, 2, 2
    trainer = Counting(model=str(tiny_llama), args=config, train_dataset=_texts())
    out = trainer.train()
    assert out.global_step == 2
    assert calls == [2, 2, 2, 2]  # 2 steps of 2 micro-batches of 2 rows: trl's batches, the script's loss
    assert {"entropy", "mean_token_accuracy", "num_tokens"} <= set(trainer.state.log_history[0])  # trl's metrics


def _texts() -> Any:
    return datasets.Dataset.from_list(TEXTS)
