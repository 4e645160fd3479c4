"""What a Trainer's own evaluation logs and evaluates during ``train()`` (an ``evaluate`` override running its own
loop, as transformers' question-answering example; Trainer's own ``evaluate`` on items that are not columns)
reaches every callback of the run as the loop's own evaluation does (``loop.EvaluationPoint``,
``hf.stand_in_handlers.EvaluationEvents``): best-checkpoint tracking (``load_best_model_at_end``,
``save_total_limit=1``), ``EarlyStoppingCallback``, the metrics file and native callbacks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import pytest
import transformers
from transformers import DataCollatorForLanguageModeling, EarlyStoppingCallback, TrainerCallback, TrainingArguments

import trainbridge
from trainbridge.demos.tiny_model import arithmetic_problems


class OwnEvaluation(trainbridge.Trainer):
    """The QA example's shape: its own loop, post-processing, ``self.log`` and ``on_evaluate`` for its own set
    (no ``super()``); first Trainer's own ``evaluate`` of another set (``metric_key_prefix="test"``)."""

    def evaluate(self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval") -> Any:
        super().evaluate(self.eval_dataset.select(range(2)), metric_key_prefix="test")  # another set, first
        dataloader = self.get_eval_dataloader(eval_dataset if eval_dataset is not None else self.eval_dataset)
        output = self.evaluation_loop(dataloader, "Evaluation", prediction_loss_only=True)
        self.evaluations = getattr(self, "evaluations", 0) + 1
        score = [3.0, 1.0, 2.0, 0.0][(self.evaluations - 1) % 4]  # the best: the first evaluation's
        loss = float(output.metrics[f"{metric_key_prefix}_loss"])
        metrics = {f"{metric_key_prefix}_score": score, f"{metric_key_prefix}_loss": loss}
        assert output.metrics is not None
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics


class NativeSeen(trainbridge.Callback):
    def __init__(self) -> None:
        self.evaluated: list[tuple[int, float]] = []

    def on_evaluate(self, context: Any, **kwargs: Any) -> None:
        if "test_loss" in kwargs["metrics"]:
            return
        self.evaluated.append((context.global_step, kwargs["metrics"].get("eval_score")))


class HFSeen(TrainerCallback):
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if "eval_score" in logs:
            self.events.append(("log", state.global_step))

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any) -> None:
        self.events.append(("evaluate" if "eval_score" in metrics else "evaluate test", state.global_step))


@pytest.fixture
def in_place(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    tok = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    texts = [p + a for p, a in arithmetic_problems(24, seed=1)]
    rows = datasets.Dataset.from_dict({"text": texts})
    rows = rows.map(lambda b: tok(b["text"]), batched=True, remove_columns=["text"])

    def make(cls: type, out: Path, callbacks: list[Any], **fields: Any) -> Any:
        args = TrainingArguments(
            output_dir=str(out), report_to="none", use_cpu=True, per_device_train_batch_size=4, max_steps=10,
            logging_steps=1, eval_strategy="steps", eval_steps=2, save_steps=2, disable_tqdm=True, **fields,
        )  # fmt: skip
        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            monkeypatch.setenv(name, value)  # a launched worker of a 1-process job: the loop runs here
        model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
        collator = DataCollatorForLanguageModeling(tok, mlm=False)
        return cls(
            model=model, args=args, train_dataset=rows, eval_dataset=rows.select(range(6)), processing_class=tok,
            data_collator=collator, callbacks=callbacks,
        )  # fmt: skip

    return make


def test_an_evaluate_override_feeds_best_checkpoint_early_stopping_and_native_callbacks(
    in_place: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    native, hf = NativeSeen(), HFSeen()
    stop = EarlyStoppingCallback(early_stopping_patience=2)
    trainer = in_place(
        OwnEvaluation, tmp_path / "out", [native, hf, stop], load_best_model_at_end=True,
        metric_for_best_model="score", save_total_limit=1,
    )  # fmt: skip
    out = trainer.train()
    # scores 3, 1, 2 at steps 2, 4, 6: no improvement twice -> EarlyStoppingCallback stops at step 6
    assert out.global_step == 6
    assert native.evaluated == [(2, 3.0), (4, 1.0), (6, 2.0)]
    assert hf.events == [(e, step) for step in (2, 4, 6) for e in ("evaluate test", "log", "evaluate")]
    assert trainer.state.best_metric == 3.0 and trainer.state.best_global_step == 2
    assert Path(trainer.state.best_model_checkpoint).name == "checkpoint-2"
    # save_total_limit=1 with a best checkpoint: only the best is left after train(), as Trainer leaves it
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-2"]
    evaluations = [e for e in trainer.state.log_history if "eval_score" in e]
    assert [e["step"] for e in evaluations] == [2, 4, 6]  # once each (Trainer.log's entry not kept twice)
    lines = [json.loads(line) for line in (tmp_path / "out" / "trainbridge" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines if "eval_score" in line] == [2, 4, 6]
    assert "failed in on_evaluate" not in caplog.text  # the other set's on_evaluate is not the best metric's
