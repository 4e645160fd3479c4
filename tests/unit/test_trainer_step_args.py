"""``TrainingArguments`` that change Trainer's own step train as under Trainer (``LoopTrainer._steps_through_instance``:
the loop steps through the instance's ``training_step`` and ``prediction_step`` on Trainer's sample batches).

- ``label_smoothing_factor``: Trainer's ``compute_loss`` smooths the labels (its ``label_smoother``); in place
  (one rank) against real ``transformers.Trainer``: every logged training loss, ``grad_norm`` and ``eval_loss``
  equal, for a token classifier and a causal LM (whose smoothed loss shifts the labels).
- ``neftune_noise_alpha``: transformers' NEFTune hook is on the input embeddings during training, as
  ``Trainer.train`` attaches it, and gone after."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
from transformers import (
    DataCollatorForLanguageModeling,
    DataCollatorForTokenClassification,
    TrainerCallback,
    TrainingArguments,
)

from trainbridge import Trainer


class EmbeddingHooks(TrainerCallback):
    """Records, at each step, the input embeddings' forward hooks and NEFTune's alpha on them; seeds the step's
    noise."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, Any]] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if embeddings is None:  # the engine's wrapper
            embeddings = model.module.get_input_embeddings()
        self.seen.append((len(embeddings._forward_hooks), getattr(embeddings, "neftune_noise_alpha", None)))
        torch.manual_seed(state.global_step)  # the same noise for the same padded batch


def _rows(tokenizer: Any, count: int, seed: int, tags: bool, identical: bool = False) -> datasets.Dataset:
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        if identical:  # every row the same: the order of a batch's rows cannot matter
            rng = random.Random(seed)
        text = "".join(rng.choice("12+ab") for _ in range(rng.randint(4, 9)))
        ids = tokenizer(text)["input_ids"]
        row: dict[str, Any] = {"input_ids": ids, "attention_mask": [1] * len(ids)}
        if tags:
            row["labels"] = [-100] + [int(c.isdigit()) + (c == "+") for c in text]
        rows.append(row)
    return datasets.Dataset.from_list(rows)


def _run(
    cls: Any,
    model: Any,
    tokenizer: Any,
    tags: bool,
    out: Path,
    monkeypatch: Any,
    identical: bool = False,
    **arguments: Any,
) -> Any:
    arguments = {"label_smoothing_factor": 0.2, **arguments}
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=8,  # the whole set in one batch: the data order cannot matter
        per_device_eval_batch_size=8,
        max_steps=3,
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=3,
        save_strategy="no",
        learning_rate=1e-2,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        **arguments,
    )
    if monkeypatch is not None:  # in place, as under a launcher (after the arguments)
        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            monkeypatch.setenv(name, value)
    collator = (
        DataCollatorForTokenClassification(tokenizer) if tags else DataCollatorForLanguageModeling(tokenizer, mlm=False)
    )
    trainer = cls(
        model=model,
        args=args,
        train_dataset=_rows(tokenizer, 8, 0, tags, identical),
        eval_dataset=_rows(tokenizer, 8, 1, tags),
        data_collator=collator,
        processing_class=tokenizer,
        callbacks=[EmbeddingHooks()],
    )
    trainer.train()
    return trainer


@pytest.mark.parametrize("tags", [True, False], ids=["token_classifier", "causal_lm"])
def test_label_smoothing_trains_and_evaluates_as_under_trainer(
    tags: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers
    from transformers import AutoModelForCausalLM, BertForTokenClassification

    from trainbridge.demos.tiny_model import build_tiny_llama_once, build_tokenizer, tiny_bert_config

    torch.manual_seed(0)
    if tags:
        tokenizer = build_tokenizer(tmp_path / "tok")
        config = tiny_bert_config(
            vocab_size=len(tokenizer), num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0
        )
        model = BertForTokenClassification(config)
    else:
        folder = build_tiny_llama_once(tmp_path / "llama")
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder)
    reference = _run(transformers.Trainer, copy.deepcopy(model), tokenizer, tags, tmp_path / "hf", None)
    trainer = _run(Trainer, model, tokenizer, tags, tmp_path / "tb", monkeypatch)

    def logged(history: list[dict]) -> list[tuple[int, dict[str, float]]]:
        keys = ("loss", "grad_norm", "eval_loss")
        return [(e["step"], {k: e[k] for k in keys if k in e}) for e in history if any(k in e for k in keys)]

    expected, got = logged(reference.state.log_history), logged(trainer.state.log_history)
    assert [step for step, _ in got] == [step for step, _ in expected] == [1, 2, 3, 3]
    for (_, want), (_, have) in zip(expected, got, strict=True):
        assert have.keys() == want.keys()
        for key, value in want.items():
            assert have[key] == pytest.approx(value, rel=1e-4), (key, got, expected)


def test_neftune_noise_is_on_the_embeddings_during_training_as_under_trainer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers
    from transformers import AutoModelForCausalLM

    from trainbridge.demos.tiny_model import build_tiny_llama_once

    folder = build_tiny_llama_once(tmp_path / "llama")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    neftune = {"label_smoothing_factor": 0.0, "neftune_noise_alpha": 5.0, "identical": True}
    reference = _run(transformers.Trainer, copy.deepcopy(model), tokenizer, False, tmp_path / "hf", None, **neftune)
    trainer = _run(Trainer, model, tokenizer, False, tmp_path / "tb", monkeypatch, **neftune)

    def seen(run: Any) -> list[tuple[int, Any]]:
        return next(c for c in run.callback_handler.callbacks if isinstance(c, EmbeddingHooks)).seen

    assert seen(trainer) == seen(reference) == [(1, 5.0)] * 3
    embeddings = model.get_input_embeddings()
    assert not embeddings._forward_hooks and not hasattr(embeddings, "neftune_noise_alpha")  # removed after
    # the noise (seeded per step) is drawn and scaled as Trainer's: the losses and gradient norms are Trainer's
    logged = [
        [e[k] for e in run.state.log_history if "loss" in e for k in ("loss", "grad_norm")]
        for run in (reference, trainer)
    ]
    assert logged[1] == pytest.approx(logged[0], rel=1e-4)
