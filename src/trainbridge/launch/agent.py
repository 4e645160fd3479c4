"""The torchrun agent as the launcher starts it: ``python -m trainbridge.launch.agent <torchrun args>``.

Exactly ``torch.distributed.run`` (torchrun), with two additions:

* it is tied to the launcher (``trainbridge.launch.lifeline``): it dies with it, and its workers die
  with it, so no process outlives ``run_training``'s caller;
* when workers fail, every failure torchrun observed (rank, exit code or signal, error file, time) is
  written as JSON to ``TRAINBRIDGE_FAILURES_FILE``, so the launcher can name the rank that failed
  first and its real error (``trainbridge.launch.failures``) instead of reading torchrun's console
  summary;
* torchrun's own report goes to the run's launch log (``TRAINBRIDGE_LAUNCH_LOG``, ``logs/launch.log``
  in the run folder), not the console: its log lines ("Sending process N closing signal SIGTERM",
  "failed (exitcode: 1) local_rank: 0 ..."), and on a failure its ``ChildFailedError`` summary (the
  "Root Cause (first observed failure)" table).  The launcher reports the failure once, naming the log.
  Without a launch log (a dry run) torchrun's lines stay on the console and the failure is one line;
* the TCP store of torchrun's static rendezvous listens on the master address only (127.0.0.1 for a
  single-node run), not on every interface (``bind_store_to_master_address``).

The workers' own output is untouched: they inherit the console (local rank 0) or are teed (the others).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import static_tcp_rendezvous
from torch.distributed.run import main as torchrun_main

from trainbridge.launch import lifeline
from trainbridge.launch.process_exit import exit_now

FAILURES_FILE_ENV = "TRAINBRIDGE_FAILURES_FILE"
"""Where the agent writes the failures of the worker group (JSON list), for the launcher."""
LAUNCH_LOG_ENV = "TRAINBRIDGE_LAUNCH_LOG"
"""The run's launch log, which torchrun's own report is appended to instead of the console."""
TORCHRUN_LOGGER = "torch.distributed"
"""The logger torchrun's agent logs under (torch gives it its own stderr handler)."""


def log_torchrun_to(path: str | Path) -> logging.Handler:
    """Send torchrun's log records (INFO and up: launch configuration, rendezvous, worker starts and exits,
    failures) to ``path`` (appended) instead of stderr; returns the handler."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    handler = logging.StreamHandler(os.fdopen(fd, "a", encoding="utf-8"))  # never through a link
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    torchrun_logger = logging.getLogger(TORCHRUN_LOGGER)
    torchrun_logger.handlers = [handler]
    torchrun_logger.propagate = False
    torchrun_logger.setLevel(logging.INFO)
    return handler


def _listener(host: str, port: int) -> socket.socket | None:
    """A socket listening on ``host:port`` only (None when ``host`` is not an address of this machine)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError:
        return None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError:
        sock.close()
        return None
    return sock


def bind_store_to_master_address() -> None:
    """Make torchrun's static rendezvous start its TCP store on a socket bound to the master address
    (``TCPStore(master_listen_fd=...)``) instead of every interface; where that address cannot be bound
    here, torchrun's default stands."""
    original = static_tcp_rendezvous.TCPStore

    def store(host: str, port: int, *args: Any, **kwargs: Any) -> Any:
        is_master = kwargs.get("is_master", args[1] if len(args) > 1 else False)
        if is_master and kwargs.get("master_listen_fd") is None:
            sock = _listener(host, port)
            if sock is not None:
                kwargs["master_listen_fd"] = sock.detach()  # the store owns and closes the descriptor
        return original(host, port, *args, **kwargs)

    static_tcp_rendezvous.TCPStore = store  # type: ignore[misc,assignment]


def failure_records(error: ChildFailedError) -> list[dict[str, object]]:
    """One JSON-able record per failed worker torchrun observed."""
    records: list[dict[str, object]] = []
    for rank, failure in sorted(error.failures.items()):
        signal_name = failure.signal_name() if failure.exitcode < 0 else None
        records.append(
            {
                "rank": int(rank),
                "local_rank": int(failure.local_rank),
                "pid": int(failure.pid),
                "exitcode": int(failure.exitcode),
                "signal": signal_name,
                "error_file": failure.error_file if os.path.isfile(failure.error_file) else None,
                "timestamp": int(failure.timestamp),
                "message": failure.message if isinstance(failure.message, str) else json.dumps(failure.message),
            }
        )
    return records


def main(argv: list[str] | None = None) -> int:
    """Run torchrun (its report into the launch log when there is one); on a worker-group failure write the
    failures file and return 1."""
    lifeline.install()
    bind_store_to_master_address()
    launch_log = os.environ.get(LAUNCH_LOG_ENV)
    if launch_log:
        log_torchrun_to(launch_log)
    try:
        torchrun_main(argv)
    except ChildFailedError as error:
        target = os.environ.get(FAILURES_FILE_ENV)
        if target:
            Path(target).write_text(json.dumps(failure_records(error), indent=2))
        summary = f"worker group failed ({len(error.failures)} rank(s) observed failing)"
        if launch_log:
            logging.getLogger(TORCHRUN_LOGGER).error("%s; torchrun's summary:\n%s", summary, error)
        else:
            print(f"trainbridge: {summary}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    exit_now(main())  # torchrun has stopped its workers and closed its store: nothing is left to tear down
