"""A Trainer subclass overriding ``compute_loss``, ``training_step``, ``prediction_step``, ``evaluate`` and ``log``
(``scripts/subclass_script.py``), both launch styles on 2 ranks, against transformers.Trainer: each override
runs in each worker where Trainer runs it (every micro-batch, every validation batch, every log), with the
step's ``num_items_in_batch``, the live ``state`` and the ``__init__``'s attribute; the same global_step,
log steps and metric keys.
One launch style: ``python script.py`` is re-executed under torchrun at the import, so it runs this same
code (test_script_launch and test_trainer_own_code check the two styles)."""

from __future__ import annotations

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
    assert "alpha" in ours["log_keys"] and "eval_token_accuracy" in ours["log_keys"]
    assert ours["entries"] == reference["entries"]  # every log's keys, the override's alpha included
    methods = ("calls", "evaluate", "log", "prediction_step", "training_step")
    expected = sorted(f"{method}-rank{rank}.txt" for method in methods for rank in (0, 1))
    assert sorted(ours["calls"]) == sorted(reference["calls"]) == expected
    for rank in (0, 1):
        # training_step: every micro-batch (4 steps x 2), with the live global_step / max_steps and the attribute
        steps = ours["calls"][f"training_step-rank{rank}.txt"]
        assert steps == reference["calls"][f"training_step-rank{rank}.txt"]
        assert steps == [f"{step} 0.3 4" for step in (0, 0, 1, 1, 2, 2, 3, 3)]
        # log: on every rank, at the same steps and kinds of log as Trainer (train, eval, the final summary)
        assert ours["calls"][f"log-rank{rank}.txt"] == reference["calls"][f"log-rank{rank}.txt"]
        # prediction_step: each evaluation (steps 2 and 4), with outputs for compute_metrics
        predicted = {line for line in ours["calls"][f"prediction_step-rank{rank}.txt"]}
        assert predicted == {line for line in reference["calls"][f"prediction_step-rank{rank}.txt"]}
        assert predicted == {"2 False", "4 False"}
        # evaluate: around each evaluation during training (steps 2 and 4), super() returning Trainer's metrics
        evaluated = ours["calls"][f"evaluate-rank{rank}.txt"]
        assert evaluated == reference["calls"][f"evaluate-rank{rank}.txt"]
        assert [line.split()[0] for line in evaluated] == ["2", "4"] and "eval_token_accuracy" in evaluated[0]
    # compute_loss ran in both ranks' processes, once per micro-batch (4 steps x 2), as under Trainer
    for name in ("calls-rank0.txt", "calls-rank1.txt"):
        lines = ours["calls"][name]
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
