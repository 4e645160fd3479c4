"""Calls a script makes around ``train()``, each in place (one rank) against real ``transformers.Trainer``.

- the final ``on_log``: a callback added after Trainer's ``PrinterCallback`` sees the row it left (no
  ``total_flos``), one given to the constructor sees ``total_flos``; ``state.total_flos`` holds the count;
- ``dataloader_drop_last=True`` in an epoch-based run: Trainer's step count (the last, short batch dropped), on
  Trainer's sample batches and on our token batches;
- no ``processing_class``, the tokenizer only in the LM collator: it trains, and checkpoints hold the collator's
  tokenizer as Trainer's do."""

from __future__ import annotations

import copy
import random
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets
import pytest
import transformers
from transformers import DataCollatorForLanguageModeling, TrainerCallback, TrainingArguments

from trainbridge import Trainer
from trainbridge.demos.tiny_model import build_tiny_llama_once
from trainbridge.hf.porting import HFPortingWarning


class LogKeys(TrainerCallback):
    """The keys of every ``logs`` ``on_log`` receives."""

    def __init__(self) -> None:
        self.rows: list[list[str]] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        self.rows.append(sorted(logs))


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, datasets.Dataset]:
    folder = build_tiny_llama_once(tmp_path_factory.mktemp("calls") / "llama")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    rng = random.Random(0)
    rows = []
    for _ in range(25):
        ids = tokenizer("".join(rng.choice("12+ab") for _ in range(rng.randint(4, 9))))["input_ids"]
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids)})
    return transformers.AutoModelForCausalLM.from_pretrained(folder), tokenizer, datasets.Dataset.from_list(rows)


def _both(
    llama: tuple[Any, Any, datasets.Dataset],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    added: bool = False,
    own_collate: bool = False,
    **arguments: Any,
) -> list[tuple[Any, LogKeys]]:
    """Trainer's run, then ours, on the same model, data and arguments; each with a ``LogKeys`` given to the
    constructor or (``added``) by ``add_callback`` after it."""
    model, tokenizer, rows = llama
    runs = []
    for cls in (transformers.Trainer, Trainer):
        args = TrainingArguments(
            output_dir=str(tmp_path / cls.__module__),
            per_device_train_batch_size=2,
            logging_steps=5,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            **{"disable_tqdm": True, "num_train_epochs": 1, **arguments},
        )
        if cls is Trainer:  # in place, as under a launcher (after the arguments)
            for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
                monkeypatch.setenv(name, value)
        keys = LogKeys()
        collator: Any = DataCollatorForLanguageModeling(tokenizer, mlm=False)
        if own_collate:  # a function of the script's: Trainer's sample batches, not our token batches
            collator = _called(collator)
        trainer = cls(
            model=copy.deepcopy(model),
            args=args,
            train_dataset=rows,
            data_collator=collator,
            callbacks=None if added else [keys],
        )
        if added:
            trainer.add_callback(keys)
        trainer.train()
        runs.append((trainer, keys))
    return runs


@pytest.mark.parametrize(
    ("added", "disable_tqdm"), [(True, True), (False, True), (True, False)], ids=["after_printer", "before", "bar"]
)
def test_final_on_log_has_trainers_keys(
    added: bool, disable_tqdm: bool, llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (reference, want), (trainer, got) = _both(llama, tmp_path, monkeypatch, added=added, disable_tqdm=disable_tqdm)
    assert got.rows[-1] == want.rows[-1]
    assert ("total_flos" in got.rows[-1]) == (not (added and disable_tqdm))
    assert "train_runtime" in got.rows[-1]
    assert trainer.state.total_flos > 0 and reference.state.total_flos > 0


def _called(collator: Any) -> Any:
    def collate(items: list[Any]) -> Any:
        return collator(items)

    return collate


@pytest.mark.parametrize("own_collate", [True, False], ids=["sample_batches", "token_batches"])
def test_drop_last_takes_trainers_step_count(
    own_collate: bool, llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """25 items in batches of 2 make 12 steps with the short batch dropped (13 without); two epochs, twice that;
    on Trainer's sample batches (the script's own collate function) and on our token batches (the LM collator)."""
    arguments = {"dataloader_drop_last": True, "num_train_epochs": 2}
    with warnings.catch_warnings():
        warnings.simplefilter("error", HFPortingWarning)  # honoured, not "ignored"
        (reference, _), (trainer, _) = _both(llama, tmp_path, monkeypatch, own_collate=own_collate, **arguments)
    assert trainer.state.global_step == trainer.state.max_steps == reference.state.global_step == 24
    assert [e["epoch"] for e in trainer.state.log_history if "loss" in e] == [
        e["epoch"] for e in reference.state.log_history if "loss" in e
    ]


def _checkpoint_files(
    model: Callable[[], Any],
    llama: tuple[Any, Any, datasets.Dataset],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    **trainer_kwargs: Any,
) -> list[set[str]]:
    """The files of Trainer's checkpoint after 3 steps, then ours: each run on a fresh ``model()``, the LM collator
    of the fixture's tokenizer and ``trainer_kwargs``."""
    _, tokenizer, rows = llama
    saved = []
    for cls in (transformers.Trainer, Trainer):
        out = tmp_path / cls.__module__
        args = TrainingArguments(
            output_dir=str(out),
            per_device_train_batch_size=4,
            max_steps=3,
            save_steps=3,
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
        )
        if cls is Trainer:
            for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
                monkeypatch.setenv(name, value)
        collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
        trainer = cls(model(), args, train_dataset=rows, data_collator=collator, **trainer_kwargs)
        trainer.train()
        assert trainer.state.global_step == 3
        saved.append({p.name for p in (out / "checkpoint-3").iterdir()})
    return saved


def test_without_processing_class_the_tokenizer_comes_from_the_collator(
    llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``Trainer(model, args, train_dataset=..., data_collator=DataCollatorForLanguageModeling(tok, mlm=False))``, the
    model's folder without a tokenizer: it trains (our token batches pad with the collator's tokenizer) and each
    checkpoint holds the collator's tokenizer, as Trainer saves it."""
    model = llama[0]
    bare = tmp_path / "bare"
    model.save_pretrained(bare)
    assert not (bare / "tokenizer_config.json").exists()
    saved = _checkpoint_files(
        lambda: transformers.AutoModelForCausalLM.from_pretrained(bare), llama, tmp_path, monkeypatch
    )
    saved = [{name for name in files if "token" in name} for files in saved]
    assert saved[1] == saved[0] and "tokenizer_config.json" in saved[0]


def test_a_multimodal_processor_is_saved_whole_into_checkpoints_as_trainer_saves_it(
    llama: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``processing_class=`` a ``ProcessorMixin`` (LLaVA's: an image processor and the tokenizer): each checkpoint
    holds every file ``processor.save_pretrained`` writes (``processor_config.json`` too, not only its
    tokenizer's), as Trainer's checkpoints do; the token batches still pad with its tokenizer."""
    model, tokenizer, _ = llama
    processor = transformers.LlavaProcessor(
        image_processor=transformers.CLIPImageProcessor(size={"shortest_edge": 16}, crop_size=16),
        tokenizer=tokenizer,
        patch_size=8,
        chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}",
    )
    processor.save_pretrained(tmp_path / "processor")
    written = {p.name for p in (tmp_path / "processor").iterdir()}
    assert "processor_config.json" in written
    saved = _checkpoint_files(lambda: copy.deepcopy(model), llama, tmp_path, monkeypatch, processing_class=processor)
    assert saved[1] & written == saved[0] & written == written
