"""A model trained on its own loss through run_training on 2 real gloo ranks (sequence classification)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.run_inputs import run_training, split_run
from tests.unit.test_model_loss import BERT, _accuracy, _classification_rows, _save
from trainbridge import TorchrunArgs

pytestmark = pytest.mark.distributed


def test_sequence_classification_trains_on_two_ranks_through_run_training(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    model = _save(BertForSequenceClassification(BertConfig(**BERT, num_labels=2)), tmp_path / "model")
    args = split_run(
        model_path=model,
        data_path=_classification_rows(tmp_path / "train.jsonl", 64, 1),
        val_data_path=_classification_rows(tmp_path / "val.jsonl", 12, 2),
        ckpt_output_dir=tmp_path / "out",
        effective_batch_size=8,
        per_device_batch_size=2,
        learning_rate=5e-3,
        lr_scheduler="constant",
        num_epochs=2,
        logging_steps=4,
        eval_strategy="epoch",
        save_strategy="epoch",
        disable_tqdm=True,
        compute_metrics=_accuracy,
    )
    result = run_training(args, TorchrunArgs(nproc_per_node=2))
    assert result.global_step == 16  # 64 items / (2 per micro-batch x 2 micro-batches x 2 ranks), 2 epochs
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval_accuracy" in r]
    assert len(evals) == 2 and evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    config = json.loads((tmp_path / "out" / "checkpoint-16" / "config.json").read_text())
    assert config["architectures"] == ["BertForSequenceClassification"]
