"""A Trainer subclass's ``training_step`` (calling ``super()``) on 2 real gloo ranks through run_training gives
the same logged loss, gradient norm and eval loss, step by step, as the model's own loss without a subclass: the
override's backward (``accelerator.backward``, the world-size and accumulation scaling of Trainer) gives
Trainer's gradients under DDP."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import TrainingArguments

from tests.unit.test_model_loss import BERT, _classification_rows, _save
from trainbridge import TorchrunArgs, Trainer, TrainingArgs, run_training
from trainbridge.trainer.subclass import script_trainer

pytestmark = pytest.mark.distributed


class SuperSteps(Trainer):
    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)


def _train(model: Path, data: Path, out: Path, methods: Any) -> list[dict[str, float]]:
    args = TrainingArgs(
        model_path=model,
        data_path=data,
        val_data_path=data.with_name("val.jsonl"),
        eval_strategy="steps",
        eval_steps=3,
        ckpt_output_dir=out,
        training_step="model_loss",
        effective_batch_size=8,
        per_device_batch_size=2,
        learning_rate=5e-3,
        lr_scheduler="constant",
        max_steps=3,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        trainer_methods=methods,
    )
    run_training(args, TorchrunArgs(nproc_per_node=2))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "grad_norm" in r or "eval_loss" in r]


def test_a_training_step_override_gives_the_gradients_of_the_models_own_loss_on_two_ranks(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(**BERT, num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = _save(BertForSequenceClassification(config), tmp_path / "model")
    data = _classification_rows(tmp_path / "train.jsonl", 48, 1)
    _classification_rows(tmp_path / "val.jsonl", 10, 2)
    hf = TrainingArguments(
        output_dir=str(tmp_path / "hf"), report_to="none", use_cpu=True, gradient_accumulation_steps=2
    )
    trainer = SuperSteps(model=torch.nn.Linear(2, 2), args=hf)
    methods = script_trainer(trainer)
    assert methods is not None
    methods.take_attributes(trainer, check_transport=True)
    reference = _train(model, data, tmp_path / "plain", None)
    ours = _train(model, data, tmp_path / "subclass", methods)
    assert len(ours) == len(reference) == 4  # 3 training logs, one evaluation
    for key in ("loss", "grad_norm", "eval_loss"):  # eval_loss: Trainer's items over both ranks in evaluation too
        values = [r[key] for r in ours if key in r]
        assert values and values == pytest.approx([r[key] for r in reference if key in r], rel=1e-5), key
