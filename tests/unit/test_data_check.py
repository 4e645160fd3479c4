"""The launcher's data check (``trainbridge.launch.data_check``): bad data fails before launch, and a
launch whose inputs have not changed since a check passed skips loading the tokenizer."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from trainbridge.core.config import TrainingArgs
from trainbridge.launch import data_check
from trainbridge.launch.errors import PreflightError


@pytest.fixture
def args(run_files, tmp_path) -> TrainingArgs:
    return TrainingArgs(
        model_path=run_files["model"],
        data_path=run_files["train"],
        val_data_path=run_files["val"],
        ckpt_output_dir=run_files["out"],
        data_cache_dir=tmp_path / "cache",
    )


@pytest.fixture
def tokenizer_loads(monkeypatch) -> list[str]:
    """Records every tokenizer load of the check (the step that imports transformers)."""
    import trainbridge.modeling.load as load

    loads: list[str] = []
    real = load.load_tokenizer

    def counted(args, *rest, **options):
        loads.append(str(args.resolved_tokenizer_path))
        return real(args, *rest, **options)

    monkeypatch.setattr(load, "load_tokenizer", counted)
    return loads


def _touch_later(path) -> None:
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


def test_a_passed_check_is_not_repeated_for_the_same_inputs(args, tokenizer_loads):
    data_check.check_data(args)
    assert len(tokenizer_loads) == 1
    notes = list((args.data_cache_dir / data_check.NOTE_FOLDER).glob("*.json"))
    assert len(notes) == 1
    data_check.check_data(args)
    data_check.check_data(args.model_copy())
    assert len(tokenizer_loads) == 1


@pytest.mark.parametrize("change", ["data", "val_data", "tokenizer", "option", "cache cleared"])
def test_any_change_to_what_the_check_depends_on_runs_it_again(args, run_files, tokenizer_loads, change):
    data_check.check_data(args)
    if change == "data":
        _touch_later(run_files["train"])
    elif change == "val_data":
        run_files["val"].write_text('{"input_ids": [2, 3, 4, 5]}\n')
    elif change == "tokenizer":
        _touch_later(run_files["model"] / "tokenizer_config.json")
    elif change == "option":
        args = args.model_copy(update={"max_seq_len": args.max_seq_len + 1})
    else:
        for meta in args.data_cache_dir.glob("*/meta.json"):
            shutil.rmtree(meta.parent)
    data_check.check_data(args)
    assert len(tokenizer_loads) == 2


def test_bad_data_fails_every_time_and_leaves_no_note(args, run_files, tokenizer_loads):
    run_files["train"].write_text('{"input_ids": [1, 2, 3]}\nnot json\n')
    for _ in range(2):
        with pytest.raises(PreflightError, match=r"data: .*train\.jsonl:2: invalid JSON"):
            data_check.check_data(args)
    assert len(tokenizer_loads) == 2
    assert not list((args.data_cache_dir / data_check.NOTE_FOLDER).glob("*.json"))


def test_a_tokenizer_without_a_local_folder_is_always_checked(args, tokenizer_loads, monkeypatch):
    assert data_check._note_path(args.model_copy(update={"tokenizer_path": Path("org/not-a-local-folder")})) is None
    monkeypatch.setattr(data_check, "_note_path", lambda args: None)  # what a hub id gets
    data_check.check_data(args)
    data_check.check_data(args)
    assert len(tokenizer_loads) == 2


def test_a_changed_named_evaluation_set_runs_the_check_again(args, run_files, tokenizer_loads):
    args = args.model_copy(update={"val_data_path": None, "eval_data_paths": {"main": run_files["val"]}})
    data_check.check_data(args)
    data_check.check_data(args)
    assert len(tokenizer_loads) == 1
    run_files["val"].write_text('{"input_ids": [2, 3, 4, 5]}\n')
    data_check.check_data(args)
    assert len(tokenizer_loads) == 2
