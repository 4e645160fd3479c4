"""``trainbridge.ORPOTrainer``/``CPOTrainer`` (and SimPO) under ``torchrun --nproc_per_node=2``, side by side
with trl's own trainers running the same script (``scripts/preference_script.py``): the same
``global_step``, log steps, logged keys (trl's preference metrics among them) and checkpoint files."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("trl")

from tests.distributed.script_runs import run_script, torchrun

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).parent / "scripts" / "preference_script.py"
TRAINBRIDGE_FILES = {"COMPLETE", "manifest.json", "training_state.json"}
"""What a trainbridge checkpoint adds: the completion marker, file hashes, callback and loop state."""


@pytest.mark.parametrize("kind", ["orpo", "simpo"])
def test_two_ranks_match_trls_trainer(tmp_path: Path, kind: str) -> None:
    trl = run_script(torchrun(SCRIPT, str(tmp_path / "trl"), kind, "real"), tmp_path / "trl")
    ours = run_script(torchrun(SCRIPT, str(tmp_path / "ours"), kind), tmp_path / "ours")
    assert ours["global_step"] == trl["global_step"] == 4
    assert [step for step, _ in ours["rows"]] == [step for step, _ in trl["rows"]] == [2, 4]
    assert ours["rows"] == trl["rows"]  # the same keys in every row: trl's metrics at trl's steps
    assert {"rewards/margins", "logps/chosen", "nll_loss", "logits/chosen"} <= set(ours["rows"][0][1])
    if kind == "orpo":
        assert {"log_odds_ratio", "log_odds_chosen"} <= set(ours["rows"][0][1])
    assert set(ours["files"]) - TRAINBRIDGE_FILES == set(trl["files"])
    assert ours["losses"][0] == pytest.approx(trl["losses"][0], rel=0.05)  # same data, different pair order
