"""``trainbridge.Trainer`` is a real ``transformers.Trainer`` (``scripts/own_loop_script.py``), both launch
styles on 2 ranks, against transformers.Trainer: an ``evaluate`` override running its own loop (Trainer's
``get_eval_dataloader``/``evaluation_loop``/``log``/``callback_handler``), ``get_train_dataloader()`` called by
the script, state set on the instance by ``compute_loss`` still there after ``train()``,
``isinstance(trainer, transformers.Trainer)``; then, in the same launch, a second Trainer whose items and batches
are tuples (``compute_loss``/``prediction_step`` unpack them) and whose best checkpoint is chosen from Trainer's
own ``evaluate()`` (``save_total_limit=1`` leaves only it); the same global_step, log steps and keys (and
losses, for the tuples), checkpoint files and tensor names, and results files; and a third, a masked LM with tied
decoder weight and bias, saving Trainer's tensors (issue 29 failure 6)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.distributed.script_runs import run_script, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

SCRIPT = Path(__file__).parent / "scripts" / "own_loop_script.py"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("own-loop") / "real"
    return run_script(torchrun(SCRIPT, str(out), "real"), out)


def _check(ours: dict, reference: dict) -> None:
    assert ours["is_trainer"] and reference["is_trainer"]
    assert ours["sample_keys"] == reference["sample_keys"] and ours["sample_rows"] == reference["sample_rows"] == 4
    assert ours["global_step"] == reference["global_step"] == 4
    assert ours["train_metrics"] == reference["train_metrics"]
    assert ours["log_steps"] == reference["log_steps"] == [1, 2, 3, 4]
    # the override's own evaluation at steps 2 and 4 and after training, logged by Trainer's log()
    assert ours["eval_entries"] == reference["eval_entries"]
    assert [step for step, _ in ours["eval_entries"]] == [2, 4, 4]
    assert ours["eval_metrics"] == reference["eval_metrics"]
    # compute_loss ran on the script's own instance: its counter, on each rank, is Trainer's (4 steps, no
    # accumulation, plus the evaluations' batches)
    assert ours["loss_calls"] == reference["loss_calls"] and min(ours["loss_calls"]) > 4
    assert ours["checkpoints"] == reference["checkpoints"] == ["checkpoint-2", "checkpoint-4"]
    for name, files in reference["checkpoint_files"].items():
        assert {"model.safetensors", "trainer_state.json", "training_args.bin", "config.json"} <= set(files)
        assert {"model.safetensors", "trainer_state.json", "training_args.bin"} <= set(ours["checkpoint_files"][name])
    assert ours["checkpoint_tensors"] == reference["checkpoint_tensors"]
    assert ours["final_tensors"] == reference["final_tensors"]
    assert ours["results_files"] == reference["results_files"]
    _check_tuples(ours["tuples"], reference["tuples"])
    # a masked LM with its decoder weight and bias tied: Trainer's tensors in the checkpoint and in save_model()
    masked, masked_reference = ours["masked_lm"], reference["masked_lm"]
    assert masked["global_step"] == masked_reference["global_step"] == 2
    assert masked["checkpoint_tensors"] == masked["final_tensors"] == masked_reference["checkpoint_tensors"]
    assert masked_reference["final_tensors"] == masked_reference["checkpoint_tensors"]


def _check_tuples(ours: dict, reference: dict) -> None:
    """The Trainer over tuple items: Trainer's own DataLoader, step and evaluation, so the same batches and
    losses; its overrides ran as often on each rank."""
    for key in ("global_step", "train_metrics", "eval_entries", "eval_metrics", "checkpoints", "results_files"):
        assert ours[key] == reference[key], key
    # the best checkpoint, chosen from what Trainer's own evaluate() gave (the loop feeds it to its callbacks), is
    # the first evaluation's: with save_total_limit=1 it is the one checkpoint left, as Trainer leaves it
    assert reference["checkpoints"] == ["checkpoint-2"] and reference["best"][0] == "checkpoint-2"
    assert ours["best"][0] == reference["best"][0] and ours["best"][2] == reference["best"][2]
    assert ours["best"][1] == pytest.approx(reference["best"][1], rel=1e-5)
    assert ours["metrics_file_evaluations"] == [2, 4]  # trainbridge's metrics file: each evaluation in train()
    assert reference["global_step"] == 4 and [step for step, _ in reference["eval_entries"]] == [2, 4, 4]
    assert [step for step, _ in ours["losses"]] == [step for step, _ in reference["losses"]] == [1, 2, 3, 4]
    assert [loss for _, loss in ours["losses"]] == pytest.approx([loss for _, loss in reference["losses"]], rel=1e-5)
    assert ours["calls"] == reference["calls"]
    for name, files in reference["checkpoint_files"].items():
        assert set(files) <= set(ours["checkpoint_files"][name])
    assert ours["checkpoint_tensors"] == reference["checkpoint_tensors"]
    assert ours["final_tensors"] == reference["final_tensors"]


def test_torchrun_runs_trainers_own_code_in_place(reference: dict, tmp_path: Path) -> None:
    out = tmp_path / "ours"
    _check(run_script(torchrun(SCRIPT, str(out)), out), reference)


def test_python_runs_trainers_own_code_as_under_torchrun(reference: dict, tmp_path: Path) -> None:
    out = tmp_path / "ours"
    _check(run_script([sys.executable, str(SCRIPT), str(out)], out, TRAINBRIDGE_NPROC_PER_NODE="2"), reference)
