"""``optimizers=`` and ``optimizer_cls_and_kwargs=`` (``trainer.optimizers``): the script's optimizer class,
hyperparameters per group and scheduler are the ones the loop steps with, rebuilt on the worker's model."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
import torch
from transformers import BertForSequenceClassification, TrainingArguments

from tests.run_inputs import as_run, split_run
from trainbridge import Trainer
from trainbridge.callbacks import ScheduleCallback
from trainbridge.core.distributed import DistributedEnv
from trainbridge.loop.build import build_run
from trainbridge.loop.loop import TrainingLoop
from trainbridge.trainer.optimizers import optimizer_factory


@pytest.fixture(scope="module")
def bert_classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:

    from trainbridge.demos.tiny_model import build_tokenizer, tiny_bert_config

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("cls")
    config = tiny_bert_config()
    BertForSequenceClassification(config).save_pretrained(folder)
    build_tokenizer(folder)
    return folder


def _rows(path: Path, count: int) -> Path:
    rng = random.Random(1)
    with path.open("w") as handle:
        for _ in range(count):
            label = rng.randrange(2)
            text = ("x" if label else "y") + "".join(rng.choice("abcdefgh") for _ in range(rng.randrange(3, 12)))
            handle.write(json.dumps({"text": text, "label": label}) + "\n")
    return path


def _run(path: Path, tmp_path: Path, factory: Any, model: Any = None) -> tuple[Any, dict[str, torch.Tensor]]:
    """A run with ``factory``; ``model``: the Trainer's own model object, trained in place (``train()``)."""
    if model is None:
        factory = cloudpickle.loads(cloudpickle.dumps(factory))  # rebuilt in another process
    args = split_run(
        model_path=path,
        model_init=(lambda: model) if model is not None else None,
        data_path=_rows(tmp_path / "train.jsonl", 32),
        ckpt_output_dir=tmp_path / "out",
        effective_batch_size=8,
        per_device_batch_size=8,
        learning_rate=5e-3,
        lr_scheduler="constant",
        max_steps=2,
        save_strategy="no",
        disable_tqdm=True,
        optimizer_factory=factory,
    )
    components = build_run(*as_run(args), DistributedEnv())
    before = {n: p.detach().clone() for n, p in components.engine.module.named_parameters()}
    TrainingLoop(as_run(args).args, DistributedEnv(), [ScheduleCallback()], components).run()
    return components, before


def test_optimizer_cls_and_kwargs_builds_the_class_over_the_weight_decay_groups(
    bert_classifier: Path, tmp_path: Path
) -> None:
    model = BertForSequenceClassification.from_pretrained(bert_classifier)
    hf = TrainingArguments(output_dir=str(tmp_path / "hf"), report_to="none", use_cpu=True, weight_decay=0.1)
    trainer = Trainer(model=model, args=hf, optimizer_cls_and_kwargs=(torch.optim.SGD, {"lr": 0.3, "momentum": 0.8}))
    components, before = _run(bert_classifier, tmp_path, trainer._optimizer_factory)
    used = components.engine.optimizer
    assert type(used) is torch.optim.SGD
    assert [g["momentum"] for g in used.param_groups] == [0.8, 0.8]
    assert sorted(g["weight_decay"] for g in used.param_groups) == [0.0, 0.0]  # TrainingArgs' weight_decay: 0
    assert [g["lr"] for g in used.param_groups] == [0.3, 0.3]
    after = dict(components.engine.module.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before)


def test_an_optimizer_over_other_parameters_fails_at_construction(bert_classifier: Path, tmp_path: Path) -> None:
    model = BertForSequenceClassification.from_pretrained(bert_classifier)
    hf = TrainingArguments(output_dir=str(tmp_path / "hf"), report_to="none", use_cpu=True)
    stranger = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"not parameters of the Trainer's model"):
        Trainer(model=model, args=hf, optimizers=(stranger, None))


def test_deepspeed_refuses_the_scripts_optimizer(bert_classifier: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"DeepSpeed builds and steps its own optimizer"):
        split_run(
            model_path=bert_classifier,
            data_path=_rows(tmp_path / "x.jsonl", 4),
            ckpt_output_dir=tmp_path / "out",
            distributed_backend="deepspeed",
            optimizer_factory=object(),
        )


class ClassifierOnlyTrainer(Trainer):
    def create_optimizer(self) -> Any:
        self.optimizer = torch.optim.SGD(self.model.classifier.parameters(), lr=0.1, momentum=0.5)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
        return self.lr_scheduler


class TweakedDefaultTrainer(Trainer):
    def create_optimizer(self) -> Any:
        optimizer = super().create_optimizer()
        for group in optimizer.param_groups:
            group["lr"] = 0.123
        return optimizer


