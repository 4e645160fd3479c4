"""A Trainer subclass overriding ``_save`` (both launch styles), or ``_save_checkpoint`` (``python script.py``)
(``scripts/save_script.py``), on 2 ranks, against transformers.Trainer: the override runs at every checkpoint
on every rank (``python script.py`` runs the script on each rank, as torchrun), and (``_save``) at the script's
final ``save_model``; its extra file is in every checkpoint (and the final folder); resuming from such a
checkpoint works.  Trainer's three reference runs share one launch (``references``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.distributed.script_runs import run_script, run_script_folders, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1200)]

SCRIPT = Path(__file__).parent / "scripts" / "save_script.py"
MODEL_FILES = {"config.json", "model.safetensors", "training_args.bin", "value_head.json"}


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Real Trainer's runs, one after another in one launch: ``first``, ``resumed`` (from the first's
    checkpoint-2) and ``checkpoint`` (the ``_save_checkpoint`` override)."""
    out = tmp_path_factory.mktemp("save") / "real"
    return run_script_folders(torchrun(SCRIPT, str(out), "real", "references"), out, ["first", "resumed", "checkpoint"])


@pytest.fixture(scope="module")
def reference(references: dict[str, dict]) -> tuple[dict, dict]:
    return references["first"], references["resumed"]


def _check_files(ours: dict, reference: dict) -> None:
    assert sorted(ours["files"]) == sorted(reference["files"]) == ["checkpoint-2", "checkpoint-4", "final"]
    for folder, names in ours["files"].items():
        assert set(names) >= MODEL_FILES and set(reference["files"][folder]) >= MODEL_FILES, folder
    assert ours["heads"] == reference["heads"]
    assert ours["global_step"] == reference["global_step"] == 4
    assert ours["log_steps"] == reference["log_steps"]


def _checkpoint_flags(lines: list[str]) -> list[str]:
    return [line.split()[1] for line in lines]


def test_torchrun_runs_the_override_in_place_and_resumes(reference: tuple[dict, dict], tmp_path: Path) -> None:
    out = tmp_path / "ours"
    ours = run_script(torchrun(SCRIPT, str(out)), out)
    _check_files(ours, reference[0])
    # every rank, at both checkpoints and the final save_model, as under Trainer (in each rank's own process)
    assert sorted(ours["saves"]) == sorted(reference[0]["saves"]) == ["save-rank0.txt", "save-rank1.txt"]
    for name, lines in ours["saves"].items():
        assert _checkpoint_flags(lines) == _checkpoint_flags(reference[0]["saves"][name]) == ["True", "True", "False"]
        assert len({line.split()[0] for line in lines}) == 1  # in place: the script's own process
    resumed = run_script(torchrun(SCRIPT, str(out), "resume"), out)
    _check_files(resumed, reference[1])
    assert resumed["log_steps"] == reference[1]["log_steps"] == [1, 2, 3, 4]  # the history restored
    assert resumed["heads"]["checkpoint-4"]["resumed"] is True


def test_python_runs_the_override_on_every_rank_as_torchrun(reference: tuple[dict, dict], tmp_path: Path) -> None:
    out = tmp_path / "ours"
    ours = run_script([sys.executable, str(SCRIPT), str(out)], out, TRAINBRIDGE_NPROC_PER_NODE="2")
    _check_files(ours, reference[0])
    # the script re-executed on each rank: both checkpoints and the final save_model on every rank, each in its
    # own process, rank 0's being the one that wrote the summary, as under torchrun and Trainer
    assert sorted(ours["saves"]) == sorted(reference[0]["saves"]) == ["save-rank0.txt", "save-rank1.txt"]
    for name, lines in ours["saves"].items():
        assert _checkpoint_flags(lines) == _checkpoint_flags(reference[0]["saves"][name]) == ["True", "True", "False"]
        assert len({line.split()[0] for line in lines}) == 1
    rank0, rank1 = ours["saves"]["save-rank0.txt"], ours["saves"]["save-rank1.txt"]
    assert rank0[0].split()[0] == str(ours["pid"]) != rank1[0].split()[0]


@pytest.fixture(scope="module")
def checkpoint_reference(references: dict[str, dict]) -> dict:
    return references["checkpoint"]


def _check_checkpoint_override(ours: dict, reference: dict) -> None:
    assert ours["global_step"] == reference["global_step"] == 4
    assert ours["heads"] == reference["heads"]
    assert sorted(reference["heads"]) == ["checkpoint-2", "checkpoint-4"]
    for folder in ("checkpoint-2", "checkpoint-4"):
        assert set(ours["files"][folder]) >= MODEL_FILES, folder
    assert sorted(ours["checkpoint_calls"]) == sorted(reference["checkpoint_calls"])
    for name, lines in ours["checkpoint_calls"].items():
        assert [line.split()[1] for line in lines] == [line.split()[1] for line in reference["checkpoint_calls"][name]]


def test_a_save_checkpoint_override_runs_under_python_as_torchrun(checkpoint_reference: dict, tmp_path: Path) -> None:
    """One launch style, for suite time: the override runs in the script's own process on each rank, the path
    the ``_save`` tests above show under both."""
    out = tmp_path / "ours"
    ours = run_script([sys.executable, str(SCRIPT), str(out), "checkpoint"], out, TRAINBRIDGE_NPROC_PER_NODE="2")
    _check_checkpoint_override(ours, checkpoint_reference)
    # in the script's own processes (re-executed on each rank), as under torchrun: rank 0's is the summary's
    assert any(line.split()[0] == str(ours["pid"]) for lines in ours["checkpoint_calls"].values() for line in lines)
