"""trainbridge's own callbacks given to a ``Trainer`` (``callbacks=``, ``add_callback``): Trainer's handler
holds them without calling them with Trainer's arguments, and the loop runs them with their context."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets
import pytest
import transformers
from transformers import TrainingArguments

from trainbridge import Callback, Trainer
from trainbridge.core.context import TrainingContext
from trainbridge.demos.tiny_model import arithmetic_problems


class Seen(Callback):
    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    def on_train_begin(self, context: TrainingContext, **kwargs: Any) -> None:
        self.events.append(("on_train_begin", context.global_step))

    def on_log(self, context: TrainingContext, **kwargs: Any) -> None:
        self.events.append(("on_log", dict(kwargs.get("logs") or {})))

    def on_evaluate(self, context: TrainingContext, **kwargs: Any) -> None:
        self.events.append(("on_evaluate", dict(kwargs.get("metrics") or {})))


class Other(Callback):
    def on_step_end(self, context: TrainingContext, **kwargs: Any) -> None:
        raise AssertionError("removed: never runs")


def _in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        monkeypatch.setenv(name, value)


def test_native_callbacks_in_a_trainer_run_in_the_loop(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
    rows = datasets.Dataset.from_dict({"text": [p + a for p, a in arithmetic_problems(16, seed=1)]})
    rows = rows.map(lambda b: tok(b["text"]), batched=True, remove_columns=["text"])
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        report_to="none",
        use_cpu=True,
        max_steps=2,
        per_device_train_batch_size=4,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="no",
        disable_tqdm=True,
    )
    _in_place(monkeypatch)
    seen, later = Seen(), Seen()
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=rows,
        eval_dataset=rows.select(range(4)),
        processing_class=tok,
        data_collator=transformers.DataCollatorForLanguageModeling(tok, mlm=False),
        callbacks=[seen, Other],  # Trainer's constructor fires on_init_end on both: nothing is called
    )
    trainer.add_callback(later)
    trainer.add_callback(Other())
    assert isinstance(trainer.pop_callback(Other), Other)  # by class: the first, as added
    trainer.remove_callback(Other)
    assert trainer.pop_callback(later) is later  # by object, returned as it was added
    trainer.add_callback(later)
    assert "eval_loss" in trainer.evaluate()  # Trainer's own evaluate: the handler holds them silently
    assert seen.events == []
    trainer.train()
    for callback in (seen, later):
        names = [name for name, _ in callback.events]
        assert names[0] == "on_train_begin" and names.count("on_evaluate") == 1, names
        assert [logs["loss"] > 0 for name, logs in callback.events if name == "on_log" and "loss" in logs] == [True] * 2


def test_a_native_callback_passes_through_a_trl_constructor(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("trl")
    from trl import SFTConfig

    from trainbridge import SFTTrainer

    args = SFTConfig(
        output_dir=str(tmp_path / "out"),
        report_to="none",
        use_cpu=True,
        bf16=False,
        max_steps=1,
        per_device_train_batch_size=4,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        max_length=16,
    )
    _in_place(monkeypatch)
    seen = Seen()
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
    tok = transformers.AutoTokenizer.from_pretrained(tiny_llama)
    data = datasets.Dataset.from_list([{"text": p + a} for p, a in arithmetic_problems(8, seed=1)])
    # positional, as trl's signature orders them: model, args, data_collator, train_dataset, eval_dataset,
    # processing_class, compute_loss_func, compute_metrics, callbacks
    trainer = SFTTrainer(model, args, None, data, None, tok, None, None, [seen])
    trainer.train()
    assert [name for name, _ in seen.events][:2] == ["on_train_begin", "on_log"]
