"""A Trainer subclass overriding ``compute_loss`` (``scripts/subclass_script.py``), both launch styles on 2
ranks, against transformers.Trainer: the override runs in each worker on every micro-batch, with the step's
``num_items_in_batch``; the same global_step, log steps and metric keys."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.distributed.script_runs import run_script, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

SCRIPT = Path(__file__).parent / "scripts" / "subclass_script.py"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("subclass") / "real"
    return run_script(torchrun(SCRIPT, str(out), "real"), out)


def _check(ours: dict, reference: dict) -> None:
    assert ours["global_step"] == reference["global_step"] == 4
    assert ours["log_steps"] == reference["log_steps"] == [1, 2, 3, 4]
    assert ours["train_metrics"] == reference["train_metrics"]
    assert set(reference["log_keys"]) <= set(ours["log_keys"])
    # the override ran in both ranks' processes, once per micro-batch (4 steps x 2), as under Trainer
    assert sorted(ours["calls"]) == sorted(reference["calls"]) == ["calls-rank0.txt", "calls-rank1.txt"]
    for name, lines in ours["calls"].items():
        assert len(lines) == len(reference["calls"][name]) == 8, (name, lines)
        assert lines[0].split()[1] == ("True" if name.endswith("0.txt") else "False")
        assert all(line.split()[2] == "LlamaForCausalLM" for line in lines)
    # num_items_in_batch: the step's label tokens over both ranks, the same number on both (as Trainer)
    ours_items = [line.split()[0] for line in ours["calls"]["calls-rank0.txt"]]
    assert ours_items == [line.split()[0] for line in ours["calls"]["calls-rank1.txt"]]
    assert all(int(n) > 0 for n in ours_items)


def test_torchrun_runs_the_override_in_place(reference: dict, tmp_path: Path) -> None:
    out = tmp_path / "ours"
    _check(run_script(torchrun(SCRIPT, str(out)), out), reference)


def test_python_sends_the_override_to_its_workers(reference: dict, tmp_path: Path) -> None:
    out = tmp_path / "ours"
    ours = run_script([sys.executable, str(SCRIPT), str(out)], out, TRAINBRIDGE_NPROC_PER_NODE="2")
    _check(ours, reference)
