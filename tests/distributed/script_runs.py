"""Run a side-by-side test script (``scripts/*_script.py``) and read the ``summary.json`` it writes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from trainbridge.launch.launcher import free_port


def run_script(command: list[str], out: Path, **env: str) -> dict:
    """Run ``command`` outside any launcher's environment; it must succeed; returns ``out/summary.json``."""
    run_checked(command, _outside_a_launcher(env), out)
    return json.loads((out / "summary.json").read_text())


def run_script_folders(command: list[str], out: Path, folders: list[str], **env: str) -> dict[str, dict]:
    """``run_script`` of a command that runs several cases in one launch, each writing ``out/<folder>/summary.json``;
    returns each folder's summary."""
    run_checked(command, _outside_a_launcher(env), out)
    return {folder: json.loads((out / folder / "summary.json").read_text()) for folder in folders}


def _outside_a_launcher(env: dict[str, str]) -> dict[str, str]:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        full_env.pop(name, None)
    return full_env


def run_checked(command: list[str], env: dict[str, str], out: Path) -> None:
    """Run ``command``; it must succeed, exit status 0 included.  Run once more, from an empty ``out``, only when
    another process took the rendezvous port (a reason outside the code under test).  An abort at interpreter
    exit is a failure: ours let gloo's threads go idle before the interpreter finalises
    (``core.distributed.wait_for_idle_gloo_threads``); the real-Trainer references leave by ``os._exit``."""
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=800)
    if proc.returncode != 0 and "EADDRINUSE" in proc.stdout + proc.stderr:
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
