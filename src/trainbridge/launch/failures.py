"""Which rank failed first, and why: turn what torchrun left behind into one ``WorkerFailedError``.

When one worker dies (the usual case: the out-of-memory killer's SIGKILL), the surviving ranks fail
*because of it* — gloo "connection reset by peer", "checkpoint save failed on another rank", the
SIGTERM torchrun sends while stopping them.  Those are consequences, not the cause.  The agent
(``trainbridge.launch.agent``) writes every failure torchrun observed (rank, exit code, signal, error
file); here the root cause is chosen:

1. a Python exception that is not a known consequence (its error file has the traceback);
2. else a death by a signal other than SIGTERM/SIGINT, or a non-zero exit without an error file;
3. else the earliest consequence;

ties broken by the rank that names itself as the cause of an error every rank raised (a ``fatal``
callback error agreed across ranks: ``core.callback_errors.OWN_CAUSE_MARKER``), then by a rank that exited on
its own over one torchrun's SIGTERM ended after it wrote its error (its exit status, 143, is not the job's),
then by time.  The others are
listed after it, one line each.  Without a failures file (the agent itself failed, or torchrun failed
before starting workers) the per-rank error files and teed stderr logs are read as before.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainbridge.core.callback_errors import OWN_CAUSE_MARKER
from trainbridge.core.config import TorchrunArgs
from trainbridge.launch.errors import LaunchError, WorkerFailedError

_CONSEQUENCE = re.compile(
    r"connection (reset|closed|refused)|connectfullmesh|broken pipe|another rank|worker interrupted|"
    r"received signal (15|2)\b|sigterm|timed out|timeout|processgroup(gloo|nccl)|nccl communicator|"
    r"socket|peer",
    re.IGNORECASE,
)
_SIGNAL_HINTS = {
    "SIGKILL": "killed with SIGKILL: usually the out-of-memory killer (see `dmesg`) or a `kill -9`",
    "SIGSEGV": "a segmentation fault in native code",
    "SIGABRT": "aborted (a C++ exception or assertion in native code)",
    "SIGBUS": "a bus error (often a full /dev/shm)",
}


def _load_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def error_fields(data: Mapping[str, Any]) -> tuple[str, str | None, int, int | None]:
    """``(message, traceback, timestamp, error_code)`` of a torchelastic error file."""
    raw = data.get("message")
    if isinstance(raw, str):
        return raw, None, 0, None
    body: dict[str, Any] = raw if isinstance(raw, dict) else {}
    raw_extra = body.get("extraInfo")
    extra: dict[str, Any] = raw_extra if isinstance(raw_extra, dict) else {}
    timestamp = str(extra.get("timestamp", ""))
    code = str(body.get("errorCode", ""))
    return (
        str(body.get("message", "unknown error")),
        extra.get("py_callstack"),
        int(timestamp) if timestamp.isdigit() else 0,
        int(code) if code.lstrip("-").isdigit() else None,
    )


def is_consequence(message: str) -> bool:
    """Whether an error message reads like the effect of another rank's failure."""
    return bool(_CONSEQUENCE.search(message))


def _describe(record: Mapping[str, Any]) -> tuple[str, str | None]:
    """``(one-line message, traceback)`` of one failure record."""
    error_file = record.get("error_file")
    data = _load_json(Path(error_file)) if error_file else None
    if isinstance(data, dict):
        message, trace, _, _ = error_fields(data)
        return message, trace
    signal_name = record.get("signal")
    code = int(record.get("exitcode", 1))
    if signal_name:
        hint = _SIGNAL_HINTS.get(str(signal_name), f"ended by signal {signal_name}")
        return f"{hint} (signal {-code}, no Python traceback)", None
    return f"exited with code {code} without a Python error (os._exit, sys.exit or a native abort)", None


def _tier(record: Mapping[str, Any], message: str) -> int:
    has_file = bool(record.get("error_file"))
    signal_name = record.get("signal")
    if has_file and not is_consequence(message):
        return 0
    if not has_file and signal_name not in ("SIGTERM", "SIGINT"):
        return 1
    return 2


def _rank_label(record: Mapping[str, Any]) -> str:
    return f"rank {record['rank']}"


def root_cause(records: list[dict[str, Any]], log_dir: Path | None = None, restarts: int = 0) -> WorkerFailedError:
    """The ``WorkerFailedError`` for the failures the agent recorded (at least one)."""
    described = [(record, *_describe(record)) for record in records]
    described.sort(
        key=lambda item: (
            _tier(item[0], item[1]),
            OWN_CAUSE_MARKER not in item[1],
            item[0].get("signal") in ("SIGTERM", "SIGINT"),  # one torchrun stopped after it wrote its error
            int(item[0].get("timestamp", 0)),
            item[0]["rank"],
        )
    )
    root, message, trace = described[0]
    consequences = [f"{_rank_label(r)}: {m.strip().splitlines()[0] if m.strip() else m}" for r, m, _ in described[1:]]
    reported = {int(r["rank"]) for r, _, _ in described}
    consequences += _stopped_ranks(log_dir, {int(r["local_rank"]) for r, _, _ in described}, reported)
    code = int(root.get("exitcode", 1))
    return WorkerFailedError(
        int(root["rank"]),
        code,
        message,
        traceback=trace,
        local_rank=int(root["local_rank"]),
        signal_name=root.get("signal"),
        consequences=consequences,
        restarts=restarts,
    )


