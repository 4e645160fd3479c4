"""Run a side-by-side test script (``scripts/*_script.py``) and read the ``summary.json`` it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from trainbridge.launch.launcher import free_port


def run_script(command: list[str], out: Path, **env: str) -> dict:
    """Run ``command`` outside any launcher's environment; it must succeed; returns ``out/summary.json``."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        full_env.pop(name, None)
    proc = subprocess.run(command, env=full_env, capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads((out / "summary.json").read_text())


def torchrun(script: Path, *script_args: str) -> list[str]:
    """``torchrun --nproc-per-node 2`` of ``script`` on a free port."""
    port = str(free_port())
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        port,
        str(script),
        *script_args,
    ]
