"""A Trainer script passing ``optimizers=(SGD(momentum=0.9), LambdaLR)`` (``scripts/optimizers_script.py``),
both launch styles on 2 ranks, against transformers.Trainer: each worker steps an SGD with the script's
momentum and per-group learning rates, and the logged learning_rate follows the script's lambda."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainbridge.launch.launcher import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

SCRIPT = Path(__file__).parent / "scripts" / "optimizers_script.py"


def _run(command: list[str], out: Path, **env: str) -> dict:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        full_env.pop(name, None)
    proc = subprocess.run(command, env=full_env, capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads((out / "summary.json").read_text())


def _torchrun() -> list[str]:
    port = str(free_port())
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("optimizers") / "real"
    return _run([*_torchrun(), str(SCRIPT), str(out), "real"], out)


def _check(ours: dict, reference: dict) -> None:
    assert ours["global_step"] == reference["global_step"] == 4
    assert ours["learning_rates"] == reference["learning_rates"] == [0.05 * 0.5**k for k in range(4)]
    assert sorted(ours["probes"]) == ["optim-rank0.txt", "optim-rank1.txt"]
    for name, steps in ours["probes"].items():
        assert steps == reference["probes"][name], name
        assert steps[0] == [1, "SGD", "LambdaLR", [[0.9, 0.025, 20], [0.9, 0.01, 1]]]


def test_torchrun_steps_the_scripts_optimizer_and_schedule(reference: dict, tmp_path: Path) -> None:
    out = tmp_path / "ours"
    _check(_run([*_torchrun(), str(SCRIPT), str(out)], out), reference)


def test_python_rebuilds_them_in_its_workers(reference: dict, tmp_path: Path) -> None:
    out = tmp_path / "ours"
    _check(_run([sys.executable, str(SCRIPT), str(out)], out, TRAINBRIDGE_NPROC_PER_NODE="2"), reference)
