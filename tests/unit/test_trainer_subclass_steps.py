"""A Trainer subclass's ``training_step``, ``prediction_step``, ``evaluate`` and ``log`` overrides run in the loop
(``step.trainer_methods``, ``trainer.subclass``) on the real model and batches, on the script's own instance:
its attributes are its own, what it sets stays, and its ``state`` is the run's live ``TrainerState``."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from transformers import TrainingArguments

from tests.run_inputs import as_run, split_run
from trainbridge import Trainer
from trainbridge.callbacks import ScheduleCallback
from trainbridge.core.callback import Callback
from trainbridge.core.config import TrainingArgs
from trainbridge.core.config.loss import InstanceStep, declared_loss
from trainbridge.core.context import TrainingContext
from trainbridge.core.distributed import DistributedEnv
from trainbridge.hf.trainer_callbacks import HuggingFaceCallbacks
from trainbridge.loop.build import build_run
from trainbridge.loop.loop import TrainingLoop
from trainbridge.step.model_loss import ModelLoss
from trainbridge.step.trainer_methods import TrainerMethodsStep
from trainbridge.trainer.subclass import (
    ScriptTrainer,
    ScriptTrainerEvents,
    unhonoured_overrides,
)


@pytest.fixture(scope="module")
def bert_classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import BertForSequenceClassification

    from trainbridge.demos.tiny_model import build_tokenizer, tiny_bert_config

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("cls")
    config = tiny_bert_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    BertForSequenceClassification(config).save_pretrained(folder)
    build_tokenizer(folder)
    return folder


def _rows(path: Path, count: int, seed: int) -> Path:
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as handle:
        for _ in range(count):
            label = rng.randrange(2)
            text = ("x" if label else "y") + "".join(rng.choice("abcdefgh") for _ in range(rng.randrange(3, 12)))
            handle.write(json.dumps({"text": text, "label": label}) + "\n")
    return path


MODELS: dict[int, Any] = {}
"""The model object of each instance ``_methods`` built (by ``id(worker)``): what ``train()`` trains in place."""


def _methods(cls: type, tmp_path: Path, path: Path, **kwargs: Any) -> ScriptTrainer:
    """A ``cls`` Trainer on the model of ``path``, as ``train()`` hands its methods to the loop."""
    from transformers import AutoModelForSequenceClassification

    hf = TrainingArguments(
        output_dir=str(tmp_path / "hf"), report_to="none", use_cpu=True, gradient_accumulation_steps=2
    )
    model = AutoModelForSequenceClassification.from_pretrained(path)
    trainer = cls(model=model, args=hf, **kwargs)
    worker = trainer._script
    MODELS[id(worker)] = model
    return worker


class Logs(Callback):
    def __init__(self) -> None:
        self.logs: list[dict[str, Any]] = []

    def on_log(self, context: TrainingContext, **kwargs: Any) -> None:
        self.logs.append(dict(kwargs["logs"]))


def _accuracy(prediction: Any) -> dict[str, float]:
    return {"accuracy": float((np.asarray(prediction.predictions).argmax(-1) == prediction.label_ids).mean())}


def _run(
    path: Path, tmp_path: Path, methods: Any, callbacks: list[Any] = (), worker: Any = None, **fields: Any
) -> tuple[Any, Any]:
    """A run of the model of ``path``; with ``methods`` (or ``worker``: an instance whose methods the run's
    callbacks call) that instance's own model object is trained, as ``train()`` trains it."""
    instance = methods if methods is not None else worker
    model = MODELS[id(instance)] if instance is not None else None
    args = split_run(
        model_path=path,
        model_init=(lambda: model) if model is not None else None,
        data_path=_rows(tmp_path / "train.jsonl", 32, 1),
        val_data_path=_rows(tmp_path / "val.jsonl", 8, 2),
        ckpt_output_dir=tmp_path / "out",
        training_step="model_loss",
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
        loss=InstanceStep(methods) if methods is not None else None,
        callbacks=[ScheduleCallback(), *callbacks],
        **fields,
    )
    components = build_run(*as_run(args), DistributedEnv())
    hf = next((c for c in callbacks if isinstance(c, HuggingFaceCallbacks)), None)
    given = [args.plan.loss.methods] if isinstance(args.plan.loss, InstanceStep) else []
    for seam in [*given, *args.plan.callbacks] if hf is not None else []:
        script = seam.worker if isinstance(seam, ScriptTrainerEvents) else seam
        if isinstance(script, ScriptTrainer):  # as train() binds the instance's ScriptTrainer
            script.bind_state(hf)
    return components, TrainingLoop(as_run(args).args, DistributedEnv(), args.plan.callbacks, components).run()


