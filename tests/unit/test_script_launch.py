"""``launch.script_launch``: when ``python script.py`` is re-executed under torchrun, forked, run in place or
refused, and the command line its workers run (the launches themselves: tests/distributed/test_script_launch.py)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from transformers import TrainingArguments

from trainbridge.core import nproc
from trainbridge.core.config import TorchrunArgs
from trainbridge.launch import forked_workers, script_launch, script_workers
from trainbridge.launch.script_launch import (
    CommandLine,
    ScriptLaunchError,
    decide,
    parse_command_line,
    session_kind,
    worker_command,
    world_problem,
)

WORKER = ("RANK", "LOCAL_RANK", "WORLD_SIZE")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["python", "train.py", "--lr", "1"], CommandLine((), "script", "train.py", ("--lr", "1"))),
        (
            ["python", "-u", "-W", "error", "-Xdev", "train.py", "-m", "x"],
            CommandLine(("-u", "-W", "error", "-Xdev"), "script", "train.py", ("-m", "x")),
        ),
        (["python", "-B", "-m", "pkg.train", "-c", "1"], CommandLine(("-B",), "module", "pkg.train", ("-c", "1"))),
        (["python", "-mpkg.train"], CommandLine((), "module", "pkg.train", ())),
        (["python", "-Im", "pkg"], CommandLine(("-I",), "module", "pkg", ())),
        (["python", "-c", "print(1)", "a"], CommandLine((), "command", "print(1)", ("a",))),
        (["python", "-uc", "print(1)"], CommandLine(("-u",), "command", "print(1)", ())),
        (["python", "-", "a"], CommandLine((), "stdin", None, ("a",))),
        (["python", "-O"], CommandLine(("-O",), "stdin", None, ())),
        (
            ["python", "--check-hash-based-pycs", "never", "-P", "s.py"],
            CommandLine(("--check-hash-based-pycs", "never", "-P"), "script", "s.py", ()),
        ),
    ],
)
def test_the_interpreters_command_line_is_read_as_the_interpreter_reads_it(argv: list[str], expected: Any) -> None:
    assert parse_command_line(argv) == expected


def test_workers_run_the_same_command_line_with_this_interpreter() -> None:
    line = parse_command_line(["python3", "-W", "error", "train.py", "--epochs", "2"])
    assert worker_command(line, "/venv/bin/python") == ["/venv/bin/python", "-W", "error", "train.py", "--epochs", "2"]
    module = parse_command_line(["python3", "-X", "utf8", "-m", "pkg.train", "a"])
    assert worker_command(module, "/py") == ["/py", "-X", "utf8", "-m", "pkg.train", "a"]
    with pytest.raises(ValueError, match="command program cannot be run again"):
        worker_command(parse_command_line(["python", "-c", "pass"]))


@pytest.mark.parametrize("session", ["worker", "test", "script", "module", "command", "stdin", "interactive"])
def test_one_process_always_runs_in_place(session: Any) -> None:
    assert decide(session, 1).action == "in_place"


def test_several_processes_fork_a_script_or_re_execute_it_where_a_fork_is_unsafe_and_refuse_a_session() -> None:
    assert decide("worker", 4).action == "in_place"  # already one rank of a job: never a nested launch
    assert decide("test", 4).action == "in_place"  # pytest is not a training script
    assert decide("script", 2).action == "fork" and decide("module", 2).action == "fork"
    unsafe = decide("script", 2, "CUDA is already initialised in this process")
    assert unsafe.action == "torchrun" and "CUDA" in unsafe.reason  # a script can run again instead
    assert decide("command", 2).action == "fork" and decide("stdin", 2).action == "fork"
    refused = decide("command", 2, "CUDA is already initialised in this process")
    assert refused.action == "refuse" and "CUDA is already initialised" in refused.reason
    interactive = decide("interactive", 2)
    assert interactive.action == "refuse" and "\n" not in interactive.reason
    assert "python script.py" in interactive.reason and f"{nproc.NPROC_ENV}=1" in interactive.reason


def test_the_session_is_read_from_the_environment_and_the_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in WORKER:
        monkeypatch.setenv(name, "0")
    assert session_kind() == "worker"
    for name in WORKER:
        monkeypatch.delenv(name)
    assert session_kind() == "test"
    monkeypatch.delitem(sys.modules, "_pytest")
    assert session_kind(orig_argv=["python", "train.py"]) == "script"
    assert session_kind(orig_argv=["python", "-m", "pkg"]) == "module"
    assert session_kind(orig_argv=["python", "-c", "pass"]) == "command"
    monkeypatch.setattr(sys, "ps1", ">>> ", raising=False)
    assert session_kind(orig_argv=["python", "train.py"]) == "interactive"


@pytest.fixture
def script_run(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """A plain ``python -W error train.py --x`` process (not pytest), launches recorded instead of started."""
    for name in WORKER:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(script_launch, "_done", False)
    monkeypatch.setattr(script_launch, "session_kind", lambda: "script")
    monkeypatch.setattr(sys, "orig_argv", ["python", "-W", "error", "train.py", "--x"])
    calls: list[Any] = []
    monkeypatch.setattr(script_workers, "run_under_torchrun", lambda command, n: calls.append((command, n)) or 7)
    monkeypatch.setattr(script_workers, "exit_with", lambda code: calls.append(("exit", code)))
    monkeypatch.setattr(forked_workers, "fork_workers", lambda n: calls.append(("fork", n)))
    monkeypatch.setattr(forked_workers, "release_openmp", lambda: None)
    monkeypatch.delenv(script_launch.SCRIPT_FORK_ENV, raising=False)
    monkeypatch.setattr(threading, "active_count", lambda: 1)  # pytest's own threads are not the script's
    return calls


def test_a_script_asking_for_several_processes_forks_them_once(
    script_run: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(nproc.NPROC_ENV, "2")
    # this test process's own state is pinned safe (as the next test pins it unsafe): the xdist worker may hold
    # threads, an accelerate state or a process group from earlier tests, which refuse the fork (re-run instead)
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    monkeypatch.setattr(script_launch, "_devices_set_up", lambda: None)
    script_launch.launch_script()
    script_launch.launch_script()  # a second Trainer name resolved: nothing more
    assert script_run == [("fork", 2)]


@pytest.mark.parametrize("unsafe", ["opted_out", "python_thread", "openmp", "devices_set_up"])
def test_a_script_that_cannot_fork_is_re_executed_once_and_exits_with_the_jobs_status(
    script_run: list[Any], monkeypatch: pytest.MonkeyPatch, unsafe: str
) -> None:
    monkeypatch.setenv(nproc.NPROC_ENV, "2")
    if unsafe == "opted_out":
        monkeypatch.setenv(script_launch.SCRIPT_FORK_ENV, "0")
    elif unsafe == "python_thread":
        monkeypatch.setattr(threading, "active_count", lambda: 2)
    elif unsafe == "devices_set_up":  # a TrainingArguments made before the import (trl's scripts): world size 1
        from accelerate.state import PartialState

        monkeypatch.setattr(PartialState, "_shared_state", {"num_processes": 1})
    else:
        monkeypatch.setattr(forked_workers, "release_openmp", lambda: "the OpenMP runtime x cannot release")
    script_launch.launch_script()
    script_launch.launch_script()
    assert script_run == [([sys.executable, "-W", "error", "train.py", "--x"], 2), ("exit", 7)]


def test_a_child_forked_after_torch_ran_its_thread_pool_can_run_its_own() -> None:
    """Without ``release_openmp`` the child waits forever on the parent's OpenMP threads (GNU libgomp)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        torch.randn(1 << 20).exp().sum()  # a parallel region: the pool starts
        assert forked_workers.release_openmp() is None
        pid = os.fork()
        if pid == 0:
            torch.randn(1 << 20).exp().sum()
            os._exit(0)
        deadline = time.monotonic() + 60
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0, "the forked child hung"
    finally:
        torch.set_num_threads(threads)


