"""``python script.py`` runs the script as ``torchrun --nproc-per-node 2 script.py`` does (issue 29, items 2 and 7).

``scripts/continual_script.py`` builds two Trainers in turn, each with ``train()`` and ``evaluate()``, with a
``TrainingArguments`` ``@dataclass`` defined in the script (its ``training_args.bin`` pickles ``__main__``'s class:
issue 29 failure 4) and a model whose output layer is tied to its embeddings (failure 6).  Under plain ``python``
(``TRAINBRIDGE_NPROC_PER_NODE=2``) the script is launched once: the same two worker processes, children of one
torchrun agent, run every call; and everything it records is what ``torchrun`` of the same script records.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.distributed.script_runs import run_script, torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

SCRIPT = Path(__file__).parent / "scripts" / "continual_script.py"
CALLS = ["train0", "evaluate0", "train1", "evaluate1"]


def _calls(out: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(out.glob("calls-*.jsonl")) for line in path.read_text().splitlines()]


def test_a_python_script_with_several_trainers_is_launched_once_as_torchrun_would(tmp_path: Path) -> None:
    launched = run_script(
        [sys.executable, str(SCRIPT), str(tmp_path / "python")], tmp_path / "python", TRAINBRIDGE_NPROC_PER_NODE="2"
    )
    reference = run_script(torchrun(SCRIPT, str(tmp_path / "torchrun")), tmp_path / "torchrun")
    calls = _calls(tmp_path / "python")
    # one launch: two processes ran every call, ranks 0 and 1, both children of one torchrun agent
    by_pid = {pid: [c["call"] for c in calls if c["pid"] == pid] for pid in {c["pid"] for c in calls}}
    assert sorted(by_pid.values()) == [CALLS, CALLS], by_pid
    assert {c["rank"] for c in calls} == {0, 1} and len({c["ppid"] for c in calls}) == 1, calls
    assert launched["world_size"] == reference["world_size"] == 2
    # everything the script records is what torchrun of it records
    for ours, theirs in zip(launched["tasks"], reference["tasks"], strict=True):
        assert ours["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-5)
        assert ours["eval_loss"] == pytest.approx(theirs["eval_loss"], rel=1e-5)
        for key in ("global_step", "eval_keys", "log_steps", "checkpoint_files", "tensors"):
            assert ours[key] == theirs[key], key
        assert ours["global_step"] == 2 and "training_args.bin" in ours["checkpoint_files"]  # failure 4


# ----------------------------------------------------------------------------- the launch itself (no training)
PROBE = """
import json, os, sys, time
from pathlib import Path
out = Path(sys.argv[1])
if "RANK" not in os.environ:
    (out / "parent.json").write_text(json.dumps({"path": sys.path}))
from trainbridge.launch.script_launch import launch_script
launch_script()
rank = os.environ["RANK"]
seen = {"argv": sys.argv, "path": sys.path, "warnoptions": sys.warnoptions, "utf8": sys.flags.utf8_mode,
        "world": os.environ["WORLD_SIZE"], "pid": os.getpid()}
(out / f"rank{rank}.json").write_text(json.dumps(seen))
print(f"hello from {rank}")
if "fail" in sys.argv and rank == "1":
    raise ValueError("rank one cannot go on")
if "exit" in sys.argv and rank == "1":
    sys.exit(3)
if "sleep" in sys.argv:
    time.sleep(120)
"""


def _probe(tmp_path: Path) -> Path:
    script = tmp_path / "scripts" / "probe.py"
    script.parent.mkdir()
    script.write_text(PROBE)
    return script


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "TRAINBRIDGE_NPROC_PER_NODE": "2", **extra}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(name, None)
    return env


def _run(command: list[str], cwd: Path, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, env=_env(**extra), capture_output=True, text=True, timeout=300, cwd=cwd)


def _seen(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("fork", ["1", "0"])
def test_a_script_runs_again_with_its_options_arguments_and_sys_path_and_its_failure_is_named(
    tmp_path: Path, fork: str
) -> None:
    """The workers run the same command line (interpreter options, script, arguments) with the ``sys.path``
    ``python script.py`` gives the script itself, nothing added, whether forked at the import or run again under
    torchrun (``TRAINBRIDGE_SCRIPT_FORK=0``); rank 1's lines carry its prefix; a failing rank is named once,
    with its error, and the script's exit status is the job's."""
    script = _probe(tmp_path)
    command = [sys.executable, "-W", "error::UserWarning", "-X", "utf8", str(script), str(tmp_path), "--flag"]
    proc = _run(command, cwd=tmp_path, TRAINBRIDGE_SCRIPT_FORK=fork)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert "hello from 0" in lines and "[rank1]: hello from 1" in lines, proc.stdout
    parent = json.loads((tmp_path / "parent.json").read_text())
    for seen in _seen(tmp_path):
        assert seen["argv"] == [str(script), str(tmp_path), "--flag"] and seen["world"] == "2"
        assert seen["warnoptions"] == ["error::UserWarning"] and seen["utf8"] == 1
        assert seen["path"] == parent["path"] and seen["path"][0] == str(script.parent)
    proc = _run([*command[:-1], "fail"], cwd=tmp_path, TRAINBRIDGE_SCRIPT_FORK=fork)
    assert proc.returncode == 1
    assert "trainbridge: training failed on rank 1 (exit code 1): ValueError: rank one cannot go on" in proc.stderr
    proc = _run([*command[:-1], "exit"], cwd=tmp_path, TRAINBRIDGE_SCRIPT_FORK=fork)
    assert proc.returncode == 3 and "training failed on rank 1 (exit code 3)" in proc.stderr, proc.stderr[-3000:]


def test_python_c_forks_its_workers_and_exits_with_the_jobs_status(tmp_path: Path) -> None:
    """``python -c`` cannot run again: the workers are forked at the import and go on with the program."""
    code = PROBE.replace("Path(sys.argv[1])", f"Path({str(tmp_path)!r})")
    proc = _run([sys.executable, "-c", code], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {seen["world"] for seen in _seen(tmp_path)} == {"2"}
    assert len({seen["pid"] for seen in _seen(tmp_path)}) == 2
    proc = _run([sys.executable, "-c", code, "exit"], cwd=tmp_path)
    assert proc.returncode == 3 and "training failed on rank 1 (exit code 3)" in proc.stderr, proc.stderr[-3000:]


def test_a_signal_to_the_script_stops_every_worker(tmp_path: Path) -> None:
    """SIGTERM (Ctrl-C takes the same path: ``launch.supervise``) reaches torchrun, which stops the ranks."""
    signum = signal.SIGTERM
    script = _probe(tmp_path)
    parent = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), "sleep"], env=_env(), cwd=tmp_path, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 240
        while not all((tmp_path / f"rank{rank}.json").is_file() for rank in range(2)):
            assert parent.poll() is None and time.monotonic() < deadline, "the workers never started"
            time.sleep(0.2)
        workers = [psutil.Process(seen["pid"]) for seen in _seen(tmp_path)]
        parent.send_signal(signum)
        assert parent.wait(timeout=120) == 128 + signum
        _gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, alive
    finally:
        if parent.poll() is None:
            parent.kill()