def test_a_subclass_create_optimizer_and_scheduler_run_on_the_worker_model(bert_classifier: Path, tmp_path: Path):
    model = BertForSequenceClassification.from_pretrained(bert_classifier)
    hf = TrainingArguments(output_dir=str(tmp_path / "hf"), report_to="none", use_cpu=True)
    trainer = ClassifierOnlyTrainer(model=model, args=hf)
    components, before = _run(bert_classifier, tmp_path, trainer._optimizer_factory, model)
    used, module = components.engine.optimizer, components.engine.module
    assert type(used) is torch.optim.SGD and used.param_groups[0]["momentum"] == 0.5
    assert {id(p) for p in used.param_groups[0]["params"]} == {id(p) for p in module.classifier.parameters()}
    assert type(components.engine.lr_scheduler) is torch.optim.lr_scheduler.LambdaLR
    assert used.param_groups[0]["lr"] == pytest.approx(0.1 / 3)
    after = dict(module.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert changed == {"classifier.weight", "classifier.bias"}


def test_super_create_optimizer_builds_the_default(bert_classifier: Path, tmp_path: Path) -> None:
    model = BertForSequenceClassification.from_pretrained(bert_classifier)
    hf = TrainingArguments(output_dir=str(tmp_path / "hf"), report_to="none", use_cpu=True)
    trainer = TweakedDefaultTrainer(model=model, args=hf)
    components, _ = _run(bert_classifier, tmp_path, trainer._optimizer_factory, model)
    used = components.engine.optimizer
    assert type(used) is torch.optim.AdamW and [g["initial_lr"] for g in used.param_groups] == [0.123, 0.123]
    assert used is trainer.optimizer  # Trainer's own create_optimizer, on the instance


class BothTrainer(Trainer):
    steps_seen: list[int] = []

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        type(self).steps_seen.append(num_training_steps)
        self.optimizer = torch.optim.SGD(self.model.classifier.parameters(), lr=0.4)
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: 1 - s / num_training_steps)


class BothSuperTrainer(Trainer):
    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        super().create_optimizer_and_scheduler(num_training_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = 0.321


def test_a_subclass_create_optimizer_and_scheduler_runs_with_the_runs_steps(bert_classifier: Path, tmp_path: Path):
    model = BertForSequenceClassification.from_pretrained(bert_classifier)
    hf = TrainingArguments(output_dir=str(tmp_path / "hf"), report_to="none", use_cpu=True)
    BothTrainer.steps_seen.clear()
    components, _ = _run(bert_classifier, tmp_path, BothTrainer(model=model, args=hf)._optimizer_factory, model)
    assert BothTrainer.steps_seen == [2]
    used, module = components.engine.optimizer, components.engine.module
    assert type(used) is torch.optim.SGD
    assert {id(p) for p in used.param_groups[0]["params"]} == {id(p) for p in module.classifier.parameters()}
    assert type(components.engine.lr_scheduler) is torch.optim.lr_scheduler.LambdaLR
    assert used.param_groups[0]["lr"] == pytest.approx(0.0)  # 1 - 2/2 after the run's 2 steps

    (tmp_path / "super").mkdir()
    model = BertForSequenceClassification.from_pretrained(bert_classifier)
    factory = BothSuperTrainer(model=model, args=hf)._optimizer_factory
    components, _ = _run(bert_classifier, tmp_path / "super", factory, model)
    used = components.engine.optimizer
    # Trainer's own create_optimizer_and_scheduler built the schedule before the override set lr: as under
    # Trainer, the schedule's initial_lr is the arguments' learning_rate
    assert type(used) is torch.optim.AdamW and [g["initial_lr"] for g in used.param_groups] == [5e-5, 5e-5]
    assert components.engine.lr_scheduler is not None  # lr_scheduler_type's, built over the chosen optimizer


def _in_place(bert_classifier: Path, tmp_path: Path, momentum: float = 0.9) -> tuple[Any, Any, Any, Any]:

    model = BertForSequenceClassification.from_pretrained(bert_classifier)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)
    hf = TrainingArguments(output_dir=str(tmp_path / "hf"), report_to="none", use_cpu=True)
    trainer = Trainer(model=model, args=hf)
    return model, optimizer, scheduler, optimizer_factory(trainer, (optimizer, scheduler), None)


def test_in_place_the_scripts_model_optimizer_and_scheduler_objects_train(bert_classifier: Path, tmp_path: Path):
    model, optimizer, scheduler, factory = _in_place(bert_classifier, tmp_path)
    args = split_run(
        model_path=bert_classifier,
        model_init=factory.model_init,
        data_path=_rows(tmp_path / "train.jsonl", 32),
        ckpt_output_dir=tmp_path / "out",
        effective_batch_size=8,
        per_device_batch_size=8,
        max_steps=2,
        save_strategy="no",
        disable_tqdm=True,
        optimizer_factory=factory,
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    components = build_run(*as_run(args), DistributedEnv())
    TrainingLoop(as_run(args).args, DistributedEnv(), [ScheduleCallback()], components).run()
    assert components.engine.unwrapped is model
    assert components.engine.optimizer is optimizer and components.engine.lr_scheduler is scheduler
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    assert len(optimizer.state) > 0 and scheduler.last_epoch == 2
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    with pytest.raises(TypeError, match="cannot be sent"):
        cloudpickle.dumps(factory)


def test_in_place_groups_follow_parameters_an_engine_replaced(bert_classifier: Path, tmp_path: Path) -> None:
    import copy

    model, optimizer, _, factory = _in_place(bert_classifier, tmp_path)
    replaced = copy.deepcopy(model)  # FSDP2 replaces the parameters by sharded ones of the same names
    assert factory.optimizer(replaced, [], None, 2) is optimizer
    assert [id(p) for p in optimizer.param_groups[0]["params"]] == [id(p) for p in replaced.parameters()]

    model, optimizer, _, factory = _in_place(bert_classifier, tmp_path)
    loss = model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([1])).loss
    loss.backward()
    optimizer.step()  # state for the script's parameters, which the engine would replace
    with pytest.raises(RuntimeError, match="already holds state"):
        factory.optimizer(copy.deepcopy(model), [], None, 2)
