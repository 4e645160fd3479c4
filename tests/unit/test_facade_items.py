"""The facade hands the workers the script's own items: a torch ``Dataset`` of tensors reaches the script's
collator as tensors (stanford_alpaca's ``train.py``), and a classifier trains on its own loss with every
column of its ``datasets.Dataset`` (in place, one rank)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pytest
import torch
import transformers
from transformers import TrainingArguments

from tests.run_inputs import RunInputs
from trainbridge import Trainer
from trainbridge.core.config.loss import InstanceStep, TokenLoss
from trainbridge.demos.tiny_model import arithmetic_problems, build_tiny_llama, build_tokenizer, tiny_bert_config


class SupervisedDataset(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """stanford_alpaca's dataset: ``input_ids`` / ``labels`` tensors, the prompt masked at -100."""

    def __init__(self, tokenizer: Any, count: int) -> None:
        self.input_ids, self.labels = [], []
        for prompt, answer in arithmetic_problems(count, seed=3):
            ids = torch.tensor(tokenizer(prompt + answer)["input_ids"])
            labels = ids.clone()
            labels[: len(tokenizer(prompt)["input_ids"])] = -100
            self.input_ids.append(ids)
            self.labels.append(labels)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids[i], "labels": self.labels[i]}


@dataclass
class DataCollatorForSupervisedDataset:
    """stanford_alpaca's collator: ``pad_sequence`` over the items' tensors."""

    tokenizer: Any
    seen: list[type] | None = None

    def __call__(self, instances: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        input_ids, labels = tuple([instance[key] for instance in instances] for key in ("input_ids", "labels"))
        if self.seen is not None:
            self.seen.extend(type(t) for t in input_ids)
        input_ids = torch.nn.utils.rnn.pad_sequence(
            input_ids, batch_first=True, padding_value=self.tokenizer.pad_token_id
        )
        labels = torch.nn.utils.rnn.pad_sequence(labels, batch_first=True, padding_value=-100)
        return {"input_ids": input_ids, "labels": labels, "attention_mask": input_ids.ne(self.tokenizer.pad_token_id)}


def _in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)


def test_alpaca_style_script_trains_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = build_tiny_llama(tmp_path / "model")
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": ["<extra>"]})
    model.resize_token_embeddings(len(tok))  # as alpaca's smart_tokenizer_and_embedding_resize
    seen: list[type] = []
    collator = DataCollatorForSupervisedDataset(tok, seen)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        report_to="none",
        use_cpu=True,
        per_device_train_batch_size=4,
        max_steps=3,
        logging_steps=1,
        save_strategy="no",
        learning_rate=1e-2,
        disable_tqdm=True,
    )
    _in_place(monkeypatch)
    trainer = Trainer(
        model=model, args=args, train_dataset=SupervisedDataset(tok, 16), processing_class=tok, data_collator=collator
    )
    out = trainer.train()
    assert out.global_step == 3 and out.training_loss > 0
    assert seen and set(seen) == {torch.Tensor}  # the collator got the items' tensors, not lists
    assert trainer.model.get_input_embeddings().weight.shape[0] == len(tok)


def test_classifier_trains_on_its_own_loss_with_its_columns(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import BertForSequenceClassification, DataCollatorWithPadding

    tok = build_tokenizer(tmp_path / "tok")
    torch.manual_seed(0)
    model = BertForSequenceClassification(tiny_bert_config(len(tok), pad_token_id=tok.pad_token_id))
    texts = [("x" if i % 2 else "y") + "abcdefg"[: 2 + i % 5] for i in range(32)]
    data = datasets.Dataset.from_dict({"sentence": texts, "label": [i % 2 for i in range(32)], "idx": list(range(32))})
    data = data.map(lambda b: tok(b["sentence"]), batched=True)

    def accuracy(p: Any) -> dict[str, float]:
        assert p.predictions.shape == (len(p.label_ids), 2)  # Trainer's EvalPrediction: one row of logits each
        return {"accuracy": float((np.argmax(p.predictions, axis=-1) == p.label_ids).mean())}

    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        report_to="none",
        use_cpu=True,
        per_device_train_batch_size=4,
        num_train_epochs=2,
        logging_steps=2,
        eval_strategy="epoch",
        save_strategy="no",
        learning_rate=5e-3,
        disable_tqdm=True,
    )
    _in_place(monkeypatch)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        eval_dataset=data.select(range(8)),
        processing_class=tok,
        data_collator=DataCollatorWithPadding(tok),
        compute_metrics=accuracy,
    )
    out = trainer.train()
    assert out.global_step == 16  # 32 items / 4 per step x 2 epochs
    evals = [e for e in trainer.state.log_history if "eval_accuracy" in e]
    assert len(evals) == 2 and "eval_loss" in evals[0]


def test_a_compute_loss_override_trains_on_sample_batches_of_its_items(tmp_path: Path) -> None:
    """No collator, a ``compute_loss`` override: the job still gets Trainer's batch shape and every column."""
    from trainbridge.trainer import job_args

    class WeightedTrainer(Trainer):
        def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kwargs: Any) -> Any:
            return super().compute_loss(model, inputs, return_outputs, **kwargs)

    path = build_tiny_llama(tmp_path / "model")
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        report_to="none",
        use_cpu=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=3,
    )
    plain, custom = Trainer(model=model, args=args), WeightedTrainer(model=model, args=args)
    assert not plain.run_plan().rows.items and custom.run_plan().rows.items
    custom.train_dataset = [{"input_ids": [1, 2, 3]}]
    ported = RunInputs(*job_args.training_job(custom, world_size=2, resume=None))
    assert (ported.per_device_batch_size, ported.effective_batch_size) == (2, 12)
    assert isinstance(ported.plan.loss, InstanceStep) and ported.training_step == "auto"  # the plan's seam
    plain.train_dataset = custom.train_dataset
    assert plain.run_plan().loss == TokenLoss()  # chosen from the class, once: Trainer's loss on token rows