def test_the_lines_of_a_forked_rank_carry_its_prefix_across_reads() -> None:
    text, at_start = forked_workers.prefixed(b"a\nb", b"[rank1]: ", True)
    assert (text, at_start) == (b"[rank1]: a\n[rank1]: b", False)
    text, at_start = forked_workers.prefixed(b"c\n\nd\n", b"[rank1]: ", at_start)
    assert (text, at_start) == (b"c\n[rank1]: \n[rank1]: d\n", True)


def test_a_script_asking_for_one_process_runs_in_place(script_run: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(nproc.NPROC_ENV, "1")
    script_launch.launch_script()
    assert script_run == []


def test_an_interactive_session_asking_for_several_is_refused_in_one_line(
    script_run: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(nproc.NPROC_ENV, "2")
    monkeypatch.setattr(script_launch, "session_kind", lambda: "interactive")
    with pytest.raises(ScriptLaunchError, match=r"interactive session cannot be run again: save the code") as error:
        script_launch.launch_script()
    assert "\n" not in str(error.value) and script_run == []


def test_torchrun_args_are_honoured_only_when_they_are_the_running_world(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in WORKER:
        monkeypatch.delenv(name, raising=False)
    assert world_problem(None) is None and world_problem(1) is None
    problem = world_problem(2)
    assert problem is not None and "\n" not in problem
    assert f"set {nproc.NPROC_ENV}=2" in problem and "torchrun --nproc-per-node 2 script.py" in problem
    for name, value in zip(WORKER, ("1", "1", "2"), strict=True):
        monkeypatch.setenv(name, value)
    assert world_problem(2) is None and "runs as 2" in (world_problem(4) or "")

    for name in WORKER:
        monkeypatch.delenv(name)
    from trainbridge.demos.tiny_model import build_tiny_llama
    from trainbridge.trainer.facade import Trainer

    model = str(build_tiny_llama(tmp_path / "model"))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to="none")
    with pytest.raises(ScriptLaunchError, match="torchrun_args= asks for 2 processes but this script runs as 1"):
        Trainer(model=model, args=args, torchrun_args=TorchrunArgs(nproc_per_node=2))
    assert Trainer(model=model, args=args, torchrun_args=TorchrunArgs(nproc_per_node=1)).torchrun_args is not None
