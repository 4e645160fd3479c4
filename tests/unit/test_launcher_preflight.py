"""run_training before and around torchrun, without starting it: preflight, command, environment, reports.

``subprocess.Popen`` is replaced in every test: either it must never be called (a preflight failure
starts nothing) or a fake stands in for torchrun and leaves what torchrun would leave on disk.
"""

import json
import stat
import sys
import threading
from pathlib import Path

import pytest
from pydantic import ValidationError
from transformers import EarlyStoppingCallback, PrinterCallback

from trainbridge.core.callback import Callback
from trainbridge.core.config import CallbackSpec, TorchrunArgs
from trainbridge.launch import launcher
from trainbridge.launch.launcher import (
    PreflightError,
    WorkerFailedError,
    build_torchrun_command,
    build_worker_environment,
    run_training,
)
from trainbridge.launch.transport import PAYLOAD_KEY_ENV, CallbackTransportError, read_payload
from trainbridge.loop.result import RunResult


class NeedsAToken(Callback):
    """Importable by path; its constructor fails like a callback missing a credential."""

    def __init__(self, token=None):
        if token is None:
            raise ValueError("NeedsAToken needs token=")


class RejectsTheConfig(Callback):
    def validate(self, args):
        raise ValueError("needs eval_strategy='steps'")


class HoldsALock(Callback):
    def __init__(self):
        self.lock = threading.Lock()


@pytest.fixture
def train_args(run_files):
    return {"model_path": run_files["model"], "data_path": run_files["train"], "ckpt_output_dir": run_files["out"]}


@pytest.fixture
def no_launch(monkeypatch):
    def popen(*args, **kwargs):
        raise AssertionError("torchrun was started although preflight should have failed")

    monkeypatch.setattr(launcher.subprocess, "Popen", popen)


class FakeTorchrun:
    """Stands in for the torchrun process: records the launch, then plays a scripted outcome."""

    launches: list["FakeTorchrun"] = []
    outcome = None  # callable(fake) -> exit code

    def __init__(self, command, env, start_new_session):
        self.command, self.env, self.start_new_session = command, env, start_new_session
        self.pid = 2**22 + 1  # above pid_max: signalling it can never hit a real process
        self.payload = Path(command[command.index("--payload") + 1])
        self.log_dir = Path(command[command.index("--log-dir") + 1])
        self.payload_mode = stat.S_IMODE(self.payload.stat().st_mode)
        self.dir_mode = stat.S_IMODE(self.payload.parent.stat().st_mode)
        self.args, self.plan = read_payload(self.payload, env[PAYLOAD_KEY_ENV])
        FakeTorchrun.launches.append(self)
        self.returncode = FakeTorchrun.outcome(self)

    def wait(self, timeout=None):
        return self.returncode

    def poll(self):
        return self.returncode


@pytest.fixture
def fake_torchrun(monkeypatch):
    FakeTorchrun.launches = []
    monkeypatch.setattr(launcher.subprocess, "Popen", FakeTorchrun)
    return FakeTorchrun


def _write_result(fake):
    RunResult(global_step=7, epoch=1.0, max_steps=7, final_loss=0.5).write(fake.args.ckpt_output_dir / "result.json")
    return 0


# ----------------------------------------------------------------------------- preflight
def test_unpicklable_callback_fails_before_anything_starts(train_args, no_launch):
    with pytest.raises(CallbackTransportError, match=r"callbacks\[1\].*HoldsALock.*holds a thread lock"):
        run_training(train_args, callbacks=[PrinterCallback(), HoldsALock()])


def test_callback_spec_whose_constructor_raises_is_named(train_args, no_launch):
    spec = {"class": f"{__name__}:NeedsAToken", "kwargs": {}}
    with pytest.raises(PreflightError) as info:
        run_training(train_args, callbacks=[spec])
    assert f"callbacks[0]: CallbackSpec '{__name__}:NeedsAToken' failed to construct" in str(info.value)
    assert "NeedsAToken needs token=" in str(info.value)


def test_callback_spec_with_a_bad_keyword_is_named_when_validated(train_args, no_launch):
    """Caught before preflight: the constructor's signature is checked when the spec is validated."""
    with pytest.raises(ValidationError, match=r"EarlyStoppingCallback has no argument 'patience'"):
        CallbackSpec.model_validate({"class": "transformers:EarlyStoppingCallback", "kwargs": {"patience": 3}})


