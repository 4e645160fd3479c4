"""``python script.py`` runs the script as ``torchrun --nproc-per-node N script.py`` would: ``launch_script``.

Called when a Trainer name is first resolved (``from trainbridge import Trainer``, ``SFTTrainer``...,
``trainbridge/__init__.py``'s PEP 562 look-up), where a script has run nothing of trainbridge yet.  ``N`` is
``core.nproc.default_nproc_per_node()`` (``TRAINBRIDGE_NPROC_PER_NODE``, else one per visible GPU, else 1),
read before the script's arguments exist.  What happens (``decide``):

- a launched worker (``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` set) or N = 1: nothing; the script goes on in
  this process and the Trainer trains in place (as ``transformers.Trainer``);
- a script file or ``python -m module``, N > 1: the workers are forked here (``launch.forked_workers``) and go
  on with the script from this point, each one rank, with what it imported so far, as the workers of
  ``torchrun script.py`` would run it after their own imports; this process streams their output, forwards
  Ctrl-C and SIGTERM, names the first failing rank (``launch.failures``) and exits with the job's status.
  Where a fork is not safe (``fork_problem``: CUDA initialised, Python threads running, the script's devices
  already set up for one process (a ``TrainingArguments`` made before the import), a platform without fork, an
  OpenMP runtime that cannot release its threads) or ``TRAINBRIDGE_SCRIPT_FORK=0``, the same command
  line (interpreter options, script or module, arguments: ``sys.orig_argv``) runs again under torchrun
  (``launch.agent``, tied to this process by ``launch.lifeline``), with the same guarantees; the workers'
  ``sys.path`` and environment are what ``torchrun script.py`` would give them (no ``PYTHONPATH`` added);
  what torchrun leaves (logs, error files) is in a private temporary folder, removed at the end;
- ``python -c`` or a program piped on stdin, N > 1: it cannot be run again, so the workers are forked the
  same way (before CUDA is initialised, as accelerate's ``notebook_launcher``); nothing is pickled;
- an interactive session (REPL, ``python -i``, IPython/Jupyter), N > 1, or a fork the platform refuses:
  ``ScriptLaunchError``, one line saying what to do.

Under pytest nothing is re-executed (a test process is not a training script): it runs in place.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from trainbridge.core.nproc import NPROC_ENV, default_nproc_per_node

SCRIPT_FORK_ENV = "TRAINBRIDGE_SCRIPT_FORK"
"""``0``: a script or module with N > 1 is always run again under torchrun, never forked."""

SCRIPT_LAUNCH_ENV = "TRAINBRIDGE_SCRIPT_LAUNCH"
"""Set in the workers of a script this module launched (``torchrun`` or ``fork``)."""

WORKER_ENV_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
"""What makes a process one rank of a launched job (``core.distributed.launched_worker``)."""

Session = Literal["worker", "script", "module", "command", "stdin", "interactive", "test"]
Action = Literal["in_place", "torchrun", "fork", "refuse"]


class ScriptLaunchError(RuntimeError):
    """This process cannot start the workers it was asked for; the message says what to do instead."""


@dataclass(frozen=True)
class Decision:
    """What ``launch_script`` does in this process, and why."""

    action: Action
    nproc: int
    session: Session
    reason: str = ""


@dataclass(frozen=True)
class CommandLine:
    """``sys.orig_argv`` read as the interpreter read it: its options, then what it runs."""

    options: tuple[str, ...]
    kind: Literal["script", "module", "command", "stdin"]
    target: str | None
    arguments: tuple[str, ...]


_OPTIONS_WITH_VALUE = frozenset("WXQ")


def parse_command_line(orig_argv: Sequence[str]) -> CommandLine:
    """Split the interpreter's own command line (``sys.orig_argv``) into options, target and arguments."""
    options: list[str] = []
    index = 1
    while index < len(orig_argv):
        token = orig_argv[index]
        if token == "-" or not token.startswith("-"):
            kind: Literal["script", "stdin"] = "stdin" if token == "-" else "script"
            return CommandLine(tuple(options), kind, None if token == "-" else token, tuple(orig_argv[index + 1 :]))
        if token == "--":
            index += 1
            continue
        if token.startswith("--"):  # --check-hash-based-pycs MODE is the one long option with a value
            options.append(token)
            if token == "--check-hash-based-pycs" and index + 1 < len(orig_argv):
                index += 1
                options.append(orig_argv[index])
            index += 1
            continue
        for at, letter in enumerate(token[1:], start=1):
            rest = token[at + 1 :]
            if letter in "cm":  # -c CODE / -m MODULE, attached or next; everything after is the program's
                value, after = (rest, index + 1) if rest else (orig_argv[index + 1], index + 2)
                if at > 1:
                    options.append(token[:at])
                kind2: Literal["command", "module"] = "command" if letter == "c" else "module"
                return CommandLine(tuple(options), kind2, value, tuple(orig_argv[after:]))
            if letter in _OPTIONS_WITH_VALUE:
                if rest:
                    options.append(token)
                else:
                    options += [token, orig_argv[index + 1]]
                    index += 1
                break
        else:
            options.append(token)
        index += 1
    return CommandLine(tuple(options), "stdin", None, ())


