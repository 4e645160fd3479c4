"""``build_training_arguments``: a real TrainingArguments describing the run, initialising nothing."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState, PartialState
from transformers import TrainingArguments
from transformers.trainer_utils import IntervalStrategy, SaveStrategy
from transformers.training_args import ParallelMode

from tests.run_inputs import split_run
from trainbridge.core.config import TrainingArgs
from trainbridge.core.distributed import DistributedEnv
from trainbridge.hf import build_training_arguments


@pytest.fixture
def files(run_files: dict[str, Path]) -> dict[str, Path]:
    return {"model": run_files["model"], "data": run_files["train"], "out": run_files["out"]}


def make_args(files: dict[str, Path], **overrides: Any) -> TrainingArgs:
    values: dict[str, Any] = dict(model_path=files["model"], data_path=files["data"], ckpt_output_dir=files["out"])
    values.update(overrides)
    return split_run(**values)


def test_fields_describe_the_run(files):
    args = make_args(
        files,
        num_epochs=3,
        max_steps=40,
        learning_rate=1e-4,
        effective_batch_size=16,
        logging_steps=5,
        logging_first_step=True,
        val_data_path=files["data"],
        eval_strategy="steps",
        eval_steps=10,
        eval_delay=5,
        eval_on_start=True,
        save_strategy="steps",
        save_steps=20,
        save_total_limit=2,
        metric_for_best_model="eval_loss",
        load_best_model_at_end=True,
        seed=3,
        report_to=["tensorboard"],
        run_name="exp",
        disable_tqdm=True,
        warmup_steps=4,
        weight_decay=0.1,
        adam_beta1=0.8,
        adam_beta2=0.9,
        adam_epsilon=1e-6,
        max_grad_norm=0.5,
        lr_scheduler="cosine",
        mixed_precision="bf16",
        device="cpu",
    )
    hf = build_training_arguments(args, DistributedEnv(world_size=1))
    assert isinstance(hf, TrainingArguments)
    assert hf.output_dir == str(files["out"])
    assert (hf.num_train_epochs, hf.max_steps, hf.learning_rate) == (3, 40, 1e-4)
    assert (hf.per_device_train_batch_size, hf.gradient_accumulation_steps) == (16, 1)
    assert hf.logging_strategy == IntervalStrategy.STEPS and hf.logging_steps == 5 and hf.logging_first_step
    assert hf.eval_strategy == IntervalStrategy.STEPS and (hf.eval_steps, hf.eval_delay) == (10, 5)
    assert hf.eval_on_start
    assert hf.save_strategy == SaveStrategy.STEPS and (hf.save_steps, hf.save_total_limit) == (20, 2)
    assert hf.metric_for_best_model == "eval_loss" and hf.greater_is_better is False
    assert hf.load_best_model_at_end and hf.seed == 3
    assert hf.report_to == ["tensorboard"] and hf.run_name == "exp" and hf.disable_tqdm
    assert (hf.warmup_steps, hf.weight_decay, hf.adam_beta1, hf.adam_beta2, hf.adam_epsilon) == (4, 0.1, 0.8, 0.9, 1e-6)
    assert hf.max_grad_norm == 0.5 and hf.lr_scheduler_type.value == "cosine"
    assert hf.bf16 and hf.use_cpu
    assert hf.restore_callback_states_from_checkpoint  # trainbridge restores callback state by default
    as_dict = json.loads(hf.to_json_string())
    assert as_dict["eval_steps"] == 10 and as_dict["report_to"] == ["tensorboard"]
    assert hf.to_dict()["save_strategy"] == "steps"
    assert hf.to_sanitized_dict()["train_batch_size"] == 16


def test_defaults_and_derived_values(files):
    args = make_args(files, effective_batch_size=5, max_grad_norm=None, save_samples=24)
    hf = build_training_arguments(args, DistributedEnv(world_size=2, rank=1, local_rank=1, local_world_size=2))
    assert hf.max_steps == -1 and hf.report_to == []
    assert hf.per_device_train_batch_size == 2  # 5 samples per step over 2 ranks
    assert hf.max_grad_norm == 0.0  # clipping off
    assert hf.save_steps == 5  # ceil(24 samples / 5 per step)
    no_step_saves = build_training_arguments(make_args(files), DistributedEnv())
    assert no_step_saves.save_strategy == SaveStrategy.STEPS and no_step_saves.save_steps == 0


def test_device_properties_report_our_env_and_initialise_nothing(files):
    partial_before = dict(PartialState._shared_state)
    accelerator_before = dict(AcceleratorState._shared_state)
    environ_before = dict(os.environ)
    env = DistributedEnv(
        rank=3, local_rank=1, world_size=4, local_world_size=2, device=torch.device("cpu"), backend="gloo"
    )
    hf = build_training_arguments(make_args(files), env)
    assert (hf.world_size, hf.process_index, hf.local_process_index) == (4, 3, 1)
    assert hf.device == torch.device("cpu") and hf.n_gpu == 0
    assert hf.parallel_mode == ParallelMode.DISTRIBUTED
    assert not hf.should_save and not hf.should_log  # rank 3 / local rank 1
    assert hf.train_batch_size == hf.per_device_train_batch_size == 2  # 8 samples over 4 ranks
    assert hf.distributed_state.is_main_process is False and hf.distributed_state.num_processes == 4
    assert dict(PartialState._shared_state) == partial_before
    assert dict(AcceleratorState._shared_state) == accelerator_before
    assert dict(os.environ) == environ_before
    assert not dist.is_initialized()
    clone = copy.deepcopy(hf)
    assert (clone.world_size, clone.process_index, clone.device) == (4, 3, torch.device("cpu"))


def test_single_rank_is_not_parallel(files):
    hf = build_training_arguments(make_args(files), DistributedEnv())
    assert hf.parallel_mode == ParallelMode.NOT_PARALLEL
    assert (hf.world_size, hf.process_index) == (1, 0) and hf.should_save and hf.should_log


def test_users_batch_fields_are_kept_when_they_describe_the_run(files, tmp_path):
    """A ported script's per_device_train_batch_size / gradient_accumulation_steps stay as Trainer
    records them when their product with the world size is the run's effective batch."""
    user = TrainingArguments(
        output_dir=str(tmp_path / "u"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=4,
        use_cpu=True,
        report_to="none",
    )
    env = DistributedEnv(world_size=2, rank=0, local_rank=0, local_world_size=2)
    same = build_training_arguments(make_args(files, effective_batch_size=16), env, user)
    assert (same.per_device_train_batch_size, same.gradient_accumulation_steps) == (2, 4)
    assert same.train_batch_size == 2
    other = build_training_arguments(make_args(files, effective_batch_size=12), env, user)
    assert (other.per_device_train_batch_size, other.gradient_accumulation_steps) == (6, 1)
