"""``run_training``: validate, check callbacks before launch, run the real ``torchrun``, return the result.

The parent process never trains.  It validates the configuration, runs the preflight checks (every
callback can travel to the workers, ``CallbackSpec``s construct, native callbacks accept the config),
writes the authenticated payload (``trainbridge.launch.transport``) and launches::

    python -m trainbridge.launch.agent --nnodes .. --nproc-per-node .. <rendezvous> --log-dir <private dir>
        --tee 1:3,... -m trainbridge.launch.worker --payload <file>

(``trainbridge.launch.agent`` is torchrun tied to this process, see ``launch.lifeline``) with the payload
key in ``TRAINBRIDGE_PAYLOAD_KEY``.  Before anything starts the run folder is locked
(``checkpoint.runlock``: a second run into the same ``ckpt_output_dir`` fails naming the first) and the
inputs are checked (``launch.checks``).  Worker output streams live: local rank 0
writes straight to the console (so a progress bar behaves), the other ranks' lines are prefixed
``[rankN]:`` by torchrun.  When a worker fails, torchrun stops the others and the ``@record`` error
file of the first failing rank becomes a ``WorkerFailedError`` naming the rank, the exception and its
traceback (``launch.failures`` tells the cause from its consequences), raised once; torchrun's own
report (its log lines, its "Root Cause" summary) and the error in full go to the run's launch log
(``logs/launch.log`` in ``ckpt_output_dir``), which the error names, not to the console.  With ``max_restarts`` the
launcher itself restarts a failed job (a fresh torchrun, rendezvous and port) resuming from the newest
complete checkpoint.  SIGINT/SIGTERM in the parent are forwarded to torchrun; ``timeout_s`` bounds the
whole run; either way the worker process tree is gone before ``run_training`` returns or raises, and
if the launcher itself is killed, torchrun and the workers die with it.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainbridge.checkpoint.runlock import RUN_ID_ENV, RunFolderBusy, RunLock
from trainbridge.core.config import (
    CallbackSpec,
    NotACallbackError,
    RunPlan,
    TorchrunArgs,
    TrainingArgs,
    check_consistent,
)
from trainbridge.core.config.checks import check_world
from trainbridge.core.config.loss import declared_loss, trains_on_items
from trainbridge.core.distributed import DistributedEnv, launched_worker
from trainbridge.core.nproc import threads_per_worker
from trainbridge.core.private_files import append_text, make_run_folder
from trainbridge.core.run_dir import launch_log_file, result_file
from trainbridge.launch import lifeline
from trainbridge.launch.agent import FAILURES_FILE_ENV, LAUNCH_LOG_ENV
from trainbridge.launch.assembly import assemble_callbacks
from trainbridge.launch.checks import check_output_dir, input_problems
from trainbridge.launch.console import RANK_PREFIX_TEMPLATE, quiet_environment
from trainbridge.launch.data_check import check_data
from trainbridge.launch.errors import (
    LaunchError,
    LaunchTimeoutError,
    PreflightError,
    RunFolderLockedError,
    TrainingInterruptedError,
    WorkerFailedError,
)
from trainbridge.launch.failures import worker_failure
from trainbridge.launch.supervise import free_port, supervise
from trainbridge.launch.transport import (
    PAYLOAD_KEY_ENV,
    check_transportable,
    describe,
    make_payload_folder,
    write_payload,
)
from trainbridge.loop.result import RunResult

__all__ = [
    "LaunchError",
    "LaunchTimeoutError",
    "PreflightError",
    "RunFolderLockedError",
    "TrainingInterruptedError",
    "WorkerFailedError",
    "build_torchrun_command",
    "build_worker_environment",
    "free_port",
    "preflight",
    "run_training",
    "worker_failure",
    "worker_import_path",
]

logger = logging.getLogger(__name__)

AGENT_MODULE = "trainbridge.launch.agent"
"""Module the launcher runs as torchrun (``torch.distributed.run`` tied to the launcher)."""

WORKER_MODULE = "trainbridge.launch.worker"
"""Module torchrun runs in every worker (``python -m trainbridge.launch.worker --payload PATH``)."""


# ----------------------------------------------------------------------------- preflight
def preflight(args: TrainingArgs, plan: RunPlan) -> None:
    """Every check of ``args`` running ``plan`` that can fail before launch, in the parent (raises
    ``PreflightError``).

    torchrun is importable; ``peft_config`` applies to the model (``check_model_setup``); each
    ``CallbackSpec`` constructs; each native ``Callback`` accepts the
    config (``Callback.validate``); every callback and event function survives pickling
    (``check_transportable``, which raises ``CallbackTransportError``); the model, resume checkpoint and
    data files pass ``launch.checks`` (the output folder is checked once, by the caller); the data reads
    and tokenises into its cache (``launch.data_check``: bad rows named by file and line, before any worker
    starts; skipped when the same inputs passed before).
    """
    if importlib.util.find_spec("torch.distributed.run") is None:
        raise PreflightError("torchrun is not available: 'torch.distributed.run' cannot be imported")
    problems = input_problems(args)
    if problems:
        raise PreflightError("\n".join(problems))
    if args.peft_config is not None:  # imported only then: the modeling layer pulls in transformers
        from trainbridge.modeling.load import check_model_setup

        try:
            check_model_setup(args)  # peft_config against the model's modules (meta device, no weights read)
        except ValueError as exc:
            raise PreflightError(str(exc)) from exc
    for index, callback in enumerate([*args.callbacks, *plan.callbacks]):
        label = f"callbacks[{index}]"
        if isinstance(callback, CallbackSpec):
            try:
                callback = callback.build()
            except NotACallbackError as exc:
                raise PreflightError(f"{label}: {exc}") from None
            except Exception as exc:
                raise PreflightError(
                    f"{label}: CallbackSpec {callback.class_path!r} failed to construct with kwargs "
                    f"{callback.kwargs!r}: {type(exc).__name__}: {exc}"
                ) from exc
            label += f" ({callback.__class__.__name__} from its CallbackSpec)"
    # Every callback the workers will run (built-ins, user callbacks, HuggingFaceCallbacks with its
    # report_to integrations, event functions) checks the config here, before launch.
    for callback in assemble_callbacks(args, plan):
        try:
            callback.validate(args)
        except Exception as exc:
            raise PreflightError(
                f"{callback.name} ({describe(callback)}) rejected the config: {type(exc).__name__}: {exc}"
            ) from exc
    check_transportable(args, plan)
    check_data(args, trains_on_items(declared_loss(args, plan)))


# ----------------------------------------------------------------------------- command and environment
def build_torchrun_command(
    torchrun_args: TorchrunArgs,
    payload_path: Path,
    log_dir: Path,
    worker_module: str = WORKER_MODULE,
    worker_args: list[str] | None = None,
) -> list[str]:
    """The torchrun command line (the payload path is on it; the payload and its key never are)."""
    command = [
        sys.executable,
        "-m",
        AGENT_MODULE,
        "--nnodes",
        str(torchrun_args.nnodes),
        "--nproc-per-node",
        str(torchrun_args.nproc_per_node),
    ]
    if torchrun_args.rdzv_endpoint:
        command += ["--rdzv-backend", torchrun_args.rdzv_backend, "--rdzv-endpoint", torchrun_args.rdzv_endpoint]
        if torchrun_args.rdzv_id:
            command += ["--rdzv-id", torchrun_args.rdzv_id]
    else:
        port = torchrun_args.master_port
        if port is None:
            if str(torchrun_args.nnodes) != "1":
                raise PreflightError(
                    "master_port: required for a multi-node run with a static rendezvous "
                    "(or give rdzv_endpoint for a c10d rendezvous)"
                )
            port = free_port(torchrun_args.master_addr)
        command += [
            "--node-rank",
            str(torchrun_args.node_rank),
            "--master-addr",
            torchrun_args.master_addr,
            "--master-port",
            str(port),
        ]
    # torchrun's in-place restart is unreliable with gloo (connectFullMesh refused after a restart);
    # the launcher restarts the whole job itself instead (``run_training``).
    command += ["--max-restarts", "0", "--log-dir", str(log_dir)]
    if torchrun_args.nproc_per_node > 1:
        # Local rank 0 keeps the real console (progress bars work); the others are teed with a prefix.
        command += ["--tee", ",".join(f"{rank}:3" for rank in range(1, torchrun_args.nproc_per_node))]
    command += ["-m", worker_module, "--payload", str(payload_path), *(worker_args or [])]
    return command


def worker_import_path() -> list[str]:
    """The parent's ``sys.path`` entries that a fresh interpreter would not have (added folders).

    They travel in the signed payload (``launch.transport``) and the workers append them after
    site-packages, so a class the parent imports by name (from a test folder, a project folder added to
    ``sys.path``) is importable when the payload is unpickled, and nothing there shadows an installed module.
    """
    install = _install_folders()
    entries: list[str] = []
    for entry in sys.path:
        path = Path(entry or os.getcwd()).resolve()
        if not path.is_dir() or any(path == root or root in path.parents for root in install):
            continue
        if str(path) not in entries:
            entries.append(str(path))
    return entries


def _install_folders() -> set[Path]:
    return {
        Path(p).resolve()
        for name in ("stdlib", "platstdlib", "purelib", "platlib")
        if (p := sysconfig.get_paths().get(name))
    }


def _trainbridge_root() -> str | None:
    """The folder this ``trainbridge`` was imported from when it is not installed (a source checkout):
    the workers must run this copy (``-m trainbridge.launch.worker``) before any payload is read."""
    root = Path(__file__).resolve().parents[2]  # this file is <root>/trainbridge/launch/launcher.py
    install = _install_folders()
    return None if any(root == r or r in root.parents for r in install) else str(root)


def build_worker_environment(
    torchrun_args: TorchrunArgs,
    payload_key: str,
    torchrun_error_file: Path,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of torchrun and its workers: ``base`` (default ``os.environ``) plus ours.

    ``PYTHONPATH`` is the user's own (plus this trainbridge's source folder when it is not installed);
    ``PYTHONSAFEPATH`` keeps ``python -m`` from putting the working directory in front of site-packages.
    """
    env = dict(os.environ if base is None else base)
    env[PAYLOAD_KEY_ENV] = payload_key
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONSAFEPATH"] = "1"
    # torchrun copies its root-cause worker's error file here (with the exit code) when a worker fails.
    env["TORCHELASTIC_ERROR_FILE"] = str(torchrun_error_file)
    env.setdefault("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", RANK_PREFIX_TEMPLATE)
    env.setdefault("OMP_NUM_THREADS", str(threads_per_worker(torchrun_args.nproc_per_node)))
    own = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    root = _trainbridge_root()
    if root is not None and root not in own:
        own.insert(0, root)
    if own:
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(own))
    return env


