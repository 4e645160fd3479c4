"""Faults that need no worker processes: run-folder lock, checkpoint manifest / fingerprint / fsync /
disk full, checks before launch, root-cause selection, outside control, save on SIGTERM, lifeline."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
from pathlib import Path

import psutil
import pytest
import yaml

from tests.run_inputs import RunInputs
from tests.unit.test_checkpoint import args, new_engine, save_tiny_llama, train_step  # noqa: F401 (fixture)
from trainbridge import cli
from trainbridge.callbacks.external_control import ExternalControl, take_requests, write_request
from trainbridge.callbacks.interrupt import SaveOnInterrupt
from trainbridge.checkpoint import durability, folders
from trainbridge.checkpoint import manager as manager_module
from trainbridge.checkpoint.folders import CheckpointError
from trainbridge.checkpoint.layout import MANIFEST_FILE, OWNER_FILE, TMP_PREFIX
from trainbridge.checkpoint.manager import CheckpointManager
from trainbridge.checkpoint.manifest import run_fingerprint, verify_checkpoint
from trainbridge.checkpoint.runlock import LOCK_DIR_NAME, RunFolderBusy, RunLock, live_holders
from trainbridge.core.agreement import ControlFlag
from trainbridge.core.callback_errors import OWN_CAUSE_MARKER, TrainingInterrupted
from trainbridge.core.config import TrainingArgs
from trainbridge.core.context import TrainingContext
from trainbridge.core.distributed import DistributedEnv
from trainbridge.launch import launcher, lifeline
from trainbridge.launch.checks import check_data_file, input_problems
from trainbridge.launch.errors import PreflightError, RunFolderLockedError
from trainbridge.launch.failures import root_cause

DEAD_PID = 2**22 + 1  # above pid_max: never a live process


# ----------------------------------------------------------------------------- run-folder lock
def _holder_file(out: Path, pid: int, host: str, job: str = "single:other", started: float = 1.0) -> Path:
    folder = out / LOCK_DIR_NAME
    folder.mkdir(parents=True, exist_ok=True)
    process_start = psutil.Process(pid).create_time() if psutil.pid_exists(pid) else 0.0
    path = folder / f"{host}-{pid}-other.json"
    path.write_text(
        json.dumps(
            {
                "run_id": "other",
                "job": job,
                "host": host,
                "pid": pid,
                "started": started,
                "process_start": process_start,
                "command": "trainbridge train first.yaml",
            }
        )
    )
    return path


def test_second_run_into_a_locked_folder_fails_naming_the_first(tmp_path):
    first = RunLock(tmp_path).acquire()
    try:
        with pytest.raises(RunFolderBusy, match=rf"in use by another run: pid {os.getpid()} on "):
            RunLock(tmp_path).acquire()
        same_job = RunLock(tmp_path, job=first.job).acquire()  # the launchers of one multi-node job share it
        same_job.release()
        assert live_holders(tmp_path)[0].run_id == first.run_id
    finally:
        first.release()
    assert not (tmp_path / LOCK_DIR_NAME).exists()  # released on exit: the next run may start
    RunLock(tmp_path).acquire().release()


def test_stale_lock_of_a_dead_process_is_removed(tmp_path, caplog):
    stale = _holder_file(tmp_path, DEAD_PID, socket.gethostname())
    reused = _holder_file(tmp_path, os.getpid(), socket.gethostname())  # our pid, another start time
    data = json.loads(reused.read_text())
    reused.write_text(json.dumps({**data, "process_start": 12.0}))
    with caplog.at_level(logging.WARNING), RunLock(tmp_path):
        assert not stale.exists() and not reused.exists()
    assert "stale lock" in caplog.text


def test_other_host_holder_counts_until_its_heartbeat_is_old(tmp_path):
    other = _holder_file(tmp_path, 1234, "another-host")
    with pytest.raises(RunFolderBusy, match="pid 1234 on another-host"):
        RunLock(tmp_path).acquire()
    os.utime(other, (0, 0))  # heartbeat long gone
    RunLock(tmp_path).acquire().release()


def test_run_training_refuses_a_locked_folder_before_anything_starts(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    data = tmp_path / "train.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    out = tmp_path / "out"
    out.mkdir()
    (out / "result.json").write_text("{}")  # the first run's result is not touched
    monkeypatch.setattr(launcher.subprocess, "Popen", lambda *a, **k: pytest.fail("launched"))
    with RunLock(out), pytest.raises(RunFolderLockedError, match="in use by another run"):
        launcher.run_training({"model_path": model, "data_path": data, "ckpt_output_dir": out})
    assert (out / "result.json").read_text() == "{}"


# ----------------------------------------------------------------------------- temporary checkpoint folders
def test_temporary_checkpoint_of_a_live_run_is_left_alone(tmp_path, monkeypatch):
    out = tmp_path / "out"
    live = out / f"{TMP_PREFIX}4"
    dead = out / f"{TMP_PREFIX}5"
    for folder, pid in ((live, os.getppid()), (dead, DEAD_PID)):  # the parent: alive, not us
        folder.mkdir(parents=True)
        (folder / OWNER_FILE).write_text(json.dumps({"run_id": "other", "host": socket.gethostname(), "pid": pid}))
    folders.clean_leftovers(out, "mine")
    assert live.is_dir() and not dead.exists()
    with pytest.raises(CheckpointError, match="being written by another live run"):
        folders.make_owned_folder(live, "mine")


# ----------------------------------------------------------------------------- manifest and fingerprint
def _two_checkpoints(args, fingerprint):  # noqa: F811
    engine = new_engine(args)
    manager = CheckpointManager(args.ckpt_output_dir, DistributedEnv(), None, fingerprint=fingerprint)
    train_step(engine, seed=1)
    first = manager.save(engine, None, 1, {"global_step": 1}, {})
    train_step(engine, seed=2)
    second = manager.save(engine, None, 2, {"global_step": 2}, {})
    return manager, first, second


@pytest.mark.parametrize("damage", ["truncate_weights", "empty_optimizer"])
def test_auto_resume_skips_a_corrupt_latest_checkpoint_naming_it(args, caplog, damage):  # noqa: F811
    fingerprint = run_fingerprint(args.model_path, args.data_path, {"model_type": "llama"})
    manager, first, second = _two_checkpoints(args, fingerprint)
    assert json.loads((second / MANIFEST_FILE).read_text())["files"]["model.safetensors"]["size"] > 0
    assert verify_checkpoint(second) == []
    if damage == "truncate_weights":
        with open(second / "model.safetensors", "r+b") as handle:
            handle.truncate(100)
    else:
        (second / "optimizer.pt").write_bytes(b"")
    with caplog.at_level(logging.WARNING):
        assert manager.resume_path("auto") == first
    assert f"skipping corrupt checkpoint {second}" in caplog.text
    with pytest.raises(CheckpointError, match=rf"checkpoint {second} is corrupt: .* bytes, the manifest recorded"):
        manager.resume_path(second)
    sizes_only = CheckpointManager(args.ckpt_output_dir, DistributedEnv(), None, fingerprint, checksums=False)
    assert sizes_only.resume_path("auto") == first  # sizes alone catch a truncated or emptied file


def test_same_size_corruption_is_caught_by_the_checksum_unless_checksums_are_off(args):  # noqa: F811
    manager, first, second = _two_checkpoints(args, None)
    with open(second / "model.safetensors", "r+b") as handle:
        handle.seek(-4, 2)
        handle.write(b"\x00\x01\x02\x03")
    assert manager.resume_path("auto") == first
    assert "model.safetensors does not match its recorded SHA-256" in verify_checkpoint(second)[0]
    unchecked = CheckpointManager(args.ckpt_output_dir, DistributedEnv(), None, checksums=False)
    assert unchecked.resume_path("auto") == second


def test_checkpoint_of_another_model_or_data_is_refused_unless_allowed(args, tmp_path):  # noqa: F811
    mine = run_fingerprint(args.model_path, args.data_path, {"model_type": "llama", "hidden_size": 32})
    manager, _, second = _two_checkpoints(args, mine)
    other_model = save_tiny_llama(tmp_path / "other_model")
    other_data = tmp_path / "other.jsonl"
    other_data.write_text('{"input_ids": [4, 5]}\n')
    cases = {
        "model configuration differs": run_fingerprint(
            args.model_path, args.data_path, {"model_type": "llama", "hidden_size": 64}
        ),
        "model architecture": run_fingerprint(args.model_path, args.data_path, {"model_type": "qwen2"}),
        "base model": run_fingerprint(other_model, args.data_path, {"model_type": "llama", "hidden_size": 32}),
        "training data differs": run_fingerprint(
            args.model_path, other_data, {"model_type": "llama", "hidden_size": 32}
        ),
    }
    for expected, fingerprint in cases.items():
        resumer = CheckpointManager(args.ckpt_output_dir, DistributedEnv(), None, fingerprint=fingerprint)
        with pytest.raises(CheckpointError, match=f"belongs to another run: .*{expected}"):
            resumer.resume_path("auto")
        assert resumer.resume_path("auto", allow_mismatch=True) == second
    assert manager.resume_path("auto") == second


def test_every_file_is_fsynced_before_the_complete_marker(args, monkeypatch):  # noqa: F811
    synced: set[str] = set()
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.add(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    real_write = manager_module.write_durably
    checked = []

    def marker(path, text, *mode):
        if path.name == "COMPLETE":
            files = {p.name for p in path.parent.rglob("*") if p.is_file()}
            assert files - synced == set(), f"not fsynced before COMPLETE: {files - synced}"
            checked.append(path)
        real_write(path, text, *mode)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(manager_module, "write_durably", marker)
    _two_checkpoints(args, None)
    assert len(checked) == 2 and {"model.safetensors", "optimizer.pt", MANIFEST_FILE} <= synced


def test_disk_full_names_the_disk_and_the_checkpoint_and_keeps_the_previous(args, monkeypatch):  # noqa: F811
    manager, _, second = _two_checkpoints(args, None)
    engine = new_engine(args)

    def no_space():
        raise RuntimeError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'
        )  # what safetensors raises

    monkeypatch.setattr(engine, "optimizer_state_dict", no_space)
    with pytest.raises(CheckpointError) as info:
        manager.save(engine, None, 3, {"global_step": 3}, {})
    text = str(info.value)
    assert f"disk full: the filesystem at {durability.mount_point(args.ckpt_output_dir)}" in text
    assert "no room for checkpoint checkpoint-3" in text and f"the previous checkpoint {second} is intact" in text
    assert manager.latest() == second and not (args.ckpt_output_dir / f"{TMP_PREFIX}3").exists()
    assert durability.is_disk_full(OSError(28, "No space left on device"))
    assert not durability.is_disk_full(OSError(13, "Permission denied"))


# ----------------------------------------------------------------------------- checks before launch
@pytest.fixture
def inputs(tmp_path):
    model = save_tiny_llama(tmp_path / "model")
    data = tmp_path / "train.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n{"text": "x"}\n')
    return {"model_path": model, "data_path": data, "ckpt_output_dir": tmp_path / "out"}


def test_inputs_that_would_fail_inside_the_workers_fail_before_launch(inputs, tmp_path):
    assert input_problems(TrainingArgs(**inputs)) == []
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    csv = tmp_path / "train.csv.jsonl"
    csv.write_text("input_ids,labels\n1 2 3,1 2 3\n")
    cases = {
        "model_path": (
            {"model_path": bert},
            r"^model: BertModel is not a causal LM and its forward takes no labels, "
            "so it returns no loss to train on; load the model with a task head",
        ),
        "resume": (
            {"resume_from_checkpoint": tmp_path / "out" / "checkpoint-9"},
            "resume_from_checkpoint: .*checkpoint-9' does not exist",
        ),
        "data": ({"data_path": csv}, r"data_path: .*train.csv.jsonl:1: not a JSON line"),
    }
    for name, (change, expected) in cases.items():
        problems = input_problems(TrainingArgs(**{**inputs, **change}))
        assert len(problems) == 1 and __import__("re").search(expected, problems[0]), (name, problems)
    array = tmp_path / "list.jsonl"
    array.write_text("[1, 2]\n")
    assert "expected a JSON object, got list" in (check_data_file("data_path", array) or "")


def test_unwritable_output_folder_is_a_preflight_error_and_one_cli_line(inputs, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(PreflightError, match=r"ckpt_output_dir = .*a-file/out': would be inside .* a file"):
        launcher.run_training({**inputs, "ckpt_output_dir": blocker / "out"})
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**{k: str(v) for k, v in inputs.items()}, "ckpt_output_dir": str(blocker / "o")}))
    assert cli.main(["train", str(config), "--nproc-per-node", "1"]) == cli.EXIT_INVALID
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and "ckpt_output_dir" in err


# ----------------------------------------------------------------------------- root cause
def test_the_killed_rank_is_the_root_cause_and_the_survivor_a_consequence(tmp_path):
    error_file = tmp_path / "error.json"
    error_file.write_text(
        json.dumps(
            {
                "message": {
                    "message": (
                        "RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234"
                    ),
                    "extraInfo": {"py_callstack": "Traceback ...", "timestamp": "100"},
                }
            }
        )
    )
    records = [
        {
            "rank": 0,
            "local_rank": 0,
            "pid": 10,
            "exitcode": 1,
            "signal": None,
            "error_file": str(error_file),
            "timestamp": 100,
            "message": "RuntimeError: Connection closed by peer",
        },
        {
            "rank": 1,
            "local_rank": 1,
            "pid": 11,
            "exitcode": -9,
            "signal": "SIGKILL",
            "error_file": None,
            "timestamp": 101,
            "message": "Signal 9 (SIGKILL) received by PID 11",
        },
    ]
    error = root_cause(records)
    assert (error.rank, error.exit_code, error.signal_name) == (1, -9, "SIGKILL")
    assert "out-of-memory killer" in error.message
    assert error.consequences == [
        "rank 0: RuntimeError: [gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234"
    ]
    real = tmp_path / "real.json"
    real.write_text(
        json.dumps(
            {"message": {"message": "ValueError: bad batch", "extraInfo": {"py_callstack": "tb", "timestamp": "102"}}}
        )
    )
    records.append(
        {
            "rank": 2,
            "local_rank": 2,
            "pid": 12,
            "exitcode": 1,
            "signal": None,
            "error_file": str(real),
            "timestamp": 102,
            "message": "ValueError: bad batch",
        }
    )
    assert root_cause(records).rank == 2  # a real Python error outranks a signal and a consequence


def test_fatal_callback_error_on_every_rank_names_the_rank_it_happened_on(tmp_path):
    """Every rank raises CallbackFatalError for an agreed abort; the rank whose callback raised (its error
    carries its own reason) is the root cause, even when another rank's error is older."""
    records = []
    for rank, own in ((0, ""), (1, f"{OWN_CAUSE_MARKER}Boom raised in on_step_end: no)")):
        error_file = tmp_path / f"error{rank}.json"
        message = (
            "CallbackFatalError: callback error under callback_error_policy='fatal' on rank 1 (Boom); "
            f"every rank stopped at step 3{own}"
        )
        error_file.write_text(
            json.dumps(
                {"message": {"message": message, "extraInfo": {"py_callstack": "tb", "timestamp": str(100 + rank)}}}
            )
        )
        records.append(
            {
                "rank": rank,
                "local_rank": rank,
                "pid": 10 + rank,
                "exitcode": 1,
                "signal": None,
                "error_file": str(error_file),
                "timestamp": 100 + rank,
                "message": message,
            }
        )
    assert root_cause(records).rank == 1