def session_kind(environ: Mapping[str, str] | None = None, orig_argv: Sequence[str] | None = None) -> Session:
    """What this process is: a launched worker, a script, ``python -m``, ``python -c``, a program on stdin,
    an interactive session (REPL, ``-i``, IPython/Jupyter) or a test run (pytest)."""
    environ = os.environ if environ is None else environ
    if all(name in environ for name in WORKER_ENV_VARS):
        return "worker"
    if "_pytest" in sys.modules:
        return "test"
    if hasattr(sys, "ps1") or sys.flags.interactive or _in_ipython():
        return "interactive"
    line = parse_command_line(sys.orig_argv if orig_argv is None else orig_argv)
    if line.kind == "stdin" and sys.stdin is not None and sys.stdin.isatty():
        return "interactive"
    return line.kind


def _in_ipython() -> bool:
    ipython = sys.modules.get("IPython")
    get = getattr(ipython, "get_ipython", None)
    return get is not None and get() is not None


def fork_problem(session: Session = "command") -> str | None:
    """Why this process cannot fork its workers (None: it can).  A script or module (which can run again
    instead) is also not forked while other Python threads run, or when ``TRAINBRIDGE_SCRIPT_FORK=0``."""
    if not hasattr(os, "fork") or sys.platform in ("win32", "darwin"):
        return f"forking workers is not safe on {sys.platform}"
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        return "CUDA is already initialised in this process, and forked workers cannot use it"
    if session in ("script", "module"):
        if os.environ.get(SCRIPT_FORK_ENV, "").strip() == "0":
            return f"{SCRIPT_FORK_ENV}=0"
        threading = sys.modules.get("threading")
        if threading is not None and threading.active_count() > 1:
            return f"{threading.active_count() - 1} other Python threads run in this process"
        return _devices_set_up()
    return None


def _devices_set_up() -> str | None:
    """Why the script's objects already hold this one process's world (None: they do not): a ``TrainingArguments``
    made before the Trainer import (trl's scripts parse theirs first) set up accelerate's state, or a process group
    exists; a worker forked now would keep world size 1."""
    state = sys.modules.get("accelerate.state")
    partial = getattr(state, "PartialState", None)
    if partial is not None and getattr(partial, "_shared_state", None):
        return "the script set up its devices (a TrainingArguments, accelerate's state) before the Trainer import"
    distributed = getattr(sys.modules.get("torch"), "distributed", None)
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return "a process group exists in this process"
    return None


def decide(session: Session, nproc: int, fork_refused: str | None = None) -> Decision:
    """The action for a process of kind ``session`` asked for ``nproc`` processes (``fork_refused``: why
    forking is not safe here, None where it is)."""
    if session in ("worker", "test") or nproc <= 1:
        return Decision("in_place", nproc, session)
    if session in ("script", "module"):
        return Decision("torchrun" if fork_refused else "fork", nproc, session, fork_refused or "")
    if session in ("command", "stdin") and fork_refused is None:
        return Decision("fork", nproc, session)
    why = fork_refused if session in ("command", "stdin") else "an interactive session cannot be run again"
    return Decision(
        "refuse",
        nproc,
        session,
        f"trainbridge: {nproc} worker processes were asked for ({NPROC_ENV}, else one per visible GPU) but {why}: "
        f"save the code as a script and run `python script.py` (or `torchrun --nproc-per-node {nproc} script.py`), "
        f"or set {NPROC_ENV}=1 to train in this process",
    )


def worker_command(line: CommandLine, executable: str | None = None) -> list[str]:
    """The command every worker runs: this interpreter with the same options, script or module, arguments."""
    if line.kind not in ("script", "module") or line.target is None:
        raise ValueError(f"a {line.kind} program cannot be run again")
    target = [line.target] if line.kind == "script" else ["-m", line.target]
    return [executable or sys.executable, *line.options, *target, *line.arguments]


_done = False


def launch_script() -> None:
    """Decide once per process (module doc): return to run in place, or in a forked worker; re-execute under
    torchrun and exit with its status; or raise ``ScriptLaunchError``."""
    global _done
    if _done:
        return
    _done = True
    session = session_kind()
    if session == "worker":
        if os.environ.get(SCRIPT_LAUNCH_ENV) == "torchrun":
            from trainbridge.launch.script_workers import become_worker

            become_worker()
        return
    nproc = default_nproc_per_node()
    forking = session in ("script", "module", "command", "stdin") and nproc > 1
    decision = decide(session, nproc, fork_problem(session) if forking else None)
    if decision.action == "in_place":
        return
    if decision.action == "refuse":
        _done = False  # asked again, refused again
        raise ScriptLaunchError(decision.reason)
    if decision.action == "fork":
        from trainbridge.launch import forked_workers

        unreleased = forked_workers.release_openmp()
        if unreleased is None or session in ("command", "stdin"):  # these cannot run again: fork regardless
            forked_workers.fork_workers(decision.nproc)  # returns in each worker; this process exits
            return
    from trainbridge.launch import script_workers

    command = worker_command(parse_command_line(sys.orig_argv))
    script_workers.exit_with(script_workers.run_under_torchrun(command, decision.nproc))


def world_problem(asked_world: int | None) -> str | None:
    """Why a Trainer given ``torchrun_args=`` (``asked_world``: the ranks they start) cannot train here (None:
    it can): they are honoured only when they are the running world (``WORLD_SIZE``, else 1)."""
    running = int(os.environ["WORLD_SIZE"]) if session_kind() == "worker" else 1
    if asked_world is None or asked_world == running:
        return None
    return (
        f"trainbridge: torchrun_args= asks for {asked_world} processes but this script runs as {running}; "
        f"a Trainer cannot start workers once the script runs: set {NPROC_ENV}={asked_world} before "
        f"`python script.py`, or launch it with `torchrun --nproc-per-node {asked_world} script.py`"
    )