# ----------------------------------------------------------------------------- entry point
def run_in_place(args: TrainingArgs, plan: RunPlan) -> RunResult:
    """Train on this rank of a job someone else launched (``torchrun script.py`` calling ``run_training``):
    the process group spans the launcher's ranks, no worker is started, every rank returns the result.

    The launcher's world decides the process count (a ``TorchrunArgs`` given to ``run_training`` is not
    used); preflight checks run on every rank.
    """
    from trainbridge.core.distributed import DistributedEnv
    from trainbridge.loop.loop import train

    preflight(args, plan)
    env = DistributedEnv.initialize(args.device, args.collective_timeout_s)

    def prepare_output_dir() -> None:
        problem = check_output_dir(args.ckpt_output_dir, args.share_run_dir_with_group)
        if problem:
            raise PreflightError(problem)
        _make_run_files_dir(args)  # result, metrics, control
        result_file(args.resolved_run_files_dir).unlink(missing_ok=True)

    env.on_rank_zero(prepare_output_dir, "preparing ckpt_output_dir", error=PreflightError)
    result = train(args, plan, env, assemble_callbacks(args, plan))
    if env.is_world_process_zero:
        result.write(result_file(args.resolved_run_files_dir))
    return result


def run_training(
    train_args: TrainingArgs | TorchrunArgs | Mapping[str, Any] | None,
    torchrun_args: TorchrunArgs | TrainingArgs | Mapping[str, Any] | None = None,
    *,
    timeout_s: float | None = None,
    worker_module: str = WORKER_MODULE,
    dry_run: bool = False,
    torch_args: TorchrunArgs | Mapping[str, Any] | None = None,
    **code: Any,
) -> RunResult | None:
    """Train with ``torchrun`` workers and return rank 0's ``RunResult``.

    ``train_args``/``torchrun_args`` are validated objects or dicts of their fields; instructlab's
    argument order ``run_training(torchrun_args, train_args)`` works too (the types tell them apart), and its
    keyword ``torch_args=``.
    ``code``: the run's code beside its settings, as ``RunPlan.from_keywords`` takes it: ``callbacks=[...]``
    (``trainbridge.Callback``/``transformers.TrainerCallback`` objects or classes), ``on_<event>=fn``,
    ``model_init=``, ``compute_metrics=``, ``preprocess_logits_for_metrics=``, ``data_collator=``,
    ``train_stream=``, ``hf_args=``... (pickled to the workers: ``launch.transport``).
    Called inside a launched worker (``torchrun script.py``: ``RANK``/``WORLD_SIZE`` set), it trains in
    place on this rank (``run_in_place``) instead of launching workers of its own.  Raises
    ``pydantic.ValidationError`` (bad config), ``PreflightError``/``CallbackTransportError`` (before
    launch, nothing started; ``RunFolderLockedError`` when another live run uses ``ckpt_output_dir``),
    ``WorkerFailedError`` (a rank failed: rank, exit code, error, traceback),
    ``LaunchTimeoutError`` (``timeout_s`` exceeded) or ``TrainingInterruptedError`` (SIGINT/SIGTERM).
    A worker failure is retried ``max_restarts`` times (``RunResult.restarts`` counts them).

    Returns None only on a node of a multi-node run that does not host rank 0 and cannot see its
    ``result.json`` (no shared file system).  ``worker_module`` replaces ``trainbridge.launch.worker`` (tests).
    ``dry_run``: the workers build the run (model, data, engine), rank 0 prints its plan, and nothing is
    trained; returns None.
    """
    if torch_args is not None:  # instructlab's keyword: run_training(torch_args=..., train_args=...)
        if torchrun_args is not None:
            raise TypeError("run_training: give torchrun_args or torch_args (instructlab's name), not both")
        torchrun_args = torch_args
    if isinstance(train_args, TorchrunArgs) or isinstance(torchrun_args, TrainingArgs):
        train_args, torchrun_args = torchrun_args, train_args  # instructlab's order: (TorchrunArgs, TrainingArgs)
    if train_args is None:
        raise TypeError("run_training: no TrainingArgs given")
    args = train_args if isinstance(train_args, TrainingArgs) else TrainingArgs.model_validate(train_args)
    plan = RunPlan.from_keywords(**code)
    check_consistent(args, plan)
    if launched_worker():
        check_world(args, int(os.environ.get("WORLD_SIZE", "1")))
        return run_in_place(args, plan)
    if torchrun_args is None:
        launch = TorchrunArgs()
    elif isinstance(torchrun_args, TorchrunArgs):
        launch = torchrun_args
    else:
        launch = TorchrunArgs.model_validate(torchrun_args)
    launch = launch.for_device(args.device)
    check_world(args, launch.max_world_size())
    # once per launch (preflight does not repeat it)
    problem = check_output_dir(args.ckpt_output_dir, args.share_run_dir_with_group)
    if problem:
        raise PreflightError(problem)
    result_path = result_file(args.resolved_run_files_dir)
    if dry_run:  # builds the run and prints its plan; writes nothing into the run folder
        preflight(args, plan)
        _launch_once(args, plan, launch, timeout_s, worker_module, "dry-run", 0, dry_run=True)
        return None
    _make_run_files_dir(args)  # the launch log, the result
    try:
        lock = RunLock(args.ckpt_output_dir, job=_job_key(launch)).acquire()
    except RunFolderBusy as exc:
        raise RunFolderLockedError(str(exc)) from None
    try:
        result_path.unlink(missing_ok=True)
        preflight(args, plan)
        restarts = _run_with_restarts(args, plan, launch, timeout_s, worker_module, lock.run_id)
    finally:
        lock.release()
    if result_path.is_file():
        result = RunResult.read(result_path)
        if restarts:
            result.restarts = restarts
            result.write(result_path)
        return result
    hosts_rank_zero = launch.node_rank == 0 if not launch.rdzv_endpoint else str(launch.nnodes) == "1"
    if hosts_rank_zero:
        raise LaunchError(f"torchrun exited cleanly but rank 0 wrote no result at {result_path}")
    return None