def test_of_ranks_that_all_raised_the_one_torchrun_sigtermed_is_not_the_root_cause(tmp_path):
    """A callback raising on every rank: each rank raises its own CallbackFatalError; the first to exit makes
    torchrun SIGTERM the other after that one wrote its error file.  The root cause (and the job's exit
    status) is the rank that exited on its own (1), not the SIGTERMed one (143), whatever their times."""
    records = []
    for rank, (code, signal_name) in enumerate(((-15, "SIGTERM"), (1, None))):
        message = f"CallbackFatalError: every rank stopped at step 5{OWN_CAUSE_MARKER}Crash raised in on_step_end)"
        error_file = tmp_path / f"error{rank}.json"
        error_file.write_text(
            json.dumps({"message": {"message": message, "extraInfo": {"py_callstack": "tb", "timestamp": "100"}}})
        )
        records.append(
            {
                "rank": rank,
                "local_rank": rank,
                "pid": 10 + rank,
                "exitcode": code,
                "signal": signal_name,
                "error_file": str(error_file),
                "timestamp": 100 + rank,
                "message": message,
            }
        )
    error = root_cause(records)
    assert (error.rank, error.exit_code) == (1, 1)


# ----------------------------------------------------------------------------- outside control
def _context(tmp_path, rank=0, eval_data=True):
    model = tmp_path / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"model_type": "llama"}')
    run_args = TrainingArgs(model_path=model, data_path=_data(tmp_path), ckpt_output_dir=tmp_path)
    context = TrainingContext(args=run_args, env=DistributedEnv(rank=rank, world_size=2))
    context.eval_dataloader = object() if eval_data else None
    return context


