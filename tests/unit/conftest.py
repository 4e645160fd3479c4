"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.run_inputs import split_run
from trainbridge.demos.tiny_model import write_arithmetic_dataset


@pytest.fixture
def args_for(tmp_path: Path, tiny_llama: Path) -> Callable[..., Any]:
    """``args_for(out="out", **overrides)``: ``TrainingArgs`` for an in-process run of the tiny Llama on
    48 arithmetic rows (6 steps of 8) with 8 validation rows, written under ``tmp_path/out``; nothing is
    saved unless asked; given code (callback objects, ``on_<event>=fn``...): ``RunInputs(args, plan)``
    (``tests.run_inputs.split_run``).  A module that wants other defaults wraps it with ``functools.partial``."""
    train_file = write_arithmetic_dataset(tmp_path / "train.jsonl", 48, seed=1)
    val_file = write_arithmetic_dataset(tmp_path / "val.jsonl", 8, seed=2)

    def make(out: str = "out", **overrides: Any) -> Any:
        values: dict[str, Any] = dict(
            model_path=tiny_llama,
            data_path=train_file,
            val_data_path=val_file,
            ckpt_output_dir=tmp_path / out,
            max_seq_len=32,
            max_batch_len=64,
            effective_batch_size=8,
            learning_rate=3e-3,
            lr_scheduler="constant",
            max_steps=6,
            logging_steps=1,
            save_strategy="no",
            disable_tqdm=True,
            seed=7,
        )
        values.update(overrides)
        return split_run(**values)

    return make


LAUNCHER_VARIABLES = (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"))


@pytest.fixture
def arguments_for(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """``arguments_for(cls, **fields)``: ``TrainingArguments(**fields)`` for a side-by-side run of
    ``transformers.Trainer`` then ``trainbridge.Trainer`` in this process.  The arguments are built without a
    launcher's variables (they would start a process group); for ours, the variables of a one-process launch
    are set after them, as our in-place ``train()`` runs under a launcher."""
    from transformers import TrainingArguments

    from trainbridge import Trainer

    def make(cls: type, **fields: Any) -> Any:
        for name, _ in LAUNCHER_VARIABLES:
            monkeypatch.delenv(name, raising=False)
        args = TrainingArguments(**fields)
        if issubclass(cls, Trainer):
            for name, value in LAUNCHER_VARIABLES:
                monkeypatch.setenv(name, value)
        return args

    return make
