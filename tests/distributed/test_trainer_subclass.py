"""A Trainer subclass overriding ``compute_loss`` (``scripts/subclass_script.py``), both launch styles on 2
ranks, against transformers.Trainer: the override runs in each worker on every micro-batch, with the step's
``num_items_in_batch``; the same global_step, log steps and metric keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainbridge.launch.launcher import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

SCRIPT = Path(__file__).parent / "scripts" / "subclass_script.py"


def _run(command: list[str], out: Path, **env: str) -> dict:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        full_env.pop(name, None)
    proc = subprocess.run(command, env=full_env, capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads((out / "summary.json").read_text())


def _torchrun(script_args: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port()),
        str(SCRIPT),
        *script_args,
    ]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("subclass") / "real"
    return _run(_torchrun([str(out), "real"]), out)


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
    _check(_run(_torchrun([str(out)]), out), reference)


def test_python_sends_the_override_to_its_workers(reference: dict, tmp_path: Path) -> None:
    out = tmp_path / "ours"
    ours = _run([sys.executable, str(SCRIPT), str(out)], out, TRAINBRIDGE_NPROC_PER_NODE="2")
    _check(ours, reference)