def test_native_callback_validate_runs_in_the_parent(train_args, no_launch):
    with pytest.raises(PreflightError, match=r"RejectsTheConfig.*rejected the config.*needs eval_strategy='steps'"):
        run_training(train_args, callbacks=[RejectsTheConfig()])


def test_misconfigured_hf_callback_fails_in_the_parent(train_args, no_launch):
    # EarlyStoppingCallback needs a metric and evaluation: under Trainer it fails at on_train_begin
    with pytest.raises(PreflightError, match=r"HuggingFaceCallbacks.*EarlyStoppingCallback.*metric_for_best_model"):
        run_training(train_args, callbacks=[EarlyStoppingCallback()])


def test_unknown_report_to_integration_fails_in_the_parent(train_args, no_launch):
    with pytest.raises(PreflightError, match=r"report_to"):
        run_training({**train_args, "report_to": ["no-such-integration"]})


def test_missing_torchrun_is_reported(train_args, no_launch, monkeypatch):
    monkeypatch.setattr(launcher.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(PreflightError, match="torchrun is not available"):
        run_training(train_args)


def test_multi_node_static_rendezvous_needs_a_port(tmp_path):
    with pytest.raises(PreflightError, match="master_port"):
        build_torchrun_command(TorchrunArgs(nnodes=2), tmp_path / "p", tmp_path / "logs")


# ----------------------------------------------------------------------------- launch
def test_launch_keeps_the_payload_private_and_returns_rank_zero_result(train_args, fake_torchrun):
    fake_torchrun.outcome = _write_result
    result = run_training(train_args, {"nproc_per_node": 2}, on_save=lambda context, **kwargs: None)
    assert result == RunResult(global_step=7, epoch=1.0, max_steps=7, final_loss=0.5)
    (fake,) = fake_torchrun.launches
    key = fake.env[PAYLOAD_KEY_ENV]
    assert all(key not in part for part in fake.command)
    assert fake.payload_mode == 0o600 and fake.dir_mode == 0o700
    assert fake.start_new_session
    assert fake.command[:3] == [sys.executable, "-m", "trainbridge.launch.agent"]  # torchrun, tied to us
    assert fake.command[-4:] == ["-m", "trainbridge.launch.worker", "--payload", str(fake.payload)]
    assert fake.command[fake.command.index("--nproc-per-node") + 1] == "2"
    assert int(fake.command[fake.command.index("--master-port") + 1]) > 0
    assert fake.command[fake.command.index("--tee") + 1] == "1:3"
    assert [e.value for e in fake.plan.event_functions] == ["on_save"]
    assert not fake.payload.parent.exists(), "the private payload directory must be removed"


def test_stale_result_is_never_returned(train_args, fake_torchrun):
    out = Path(train_args["ckpt_output_dir"])
    out.mkdir()
    RunResult(global_step=1, epoch=0.1, max_steps=1).write(out / "result.json")
    fake_torchrun.outcome = lambda fake: 0
    with pytest.raises(launcher.LaunchError, match="rank 0 wrote no result"):
        run_training(train_args)


def _fail_with_error_files(fake):
    """What torchrun leaves when local rank 1 raises under @record and rank 0 is torn down."""
    attempt = fake.log_dir / "none_abc" / "attempt_0"
    (attempt / "0").mkdir(parents=True)
    (attempt / "1").mkdir(parents=True)
    error = {
        "message": {
            "message": "ValueError: bad batch on purpose",
            "extraInfo": {
                "py_callstack": 'Traceback (most recent call last):\n  File "loop.py", line 9\n'
                "ValueError: bad batch on purpose\n",
                "timestamp": "100",
            },
        }
    }
    (attempt / "1" / "error.json").write_text(json.dumps(error))
    root = json.loads(json.dumps(error))
    root["message"]["errorCode"] = 1
    Path(fake.env["TORCHELASTIC_ERROR_FILE"]).write_text(json.dumps(root))
    return 1


def test_worker_failure_names_rank_error_and_traceback(train_args, fake_torchrun):
    fake_torchrun.outcome = _fail_with_error_files
    with pytest.raises(WorkerFailedError) as info:
        run_training(train_args, TorchrunArgs(nproc_per_node=2, nnodes=2, node_rank=1, master_port=29511))
    error = info.value
    assert (error.rank, error.local_rank, error.exit_code) == (3, 1, 1)
    assert error.message == "ValueError: bad batch on purpose"
    assert str(error).startswith("training failed on rank 3 (exit code 1): ValueError: bad batch on purpose")
    assert 'File "loop.py", line 9' in str(error)


def test_failure_names_the_launch_log_holding_torchrun_report_and_every_traceback(train_args, fake_torchrun):
    def fails_and_logs(fake):
        with open(fake.env["TRAINBRIDGE_LAUNCH_LOG"], "a") as log:  # what the agent sends there
            log.write("E torch.distributed.elastic: failed (exitcode: 1) local_rank: 1\n")
        return _fail_with_error_files(fake)

    fake_torchrun.outcome = fails_and_logs
    with pytest.raises(WorkerFailedError) as info:
        run_training(train_args, TorchrunArgs(nproc_per_node=2))
    log = Path(train_args["ckpt_output_dir"]) / "logs" / "launch.log"
    assert info.value.log_file == str(log)
    assert str(info.value).startswith("training failed on rank 1 (exit code 1): ValueError: bad batch on purpose")
    assert str(info.value).endswith(f"Full log (torchrun's own report, every rank's error): {log}")
    text = log.read_text()
    assert "trainbridge launch: torchrun --nnodes 1 --nproc-per-node 2" in text
    assert text.index("failed (exitcode: 1) local_rank: 1") < text.index("trainbridge: training failed on rank 1")
    assert 'File "loop.py", line 9' in text


def test_a_dry_run_writes_no_launch_log(train_args, fake_torchrun):
    fake_torchrun.outcome = lambda fake: 0
    assert run_training(train_args, TorchrunArgs(nproc_per_node=2), dry_run=True) is None
    assert "TRAINBRIDGE_LAUNCH_LOG" not in fake_torchrun.launches[0].env
    assert not (Path(train_args["ckpt_output_dir"]) / "logs").exists()


def test_failure_before_record_is_read_from_teed_stderr(train_args, fake_torchrun):
    def import_error(fake):
        rank_dir = fake.log_dir / "none_abc" / "attempt_0" / "1"
        rank_dir.mkdir(parents=True)
        (rank_dir / "stderr.log").write_text(
            'warning\nTraceback (most recent call last):\n  File "worker.py", line 3\n'
            "ImportError: cannot import name 'X'\n"
        )
        return 1

    fake_torchrun.outcome = import_error
    with pytest.raises(WorkerFailedError) as info:
        run_training(train_args, TorchrunArgs(nproc_per_node=2))
    assert (info.value.rank, info.value.message) == (1, "ImportError: cannot import name 'X'")


def test_torchrun_own_failure_is_not_blamed_on_a_worker(train_args, fake_torchrun):
    def rendezvous_error(fake):
        Path(fake.env["TORCHELASTIC_ERROR_FILE"]).write_text(
            json.dumps(
                {
                    "message": {
                        "message": "DistNetworkError: address already in use",
                        "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "1"},
                    }
                }
            )
        )
        return 1

    fake_torchrun.outcome = rendezvous_error
    with pytest.raises(launcher.LaunchError, match=r"torchrun failed.*address already in use") as info:
        run_training(train_args)
    assert not isinstance(info.value, WorkerFailedError)


# ----------------------------------------------------------------------------- command and environment
def test_c10d_rendezvous_command(tmp_path):
    command = build_torchrun_command(
        TorchrunArgs(nnodes="1:2", nproc_per_node=1, rdzv_endpoint="head:29400", rdzv_id="job7"),
        tmp_path / "payload",
        tmp_path / "logs",
    )
    assert command[command.index("--rdzv-endpoint") + 1] == "head:29400"
    assert command[command.index("--rdzv-id") + 1] == "job7"
    assert command[command.index("--nnodes") + 1] == "1:2"
    assert "--master-port" not in command and "--tee" not in command


def test_worker_environment(tmp_path, monkeypatch):
    extra = tmp_path / "project_code"
    extra.mkdir()
    monkeypatch.syspath_prepend(str(extra))
    env = build_worker_environment(TorchrunArgs(nproc_per_node=2), "k" * 64, tmp_path / "err.json", base={})
    assert env[PAYLOAD_KEY_ENV] == "k" * 64
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["TORCHELASTIC_ERROR_FILE"] == str(tmp_path / "err.json")
    assert int(env["OMP_NUM_THREADS"]) >= 1
    assert str(extra.resolve()) not in env.get("PYTHONPATH", "")  # it travels in the signed payload
    assert str(extra.resolve()) in launcher.worker_import_path()
    assert env["PYTHONSAFEPATH"] == "1"
    kept = build_worker_environment(TorchrunArgs(), "k", tmp_path / "e", base={"OMP_NUM_THREADS": "7"})
    assert kept["OMP_NUM_THREADS"] == "7"
