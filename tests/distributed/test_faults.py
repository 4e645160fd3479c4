"""Faults with real torchrun workers on 2 gloo ranks (tiny model, few steps): no orphans when the
launcher is SIGKILLed, a restart after ``kill -9`` of a worker that resumes by itself (two restart tests
against one uninterrupted reference run), the failing rank named with its real error, save on SIGTERM,
outside control, multi-node c10d on one machine."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.distributed.conftest import free_port
from tests.distributed.fault_callbacks import ControlThenTerminate, ExitZero, KillOnce
from tests.distributed.training_fixtures import base_args
from tests.run_inputs import run_training
from trainbridge import TorchrunArgs, TrainingInterruptedError, WorkerFailedError
from trainbridge.checkpoint.manifest import verify_checkpoint
from trainbridge.loop.result import RunResult

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(420)]
REPO = Path(__file__).resolve().parents[2]
TWO = TorchrunArgs(nproc_per_node=2)


def _env() -> dict[str, str]:
    python_path = os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": python_path}


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


def test_no_process_outlives_a_sigkilled_launcher(assets, tmp_path):
    out = tmp_path / "out"
    script = tmp_path / "launch.py"
    script.write_text(
        textwrap.dedent(f"""
        from pathlib import Path
        from tests.distributed.fault_callbacks import SlowSteps
        from tests.distributed.training_fixtures import base_args
        from tests.run_inputs import run_training
        from trainbridge import TorchrunArgs
        assets = {{k: Path(v) for k, v in { ({k: str(v) for k, v in assets.items()})!r}.items()}}
        run_training(base_args(assets, Path({str(out)!r}), max_steps=100000, callbacks=[SlowSteps()]),
                     TorchrunArgs(nproc_per_node=2))
    """)
    )
    launcher = subprocess.Popen([sys.executable, str(script)], cwd=REPO, env=_env())
    tree: list[psutil.Process] = []
    try:
        _wait_for(
            lambda: all((out / f"pid-rank{r}").is_file() for r in (0, 1)) or launcher.poll() is not None,
            240,
            "both workers to train",
        )
        assert launcher.poll() is None, "the launcher ended before its workers trained"
        tree = psutil.Process(launcher.pid).children(recursive=True)
        workers = {int((out / f"pid-rank{r}").read_text()) for r in (0, 1)}
        assert workers <= {p.pid for p in tree} and len(tree) >= 3  # torchrun agent + 2 workers
        launcher.kill()  # SIGKILL: no clean-up code runs in the launcher
        launcher.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in tree):
            time.sleep(0.2)
        survivors = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert survivors == [], f"outlived their launcher: {[(p.pid, p.cmdline()[:4]) for p in survivors]}"
    finally:
        # the launcher's tree only, the launcher reaped: not every child of this pytest worker (its
        # multiprocessing resource tracker, killed unreaped, stayed a zombie that later tests' process checks met)
        tree += psutil.Process(launcher.pid).children(recursive=True) if launcher.poll() is None else []
        launcher.kill()
        launcher.wait()
        for process in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()


SETTINGS = dict(max_steps=6, save_strategy="steps", save_steps=2, checkpoint_weights_dtype="bfloat16")
"""The two restart tests and their uninterrupted reference: checkpoints at 2, 4, 6 with bf16 weight exports
(fp32 weights and optimizer in ``dcp/`` beside them, what resume reads)."""


@pytest.fixture(scope="module")
def uninterrupted(assets, tmp_path_factory) -> tuple[RunResult, Path]:
    """The run both restart tests must end like: ``SETTINGS``, synchronous saves, never killed."""
    out = tmp_path_factory.mktemp("uninterrupted") / "plain"
    plain = run_training(base_args(assets, out, **SETTINGS), TWO, timeout_s=300)
    assert plain.restarts == 0 and plain.resumed_from is None
    return plain, out / "checkpoint-6"


def _same_final_weights(killed_dir: Path, plain_dir: Path) -> None:
    assert verify_checkpoint(killed_dir) == []
    resumed, uninterrupted = load_file(killed_dir / "model.safetensors"), load_file(plain_dir / "model.safetensors")
    assert {t.dtype for t in resumed.values()} == {torch.bfloat16}
    assert resumed.keys() == uninterrupted.keys()
    assert all(resumed[k].equal(uninterrupted[k]) for k in uninterrupted)


def test_kill_9_of_a_worker_restarts_the_job_from_its_checkpoint_to_the_same_weights(assets, tmp_path, uninterrupted):
    result = run_training(
        base_args(assets, tmp_path / "killed", callbacks=[KillOnce(1, 3)], **SETTINGS),
        TorchrunArgs(nproc_per_node=2, max_restarts=1),
        timeout_s=400,
    )
    assert (tmp_path / "killed" / "killed-once").is_file()
    assert result.restarts == 1 and result.global_step == 6
    assert Path(result.resumed_from or "").name == "checkpoint-2"
    plain, plain_dir = uninterrupted
    assert result.final_loss == plain.final_loss
    _same_final_weights(tmp_path / "killed" / "checkpoint-6", plain_dir)


def test_kill_9_while_an_async_checkpoint_is_pending_resumes_from_the_previous_one(assets, tmp_path, uninterrupted):
    """checkpoint_async: rank 1 is killed at step 5's end, while checkpoint-4 (begun at step 4, its dcp/
    part written in the background) is not yet published; checkpoint-2 is whole, the restarted job
    resumes from it, and its final weights equal an uninterrupted run's (synchronous saves)."""
    result = run_training(
        base_args(assets, tmp_path / "killed", callbacks=[KillOnce(1, 5)], checkpoint_async=True, **SETTINGS),
        TorchrunArgs(nproc_per_node=2, max_restarts=1),
        timeout_s=400,
    )
    assert result.restarts == 1 and result.global_step == 6
    assert Path(result.resumed_from or "").name == "checkpoint-2"
    plain, plain_dir = uninterrupted
    assert plain.final_loss == result.final_loss
    _same_final_weights(tmp_path / "killed" / "checkpoint-6", plain_dir)