def _weights(components: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in components.engine.unwrapped.state_dict().items()}


class SuperStep(Trainer):
    calls: ClassVar[list[tuple[int, float, int]]] = []

    def __init__(self, *args: Any, alpha: float = 0.5, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.alpha = alpha
        self.flags = {"seen": True}

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        loss = super().training_step(model, inputs, num_items_in_batch)
        SuperStep.calls.append((self.state.global_step, self.alpha, int(num_items_in_batch)))
        return loss


def test_a_training_step_calling_super_gives_trainers_gradients_and_logged_loss(bert_classifier, tmp_path):
    reference_logs, ours_logs = Logs(), Logs()
    reference, _ = _run(bert_classifier, tmp_path / "a", None, [reference_logs])
    assert isinstance(reference.step, ModelLoss)
    SuperStep.calls.clear()
    ours, result = _run(
        bert_classifier, tmp_path / "b", _methods(SuperStep, tmp_path, bert_classifier, alpha=0.25), [ours_logs]
    )
    assert isinstance(ours.step, TrainerMethodsStep) and result.global_step == 2
    # each micro-batch (2 steps x 2) ran the override, with the script's attribute and the step's items
    assert [(c[1], c[2]) for c in SuperStep.calls] == [(0.25, 8)] * 2 + [(0.25, 8)] * 2
    for name, value in _weights(reference).items():
        torch.testing.assert_close(_weights(ours)[name], value, rtol=1e-5, atol=1e-6)
    for key in ("loss", "grad_norm", "eval_loss"):  # Adam hides a gradient's scale from the weights: the norm
        values = [log[key] for log in ours_logs.logs if key in log]
        assert values and values == pytest.approx([log[key] for log in reference_logs.logs if key in log], rel=1e-5)


class PerBatchMean(Trainer):
    """Trainer's training_step for a model whose loss ignores ``num_items_in_batch``: a per-batch mean,
    divided by the accumulation steps."""

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        self.model_accepts_loss_kwargs = False
        return super().training_step(model, inputs, num_items_in_batch)


def test_a_per_batch_mean_is_divided_by_the_steps_accumulation(bert_classifier, tmp_path):
    reference_logs, ours_logs = Logs(), Logs()
    _run(bert_classifier, tmp_path / "a", None, [reference_logs])
    _run(bert_classifier, tmp_path / "b", _methods(PerBatchMean, tmp_path, bert_classifier), [ours_logs])
    reference, ours = reference_logs.logs[0], ours_logs.logs[0]
    # the model's own loss step treats Bert's (item-ignoring) mean as normalised by the step's items, as
    # Trainer does: its first-step gradient is the sum over the 2 micro-batches; Trainer's per-batch path
    # divides each micro-batch's mean by the 2 accumulation steps
    assert ours["grad_norm"] == pytest.approx(reference["grad_norm"] / 2, rel=1e-5)
    assert ours["loss"] == pytest.approx(reference["loss"] / 2, rel=1e-5)


class DoubledStep(Trainer):
    """Adversarial-style: its own forward and backward twice per micro-batch, reading the gradients between."""

    increments: ClassVar[list[tuple[torch.Tensor, torch.Tensor]]] = []

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        weight = self.accelerator.unwrap_model(model).classifier.weight
        grads = [weight.grad.clone() if weight.grad is not None else torch.zeros_like(weight)]
        for _ in range(2):
            loss = self.compute_loss(model, dict(inputs), num_items_in_batch=num_items_in_batch)
            self.accelerator.backward(loss)
            grads.append(weight.grad.clone())
        DoubledStep.increments.append((grads[1] - grads[0], grads[2] - grads[1]))
        return loss.detach()


class ClearingStep(Trainer):
    """Custom gradient manipulation: drops every gradient after Trainer's backward."""

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        loss = super().training_step(model, inputs, num_items_in_batch)
        for parameter in model.parameters():
            parameter.grad = None
        return loss


def test_a_training_step_with_its_own_backward_is_what_the_step_runs(bert_classifier, tmp_path):
    DoubledStep.increments.clear()
    _run(bert_classifier, tmp_path / "a", _methods(DoubledStep, tmp_path, bert_classifier))
    assert len(DoubledStep.increments) == 4
    for first, second in DoubledStep.increments:  # each backward added the same gradient where it was called
        assert first.abs().sum() > 0
        torch.testing.assert_close(second, first)
    start = _weights(build_run(*as_run(_args_only(bert_classifier, tmp_path / "c")), DistributedEnv()))
    cleared, _ = _run(bert_classifier, tmp_path / "b", _methods(ClearingStep, tmp_path, bert_classifier))
    for name, value in start.items():  # the override's gradient manipulation is what the optimizer saw
        torch.testing.assert_close(_weights(cleared)[name], value)


def _args_only(path: Path, tmp_path: Path) -> TrainingArgs:
    return split_run(
        model_path=path,
        data_path=_rows(tmp_path / "train.jsonl", 32, 1),
        ckpt_output_dir=tmp_path / "out",
        training_step="model_loss",
        effective_batch_size=8,
        per_device_batch_size=4,
        max_steps=2,
    )


class Predicting(Trainer):
    calls: ClassVar[list[tuple[bool, list[str]]]] = []

    def prediction_step(self, model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: Any = None) -> Any:
        Predicting.calls.append((prediction_loss_only, sorted(inputs)))
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if prediction_loss_only:
            return loss, None, None
        return loss * 0 + 7.0, -logits, labels  # what compute_metrics and eval_loss get is the override's


def test_a_prediction_step_override_feeds_eval_loss_and_compute_metrics(bert_classifier, tmp_path):
    reference_logs, ours_logs = Logs(), Logs()
    _run(bert_classifier, tmp_path / "a", None, [reference_logs], compute_metrics=_accuracy)
    Predicting.calls.clear()
    _run(
        bert_classifier,
        tmp_path / "b",
        _methods(Predicting, tmp_path, bert_classifier),
        [ours_logs],
        compute_metrics=_accuracy,
    )
    assert Predicting.calls and all(not only for only, _ in Predicting.calls)
    assert Predicting.calls[0][1] == ["attention_mask", "input_ids", "labels"]
    reference = next(log for log in reference_logs.logs if "eval_loss" in log)
    ours = next(log for log in ours_logs.logs if "eval_loss" in log)
    assert ours["eval_loss"] == pytest.approx(7.0)
    assert ours["eval_accuracy"] == pytest.approx(1.0 - reference["eval_accuracy"])  # negated logits


class LoggingTrainer(Trainer):
    seen: ClassVar[list[tuple[int, float | None, list[str]]]] = []

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        LoggingTrainer.seen.append((self.state.global_step, start_time, sorted(logs)))
        logs["custom_metric"] = 3.0
        super().log({k: v for k, v in logs.items() if k != "grad_norm"}, start_time)


def test_a_log_override_runs_on_each_log_and_what_it_logs_lands(bert_classifier, tmp_path):
    worker = _methods(LoggingTrainer, tmp_path, bert_classifier)
    LoggingTrainer.seen.clear()
    logs, hf = Logs(), HuggingFaceCallbacks([], progress=False)
    _run(bert_classifier, tmp_path, None, [ScriptTrainerEvents(worker), hf, logs], worker=worker)
    assert [entry[0] for entry in LoggingTrainer.seen] == [1, 2, 2, 2]  # two train logs, eval, final summary
    assert LoggingTrainer.seen[0][1] is not None and LoggingTrainer.seen[2][1] is None  # start_time as Trainer
    assert all(log["custom_metric"] == 3.0 and "grad_norm" not in log for log in logs.logs)
    history = hf.state.log_history
    assert all(entry["custom_metric"] == 3.0 for entry in history) and len(history) == 4


class Stateful(Trainer):
    steps: ClassVar[list[tuple[int, bool]]] = []

    def __init__(self, *args: Any, alpha: float = 0.5, **kwargs: Any) -> None:
        self.before = "set before super().__init__"
        super().__init__(*args, **kwargs)
        self.alpha = alpha
        self.counted = 0

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        live = self.state.max_steps == 2 and self.alpha == 0.75 and self.optimizer is not None
        Stateful.steps.append((self.state.global_step, live))
        self.counted += 1  # instance state: it stays on the script's object
        return super().training_step(model, inputs, num_items_in_batch)


def test_the_instance_is_the_scripts_own_with_the_live_state(bert_classifier, tmp_path):
    Stateful.steps.clear()
    hf = HuggingFaceCallbacks([], progress=False)
    worker = _methods(Stateful, tmp_path, bert_classifier, alpha=0.75)
    _run(bert_classifier, tmp_path, worker, [ScriptTrainerEvents(worker), hf])
    assert Stateful.steps == [(0, True), (0, True), (1, True), (1, True)]
    assert worker.instance.counted == 4 and worker.instance.before == "set before super().__init__"
    assert worker.instance.state is hf.state  # the run's TrainerState


class Evaluating(Trainer):
    seen: ClassVar[list[tuple[int, list[str]]]] = []

    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval") -> Any:
        metrics = super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)  # the loop's evaluation
        Evaluating.seen.append((self.state.global_step, sorted(metrics)))
        self.log({"sample": 1.0})  # Trainer's own log, during training: logged as under Trainer
        return {**metrics, "eval_extra": 1.0}


