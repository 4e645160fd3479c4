"""run_training with the real torchrun and a stub worker: payload in real workers, failures, timeout, SIGINT.

The stub worker (written to a temporary folder the test puts on the workers' PYTHONPATH)
reads the real payload with the real key, then does what ``run_name`` says; rank 0 writes a
``RunResult`` like ``trainbridge.launch.worker`` does.  No training happens, so each test takes seconds.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import types
from pathlib import Path

import psutil
import pytest

from tests.distributed.demo_run import (
    DEMO_STEPS,
    assert_the_demo_trained_and_only_our_lines_show,
    library_lines,
    login_user_can_run,
)
from tests.run_inputs import run_training, split_run
from trainbridge.core.config import TorchrunArgs
from trainbridge.launch.launcher import (
    LaunchTimeoutError,
    TrainingInterruptedError,
    WorkerFailedError,
)
from trainbridge.launch.transport import register_by_value

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(180)]

STUB_WORKER = """
import argparse, os, sys, time

from torch.distributed.elastic.multiprocessing.errors import record

from trainbridge.loop.result import RunResult
from trainbridge.launch.transport import PAYLOAD_KEY_ENV, read_payload


@record
def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--payload", required=True)
    args, plan = read_payload(parser.parse_args().payload, os.environ[PAYLOAD_KEY_ENV])
    rank = int(os.environ["RANK"])
    print(f"stub worker rank {rank} of {os.environ['WORLD_SIZE']} says hello", flush=True)
    if args.run_name == "fail-on-rank-1":
        if rank == 1:
            raise ValueError("rank 1 failed on purpose")
        time.sleep(120)  # torchrun must tear this rank down
    if args.run_name == "killed-on-rank-1":
        if rank == 1:
            os.kill(os.getpid(), 9)  # no Python exception, so no error file
        time.sleep(120)
    if args.run_name == "sleep":
        args.ckpt_output_dir.mkdir(parents=True, exist_ok=True)
        (args.ckpt_output_dir / f"sleeping-rank{rank}").write_text(str(os.getpid()))
        time.sleep(300)
    (function,) = [fn for fns in plan.event_functions.values() for fn in fns]
    (callback,) = plan.callbacks
    if rank == 0:
        import json, psutil
        store_port = int(os.environ["MASTER_PORT"])
        agent = psutil.Process(os.getppid())
        listening = [c.laddr.ip for c in agent.net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == store_port]
        (args.ckpt_output_dir / "store-listens-on.json").write_text(json.dumps(listening))
        RunResult(
            global_step=function(rank), epoch=1.0, max_steps=callback.scale, stop_reason=callback.describe(2),
        ).write(args.ckpt_output_dir / "result.json")


if __name__ == "__main__":
    main()