def _data(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"input_ids": [1, 2]}\n')
    return path


def test_control_requests_become_rank_zero_requests(tmp_path):
    context = _context(tmp_path)
    write_request(tmp_path, "stop")
    control = ExternalControl()
    control.on_train_begin(context)  # requests from an earlier run are discarded
    assert take_requests(tmp_path) == []
    for action in ("save", "evaluate", "stop", "log"):
        write_request(tmp_path, action)
    control.on_step_end(context)
    assert set(context.requests.pending) == {
        ControlFlag.SAVE,
        ControlFlag.EVALUATE,
        ControlFlag.STOP_TRAINING,
        ControlFlag.LOG,
    }
    assert "trainbridge control save" in context.requests.reasons[ControlFlag.SAVE]
    assert take_requests(tmp_path) == []
    other_rank = _context(tmp_path / "r1", rank=1)
    write_request(tmp_path / "r1", "save")
    ExternalControl().on_step_end(other_rank)
    assert other_rank.requests.pending == {}  # only rank 0 reads the folder; the agreement tells the rest


def test_cli_control_needs_a_running_job(tmp_path, capsys):
    assert cli.main(["control", str(tmp_path), "save"]) == cli.EXIT_FAILED
    assert "no running trainbridge job" in capsys.readouterr().err
    with RunLock(tmp_path):
        assert cli.main(["control", str(tmp_path), "save"]) == cli.EXIT_OK
    assert take_requests(tmp_path) == ["save"]


