"""The script's model object is what trains, as it is (in place, one rank): layers it froze stay frozen, a
module it replaced in memory trains as replaced; a plain ``nn.Module`` (no ``config``) is refused before any
step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from transformers import BertForSequenceClassification, DataCollatorWithPadding, TrainingArguments

from trainbridge import Trainer
from trainbridge.demos.tiny_model import build_tokenizer, tiny_bert_config
from trainbridge.modeling.load import set_requires_grad


def _classifier(tok: Any) -> BertForSequenceClassification:
    torch.manual_seed(0)
    config = tiny_bert_config(len(tok), pad_token_id=tok.pad_token_id)
    return BertForSequenceClassification(config)


def _trainer(tmp_path: Path, tok: Any, model: Any, monkeypatch: pytest.MonkeyPatch) -> Trainer:
    texts = [("x" if i % 2 else "y") + "abcdefg"[: 2 + i % 5] for i in range(16)]
    data = datasets.Dataset.from_dict({"sentence": texts, "label": [i % 2 for i in range(16)]})
    data = data.map(lambda b: tok(b["sentence"]), batched=True)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        report_to="none",
        use_cpu=True,
        per_device_train_batch_size=4,
        max_steps=3,
        save_strategy="no",
        learning_rate=5e-2,
        disable_tqdm=True,
    )
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):  # in place, one rank
        monkeypatch.setenv(name, value)
    return Trainer(model=model, args=args, train_dataset=data, data_collator=DataCollatorWithPadding(tok))


def test_layers_the_script_froze_stay_frozen_in_the_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = build_tokenizer(tmp_path / "tok")
    model = _classifier(tok)
    for parameter in model.bert.parameters():  # train the head only, as many classification scripts do
        parameter.requires_grad = False
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = _trainer(tmp_path, tok, model, monkeypatch)
    trainer.train()
    after = dict(trainer.model.named_parameters())
    changed = {name for name, value in before.items() if not torch.equal(value, after[name].detach())}
    assert changed == {"classifier.weight", "classifier.bias"}, sorted(changed)[:5]
    assert not any(p.requires_grad for p in trainer.model.bert.parameters())


def test_a_module_replaced_in_memory_trains_as_replaced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = build_tokenizer(tmp_path / "tok")
    model = _classifier(tok)
    model.classifier = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    head = model.classifier[0].weight.detach().clone()
    trainer = _trainer(tmp_path, tok, model, monkeypatch)
    trainer.train()
    assert trainer.model is model and not torch.equal(head, model.classifier[0].weight.detach())


def test_set_requires_grad_names_the_difference() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    set_requires_grad(model, {"0.weight": False, "0.bias": False, "1.weight": True, "1.bias": True})
    assert [p.requires_grad for p in model.parameters()] == [False, False, True, True]
    with pytest.raises(ValueError, match=r"missing \['2.weight'\], unexpected \['1.bias'\]"):
        set_requires_grad(model, {"0.weight": True, "0.bias": True, "1.weight": True, "2.weight": True})


def test_a_plain_module_is_refused_before_any_job_in_one_line(tmp_path: Path) -> None:
    from trainbridge.trainer.facade import UnsupportedTrainerFeatureError

    class Regressor(torch.nn.Module):  # Trainer trains it; trainbridge's checkpoints need a config
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(2, 2)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": (self.linear(x) - labels).pow(2).mean()}

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, use_cpu=True, report_to="none")
    with pytest.raises(UnsupportedTrainerFeatureError, match=r"model: a plain Regressor .*PreTrainedModel"):
        Trainer(model=Regressor(), args=args, train_dataset=[{"x": torch.zeros(2), "labels": torch.zeros(2)}]).train()
    with pytest.raises(UnsupportedTrainerFeatureError, match=r"model: a plain Regressor"):
        Trainer(
            model_init=Regressor, args=args, train_dataset=[{"x": torch.zeros(2), "labels": torch.zeros(2)}]
        ).train()
    assert not (tmp_path / ".trainbridge").exists()  # refused before anything was written
