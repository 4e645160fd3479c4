"""Run a scenario with ``transformers.Trainer`` (torchrun + ``compat.trainer_worker``) or with
trainbridge (``run_training`` with ``TrainingArgs`` ported by ``training_args_from_hf``, called in place on
each rank of the same worker's torchrun, as a ``torchrun script.py`` calling it would; for a non-causal
scenario, the same worker with ``trainbridge.Trainer``, the facade, in place).

Layout of one run, ``{work}/{scenario}/{runner}-ws{N}/``: ``out/`` (output_dir: checkpoints, TensorBoard
runs, observations), ``trace/`` (and ``trace-resume/`` for a resume phase), ``mlruns/``, ``wandb/``,
``console.log``.  A run never raises for a training failure: the ``RunOutcome`` says what happened
(a crash or a timeout of Trainer is a finding, not an error of the suite).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from compat.assets import SAMPLE_TOKENS, CompatAssets
from compat.recorder import OBSERVED_CALLBACK_CLASSES, AttributeAccessProbe, TraceRecorder
from compat.scenarios import Scenario
from trainbridge.hf import HFPortingWarning, training_args_from_hf
from trainbridge.launch.launcher import free_port

Runner = Literal["trainer", "trainbridge"]
RUNNERS: tuple[Runner, ...] = ("trainer", "trainbridge")
REPO_ROOT = Path(__file__).resolve().parent.parent


@dataclass
class RunOutcome:
    """What one run did."""

    scenario: str
    runner: Runner
    world_size: int
    run_dir: Path
    status: Literal["completed", "failed", "timeout"] = "completed"
    error: str | None = None
    seconds: float = 0.0
    porting_warnings: list[str] = field(default_factory=list)
    console: Path | None = None
    """The console log of the launch (Trainer scenarios sharing a launch share one)."""
    shared_launch: bool = False
    """Trainer only: the launch ran other scenarios too (``seconds`` is then the launch's average)."""
    callback_errors: list[str] = field(default_factory=list)
    """trainbridge only: the callback classes ``RunResult.callback_errors`` names (every phase, every rank)."""

    @property
    def output_dir(self) -> Path:
        """The run's ``output_dir`` / ``ckpt_output_dir``."""
        return self.run_dir / "out"

    def trace_dir(self, phase: str = "") -> Path:
        """The trace directory of a phase (``""`` or ``"resume"``)."""
        return self.run_dir / ("trace" if not phase else f"trace-{phase}")


def run_dir_for(work: Path, spec: Scenario, runner: Runner, world_size: int) -> Path:
    """Where a run of ``spec`` keeps everything."""
    return work / spec.name / f"{runner}-ws{world_size}"


def integration_environment(run_dir: Path) -> dict[str, str]:
    """Environment for the reporting integrations: MLflow file store, W&B offline, all under ``run_dir``."""
    return {
        "MLFLOW_TRACKING_URI": (run_dir / "mlruns").resolve().as_uri(),
        "MLFLOW_EXPERIMENT_NAME": "compat",
        "MLFLOW_ALLOW_FILE_STORE": "true",
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(run_dir / "wandb"),
        "WANDB_PROJECT": "compat",
        "WANDB_SILENT": "true",
        "WANDB_DISABLE_GIT": "true",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


def run_scenarios(
    specs: Sequence[Scenario], runner: Runner, world_size: int, assets: CompatAssets, work: Path
) -> list[RunOutcome]:
    """Run each of ``specs`` with ``runner`` on ``world_size`` ranks (both phases of a resume scenario).

    Scenarios that do not run alone (``_runs_alone``) share one torchrun launch of ``compat.trainer_worker``
    per runner (phases run one after another in the same worker processes): the interpreter and torchrun
    start-up, not the training, is most of a tiny run's time."""
    outcomes = [_fresh_outcome(spec, runner, world_size, work) for spec in specs]
    if runner == "trainbridge":
        for spec, outcome in zip(specs, outcomes):
            if spec.task == "causal-lm":  # built here too: the porting warnings are the parent's to report
                *_, outcome.porting_warnings = trainbridge_arguments(
                    spec, world_size, assets, outcome.output_dir, outcome.trace_dir(), None
                )
    pairs = list(zip(specs, outcomes))
    shared = [(s, o) for s, o in pairs if not _runs_alone(s, runner, world_size)]
    groups = [shared] if shared else []
    groups += [[(s, o)] for s, o in pairs if _runs_alone(s, runner, world_size)]
    for group in groups:
        _launch_jobs(group, runner, world_size, assets)
    return outcomes


def _runs_alone(spec: Scenario, runner: Runner, world_size: int) -> bool:
    """Whether a run needs a launch of its own: Trainer where it is expected to fail at ``world_size``, and
    either runner with reporting integrations (their global state is not shared with other scenarios)."""
    expected_failure = runner == "trainer" and world_size in spec.trainer_fails
    return expected_failure or bool(spec.arguments.get("report_to"))


def _job_kind(spec: Scenario, runner: Runner) -> str:
    """What ``compat.trainer_worker`` runs a job with: ``transformers`` (Trainer), ``trainbridge`` (the
    facade in place of Trainer) or ``run_training`` (trainbridge's ``run_training``, in place)."""
    if runner == "trainer":
        return "transformers"
    return "run_training" if spec.task == "causal-lm" else "trainbridge"


def _phases(spec: Scenario) -> list[tuple[str, int | None]]:
    """``(phase name, resume step)`` of each launch of ``spec``."""
    return [("", None)] + ([("resume", spec.resume_from)] if spec.resume_from is not None else [])


def _fresh_outcome(spec: Scenario, runner: Runner, world_size: int, work: Path) -> RunOutcome:
    run_dir = run_dir_for(work, spec, runner, world_size)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    (run_dir / "wandb").mkdir(parents=True)
    return RunOutcome(spec.name, runner, world_size, run_dir)


# ============================================================================ launches
def _launch_jobs(
    group: Sequence[tuple[Scenario, RunOutcome]], runner: Runner, world_size: int, assets: CompatAssets
) -> None:
    """One torchrun launch of ``compat.trainer_worker`` running every phase of every scenario of ``group``
    with ``runner``."""
    jobs = [
        {
            "scenario": spec.name,
            "world_size": world_size,
            "out": str(outcome.output_dir),
            "trace": str(outcome.trace_dir(phase)),
            "resume_from": resume_from,
            "env": integration_environment(outcome.run_dir),
            "status": str(outcome.run_dir / f"status{'-' + phase if phase else ''}.json"),
            "trainer": _job_kind(spec, runner),
            "phase": phase,
            "timeout_s": spec.timeout_s,
        }
        for spec, outcome in group
        for phase, resume_from in _phases(spec)
    ]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(world_size),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "compat.trainer_worker",
        "--assets",
        json.dumps(assets.as_json()),
        "--jobs",
        json.dumps(jobs),
    ]
    env = {**os.environ, **integration_environment(group[0][1].run_dir)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    console_path = group[0][1].run_dir / "console.log"
    start = time.monotonic()
    error = _run_launch(command, env, jobs, console_path)
    seconds = (time.monotonic() - start) / len(group)
    for _, outcome in group:
        outcome.seconds = seconds
        outcome.console = console_path
        outcome.shared_launch = len(group) > 1
        own = [job for job in jobs if job["out"] == str(outcome.output_dir)]
        outcome.callback_errors = sorted({name for job in own for name in _job_callback_errors(job)})
        if not all(_job_state(job) == "completed" for job in own):
            outcome.status, outcome.error = error or ("failed", "the worker wrote no status")
            error = ("failed", "not run: an earlier scenario of the same launch failed")


def _job_callback_errors(job: Mapping[str, Any]) -> list[str]:
    """The callback classes a ``run_training`` job's ``RunResult.callback_errors`` named (its status file)."""
    try:
        return list(json.loads(Path(job["status"]).read_text()).get("callback_errors", []))
    except (FileNotFoundError, ValueError):
        return []


def _run_launch(
    command: Sequence[str], env: Mapping[str, str], jobs: Sequence[Mapping[str, Any]], console_path: Path
) -> tuple[Literal["failed", "timeout"], str] | None:
    """Run one Trainer launch of ``jobs`` to its end or to a job's deadline; what went wrong, if anything."""
    error: tuple[Literal["failed", "timeout"], str] | None = None
    with console_path.open("ab") as console:
        process = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=console, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            returncode = _wait_job_by_job(process, jobs)
        except BaseException:  # interrupted (Ctrl-C, a test's timeout): no torchrun worker may outlive this run
            _kill_session(process)
            raise
    late = next((job for job in jobs if _job_state(job) != "completed"), None)
    if returncode is None and late is not None:
        error = ("timeout", f"{_job_name(late, jobs)} did not finish within its {late['timeout_s']:.0f} s (a "
                 "hang); the launch's process tree was killed")  # fmt: skip
    elif returncode is None:  # every job's outcome is complete: the hang is reported, not compared
        print(f"compat: the launch of {_job_name(jobs[-1], jobs)} did not exit within {EXIT_GRACE_S:.0f} s "
              f"of its last job; killed (see {console_path})", file=sys.stderr, flush=True)  # fmt: skip
    elif returncode != 0:
        error = ("failed", f"torchrun exited with {returncode}: {_first_error_line(console_path)}")
    return error


JobState = Literal["pending", "started", "completed"]
EXIT_GRACE_S = 120.0
"""How long a Trainer launch may take to exit after its last job's end."""


def _job_state(job: Mapping[str, Any]) -> JobState:
    """What rank 0 of ``compat.trainer_worker`` wrote to the job's status file so far."""
    try:
        status = json.loads(Path(job["status"]).read_text()).get("status")
    except FileNotFoundError:
        return "pending"
    except ValueError:  # being written
        return "started"
    return "completed" if status == "completed" else "started"


def _job_name(job: Mapping[str, Any], jobs: Sequence[Mapping[str, Any]]) -> str:
    """``Trainer job step_schedules x2 (2 of 9 of its launch)``: a job as a report names it."""
    phase = f" ({job['phase']} phase)" if job["phase"] else ""
    runner = {"trainbridge": "trainbridge.Trainer", "run_training": "trainbridge run_training"}.get(
        job["trainer"], "Trainer"
    )
    where = f"{jobs.index(job) + 1} of {len(jobs)} of its launch"
    return f"{runner} job {job['scenario']}{phase} x{job['world_size']} ({where})"


def _wait_job_by_job(
    process: subprocess.Popen[bytes], jobs: Sequence[Mapping[str, Any]], poll_s: float = 0.5
) -> int | None:
    """Wait for a launch running ``jobs`` one after another; its exit status, or None after killing its
    process tree when a job ran past its own ``timeout_s`` (counted from the end of the job before it, so
    the launch's start-up counts to the first job) or the launch did not exit within ``EXIT_GRACE_S`` of the
    last job's end.  Each job's start and end is printed to stderr: a long suite never waits silently."""
    job_start = time.monotonic()
    current = 0
    announced = -1
    while True:
        returncode = process.poll()
        while current < len(jobs) and _job_state(jobs[current]) == "completed":
            print(f"compat: {_job_name(jobs[current], jobs)} done in {time.monotonic() - job_start:.0f} s",
                  file=sys.stderr, flush=True)  # fmt: skip
            current += 1
            job_start = time.monotonic()
        if returncode is not None:
            return returncode
        if current < len(jobs) and announced < current and _job_state(jobs[current]) == "started":
            print(f"compat: {_job_name(jobs[current], jobs)} started", file=sys.stderr, flush=True)
            announced = current
        allowed = jobs[current]["timeout_s"] if current < len(jobs) else EXIT_GRACE_S
        if time.monotonic() - job_start > allowed:
            _kill_session(process)
            return None
        time.sleep(poll_s)


def _kill_session(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the torchrun session started for this run (its workers included)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _first_error_line(log: Path) -> str:
    """The most telling error of a torchrun console log: the C++ ``what():`` of an aborting worker, else
    the exception line ending a worker's traceback, else the last line; plus torchrun's root-cause rank."""
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    message = next((line.split("what():", 1)[1].strip() for line in lines if "what():" in line), None)
    if message is None:
        for line in reversed(lines):
            prefix, _, text = line.partition("]:")
            text = text.strip()
            if (
                prefix.startswith("[rank")
                and ("Error" in text or "Exception" in text)
                and not text.startswith(("File ", "raise ", "^"))
            ):
                message = f"{prefix}] {text}"
                break
    message = (message or (lines[-1] if lines else "no output"))[:400]
    root = _root_cause(lines)
    return f"{message} (root cause: {root})" if root else message


def _root_cause(lines: list[str]) -> str | None:
    """``rank R, exitcode C (SIGNAL)`` from torchrun's "Root Cause" block, if present."""
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith("Root Cause"))
    except StopIteration:
        return None
    fields = {}
    for line in lines[start : start + 10]:
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    if "rank" not in fields:
        return None
    exitcode = re.sub(r"\s*\(pid: \d+\)", "", fields.get("exitcode", "?"))  # pids change run to run
    return f"rank {fields['rank'].split()[0]}, exitcode {exitcode}"


# ============================================================================ trainbridge
def trainbridge_arguments(
    spec: Scenario,
    world_size: int,
    assets: CompatAssets,
    output_dir: Path,
    trace_dir: Path,
    resume_from: int | None,
) -> tuple[Any, dict[str, Any], list[str]]:
    """The ``TrainingArgs`` of a trainbridge run (``training_args_from_hf`` of the scenario's
    ``TrainingArguments`` plus the paths and batch shape), its code for ``run_training`` (the callbacks, the
    ``TrainingArguments`` they see) and the porting warnings ``training_args_from_hf`` gave."""
    hf_values = spec.training_arguments(output_dir, world_size)
    if resume_from is not None:
        hf_values["resume_from_checkpoint"] = str(output_dir / f"checkpoint-{resume_from}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hf_args = spec.arguments_class()(**hf_values)
        probe = AttributeAccessProbe(OBSERVED_CALLBACK_CLASSES, str(trace_dir))
        callbacks = spec.callbacks()
        callbacks[1:1] = spec.trainbridge_extra()
        args = training_args_from_hf(
            hf_args,
            model_path=assets.model,
            data_path=assets.train,
            val_data_path=assets.val,
            effective_batch_size=spec.samples_per_step,
            max_seq_len=SAMPLE_TOKENS,
            max_batch_len=spec.max_batch_len(world_size),
        )
    code = {"callbacks": [probe, *callbacks, TraceRecorder(str(trace_dir)), probe.closer()], "hf_args": hf_args}
    porting = sorted({str(w.message) for w in caught if issubclass(w.category, HFPortingWarning)})
    return args, code, porting


@contextlib.contextmanager
def scoped_environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables for the block (torchrun and its workers inherit them)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