# ----------------------------------------------------------------------------- save on SIGTERM
def test_sigterm_becomes_an_agreed_save_and_stop_and_a_second_one_raises(tmp_path):
    context = _context(tmp_path)
    context.args.save_on_interrupt = True
    saver = SaveOnInterrupt()
    previous = signal.getsignal(signal.SIGTERM)
    try:
        saver.on_train_begin(context)
        os.kill(os.getpid(), signal.SIGTERM)  # handled: no exception, only a flag
        saver.on_step_end(context)
        assert set(context.requests.pending) == {ControlFlag.SAVE, ControlFlag.STOP_TRAINING}
        with pytest.raises(TrainingInterrupted, match="again"):
            os.kill(os.getpid(), signal.SIGTERM)
        saver.on_train_end(context)
    finally:
        signal.signal(signal.SIGTERM, previous)


# ----------------------------------------------------------------------------- lifeline
def test_launcher_token_tells_a_live_process_from_a_dead_or_reused_pid():
    token = lifeline.launcher_token()
    assert lifeline.is_alive(token)
    assert not lifeline.is_alive(f"{DEAD_PID}:1.000")
    assert not lifeline.is_alive(f"{os.getpid()}:1.000")  # same pid, other start time: reused
    assert lifeline.set_parent_death_signal(0) is True  # 0 clears it again


