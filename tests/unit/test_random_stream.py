"""Dropout and random per-access transforms on Trainer's sample batches draw torch's random stream as under
``transformers.Trainer`` (in place, one rank): each epoch's pass draws the ``DataLoader``'s base seed and
reads one micro-batch ahead of the step (accelerate's ``DataLoaderShard``), so a classifier with dropout, on
items masked at random when read, gives Trainer's loss at every step, over two epochs, with and without
gradient accumulation (``data.loader_workers``)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from transformers import BertConfig, BertForSequenceClassification, TrainingArguments

from trainbridge import Trainer


class RandomlyMasked(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Token rows whose tokens are masked at random (torch's stream) each time an item is read."""

    def __init__(self, count: int) -> None:
        rng = np.random.default_rng(0)
        self.ids = torch.tensor(rng.integers(5, 60, (count, 8)))
        self.labels = torch.tensor(rng.integers(0, 2, count))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        keep = torch.rand(self.ids.shape[1]) > 0.2
        return {"input_ids": torch.where(keep, self.ids[i], 4), "labels": self.labels[i]}


@pytest.mark.parametrize("accumulation", [1, 2])
def test_dropout_and_random_transforms_give_trainers_losses(
    accumulation: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        hidden_dropout_prob=0.3,
        attention_probs_dropout_prob=0.3,
        num_labels=2,
    )
    model = BertForSequenceClassification(config)
    losses: list[list[Any]] = []
    for cls in (transformers.Trainer, Trainer):
        args = TrainingArguments(
            output_dir=str(tmp_path / cls.__module__),
            per_device_train_batch_size=4,
            gradient_accumulation_steps=accumulation,
            num_train_epochs=2,
            learning_rate=1e-3,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
            seed=3,
        )
        if cls is Trainer:  # in place, as under a launcher (after the arguments)
            for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
                monkeypatch.setenv(name, value)
        trainer = cls(model=copy.deepcopy(model), args=args, train_dataset=RandomlyMasked(16))
        trainer.train()
        losses.append([e["loss"] for e in trainer.state.log_history if "loss" in e])
    assert len(losses[1]) == len(losses[0]) == 8 // accumulation
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
