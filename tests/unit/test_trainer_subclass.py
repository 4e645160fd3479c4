"""A Trainer subclass's ``compute_loss`` and ``compute_loss_func`` run in the loop (``step.custom_loss``,
``trainer.subclass``), on the real model and batches, with the attributes a typical override reads."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from transformers import TrainingArguments

from tests.run_inputs import as_run, split_run
from trainbridge import Trainer
from trainbridge.callbacks import ScheduleCallback
from trainbridge.core.config.loss import InstanceStep
from trainbridge.core.distributed import DistributedEnv
from trainbridge.loop.build import build_run
from trainbridge.loop.loop import TrainingLoop
from trainbridge.step.trainer_methods import TrainerMethodsStep
from trainbridge.trainer.subclass import ScriptTrainer


@pytest.fixture(scope="module")
def bert_classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import BertForSequenceClassification

    from trainbridge.demos.tiny_model import build_tokenizer, tiny_bert_config

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("cls")
    BertForSequenceClassification(tiny_bert_config()).save_pretrained(folder)
    build_tokenizer(folder)
    return folder


def _classification_rows(path: Path, count: int, seed: int) -> Path:
    """Text starting with 'x' is label 1, with 'y' label 0."""
    rng = random.Random(seed)
    with path.open("w") as handle:
        for _ in range(count):
            label = rng.randrange(2)
            text = ("x" if label else "y") + "".join(rng.choice("abcdefgh") for _ in range(rng.randrange(3, 12)))
            handle.write(json.dumps({"text": text, "label": label}) + "\n")
    return path


class CountingTrainer(Trainer):
    calls: ClassVar[list[dict[str, Any]]] = []

    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        type(self).calls.append(
            {
                "keys": sorted(inputs),
                "items": None if num_items_in_batch is None else int(num_items_in_batch),
                "args": type(self.args).__name__,
                "model": type(self.model).__name__,
                "main": self.accelerator.is_main_process,
                "gathered": tuple(self.accelerator.gather(torch.tensor(1.0)).shape),
                "unwrapped": self.accelerator.unwrap_model(model) is self.model,
                "return_outputs": return_outputs,
            }
        )
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)


def _methods(cls: type, tmp_path: Path, path: Path, **kwargs: Any) -> tuple[ScriptTrainer, Any]:
    """The methods of a ``cls`` Trainer on the model of ``path`` as ``train()`` hands them to the loop, and
    that model (the loop trains the instance's own model object)."""
    from transformers import AutoModelForSequenceClassification

    hf = TrainingArguments(output_dir=str(tmp_path / "hf"), report_to="none", use_cpu=True)
    model = AutoModelForSequenceClassification.from_pretrained(path)
    trainer = cls(model=model, args=hf, **kwargs)
    return trainer._script, model


def _run(
    path: Path, tmp_path: Path, methods: tuple[Any, Any], callbacks: list[Any] | None = None, **fields: Any
) -> tuple[Any, Any]:
    worker, model = methods
    args = split_run(
        model_init=lambda: model,
        tokenizer_path=path,
        data_path=_classification_rows(tmp_path / "train.jsonl", 32, 1),
        val_data_path=_classification_rows(tmp_path / "val.jsonl", 8, 2),
        ckpt_output_dir=tmp_path / "out",
        effective_batch_size=8,
        per_device_batch_size=4,
        learning_rate=5e-3,
        lr_scheduler="constant",
        max_steps=2,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="no",
        disable_tqdm=True,
        loss=InstanceStep(worker) if worker is not None else None,
        **fields,
    )
    components = build_run(*as_run(args), DistributedEnv())
    return components, TrainingLoop(
        as_run(args).args, DistributedEnv(), [ScheduleCallback(), *(callbacks or [])], components
    ).run()


def test_a_compute_loss_override_runs_on_every_micro_batch_with_the_model_and_batch(bert_classifier, tmp_path):
    CountingTrainer.calls.clear()
    components, result = _run(bert_classifier, tmp_path, _methods(CountingTrainer, tmp_path, bert_classifier))
    assert isinstance(components.step, TrainerMethodsStep) and result.global_step == 2
    training = [c for c in CountingTrainer.calls if not c["return_outputs"]]
    assert len(training) == 4  # 2 steps x 2 micro-batches, each through the override
    first = training[0]
    assert first["keys"] == ["attention_mask", "input_ids", "labels"]
    assert first["args"] == "TrainingArguments" and first["model"] == "BertForSequenceClassification"
    assert first["main"] and first["gathered"] == () and first["unwrapped"]  # accelerate's own, one process
    assert first["items"] == 8  # Bert takes **kwargs: the step's labels over both micro-batches, as Trainer
    assert any(c["return_outputs"] for c in CountingTrainer.calls)  # evaluation through the override too


def test_compute_loss_func_gets_outputs_labels_and_the_step_items(bert_classifier, tmp_path):
    seen: list[tuple[str, int]] = []

    def loss_func(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
        if torch.is_grad_enabled():  # training (evaluation counts the items too, as Trainer 5's prediction_step)
            seen.append((type(outputs).__name__, int(num_items_in_batch)))
        return torch.nn.functional.cross_entropy(outputs.logits, labels, reduction="sum") / num_items_in_batch

    _, result = _run(
        bert_classifier, tmp_path, _methods(Trainer, tmp_path, bert_classifier, compute_loss_func=loss_func)
    )
    assert result.global_step == 2
    assert len(seen) == 4 and seen[0] == ("SequenceClassifierOutput", 8)


def test_the_facade_hands_a_subclass_or_loss_func_to_its_jobs(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    hf = TrainingArguments(output_dir=str(tmp_path / "hf"), report_to="none", use_cpu=True)
    assert not isinstance(Trainer(model=model, args=hf).run_plan().loss, InstanceStep)
    loss = CountingTrainer(model=model, args=hf).run_plan().loss
    assert isinstance(loss, InstanceStep) and isinstance(loss.methods, ScriptTrainer)
    assert type(loss.methods.instance) is CountingTrainer and not loss.methods.counts_items
    loss = Trainer(model=model, args=hf, compute_loss_func=len).run_plan().loss
    assert isinstance(loss, InstanceStep) and loss.methods.counts_items
