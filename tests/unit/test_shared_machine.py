"""Safe on a shared machine (issue 24): nothing from a config's folder runs unless named, a private and
checked run folder, a control channel only its owner can use, nothing left in /tmp, no open store.

Where another user is needed, the test runs a command as ``nobody`` through ``setpriv`` (when run as root)
and is skipped otherwise.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import pwd
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import yaml

from tests.run_inputs import as_run, split_run
from trainbridge import cli
from trainbridge.core.config import RunPlan, TorchrunArgs, TrainingArgs
from trainbridge.core.private_files import folder_problem
from trainbridge.launch import launcher, lifeline, transport

OTHER_UID = 65534  # nobody
DEAD_PID = 2**22 + 12345


def as_other_user(command: list[str], **kwargs) -> subprocess.CompletedProcess[str]:
    """Run ``command`` as uid/gid ``OTHER_UID`` (skips the test unless root with ``setpriv``)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs a second user: run as root with setpriv (util-linux) to drop privileges")
    return subprocess.run(
        ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups", *command],
        capture_output=True,
        text=True,
        timeout=120,
        **kwargs,
    )


def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to give a folder to another user (chown)")


# ----------------------------------------------------------------------------- finding 1: import folders
@pytest.fixture
def project(tmp_path, run_files, monkeypatch):
    """A config folder holding a callback module, a planted ``datasets.py`` and a ``sitecustomize.py``."""
    folder = tmp_path / "project"
    folder.mkdir(mode=0o700)
    (folder / "my_callbacks.py").write_text("from trainbridge import Callback\nclass Mine(Callback):\n    pass\n")
    (folder / "datasets.py").write_text("raise SystemExit('planted datasets.py ran')\n")
    (folder / "sitecustomize.py").write_text(f"open({str(tmp_path / 'sitecustomize-ran')!r}, 'w').close()\n")
    config = {"model_path": str(run_files["model"]), "data_path": str(run_files["train"]), "ckpt_output_dir": "out"}
    (folder / "plain.yaml").write_text(yaml.safe_dump(config))
    (folder / "named.yaml").write_text(yaml.safe_dump({**config, "callbacks": [{"class": "my_callbacks:Mine"}]}))
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "my_callbacks", raising=False)  # test_cli imports a module of that name
    return folder


def test_a_config_folder_is_added_only_for_a_named_module_and_after_site_packages(project):
    assert cli.add_user_import_paths(project / "plain.yaml") == []
    assert str(project) not in sys.path
    assert cli.add_user_import_paths(project / "named.yaml") == [str(project)]
    assert sys.path[-1] == str(project)  # after site-packages: the installed datasets wins
    assert Path(importlib.util.find_spec("datasets").origin).parent.name == "datasets"
    assert importlib.util.find_spec("my_callbacks").origin == str(project / "my_callbacks.py")


def test_a_config_folder_others_can_write_is_refused_with_the_way_to_allow_it(project, monkeypatch):
    from trainbridge.core import private_files

    project.chmod(0o770)  # a group with another member (a user-private group is the user's alone: accepted)
    monkeypatch.setattr(private_files, "group_members", lambda gid: {"nobody", pwd.getpwuid(os.geteuid()).pw_name})
    with pytest.raises(cli.UntrustedFolderError, match=r"writable by its group .*\(mode 0770\).*chmod go-w"):
        cli.add_user_import_paths(project / "named.yaml")
    assert str(project) not in sys.path
    project.chmod(0o700)
    needs_root()
    os.chown(project, OTHER_UID, OTHER_UID)
    with pytest.raises(cli.UntrustedFolderError, match=f"owned by uid {OTHER_UID}"):
        cli.add_user_import_paths(project / "named.yaml")


def test_the_train_command_refuses_before_loading_anything(project, capsys):
    project.chmod(0o777)
    assert cli.main(["train", str(project / "named.yaml"), "--dry-run"]) == cli.EXIT_INVALID
    err = capsys.readouterr().err
    assert "not launched: callbacks[0].class: module 'my_callbacks'" in err and err.count("\n") == 1


