"""Trainer scripts whose collators take the dataset's own items, with only the import changed, both launch
styles (``LAUNCHES``) on 2 gloo ranks, against transformers.Trainer under torchrun (``scripts/items_script.py``).

- ``alpaca``: stanford_alpaca's ``train.py`` in small (torch ``Dataset`` of tensors, its ``pad_sequence``
  collator, resized embeddings): under the facade the collator must get tensors, as under Trainer.
- ``classify``: ``BertForSequenceClassification`` on its own loss, ``DataCollatorWithPadding``, accuracy in
  ``compute_metrics``, ``EarlyStoppingCallback`` on ``eval_accuracy``: the same global step (the early stop),
  log steps, metric keys and checkpoints as Trainer, and the same ``eval_loss`` of the untrained model
  (``evaluate()`` before training: 21 items, 5 per batch on 2 ranks, a padded last batch).

The real Trainer's runs of both cases share one launch (``references``); ours, one launch per style (``ours``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.distributed.script_runs import run_checked
from trainbridge.launch.launcher import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

SCRIPT = Path(__file__).parent / "scripts" / "items_script.py"
SAME = ("global_step", "train_metrics", "loss_steps", "eval_steps", "checkpoints", "embeddings")


def _run(out: Path, kind: str, launch: str, real: bool = False) -> dict | None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAINBRIDGE_NPROC_PER_NODE": "2"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(name, None)
    script = [str(SCRIPT), str(out), kind, *(["real"] if real else [])]
    command = (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            *script,
        ]
        if launch == "torchrun"
        else [sys.executable, *script]
    )
    run_checked(command, env, out)
    summary = out / "summary.json"  # several kinds: each in out/<kind>
    return json.loads(summary.read_text()) if summary.is_file() else None


LAUNCHES = {"alpaca": ("torchrun", "python"), "classify": ("python",)}
"""Our launch styles per case: both for alpaca; classify runs one, for suite time (its items reach the
collator by alpaca's path, shown in both styles; what it adds, the classifier's loss, metrics, early stop
and ``evaluate()`` before training, is the same in both, as alpaca's ``losses`` check shows)."""


KINDS = ["alpaca", "classify"]


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """The real Trainer's run of each kind under torchrun, one after another in the same two processes (one
    launch for the references), each kind's summary by name."""
    root = tmp_path_factory.mktemp("facade-items") / "real"
    _run(root, ",".join(KINDS), "torchrun", real=True)
    return {kind: json.loads((root / kind / "summary.json").read_text()) for kind in KINDS}


@pytest.fixture(scope="module")
def ours(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, dict]]:
    """Our runs, ``{launch style: {kind: summary}}``: each style's kinds (``LAUNCHES``) one after another in the
    same processes, one launch per style."""
    root = tmp_path_factory.mktemp("facade-items-ours")
    runs: dict[str, dict[str, dict]] = {}
    for launch in ("torchrun", "python"):
        kinds = [kind for kind in KINDS if launch in LAUNCHES[kind]]
        summary = _run(root / launch, ",".join(kinds), launch)
        runs[launch] = {kinds[0]: summary} if summary is not None else {}
        for kind in kinds if summary is None else []:
            runs[launch][kind] = json.loads((root / launch / kind / "summary.json").read_text())
    return runs


@pytest.mark.parametrize("kind", KINDS)
def test_items_reach_the_scripts_collator_as_under_trainer(
    kind: str, references: dict, ours: dict[str, dict[str, dict]]
) -> None:
    reference = references[kind]
    runs = {launch: ours[launch][kind] for launch in LAUNCHES[kind]}
    for ours in runs.values():
        assert {k: ours[k] for k in SAME} == {k: reference[k] for k in SAME}
    if len(runs) == 2:  # the same run both ways
        assert runs["torchrun"]["losses"] == pytest.approx(runs["python"]["losses"], rel=1e-4)
    if kind == "classify":
        assert reference["global_step"] == 8  # stopped early at the 2nd evaluation (of 48 steps)
        assert ["eval_accuracy" in keys for _, keys in reference["eval_steps"]] == [True, True]
        # evaluate() of the untrained classifier: Trainer's eval batches (accelerate's even_batches, the last one
        # completed with the first items), each batch's loss with num_items_in_batch over the ranks and the
        # world-size scale, weighted by its real items
        for ours in runs.values():
            assert ours["before"]["eval_loss"] == pytest.approx(reference["before"]["eval_loss"], rel=1e-6)
            assert ours["before"]["eval_accuracy"] == reference["before"]["eval_accuracy"]
