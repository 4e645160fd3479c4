"""A Trainer script passing ``optimizers=(SGD(momentum=0.9), LambdaLR)`` (``scripts/optimizers_script.py``),
both launch styles on 2 ranks, against transformers.Trainer: each worker steps an SGD with the script's
momentum and per-group learning rates, and the logged learning_rate follows the script's lambda.  Under
torchrun, and under ``python script.py`` (re-executed under torchrun), the optimizer stepping is the script's own
object, as under Trainer.
One launch style: ``python script.py`` is re-executed under torchrun at the import, so it runs this same
code (test_script_launch and test_trainer_own_code check the two styles)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.script_runs import run_script, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

SCRIPT = Path(__file__).parent / "scripts" / "optimizers_script.py"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("optimizers") / "real"
    return run_script(torchrun(SCRIPT, str(out), "real"), out)


def _check(ours: dict, reference: dict) -> None:
    assert ours["global_step"] == reference["global_step"] == 4
    assert ours["learning_rates"] == reference["learning_rates"] == [0.05 * 0.5**k for k in range(4)]
    assert sorted(ours["probes"]) == ["optim-rank0.txt", "optim-rank1.txt"]
    for name, steps in ours["probes"].items():
        assert [s[:4] for s in steps] == [s[:4] for s in reference["probes"][name]], name
        assert steps[0][:4] == [1, "SGD", "LambdaLR", [[0.9, 0.025, 20], [0.9, 0.01, 1]]]
    assert reference["stepped_in_place"] and reference["groups_hold_model_parameters"]
    assert all(s[4] for steps in reference["probes"].values() for s in steps)
    assert ours["groups_hold_model_parameters"]


def test_torchrun_steps_the_scripts_own_optimizer_objects(reference: dict, tmp_path: Path) -> None:
    out = tmp_path / "ours"
    ours = run_script(torchrun(SCRIPT, str(out)), out)
    _check(ours, reference)
    # the very object the script built, on both ranks, over the script's model's parameters, as under Trainer
    assert all(s[4] for steps in ours["probes"].values() for s in steps)
    assert ours["stepped_in_place"]
