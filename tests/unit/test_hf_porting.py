"""``training_args_from_hf``: carry over what has a meaning, warn once per ignored non-default field."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
from accelerate.state import AcceleratorState
from transformers import TrainingArguments

from trainbridge.core.config import RunPlan, check_consistent
from trainbridge.hf import HFPortingWarning, training_args_from_hf


@pytest.fixture
def required(run_files: dict[str, Path]) -> dict[str, Any]:
    return {"model_path": run_files["model"], "data_path": run_files["train"], "val_data_path": run_files["train"]}


@pytest.fixture
def hf_args(tmp_path: Path):
    """Build TrainingArguments (which sets up accelerate's state) and reset that state afterwards."""

    def build(**kwargs: Any) -> TrainingArguments:
        kwargs.setdefault("output_dir", str(tmp_path / "out"))
        return TrainingArguments(use_cpu=True, **kwargs)

    yield build
    AcceleratorState._reset_state(reset_partial_state=True)


def porting_warnings(hf: TrainingArguments, **required: Any) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        args = training_args_from_hf(hf, **required)
    return args, [str(w.message) for w in caught if issubclass(w.category, HFPortingWarning)]


def test_schedules_and_settings_are_carried_over(hf_args, required, tmp_path):
    hf = hf_args(
        num_train_epochs=2,
        max_steps=50,
        learning_rate=1e-4,
        lr_scheduler_type="cosine",
        warmup_steps=5,
        weight_decay=0.01,
        adam_beta1=0.8,
        adam_beta2=0.9,
        adam_epsilon=1e-7,
        max_grad_norm=0.3,
        seed=11,
        logging_strategy="steps",
        logging_steps=7,
        logging_first_step=True,
        eval_strategy="steps",
        eval_steps=10,
        eval_delay=3,
        eval_on_start=True,
        save_strategy="steps",
        save_steps=20,
        save_total_limit=3,
        metric_for_best_model="accuracy",
        load_best_model_at_end=True,
        report_to=["tensorboard"],
        run_name="port",
        disable_tqdm=True,
        ddp_timeout=99,
    )
    args, messages = porting_warnings(hf, **required)
    assert messages == []
    assert args.ckpt_output_dir == tmp_path / "out"
    assert (args.num_epochs, args.max_steps, args.learning_rate, args.lr_scheduler) == (2, 50, 1e-4, "cosine")
    assert (args.warmup_steps, args.weight_decay, args.adam_beta1, args.adam_beta2) == (5, 0.01, 0.8, 0.9)
    assert args.adam_epsilon == 1e-7 and args.max_grad_norm == 0.3 and args.seed == 11
    assert (args.logging_strategy, args.logging_steps, args.logging_first_step) == ("steps", 7, True)
    assert (args.eval_strategy, args.eval_steps, args.eval_delay, args.eval_on_start) == ("steps", 10, 3.0, True)
    assert (args.save_strategy, args.save_steps, args.save_total_limit) == ("steps", 20, 3)
    assert args.metric_for_best_model == "accuracy" and args.greater_is_better is True
    assert args.load_best_model_at_end
    assert args.report_to == ["tensorboard"] and args.run_name == "port" and args.disable_tqdm
    assert args.collective_timeout_s == 99 and args.device == "cpu"


def test_default_training_arguments_port_without_warnings(hf_args, required):
    args, messages = porting_warnings(hf_args(), **required)
    assert messages == []
    assert args.num_epochs == 3 and args.max_steps is None and args.logging_steps == 500
    assert args.report_to == [] and args.max_grad_norm == 1.0 and args.mixed_precision == "no"


def test_each_ignored_non_default_field_warns_once_and_says_why(hf_args, required):
    hf = hf_args(
        per_device_train_batch_size=4,
        gradient_accumulation_steps=8,
        label_smoothing_factor=0.1,
        neftune_noise_alpha=5.0,
        save_on_each_node=True,
    )
    _, messages = porting_warnings(hf, **required)
    fields = sorted(m.split("=")[0].removeprefix("TrainingArguments.") for m in messages)
    assert fields == [
        "gradient_accumulation_steps",
        "label_smoothing_factor",
        "neftune_noise_alpha",
        "per_device_train_batch_size",
        "save_on_each_node",
    ]
    batch = next(m for m in messages if m.startswith("TrainingArguments.per_device_train_batch_size=4"))
    assert "effective_batch_size" in batch and "max_batch_len" in batch
    assert any("no equivalent" in m for m in messages if "neftune" in m)


def test_required_values_win_and_ratios_become_steps(hf_args, required, tmp_path):
    hf = hf_args(max_steps=200, logging_steps=0.05, eval_strategy="steps", eval_steps=0.25, save_steps=0.5, bf16=True)
    args = training_args_from_hf(
        hf, **required, ckpt_output_dir=tmp_path / "elsewhere", logging_steps=3, effective_batch_size=32
    )
    assert args.ckpt_output_dir == tmp_path / "elsewhere" and args.logging_steps == 3
    assert args.effective_batch_size == 32
    assert (args.eval_steps, args.save_steps) == (50, 100)
    assert args.mixed_precision == "bf16"


def test_optim_names_args_and_schedules_are_carried_over(hf_args, required):
    args = training_args_from_hf(
        hf_args(optim="sgd", optim_args="momentum=0.9, nesterov=True", lr_scheduler_type="polynomial"), **required
    )
    assert (args.optim, args.optim_args, args.lr_scheduler) == (
        "sgd",
        {"momentum": 0.9, "nesterov": True},
        "polynomial",
    )


def test_every_optimizer_and_schedule_is_ported(hf_args, required):
    # refused before issue 41 ("trainbridge supports constant, ..." / "adamw_torch, ...")
    args = training_args_from_hf(hf_args(lr_scheduler_type="greedy", eval_strategy="steps", eval_steps=5), **required)
    assert args.lr_scheduler == "greedy"
    args = training_args_from_hf(hf_args(optim="rmsprop", optim_target_modules=["q_proj"]), **required)
    assert (args.optim, args.optim_target_modules) == ("rmsprop", ["q_proj"])


def test_what_cannot_be_ported_fails_naming_the_field(hf_args, required):
    with pytest.raises(ValueError, match=r"logging_steps=0\.1 is a ratio of max_steps"):
        training_args_from_hf(hf_args(logging_steps=0.1), **required)
    with pytest.raises(ValueError, match="model_path"):  # at the run boundary, with the run's code
        check_consistent(training_args_from_hf(hf_args(), data_path=required["data_path"]), RunPlan())
