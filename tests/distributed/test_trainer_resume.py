"""Resume restores Trainer's history: a Trainer script run twice in one ``output_dir``, against transformers.Trainer.

``scripts/resume_script.py`` trains to step 12, then again with ``trainer.train(resume_from_checkpoint=True)``
and ``max_steps=24``; the restored ``EarlyStoppingCallback`` stops it at step 16.  After each run
``trainer.state`` and the ``trainer_state.json`` of ``save_state()`` must hold what Trainer's hold: every row
since step 2 (steps and keys), the best metric and checkpoint over both runs, cumulative ``total_flos`` and
``num_input_tokens_seen``, and the stateful callbacks.  Ours runs under ``torchrun --nproc_per_node=2``; the
reference is transformers.Trainer under torchrun.
One launch style: ``python script.py`` is re-executed under torchrun at the import, so it runs this same
code (test_script_launch and test_trainer_own_code check the two styles)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainbridge.launch.launcher import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

SCRIPT = Path(__file__).parent / "scripts" / "resume_script.py"
RUNS = (["12"], ["24", "resume"])


def _twice(out: Path, *extra: str, python: bool = False) -> list[dict]:
    summaries = []
    for run in RUNS:
        script = [str(SCRIPT), str(out), *run, *extra]
        if python:
            command = [sys.executable, *script]
        else:
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc-per-node",
                "2",
                "--master-port",
                str(free_port()),
                *script,
            ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAINBRIDGE_NPROC_PER_NODE": "2"}
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
            env.pop(name, None)
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=800)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
        summaries.append(json.loads((out / f"summary-{run[0]}.json").read_text()))
    return summaries


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return _twice(tmp_path_factory.mktemp("resume") / "real", "real")


def _check(ours: list[dict], reference: list[dict]) -> None:
    problems = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            problems.append(what)

    for run, (mine, theirs) in enumerate(zip(ours, reference, strict=True)):
        check(
            mine["global_step"] == theirs["global_step"],
            f"run {run}: step {mine['global_step']} != {theirs['global_step']}",
        )
        check(mine["rows"] == theirs["rows"], f"run {run}: log_history {mine['rows']} != {theirs['rows']}")
        check(mine["saved_rows"] == mine["rows"], f"run {run}: trainer_state.json rows {mine['saved_rows']}")
        check(
            mine["stateful_callbacks"] == theirs["stateful_callbacks"],
            f"run {run}: stateful callbacks {mine['stateful_callbacks']} != {theirs['stateful_callbacks']}",
        )
        # the best of every evaluation of both runs (values differ from Trainer's in the last digits)
        best_step, best = max(mine["accuracy"], key=lambda pair: (pair[1], -pair[0]))
        check(
            mine["best_metric"] == best and mine["best_global_step"] == best_step,
            f"run {run}: best {mine['best_metric']} at {mine['best_global_step']}, evaluations {mine['accuracy']}",
        )
        check(
            Path(mine["best_model_checkpoint"]).name == f"checkpoint-{best_step}",
            f"run {run}: best checkpoint {mine['best_model_checkpoint']}",
        )
        check(
            mine["num_input_tokens_seen"] == mine["last_tokens"],
            f"run {run}: tokens {mine['num_input_tokens_seen']} != last row's {mine['last_tokens']}",
        )
        saved = {k: mine[k] for k in mine["saved"]}
        check(mine["saved"] == saved, f"run {run}: trainer_state.json {mine['saved']} != state {saved}")
    for key in ("total_flos", "num_input_tokens_seen"):  # counted on from the checkpoint, not from 0
        check(ours[1][key] > ours[0][key] * 1.2, f"{key}: {ours[0][key]} then {ours[1][key]}")
    assert not problems, problems


def test_torchrun_script_resumes_with_trainers_history(reference: list[dict], tmp_path: Path) -> None:
    _check(_twice(tmp_path / "ours"), reference)