def _make_run_files_dir(args: TrainingArgs) -> None:
    """Create the run's own files' folder (``run_files_dir``; ``ckpt_output_dir`` exists by now)."""
    try:
        make_run_folder(args.resolved_run_files_dir, args.share_run_dir_with_group)
    except OSError as exc:
        raise PreflightError(
            f"run_files_dir = {str(args.resolved_run_files_dir)!r}: cannot be created: {exc.strerror or exc}; "
            "choose a folder you can write to."
        ) from None


def _job_key(launch: TorchrunArgs) -> str | None:
    """What the launchers of one multi-node job share (they lock the run folder together); None: unique."""
    if launch.rdzv_endpoint:
        return f"c10d:{launch.rdzv_endpoint}:{launch.rdzv_id or ''}"
    if str(launch.nnodes) != "1":
        return f"static:{launch.master_addr}:{launch.master_port}"
    return None


def _run_with_restarts(
    args: TrainingArgs, plan: RunPlan, launch: TorchrunArgs, timeout_s: float | None, worker_module: str, run_id: str
) -> int:
    """Launch; after a worker failure, launch again (up to ``max_restarts``) from the newest checkpoint
    that verifies.  Returns how many restarts happened; raises the last failure when they run out."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    restarts = 0
    attempt_args = args
    while True:
        remaining = timeout_s if deadline is None or not restarts else max(deadline - time.monotonic(), 1.0)
        try:
            _launch_once(attempt_args, plan, launch, remaining, worker_module, run_id, restarts)
            return restarts
        except WorkerFailedError as failure:
            if restarts >= launch.max_restarts:
                raise
            restarts += 1
            from trainbridge.checkpoint.manager import CheckpointManager  # here: it imports the model layer

            resume = CheckpointManager(
                args.ckpt_output_dir, DistributedEnv(), None, allow_unverified=args.resume_allow_unverified
            ).latest_verified()
            if resume is not None:
                attempt_args = args.model_copy(update={"resume_from_checkpoint": resume})
            first_line = str(failure).splitlines()[0]
            print(
                f"trainbridge: {first_line}\ntrainbridge: restart {restarts}/{launch.max_restarts}: a fresh "
                f"torchrun and rendezvous, resuming from "
                f"{resume or attempt_args.resume_from_checkpoint or 'the start'}",
                file=sys.stderr,
                flush=True,
            )


def _launch_once(
    args: TrainingArgs,
    plan: RunPlan,
    launch: TorchrunArgs,
    timeout_s: float | None,
    worker_module: str,
    run_id: str,
    restarts: int,
    dry_run: bool = False,
) -> None:
    """One torchrun job; raises ``WorkerFailedError`` (or another ``LaunchError``) when it fails."""
    private_dir = make_payload_folder()
    try:
        payload_path, key = write_payload(args, plan, private_dir, worker_import_path())
        log_dir = private_dir / "torchrun-logs"
        torchrun_error_file = private_dir / "torchrun-error.json"
        failures_file = private_dir / "failures.json"
        command = build_torchrun_command(
            launch, payload_path, log_dir, worker_module, ["--dry-run"] if dry_run else None
        )
        env = build_worker_environment(launch, key, torchrun_error_file)
        env.update(quiet_environment(args.device, env))
        env[lifeline.LAUNCHER_ENV] = lifeline.launcher_token()
        env[RUN_ID_ENV] = run_id
        env[FAILURES_FILE_ENV] = str(failures_file)
        launch_log = None if dry_run else _start_launch_log(args, launch, restarts)  # a dry run writes nothing
        if launch_log is not None:
            env[LAUNCH_LOG_ENV] = str(launch_log)
        sys.stdout.flush()
        sys.stderr.flush()
        process = subprocess.Popen(command, env=env, start_new_session=True)
        try:
            returncode = supervise(process, timeout_s)
            if returncode != 0:
                raise worker_failure(log_dir, torchrun_error_file, launch, returncode, failures_file, restarts)
        except LaunchError as error:
            if launch_log is not None and _append_to_log(launch_log, f"trainbridge: {error}\n"):
                error.name_log_file(launch_log)
            raise
    finally:
        shutil.rmtree(private_dir, ignore_errors=True)


def _start_launch_log(args: TrainingArgs, launch: TorchrunArgs, restarts: int) -> Path | None:
    """The run's launch log with this launch's header appended (torchrun's report follows); None when the
    run folder cannot take it (torchrun then reports on the console)."""
    if str(launch.nnodes) == "1":
        node = None
    else:
        node = socket.gethostname() if launch.rdzv_endpoint else f"node{launch.node_rank}"
    path = launch_log_file(args.resolved_run_files_dir, node)
    header = (
        f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S %Z')}: trainbridge launch"
        f"{f' (restart {restarts})' if restarts else ''}: torchrun --nnodes {launch.nnodes} "
        f"--nproc-per-node {launch.nproc_per_node}, launcher pid {os.getpid()} =====\n"
    )
    return path if _append_to_log(path, header) else None


def _append_to_log(path: Path, text: str) -> bool:
    """Append to a log inside the run folder, following no link (a planted one is refused, not written through)."""
    try:
        append_text(path.parent.parent, Path(path.parent.name) / path.name, text)
    except OSError:
        return False
    return True
