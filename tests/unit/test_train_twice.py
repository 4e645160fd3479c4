"""``train()`` called twice on the same Trainer, in place (one rank), against real ``transformers.Trainer``: the
second call keeps the optimizer and its state (Adam's moments) and builds a new schedule, as Trainer's
``train()`` does (``LoopTrainer._optimizers``); its losses are Trainer's.  With ``skip_memory_metrics=False``
each call's metrics and final log row carry Trainer's memory metrics (its own ``TrainerMemoryTracker``: the
``init_*`` ones with the first call only), an evaluation during training adding none."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import datasets
import pytest
import transformers
from transformers import DataCollatorForLanguageModeling, TrainerCallback, TrainingArguments

from trainbridge import Trainer
from trainbridge.demos.tiny_model import build_tiny_llama_once


class FinalLogs(TrainerCallback):
    """The keys of each ``train()``'s final log row (the one with ``train_runtime``)."""

    def __init__(self) -> None:
        self.keys: list[list[str]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        if "train_runtime" in logs:
            self.keys.append(sorted(logs))


def _memory_keys(metrics: dict[str, Any]) -> list[str]:
    return sorted(k for k in metrics if "_mem_" in k)


def test_a_second_train_keeps_the_optimizer_and_builds_a_new_schedule(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = build_tiny_llama_once(tmp_path / "llama")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    rng = random.Random(0)
    rows = datasets.Dataset.from_list(
        [{"input_ids": tokenizer("".join(rng.choice("12+ab") for _ in range(8)))["input_ids"]} for _ in range(8)]
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    runs: list[tuple[list[float], Any, Any]] = []
    keys: list[tuple[list[list[str]], list[list[str]]]] = []
    for cls in (transformers.Trainer, Trainer):
        args = TrainingArguments(
            output_dir=str(tmp_path / cls.__module__), per_device_train_batch_size=8, max_steps=3, logging_steps=1,
            learning_rate=5e-3, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True,
            skip_memory_metrics=False, eval_strategy="steps", eval_steps=2,
        )  # fmt: skip
        if cls is Trainer:  # in place, as under a launcher (after the arguments)
            for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
                monkeypatch.setenv(name, value)
        trainer = cls(
            model=copy.deepcopy(model), args=args, train_dataset=rows,
            data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False), eval_dataset=rows.select(range(4)),
            callbacks=[final := FinalLogs()],
        )  # fmt: skip
        first = trainer.train().metrics

        optimizer, scheduler = trainer.optimizer, trainer.lr_scheduler
        second = trainer.train().metrics
        keys.append(([_memory_keys(first), _memory_keys(second)], final.keys))
        losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]

        runs.append((losses, trainer.optimizer is optimizer, trainer.lr_scheduler is not scheduler))
    (want, kept, renewed), (got, our_kept, our_renewed) = runs
    assert keys[1] == keys[0]
    (want_memory, _), _ = keys
    assert "init_mem_cpu_alloc_delta" in want_memory[0] and "train_mem_cpu_peaked_delta" in want_memory[1]
    assert not any(k.startswith("init_") or k.startswith("before_") for k in want_memory[1])
    assert kept and renewed and our_kept and our_renewed
    assert len(got) == len(want) == 3  # the second train()'s rows (its state starts anew)
    assert got == pytest.approx(want, rel=2e-3)