class OtherSet(Trainer):
    seen: ClassVar[list[list[str]]] = []

    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval") -> Any:
        rows = [{"input_ids": [2, 5, 6], "attention_mask": [1, 1, 1], "labels": 1}]
        metrics = super().evaluate(rows, ignore_keys, "train")  # another set: Trainer's own evaluate runs
        OtherSet.seen.append(sorted(metrics))
        return metrics


def test_an_evaluate_override_runs_around_each_evaluation_during_training(bert_classifier, tmp_path):
    assert unhonoured_overrides(Stateful) == [] and unhonoured_overrides(Evaluating) == []
    worker = _methods(Evaluating, tmp_path, bert_classifier)
    Evaluating.seen.clear()
    logs, hf = Logs(), HuggingFaceCallbacks([], progress=False)
    _run(
        bert_classifier,
        tmp_path,
        None,
        [ScriptTrainerEvents(worker), hf, logs],
        worker=worker,
        evaluation=worker.evaluation,
        eval_on_start=True,
        compute_metrics=_accuracy,
    )
    keys = ["epoch", "eval_accuracy", "eval_loss", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second"]
    assert Evaluating.seen == [(0, keys), (2, keys)]  # on start and at step 2: the loop's metrics via super()
    assert [log["eval_loss"] for log in logs.logs if "eval_loss" in log]
    assert [entry["step"] for entry in hf.state.log_history if "sample" in entry] == [0, 2]  # Trainer.log's
    other = _methods(OtherSet, tmp_path / "other", bert_classifier)
    OtherSet.seen.clear()
    _run(
        bert_classifier,
        tmp_path / "other",
        None,
        [ScriptTrainerEvents(other)],
        worker=other,
        evaluation=other.evaluation,
    )
    assert OtherSet.seen and "train_loss" in OtherSet.seen[0]


def test_overrides_of_trainers_own_loop_are_refused_naming_them() -> None:
    class Looping(Predicting):
        def _inner_training_loop(self, *args: Any, **kwargs: Any) -> Any:
            return super()._inner_training_loop(*args, **kwargs)

        def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:  # honoured: Trainer's evaluate calls it
            return super().evaluation_loop(*args, **kwargs)

    assert unhonoured_overrides(Looping) == ["_inner_training_loop"]
    hf_args = TrainingArguments(output_dir="unused", report_to="none", use_cpu=True)
    with pytest.raises(ValueError, match=r"overrides _inner_training_loop\(\)"):
        Looping(model=torch.nn.Linear(2, 2), args=hf_args)


def test_the_loss_seam_is_one_typed_plan_object_checked_against_training_step(bert_classifier, tmp_path):
    methods = _methods(SuperStep, tmp_path, bert_classifier)
    common: dict[str, Any] = dict(
        model_path=bert_classifier, data_path=_rows(tmp_path / "train.jsonl", 8, 1), ckpt_output_dir=tmp_path / "out"
    )
    with pytest.raises(ValueError, match=r"loss: expected one of TokenLoss, .* got function; wrap .* LossFunction"):
        split_run(**common, loss=lambda model, inputs: 0)
    with pytest.raises(
        ValueError, match=r"training_step: 'token_cross_entropy' computes its own loss, .* InstanceStep"
    ):
        split_run(**common, training_step="token_cross_entropy", loss=InstanceStep(methods))
    run = split_run(**common, training_step="model_loss", loss=InstanceStep(methods))  # the same batches: fine
    assert declared_loss(*run) == InstanceStep(methods)