@pytest.mark.parametrize("field", ["per_device_train_batch_size", "gradient_accumulation_steps"])
def test_a_zero_batch_size_of_a_trainer_script_names_the_field_and_value(tmp_path, field):
    """``TrainingArguments(per_device_train_batch_size=0)``: one line naming the script's field and value before
    any step; before, a pydantic dump naming trainbridge's own fields (effective_batch_size...)."""
    import transformers

    from trainbridge import Trainer
    from trainbridge.demos.tiny_model import build_tiny_llama
    from trainbridge.trainer import job_args

    model = transformers.AutoModelForCausalLM.from_pretrained(build_tiny_llama(tmp_path / "model"))
    hf = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", use_cpu=True)
    setattr(hf, field, 0)  # as a script's argument parser could leave it
    trainer = Trainer(model=model, args=hf, train_dataset=[{"input_ids": [1, 2, 3]}])
    with pytest.raises(ValueError, match=rf"^TrainingArguments\.{field}=0: must be a positive integer"):
        RunInputs(*job_args.training_job(trainer, world_size=2, resume=None))


@pytest.mark.parametrize("where", ["a_file", "under_a_file"])
def test_an_output_dir_that_is_a_file_names_the_field_before_anything_starts(tmp_path, where):
    """``TrainingArguments(output_dir=<a file>)`` (or a folder under a file): one error naming the field and
    value, at construction; the file is left as it was.  Before: Trainer's "[Errno 17] File exists: '...'"
    from every rank, no field named."""
    import transformers

    from trainbridge import Trainer
    from trainbridge.demos.tiny_model import build_tiny_llama

    model = transformers.AutoModelForCausalLM.from_pretrained(build_tiny_llama(tmp_path / "model"))
    file = tmp_path / "notes.txt"
    file.write_text("keep me")
    output_dir = file if where == "a_file" else file / "out"
    hf = transformers.TrainingArguments(output_dir=str(output_dir), report_to="none", use_cpu=True)
    with pytest.raises(NotADirectoryError, match=r"^TrainingArguments\.output_dir='.*notes\.txt.*': cannot be used"):
        Trainer(model=model, args=hf, train_dataset=[{"input_ids": [1, 2, 3]}])
    assert file.read_text() == "keep me"