def test_workers_get_user_folders_in_the_signed_payload_not_in_pythonpath(project, tmp_path):
    sys.path.insert(0, str(project))  # a script's own folder, say
    env = launcher.build_worker_environment(TorchrunArgs(), "k" * 64, tmp_path / "e.json", base={})
    assert str(project) not in env.get("PYTHONPATH", "") and env["PYTHONSAFEPATH"] == "1"
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    path, key = transport.write_payload(
        TrainingArgs.from_yaml(project / "plain.yaml"), RunPlan(), private, launcher.worker_import_path()
    )
    code = (
        "import os, sys; from trainbridge.launch.transport import read_payload; "
        "before = len(sys.path); read_payload(sys.argv[1], os.environ['K']); "
        "import datasets, my_callbacks; print(sys.path.index(sys.argv[2]) >= before, datasets.__file__)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(path), str(project)],
        cwd=project,
        text=True,
        capture_output=True,
        env={**os.environ, **env, "K": key},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    appended, datasets_file = proc.stdout.split()
    assert appended == "True" and str(project) not in datasets_file
    assert not (tmp_path / "sitecustomize-ran").exists()


# ----------------------------------------------------------------------------- finding 10: /tmp and the store
def test_a_dead_launchers_payload_folder_is_removed_on_the_next_launch(tmp_path):
    dead = tmp_path / f"{transport.PAYLOAD_DIR_PREFIX}{DEAD_PID}_1700000000.000-abcd1234"
    live = tmp_path / f"{transport.PAYLOAD_DIR_PREFIX}{lifeline.launcher_token().replace(':', '_')}-efgh5678"
    unrelated = tmp_path / f"{transport.PAYLOAD_DIR_PREFIX}cache"
    for folder in (dead, live, unrelated):
        folder.mkdir(mode=0o700)
        (folder / "training_args.payload").write_bytes(b"x")
    link = tmp_path / f"{transport.PAYLOAD_DIR_PREFIX}{DEAD_PID}_1.000-link"
    link.symlink_to(unrelated)
    assert transport.remove_stale_payload_folders(tmp_path) == [dead]
    assert not dead.exists() and live.is_dir() and unrelated.is_dir() and link.is_symlink()


def test_a_launch_removes_a_stale_payload_folder_and_names_its_own_after_the_launcher(tmp_path, monkeypatch):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    stale = tmp_path / f"{transport.PAYLOAD_DIR_PREFIX}{DEAD_PID}_1700000000.000-abcd1234"
    stale.mkdir(mode=0o700)
    mine = transport.make_payload_folder()
    assert not stale.exists()
    assert mine.name.startswith(transport.PAYLOAD_DIR_PREFIX + lifeline.launcher_token().replace(":", "_"))
    assert (mine.stat().st_mode & 0o777) == 0o700


def test_the_agents_store_listens_on_the_master_address_only(monkeypatch):
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous

    from trainbridge.launch import agent

    monkeypatch.setattr(static_tcp_rendezvous, "TCPStore", static_tcp_rendezvous.TCPStore)  # restored after
    agent.bind_store_to_master_address()
    port = launcher.free_port()
    store = static_tcp_rendezvous.TCPStore(
        "127.0.0.1", port, 1, True, datetime.timedelta(seconds=30), multi_tenant=True
    )
    store.set("k", "v")
    listening = [
        c.laddr.ip
        for c in psutil.Process().net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    ]
    assert listening == ["127.0.0.1"]


def test_folder_problem_names_what_others_could_change(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir(mode=0o700)
    assert folder_problem(folder) is None
    folder.chmod(0o702)
    assert "writable by others" in (folder_problem(folder) or "")
    folder.chmod(0o700)
    inner = folder / "inner"
    inner.mkdir(mode=0o700)
    folder.chmod(0o777)
    assert "a parent of" in (folder_problem(inner) or "") and "sticky" in (folder_problem(inner) or "")
    folder.chmod(0o1777)
    assert folder_problem(inner) is None


# ----------------------------------------------------------------------------- finding 4: the control channel
@pytest.fixture
def shared_dir():
    """A folder in /tmp that another user can reach (pytest's own tmp_path is private to this user)."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="tb-shared-test-", dir="/tmp"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _rank0_context(run_dir: Path, run_files):
    from trainbridge.core.context import TrainingContext
    from trainbridge.core.distributed import DistributedEnv

    args = split_run(model_path=run_files["model"], data_path=run_files["train"], ckpt_output_dir=run_dir)
    return TrainingContext(args=args, env=DistributedEnv(rank=0, world_size=1))


def test_control_folder_is_private_and_a_malformed_request_is_reported_not_fatal(tmp_path, run_files, caplog):
    from trainbridge.callbacks.external_control import ExternalControl, take_requests

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    old = os.umask(0o022)
    try:
        ExternalControl().on_train_begin(_rank0_context(run_dir, run_files))
    finally:
        os.umask(old)
    control = run_dir / "control"
    assert (control.stat().st_mode & 0o777) == 0o700
    (control / "notes.json").write_text("[1, 2]")  # not a request's name: neither read nor deleted
    (control / "1-1-stop.json").write_text("[1, 2]")  # a request's name, but a JSON array
    (control / "2-1-save.json").write_text('{"action": "save"}')
    assert take_requests(run_dir) == ["save"]
    assert "1-1-stop.json ignored: not a request" in caplog.text
    assert sorted(p.name for p in control.iterdir()) == ["listening.json", "notes.json"]  # (rank 0's marker)
    assert (control / "listening.json").stat().st_mode & 0o777 == 0o600


def test_a_linked_control_folder_is_not_followed_and_nothing_there_is_deleted(tmp_path, caplog):
    from trainbridge.callbacks.external_control import take_requests, write_request

    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run_dir.mkdir()
    elsewhere.mkdir()
    (elsewhere / "1-1-stop.json").write_text('{"action": "stop"}')
    (elsewhere / "data.json").write_text("{}")
    (run_dir / "control").symlink_to(elsewhere)
    assert take_requests(run_dir) == []
    assert "is a link or not a folder" in caplog.text
    assert sorted(p.name for p in elsewhere.iterdir()) == ["1-1-stop.json", "data.json"]
    with pytest.raises(OSError, match="refusing to follow"):
        write_request(run_dir, "save")


def test_a_request_of_another_user_is_ignored_and_logged(tmp_path, run_files, caplog):
    from trainbridge.callbacks.external_control import ExternalControl, take_requests

    needs_root()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ExternalControl().on_train_begin(_rank0_context(run_dir, run_files))
    planted = run_dir / "control" / "1-1-stop.json"
    planted.write_text('{"action": "stop"}')
    os.chown(planted, OTHER_UID, OTHER_UID)
    assert take_requests(run_dir) == []
    assert f"written by uid {OTHER_UID}" in caplog.text and not planted.exists()


def test_another_user_cannot_reach_the_control_folder_of_a_run_in_a_shared_folder(shared_dir, run_files, caplog):
    from trainbridge.callbacks.external_control import ExternalControl, take_requests

    run_dir = shared_dir / "group-project-run"
    run_dir.mkdir()
    run_dir.chmod(0o777)  # a group project folder every member can write
    ExternalControl().on_train_begin(_rank0_context(run_dir, run_files))
    attempt = as_other_user(
        ["sh", "-c", f'mkdir -p {run_dir}/control; echo \'{{"action": "stop"}}\' > {run_dir}/control/1-1-stop.json']
    )
    assert attempt.returncode != 0 and "Permission denied" in attempt.stderr
    assert take_requests(run_dir) == []


# ----------------------------------------------------------------------------- finding 5: the run folder
def test_a_new_run_folder_is_private_whatever_the_umask(tmp_path):
    from trainbridge.launch.checks import check_output_dir

    old = os.umask(0o002)
    try:
        assert check_output_dir(tmp_path / "new" / "run") is None
    finally:
        os.umask(old)
    assert ((tmp_path / "new" / "run").stat().st_mode & 0o777) == 0o700


def test_a_run_folder_others_can_write_or_another_user_owns_is_refused_before_launch(tmp_path, run_files, monkeypatch):
    monkeypatch.setattr(launcher.subprocess, "Popen", lambda *a, **k: pytest.fail("launched"))
    out = tmp_path / "out"
    out.mkdir()
    out.chmod(0o777)
    args = {"model_path": run_files["model"], "data_path": run_files["train"], "ckpt_output_dir": out}
    with pytest.raises(
        launcher.PreflightError, match=r"writable by (its group .* and )?others \(mode 0777\).*chmod go-w"
    ):
        launcher.run_training(args)
    out.chmod(0o755)
    needs_root()
    os.chown(out, OTHER_UID, OTHER_UID)
    with pytest.raises(launcher.PreflightError, match=f"owned by uid {OTHER_UID}"):
        launcher.run_training(args)
    assert not (out / ".trainbridge-lock").exists()


def test_logs_and_results_are_not_written_through_planted_links(tmp_path):
    from trainbridge.loop.result import RunResult

    out, victim = tmp_path / "out", tmp_path / "bashrc"
    (out / "logs").mkdir(parents=True)
    victim.write_text("mine\n")
    (out / "logs" / "launch.log").symlink_to(victim)
    assert launcher._append_to_log(out / "logs" / "launch.log", "appended\n") is False
    for name in ("result.tmp", f".result.json.{os.getpid()}.tmp"):
        (out / name).symlink_to(victim)
    RunResult(global_step=1, epoch=1.0, max_steps=1).write(out / "result.json")
    assert victim.read_text() == "mine\n"
    assert RunResult.read(out / "result.json").global_step == 1
    assert ((out / "result.json").stat().st_mode & 0o777) == 0o600
    (out / "logs" / "launch.log").unlink()
    (out / "logs").rmdir()
    (out / "logs").symlink_to(tmp_path)  # a linked folder is refused too
    assert launcher._append_to_log(out / "logs" / "launch.log", "appended\n") is False
    assert not (tmp_path / "launch.log").exists()


def _planted_lock(out: Path, pid: int, process_start: float) -> Path:
    import json
    import socket

    folder = out / ".trainbridge-lock"
    folder.mkdir(parents=True, mode=0o700)
    path = folder / f"{socket.gethostname()}-{pid}-planted.json"
    path.write_text(
        json.dumps(
            {
                "run_id": "planted",
                "job": "single:planted",
                "host": socket.gethostname(),
                "pid": pid,
                "started": 1.0,
                "process_start": process_start,
                "command": "?",
            }
        )
    )
    return path


def test_a_planted_lock_naming_pid_1_is_taken_over_with_a_note(tmp_path, caplog):
    from trainbridge.checkpoint.runlock import RunLock

    planted = _planted_lock(tmp_path, 1, psutil.Process(1).create_time())
    with RunLock(tmp_path) as lock:
        assert not planted.exists()
        assert (lock.folder.stat().st_mode & 0o777) == 0o700 and (lock.path.stat().st_mode & 0o777) == 0o600
    assert "taking over the stale lock" in caplog.text and "no trainbridge launcher of yours holds it" in caplog.text


def test_a_lock_file_of_another_user_is_taken_over(tmp_path, caplog):
    from trainbridge.checkpoint.runlock import RunLock

    needs_root()
    planted = _planted_lock(tmp_path, os.getpid(), psutil.Process().create_time())  # names a live launcher
    os.chown(planted, OTHER_UID, OTHER_UID)
    RunLock(tmp_path).acquire().release()
    assert f"belongs to uid {OTHER_UID}" in caplog.text


def test_another_user_cannot_plant_links_in_a_new_run_folder(shared_dir, run_files):
    from trainbridge.launch.checks import check_output_dir

    out = shared_dir / "run"
    old = os.umask(0)
    try:
        assert check_output_dir(out) is None
    finally:
        os.umask(old)
    attempt = as_other_user(["sh", "-c", f"mkdir -p {out}/logs && ln -s /etc/passwd {out}/logs/launch.log"])
    assert attempt.returncode != 0 and "Permission denied" in attempt.stderr


# ----------------------------------------------------------------------------- finding 6: a config is code
def test_a_yaml_class_that_is_not_a_callback_is_never_instantiated(tmp_path, run_files):
    from pydantic import ValidationError

    from trainbridge.core.config import CallbackSpec, NotACallbackError

    marker = tmp_path / "ran"
    spec = {"class": "subprocess:Popen", "kwargs": {"args": ["touch", str(marker)]}}
    with pytest.raises(
        ValidationError,
        match=r"callbacks\[0\].*'subprocess:Popen' is the class subprocess.Popen, "
        r"not a subclass of trainbridge.Callback",
    ):
        split_run(
            model_path=run_files["model"],
            data_path=run_files["train"],
            ckpt_output_dir=tmp_path / "out",
            callbacks=[spec],
        )
    with pytest.raises(NotACallbackError, match="it was not called"):
        CallbackSpec.model_construct(class_path="subprocess:Popen", kwargs=spec["kwargs"]).build()  # unvalidated
    assert not marker.exists()


def test_yaml_callbacks_of_both_kinds_are_still_built(tmp_path, run_files):
    from trainbridge.launch.assembly import assemble_callbacks

    args = split_run(
        model_path=run_files["model"],
        data_path=run_files["train"],
        ckpt_output_dir=tmp_path / "out",
        callbacks=[
            {"class": "transformers:EarlyStoppingCallback"},
            {"class": "trainbridge.callbacks:MetricsFileCallback"},
        ],
    )
    names = [type(c).__name__ for c in assemble_callbacks(*as_run(args))]
    assert "HuggingFaceCallbacks" in names and names.count("MetricsFileCallback") == 2


def test_a_group_project_folder_is_accepted_only_when_the_group_is_trusted(tmp_path, monkeypatch):
    from trainbridge.core import private_files
    from trainbridge.launch.checks import check_output_dir

    project = tmp_path / "project"
    project.mkdir()
    project.chmod(0o2770)  # a group project folder: members may write, no sticky bit
    monkeypatch.setattr(private_files, "group_members", lambda gid: {"nobody", pwd.getpwuid(os.geteuid()).pw_name})
    problem = check_output_dir(project / "run") or ""
    assert "writable by its group" in problem and "members: nobody" in problem and "without the sticky bit" in problem
    assert "share_run_dir_with_group=true" in problem  # the way to trust a real shared group
    assert not (project / "run").exists()  # a refused run folder is not left behind
    assert check_output_dir(project / "run", share_with_group=True) is None
    assert ((project / "run").stat().st_mode & 0o777) == 0o750
    project.chmod(0o777)
    problem = check_output_dir(project / "run", share_with_group=True) or ""
    assert "writable by others without the sticky bit" in problem and "share_run_dir_with_group" not in problem


# ----------------------------------------------------------------------------- issue 32: a login user's umask 002
def test_a_folder_writable_by_the_users_private_group_is_accepted(tmp_path, monkeypatch):
    from trainbridge.core import private_files
    from trainbridge.launch.checks import check_output_dir

    me = pwd.getpwuid(os.geteuid()).pw_name
    project = tmp_path / "project"
    project.mkdir()
    project.chmod(0o775)  # what mkdir makes under umask 002
    monkeypatch.setattr(private_files, "group_members", lambda gid: {me})
    assert folder_problem(project) is None
    assert check_output_dir(project / "run") is None
    monkeypatch.setattr(private_files, "group_members", lambda gid: {me, "nobody"})
    assert "writable by its group" in (folder_problem(project) or "")
    monkeypatch.setattr(private_files, "group_members", lambda gid: set())  # a setgid program's group
    assert "writable by its group" in (folder_problem(project) or "")


def test_a_private_group_has_the_user_as_its_only_member(monkeypatch):
    """As Debian's OpenSSH decides for StrictModes: members by primary group and by listing."""
    from trainbridge.core import private_files

    users = {"alice": 1000, "bob": 1001, "root": 0}
    primary = {"alice": 1000, "bob": 1000}
    listed: dict[int, list[str]] = {1000: [], 1001: ["alice"], 1002: [], 1003: ["alice", "bob"], 1004: ["root"]}

    def entry(name: str) -> SimpleNamespace:
        return SimpleNamespace(pw_name=name, pw_uid=users[name], pw_gid=primary.get(name, 1002 + users[name]))

    monkeypatch.setattr(private_files.pwd, "getpwall", lambda: [entry(n) for n in users])
    monkeypatch.setattr(private_files.pwd, "getpwnam", entry)
    monkeypatch.setattr(private_files.grp, "getgrgid", lambda gid: SimpleNamespace(gr_mem=listed[gid]))
    assert not private_files.private_group(1000, 1000)  # bob's primary group too
    primary["bob"] = 1001
    assert private_files.private_group(1000, 1000)  # alice's alone
    assert not private_files.private_group(1001, 1001)  # bob's primary group, but alice is listed in it
    assert not private_files.private_group(1003, 1000)  # a shared group
    assert private_files.private_group(1004, 1000)  # only root: nobody else can write
    assert not private_files.private_group(1000, 1001)  # alice's, seen by bob


def test_the_demo_folder_is_private_whatever_the_umask(tmp_path):
    from trainbridge.demos.demo import demo_training_args

    old = os.umask(0o002)
    try:
        demo_training_args(tmp_path / "demo_output", max_steps=2)
    finally:
        os.umask(old)
    assert ((tmp_path / "demo_output").stat().st_mode & 0o777) == 0o700
    written = [p for p in (tmp_path / "demo_output").rglob("*")]
    assert any(p.name == "config.json" for p in written) and any(p.suffix == ".jsonl" for p in written)
    assert {oct(p.stat().st_mode & 0o777) for p in written if p.is_file()} == {oct(0o600)}  # model, tokenizer, data
    assert {oct(p.stat().st_mode & 0o777) for p in written if p.is_dir()} == {oct(0o700)}


def test_the_metrics_file_and_its_plot_are_private_whatever_the_umask(tmp_path):
    """A run folder given by the user may already exist with the umask's modes; what the run writes there
    itself (the metrics file, the plot) is private all the same."""
    from types import SimpleNamespace

    from trainbridge.callbacks.metrics_file import MetricsFileCallback
    from trainbridge.report.plot import plot_metrics

    run = tmp_path / "run"
    old = os.umask(0o002)
    try:
        run.mkdir()  # the user's own folder: 0775
        args = SimpleNamespace(resolved_metrics_file=run / "metrics.jsonl", share_run_dir_with_group=False)
        context = SimpleNamespace(args=args, global_step=1, epoch=0.5)
        callback = MetricsFileCallback()
        callback.on_train_begin(context)
        callback.on_log(context, logs={"eval_loss": 1.0})
        callback.close(context)
        picture = plot_metrics(run)
    finally:
        os.umask(old)
    assert ((run / "metrics.jsonl").stat().st_mode & 0o777) == 0o600
    assert (picture.stat().st_mode & 0o777) == 0o600 and picture.read_bytes().startswith(b"\x89PNG")


def test_before_python_3_11_a_working_directory_others_can_write_is_refused(tmp_path):
    """Python 3.10 has no PYTHONSAFEPATH: torchrun's ``python -m`` puts the working directory first in the
    workers' sys.path, so one that others can write is refused before launch there."""
    from trainbridge.launch.checks import check_working_directory

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    problem = check_working_directory((3, 10), shared) or ""
    assert "Python 3.10 puts it first in the workers' sys.path" in problem and "writable by others" in problem
    assert "Python 3.11 or newer" in problem
    assert check_working_directory((3, 11), shared) is None  # PYTHONSAFEPATH keeps it out
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    assert check_working_directory((3, 10), mine) is None
    assert check_working_directory((3, 12)) is None
    assert problem.split(":")[0] == "working directory"