"""


@pytest.fixture
def stub_worker(tmp_path, monkeypatch):
    folder = tmp_path / "stub_code"
    folder.mkdir()
    (folder / "tb_stub_worker.py").write_text(STUB_WORKER)
    monkeypatch.syspath_prepend(str(folder))
    # the worker module runs before any payload is read: the user's own PYTHONPATH must name its folder
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])))
    return "tb_stub_worker"


@pytest.fixture
def make_args(tmp_path, monkeypatch, run_files):
    model, data = run_files["model"], run_files["train"]  # the preflight reads the data with its tokenizer
    module = types.ModuleType("tb_launcher_notebook")
    exec(
        textwrap.dedent(
            """
        from trainbridge import Callback

        class Scaled(Callback):
            def __init__(self, scale):
                self.scale = scale
            def describe(self, value):
                return f"scaled {value * self.scale}"
        """
        ),
        module.__dict__,
    )
    monkeypatch.setitem(sys.modules, module.__name__, module)  # like a notebook: in this process only
    register_by_value(module)
    offset = 40

    def make(run_name):
        return split_run(
            model_path=model,
            data_path=data,
            ckpt_output_dir=tmp_path / "out",
            run_name=run_name,
            callbacks=[module.Scaled(3)],
            on_step_end=lambda rank: rank + offset + 2,
        )

    return make


def _no_stub_processes_left():
    me = psutil.Process()
    left = []
    for p in me.children(recursive=True):
        try:
            if "tb_stub_worker" in " ".join(p.cmdline()):
                left.append(p)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            continue  # exited: a zombie (an earlier test's child, not reaped yet) runs nothing and has no cmdline
    return left


def test_real_workers_rebuild_callbacks_and_rank_zero_result_comes_back(make_args, stub_worker, capfd, tmp_path):
    result = run_training(make_args("ok"), TorchrunArgs(nproc_per_node=2), worker_module=stub_worker, timeout_s=120)
    assert result is not None
    assert (result.global_step, result.max_steps, result.stop_reason) == (42, 3, "scaled 6")
    out = capfd.readouterr().out
    assert "stub worker rank 0 of 2 says hello" in out
    assert "[rank1]: stub worker rank 1 of 2 says hello" in out
    # the agent's TCP store listens on the master address only, not on every interface
    listening = json.loads((tmp_path / "out" / "store-listens-on.json").read_text())
    assert listening == ["127.0.0.1"]


def test_failing_rank_is_reported_and_the_other_rank_torn_down(make_args, stub_worker):
    with pytest.raises(WorkerFailedError) as info:
        run_training(make_args("fail-on-rank-1"), TorchrunArgs(nproc_per_node=2), worker_module=stub_worker)
    error = info.value
    assert (error.rank, error.exit_code) == (1, 1)
    assert error.message == "ValueError: rank 1 failed on purpose"
    assert "tb_stub_worker.py" in error.traceback
    assert "training failed on rank 1 (exit code 1): ValueError: rank 1 failed on purpose" in str(error)
    assert _no_stub_processes_left() == []


def test_timeout_stops_every_worker(make_args, stub_worker):
    with pytest.raises(LaunchTimeoutError, match="timeout_s=8"):
        run_training(make_args("sleep"), TorchrunArgs(nproc_per_node=2), worker_module=stub_worker, timeout_s=8)
    assert _no_stub_processes_left() == []


def test_worker_killed_by_a_signal_is_named_with_its_signal(make_args, stub_worker):
    """The killed rank is the root cause (not the survivor torchrun stopped), with the signal that ended it."""
    with pytest.raises(WorkerFailedError, match="SIGKILL") as info:
        run_training(make_args("killed-on-rank-1"), TorchrunArgs(nproc_per_node=2), worker_module=stub_worker)
    assert (info.value.rank, info.value.exit_code, info.value.signal_name) == (1, -9, "SIGKILL")
    assert str(info.value).startswith("training failed on rank 1 (exit code -9): killed with SIGKILL")
    assert _no_stub_processes_left() == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_in_the_parent_is_forwarded_and_workers_stop(make_args, stub_worker, signum, tmp_path):
    """The signal comes once both workers run (whatever the machine's speed), from another thread."""
    handler_before = signal.getsignal(signum)
    out, stop = tmp_path / "out", threading.Event()

    def signal_once_both_sleep():
        while not stop.wait(0.1):
            if all((out / f"sleeping-rank{r}").is_file() for r in (0, 1)):
                os.kill(os.getpid(), signum)
                return

    thread = threading.Thread(target=signal_once_both_sleep, daemon=True)
    thread.start()
    try:
        with pytest.raises(TrainingInterruptedError, match=signal.Signals(signum).name):
            run_training(make_args("sleep"), TorchrunArgs(nproc_per_node=2), worker_module=stub_worker)
    finally:
        stop.set()
    assert _no_stub_processes_left() == []
    assert signal.getsignal(signum) is handler_before  # the parent's own handler is back


# ----------------------------------------------------------------------------- the real worker, end to end
@pytest.mark.skipif(login_user_can_run(), reason="run as a login user by test_ordinary_user (one demo run for both)")
def test_demo_trains_two_ranks_the_loss_falls_and_only_our_lines_show(tmp_path):
    """``trainbridge demo`` as a newcomer runs it (``demo_run``'s checks), where no login user can be made."""
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_DISABLE_PROGRESS_BARS", "DS_ACCELERATOR")}
    command = [str(Path(sys.executable).with_name("trainbridge")), "demo", "--output-dir", "demo"]
    command += ["--max-steps", str(DEMO_STEPS)]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert_the_demo_trained_and_only_our_lines_show(proc.stdout, proc.stderr, tmp_path / "demo")


def test_library_lines_are_told_from_ours():
    """The classifier above, on the lines the demo printed before bitsandbytes was deferred and DDP's call
    updated, and on ours."""
    stderr = (
        "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'.\n"
        "[rank1]: WARNING bitsandbytes.backends.cpu.ops: Failed to load CPU gemm_4bit_forward\n"
        "[rank0] INFO trainbridge.data.sources: data: 2000 training samples, 200 validation samples\n"
        "/x/src/trainbridge/parallel/ddp.py:49: FutureWarning: `broadcast_buffers` is deprecated.\n"
        "  wrapped = DistributedDataParallel(\n"
        "\r 33%|###       | 1/3 [00:00<00:00,  7.93it/s]\x1b[A\r100%|##########| 3/3 [00:08<00:00,  2.61s/it]"
        "[rank0] INFO trainbridge.loop.loop: loading best model\n"
        "[rank1]: WARNING trainbridge.loop.loop: a warning of ours\n"
    )
    stdout = "trainbridge demo finished\n  steps:           3/3 (completed)\n{'loss': '4.366'}\nsome library print\n"
    assert library_lines(stdout, stderr) == [
        "some library print",
        "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'.",
        "[rank1]: WARNING bitsandbytes.backends.cpu.ops: Failed to load CPU gemm_4bit_forward",
        "/x/src/trainbridge/parallel/ddp.py:49: FutureWarning: `broadcast_buffers` is deprecated.",
        "  wrapped = DistributedDataParallel(",
    ]
