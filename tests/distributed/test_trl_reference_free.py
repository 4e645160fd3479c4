"""``trainbridge.ORPOTrainer``/``CPOTrainer`` (and SimPO) under ``torchrun --nproc_per_node=2``, side by side
with trl's own trainers running the same script (``scripts/preference_script.py``): the same
``global_step``, log steps, logged keys (trl's preference metrics among them) and checkpoint files."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("trl")

from tests.distributed.script_runs import run_script_folders, torchrun

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).parent / "scripts" / "preference_script.py"
TRAINBRIDGE_FILES = {"COMPLETE", "manifest.json", "training_state.json"}
"""What a trainbridge checkpoint adds: the completion marker, file hashes, callback and loop state."""


KINDS = ["orpo", "simpo"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, dict]]:
    """trl's runs and ours, ``{"trl"|"ours": {kind: summary}}``: each side's kinds one after another in the same
    processes, one launch per side."""
    root = tmp_path_factory.mktemp("preference")
    found = {}
    for side, real in (("trl", ["real"]), ("ours", [])):
        found[side] = run_script_folders(torchrun(SCRIPT, str(root / side), ",".join(KINDS), *real), root / side, KINDS)
    return found


@pytest.mark.parametrize("kind", KINDS)
def test_two_ranks_match_trls_trainer(runs: dict[str, dict[str, dict]], kind: str) -> None:
    trl, ours = runs["trl"][kind], runs["ours"][kind]
    assert ours["global_step"] == trl["global_step"] == 4
    assert [step for step, _ in ours["rows"]] == [step for step, _ in trl["rows"]] == [2, 4]
    assert ours["rows"] == trl["rows"]  # the same keys in every row: trl's metrics at trl's steps
    assert {"rewards/margins", "logps/chosen", "nll_loss", "logits/chosen"} <= set(ours["rows"][0][1])
    if kind == "orpo":
        assert {"log_odds_ratio", "log_odds_chosen"} <= set(ours["rows"][0][1])
    assert set(ours["files"]) - TRAINBRIDGE_FILES == set(trl["files"])
    assert ours["losses"][0] == pytest.approx(trl["losses"][0], rel=0.05)  # same data, different pair order
