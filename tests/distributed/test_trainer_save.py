"""A Trainer subclass overriding ``_save`` (both launch styles), or ``_save_checkpoint`` (``python script.py``)
(``scripts/save_script.py``), on 2 ranks, against transformers.Trainer: the override runs at every checkpoint
on every rank (``python script.py`` runs the script on each rank, as torchrun), and (``_save``) at the script's
final ``save_model``; its extra file is in every checkpoint (and the final folder); resuming from such a
checkpoint works.  Each side runs its cases one after another in one launch per launch style (``cases``):
Trainer's three references; ours under torchrun (the run, then its resume), and under ``python script.py``
(the ``_save`` run, then the ``_save_checkpoint`` one)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.distributed.script_runs import run_script_folders, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(1200)]

SCRIPT = Path(__file__).parent / "scripts" / "save_script.py"
MODEL_FILES = {"config.json", "model.safetensors", "training_args.bin", "value_head.json"}


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Real Trainer's runs, one after another in one launch: ``first``, ``resumed`` (from the first's
    checkpoint-2) and ``checkpoint`` (the ``_save_checkpoint`` override)."""
    out = tmp_path_factory.mktemp("save") / "real"
    cases = ["first", "resumed", "checkpoint"]
    return run_script_folders(torchrun(SCRIPT, str(out), "real", "cases", ",".join(cases)), out, cases)


@pytest.fixture(scope="module")
def python_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Ours under ``python script.py`` (2 ranks), one launch: ``first`` (the ``_save`` override), then
    ``checkpoint`` (the ``_save_checkpoint`` one)."""
    out = tmp_path_factory.mktemp("save") / "python"
    cases = ["first", "checkpoint"]
    command = [sys.executable, str(SCRIPT), str(out), "cases", ",".join(cases)]
    return run_script_folders(command, out, cases, TRAINBRIDGE_NPROC_PER_NODE="2")


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
    runs = run_script_folders(torchrun(SCRIPT, str(out), "cases", "first,resumed"), out, ["first", "resumed"])
    ours, resumed = runs["first"], runs["resumed"]
    _check_files(ours, reference[0])
    # every rank, at both checkpoints and the final save_model, as under Trainer (in each rank's own process)
    assert sorted(ours["saves"]) == sorted(reference[0]["saves"]) == ["save-rank0.txt", "save-rank1.txt"]
    for name, lines in ours["saves"].items():
        assert _checkpoint_flags(lines) == _checkpoint_flags(reference[0]["saves"][name]) == ["True", "True", "False"]
        assert len({line.split()[0] for line in lines}) == 1  # in place: the script's own process
    _check_files(resumed, reference[1])
    assert resumed["log_steps"] == reference[1]["log_steps"] == [1, 2, 3, 4]  # the history restored
    assert resumed["heads"]["checkpoint-4"]["resumed"] is True


def test_python_runs_the_override_on_every_rank_as_torchrun(
    reference: tuple[dict, dict], python_runs: dict[str, dict]
) -> None:
    ours = python_runs["first"]
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


def test_a_save_checkpoint_override_runs_under_python_as_torchrun(
    checkpoint_reference: dict, python_runs: dict[str, dict]
) -> None:
    """One launch style, for suite time: the override runs in the script's own process on each rank, the path
    the ``_save`` tests above show under both."""
    ours = python_runs["checkpoint"]
    _check_checkpoint_override(ours, checkpoint_reference)
    # in the script's own processes (re-executed on each rank), as under torchrun: rank 0's is the summary's
    assert any(line.split()[0] == str(ours["pid"]) for lines in ours["checkpoint_calls"].values() for line in lines)