def test_sys_exit_in_a_callback_fails_its_rank_and_the_error_is_shown_once(assets, tmp_path, capfd):
    """sys.exit(0) on rank 1 mid-run is a failure of rank 1 (not a clean exit leaving rank 0 in a
    collective); each worker prints one line, without doubled [rankN]: prefixes."""
    with pytest.raises(WorkerFailedError) as info:
        run_training(base_args(assets, tmp_path / "exit", callbacks=[ExitZero(1, 2)], max_steps=6), TWO, timeout_s=300)
    assert info.value.rank == 1 and "sys.exit(0) was called during training on rank 1" in info.value.message
    err = capfd.readouterr().err
    assert "[rank1]: trainbridge worker rank 1 failed: RuntimeError: sys.exit(0)" in err
    assert "[rank1]: [rank1]:" not in err and "Traceback" not in err


def test_sigterm_saves_at_the_next_step_and_outside_control_is_obeyed(assets, tmp_path, capfd):
    out = tmp_path / "out"
    args = base_args(assets, out, callbacks=[ControlThenTerminate()], max_steps=400, save_on_interrupt=True)
    with pytest.raises(TrainingInterruptedError, match="SIGTERM"):
        run_training(args, TWO, timeout_s=400)
    checkpoints = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    assert checkpoints == [2, 6]  # `trainbridge control out save` taken at step 2; SIGTERM received at step 6
    assert verify_checkpoint(out / "checkpoint-6") == []
    err = capfd.readouterr().err
    assert "trainbridge control save" in err and "save_on_interrupt" in err
    assert "[rank1]: [rank1]:" not in err


@pytest.mark.parametrize("nnodes", ["2", "1:2"])
def test_two_nodes_of_one_process_with_c10d_rendezvous(assets, tmp_path, nnodes):
    """``python -m trainbridge train`` from a YAML config with a callback spec, ``--set`` overrides and a timeout,
    as two single-process nodes meeting at a c10d rendezvous."""
    (tmp_path / "run.yaml").write_text(
        yaml.safe_dump(
            {
                "model_path": str(assets["model"]),
                "data_path": str(assets["train"]),
                "ckpt_output_dir": "out",
                "max_seq_len": 32,
                "max_batch_len": 64,
                "effective_batch_size": 8,
                "max_steps": 30,
                "save_strategy": "no",
                "disable_tqdm": True,
                "device": "cpu",
                "callbacks": [{"class": "transformers:PrinterCallback"}],  # a spec naming a library's class
            }
        )
    )
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "trainbridge",
        "train",
        str(tmp_path / "run.yaml"),
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        "1",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "faults",
        "--set",
        "max_steps=3",
        "--set",
        "learning_rate=0.003",
        "--timeout",
        "300",
    ]
    nodes = [
        subprocess.Popen(command, cwd=tmp_path, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    outputs = [node.communicate(timeout=360)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n----\n".join(o[-3000:] for o in outputs)
    assert any("steps:           3/3 (completed)" in o for o in outputs)
    assert (tmp_path / "out" / "result.json").is_file()
