"""A Trainer subclass's ``_save`` / ``save_model`` / ``_save_checkpoint`` (``trainer.save_overrides``): run by
the checkpoint manager for the model part of each checkpoint, inside its temporary folder before
publication; resume exact whatever the override wrote; a failing override leaves the previous checkpoint
whole."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, TrainingArguments

from tests.unit.test_checkpoint import assert_same_weights, new_engine, save_tiny_llama, train_step, weights
from trainbridge import Trainer
from trainbridge.checkpoint.folders import CheckpointError
from trainbridge.checkpoint.manager import CheckpointManager
from trainbridge.checkpoint.manifest import read_manifest
from trainbridge.core.config import TrainingArgs
from trainbridge.core.distributed import DistributedEnv
from trainbridge.trainer.facade import UnsupportedTrainerFeatureError
from trainbridge.trainer.save_overrides import subclass_save


@pytest.fixture()
def ckpt_args(tmp_path: Path) -> TrainingArgs:
    data = tmp_path / "data.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    return TrainingArgs(
        model_path=save_tiny_llama(tmp_path / "model"),
        data_path=data,
        ckpt_output_dir=tmp_path / "out",
        learning_rate=1e-2,
        lr_scheduler="linear",
        device="cpu",
    )


class ValueHeadTrainer(Trainer):
    """Saves the model as Trainer does, then a file of its own beside it."""

    def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
        super()._save(output_dir, state_dict)
        names = sorted(state_dict) if state_dict is not None else []
        Path(output_dir, "value_head.json").write_text(json.dumps({"dir": Path(output_dir).name, "keys": len(names)}))


class HeadOnlyTrainer(Trainer):
    """Writes only the output head's weights and the config: no model.safetensors."""

    def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
        assert state_dict is not None
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        torch.save({k: v for k, v in state_dict.items() if k.startswith("lm_head")}, Path(output_dir, "head.bin"))
        self.model.config.save_pretrained(output_dir)


class FailingTrainer(Trainer):
    fail = False

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)
        if type(self).fail:
            raise OSError("the override failed")


def _model_files(cls: type, args: TrainingArgs, tmp_path: Path) -> Any:
    model = AutoModelForCausalLM.from_pretrained(args.model_path)
    hf = TrainingArguments(output_dir=str(tmp_path / "hf"), report_to="none", use_cpu=True)
    files = subclass_save(cls(model=model, args=hf))
    assert files is not None
    return files  # in place: the instance's own methods write


def test_the_override_writes_into_each_checkpoint_before_it_is_published(
    ckpt_args: TrainingArgs, tmp_path: Path
) -> None:
    args = ckpt_args
    engine = new_engine(args)
    train_step(engine, seed=1)
    files = _model_files(ValueHeadTrainer, args, tmp_path)
    manager = CheckpointManager(args.ckpt_output_dir, DistributedEnv(), save_total_limit=None, model_files=files)
    path = manager.save(engine, None, 1, {"global_step": 1}, {})

    extra = json.loads((path / "value_head.json").read_text())
    assert extra == {"dir": ".tmp-checkpoint-1", "keys": len(engine.unwrapped.state_dict())}  # inside the temp folder
    listed = set((read_manifest(path) or {})["files"])
    assert {"value_head.json", "model.safetensors", "config.json", "training_args.bin"} <= listed
    assert_same_weights(AutoModelForCausalLM.from_pretrained(path).state_dict(), weights(engine))  # super()._save
    assert (path / "dcp").is_dir()  # the model's own weights kept for resume
    assert [p.name for p in args.ckpt_output_dir.iterdir()] == ["checkpoint-1"]


def test_resume_is_exact_when_the_override_writes_only_some_weights(ckpt_args: TrainingArgs, tmp_path: Path) -> None:
    args = ckpt_args
    engine = new_engine(args)
    train_step(engine, seed=1)
    files = _model_files(HeadOnlyTrainer, args, tmp_path)
    manager = CheckpointManager(args.ckpt_output_dir, DistributedEnv(), save_total_limit=None, model_files=files)
    path = manager.save(engine, None, 1, {"global_step": 1}, {})
    assert not (path / "model.safetensors").exists() and (path / "head.bin").is_file()
    train_step(engine, seed=2)
    uninterrupted = weights(engine)

    resumed = new_engine(args)
    assert manager.load(path, resumed) == {"global_step": 1}
    train_step(resumed, seed=2)
    assert_same_weights(weights(resumed), uninterrupted)


