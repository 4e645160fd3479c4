"""Run a side-by-side test script (``scripts/*_script.py``) and read the ``summary.json`` it writes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from trainbridge.launch.launcher import free_port

EXIT_ABORT = "terminate called without an active exception"
"""What a real ``transformers.Trainer`` rank prints when gloo's threads abort it at interpreter exit (now and
then, after its work: outside trainbridge, which tears its process group down itself)."""


def run_script(command: list[str], out: Path, **env: str) -> dict:
    """Run ``command`` outside any launcher's environment; it must succeed; returns ``out/summary.json``."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        full_env.pop(name, None)
    run_checked(command, full_env, out)
    return json.loads((out / "summary.json").read_text())


def run_checked(command: list[str], env: dict[str, str], out: Path) -> None:
    """Run ``command``; it must succeed.  Run once more, from an empty ``out``, only when it failed for a reason
    outside the code under test: the reference (``real``) run aborted at exit (``EXIT_ABORT``), or another
    process took the rendezvous port.  One of ours that aborted at exit after writing its summary passes (its
    checks read the summary); the facade leaves its process group at exit to avoid that abort."""
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=800)
    output = proc.stdout + proc.stderr
    finished = (out / "summary.json").is_file()  # the script's work is done and recorded
    if proc.returncode != 0 and EXIT_ABORT in output and finished and "real" not in command:
        return  # ours aborted at interpreter exit after its work (gloo's threads); its checks run on the summary
    if proc.returncode != 0 and (("real" in command and EXIT_ABORT in output) or "EADDRINUSE" in output):
        shutil.rmtree(out, ignore_errors=True)
        proc = subprocess.run(_on_a_new_port(command), env=env, capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]


def _on_a_new_port(command: list[str]) -> list[str]:
    """``command`` with its ``--master-port`` value replaced by a free port (unchanged without one)."""
    if "--master-port" not in command:
        return command
    at = command.index("--master-port") + 1
    return [*command[:at], str(free_port()), *command[at + 1 :]]


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