def _stopped_ranks(log_dir: Path | None, failed_local: set[int], reported: set[int]) -> list[str]:
    """One line per local rank that torchrun stopped after the failure and that left an error file."""
    if log_dir is None:
        return []
    attempts = sorted(log_dir.glob("*/attempt_*"), key=lambda p: int(p.name.rpartition("_")[2]))
    if not attempts:
        return []
    lines = []
    for error_file in sorted(attempts[-1].glob("*/error.json")):
        local = error_file.parent.name
        if not local.isdigit() or int(local) in failed_local:
            continue
        data = _load_json(error_file)
        if isinstance(data, dict):
            message = error_fields(data)[0].strip().splitlines()[0]
            lines.append(f"local rank {local}: stopped by torchrun after the failure ({message})")
    return lines


def worker_failure(
    log_dir: Path,
    torchrun_error_file: Path,
    torchrun_args: TorchrunArgs,
    returncode: int,
    failures_file: Path | None = None,
    restarts: int = 0,
) -> LaunchError:
    """Turn what the agent and torchrun left behind into the error to raise.

    The agent's failures file wins.  Without it: per-rank error files in
    ``log_dir/<run>/attempt_<n>/<local_rank>/error.json`` (newest attempt), the first failure being
    the one torchrun copied into its own error file, else the earliest; then teed stderr logs.
    """
    records = _load_json(failures_file) if failures_file is not None else None
    if isinstance(records, list) and records:
        return root_cause(records, log_dir, restarts)
    attempts = sorted(log_dir.glob("*/attempt_*"), key=lambda p: int(p.name.rpartition("_")[2]))
    per_rank: dict[int, dict[str, Any]] = {}
    if attempts:
        for error_file in attempts[-1].glob("*/error.json"):
            data = _load_json(error_file)
            if isinstance(data, dict) and error_file.parent.name.isdigit():
                per_rank[int(error_file.parent.name)] = data
    loaded = _load_json(torchrun_error_file)
    root = loaded if isinstance(loaded, dict) else None
    if not per_rank:
        if root is not None:
            message, trace, _, _ = error_fields(root)
            return LaunchError(f"torchrun failed (exit code {returncode}): {message}\n{trace or ''}".rstrip())
        logged = _traceback_from_stderr_logs(attempts[-1]) if attempts else None
        if logged is not None:
            local_rank, trace = logged
            return WorkerFailedError(
                global_rank(torchrun_args, local_rank),
                None,
                trace.rstrip().splitlines()[-1],
                traceback=trace,
                local_rank=local_rank,
                restarts=restarts,
            )
        return WorkerFailedError(
            None,
            None,
            "a worker exited without an error file (it failed before its @record entry point ran, was "
            f"killed by a signal or ran out of memory); torchrun exited with {returncode} and its own report "
            "(the launch log named below, or the console above) names the rank",
            restarts=restarts,
        )

    def first(item: tuple[int, dict[str, Any]]) -> tuple[int, int, int]:
        message, trace, timestamp, _ = error_fields(item[1])
        if root is not None and error_fields(root)[:3] == (message, trace, timestamp):
            return (0, 0, 0)
        return (1, int(is_consequence(message)), timestamp)

    local_rank, data = min(per_rank.items(), key=first)
    message, trace, _, _ = error_fields(data)
    exit_code = error_fields(root)[3] if root is not None else None
    return WorkerFailedError(
        global_rank(torchrun_args, local_rank),
        exit_code,
        message,
        traceback=trace,
        local_rank=local_rank,
        restarts=restarts,
    )


def global_rank(torchrun_args: TorchrunArgs, local_rank: int) -> int | None:
    """Global rank of ``local_rank`` on this node, when it can be known from the launch arguments."""
    if not torchrun_args.rdzv_endpoint:
        return torchrun_args.node_rank * torchrun_args.nproc_per_node + local_rank
    if str(torchrun_args.nnodes) == "1":
        return local_rank
    return None  # c10d assigns node ranks at rendezvous time; only the local rank is known here


def _traceback_from_stderr_logs(attempt_dir: Path) -> tuple[int, str] | None:
    """``(local_rank, traceback)`` of the first teed worker stderr that ends in a Python traceback.

    Covers failures before the ``@record`` entry point runs (e.g. an import error), which leave no
    error file.  Only teed ranks (local rank 1 and up) have a log file.
    """
    for log in sorted(attempt_dir.glob("*/stderr.log"), key=lambda p: p.parent.name):
        if not log.parent.name.isdigit():
            continue
        text = log.read_text(errors="replace")
        start = text.rfind("Traceback (most recent call last):")
        if start >= 0:
            return int(log.parent.name), text[start:]
    return None