def test_a_failing_override_leaves_the_previous_checkpoint_whole(ckpt_args: TrainingArgs, tmp_path: Path) -> None:
    args = ckpt_args
    engine = new_engine(args)
    train_step(engine, seed=1)
    files = _model_files(FailingTrainer, args, tmp_path)
    manager = CheckpointManager(args.ckpt_output_dir, DistributedEnv(), save_total_limit=None, model_files=files)
    first = manager.save(engine, None, 1, {"global_step": 1}, {})
    FailingTrainer.fail = True
    try:
        with pytest.raises(CheckpointError, match="the override failed"):
            manager.save(engine, None, 2, {"global_step": 2}, {})
    finally:
        FailingTrainer.fail = False
    assert manager.list_checkpoints() == [first]
    assert [p.name for p in args.ckpt_output_dir.iterdir()] == ["checkpoint-1"]  # the temp folder removed


def test_the_scripts_final_save_model_calls_its_save_override(ckpt_args: TrainingArgs, tmp_path: Path) -> None:
    args = ckpt_args
    model = AutoModelForCausalLM.from_pretrained(args.model_path)
    hf = TrainingArguments(output_dir=str(tmp_path / "hf"), report_to="none", use_cpu=True)
    ValueHeadTrainer(model=model, args=hf).save_model(str(tmp_path / "final"))
    assert json.loads((tmp_path / "final" / "value_head.json").read_text())["dir"] == "final"
    assert (tmp_path / "final" / "training_args.bin").is_file()
    assert_same_weights(AutoModelForCausalLM.from_pretrained(tmp_path / "final").state_dict(), model.state_dict())


class ProjectorTrainer(Trainer):
    """As LLaVA's: only the projector's weights when tuning it, else Trainer's checkpoint plus a file."""

    projector_only = False

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        folder = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
        if type(self).projector_only:
            os.makedirs(folder, exist_ok=True)
            head = {k: v for k, v in self.model.state_dict().items() if k.startswith("lm_head")}
            torch.save(head, os.path.join(folder, "mm_projector.bin"))
            return
        super()._save_checkpoint(model, trial)
        Path(self.args.output_dir, f"checkpoint-{self.state.global_step}", "extra.txt").write_text(folder)


def test_a_save_checkpoint_override_writes_into_the_checkpoint_being_written(
    ckpt_args: TrainingArgs, tmp_path: Path
) -> None:
    args = ckpt_args
    engine = new_engine(args)
    train_step(engine, seed=1)
    files = _model_files(ProjectorTrainer, args, tmp_path)
    manager = CheckpointManager(args.ckpt_output_dir, DistributedEnv(), save_total_limit=None, model_files=files)
    path = manager.save(engine, None, 3, {"global_step": 3}, {})
    assert (path / "extra.txt").read_text().endswith("checkpoint-3")
    assert {"extra.txt", "model.safetensors", "training_args.bin", "optimizer.pt"} <= set(
        (read_manifest(path) or {})["files"]
    )
    assert_same_weights(AutoModelForCausalLM.from_pretrained(path).state_dict(), weights(engine))
    assert sorted(p.name for p in args.ckpt_output_dir.iterdir()) == ["checkpoint-3"]  # nothing beside it
    assert not [p for p in path.rglob("*") if p.is_symlink()]

    ProjectorTrainer.projector_only = True
    try:
        path = manager.save(engine, None, 4, {"global_step": 4}, {})
    finally:
        ProjectorTrainer.projector_only = False
    assert (path / "mm_projector.bin").is_file() and not (path / "model.safetensors").exists()
    train_step(engine, seed=2)
    uninterrupted = weights(engine)
    resumed = new_engine(args)
    assert manager.load(path, resumed) == {"global_step": 4}
    train_step(resumed, seed=2)
    assert_same_weights(weights(resumed), uninterrupted)
    model = AutoModelForCausalLM.from_pretrained(args.model_path)
    hf = TrainingArguments(output_dir=str(tmp_path / "hf"), report_to="none", use_cpu=True)
    assert subclass_save(Trainer(model=model, args=hf)) is None  # no override: the checkpoint's own files
    with pytest.raises(UnsupportedTrainerFeatureError, match="runs inside train"):
        ProjectorTrainer(model=model, args=hf)._save_checkpoint(model, None)
