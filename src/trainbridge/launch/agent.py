"""The torchrun agent as the launcher starts it: ``python -m trainbridge.launch.agent <torchrun args>``.

Exactly ``torch.distributed.run`` (torchrun), with two additions:

* it is tied to the launcher (``trainbridge.launch.lifeline``): it dies with it, and its workers die
  with it, so no process outlives ``run_training``'s caller;
* when workers fail, every failure torchrun observed (rank, exit code or signal, error file, time) is
  written as JSON to ``TRAINBRIDGE_FAILURES_FILE``, so the launcher can name the rank that failed
  first and its real error (``trainbridge.launch.failures``) instead of reading torchrun's console
  summary.  The long ``ChildFailedError`` traceback is not printed: the launcher reports the failure once.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main

from trainbridge.launch import lifeline
from trainbridge.launch.process_exit import exit_now

FAILURES_FILE_ENV = "TRAINBRIDGE_FAILURES_FILE"
"""Where the agent writes the failures of the worker group (JSON list), for the launcher."""


def failure_records(error: ChildFailedError) -> list[dict[str, object]]:
    """One JSON-able record per failed worker torchrun observed."""
    records: list[dict[str, object]] = []
    for rank, failure in sorted(error.failures.items()):
        signal_name = failure.signal_name() if failure.exitcode < 0 else None
        records.append({
            "rank": int(rank),
            "local_rank": int(failure.local_rank),
            "pid": int(failure.pid),
            "exitcode": int(failure.exitcode),
            "signal": signal_name,
            "error_file": failure.error_file if os.path.isfile(failure.error_file) else None,
            "timestamp": int(failure.timestamp),
            "message": failure.message if isinstance(failure.message, str) else json.dumps(failure.message),
        })
    return records


def main(argv: list[str] | None = None) -> int:
    """Run torchrun; on a worker-group failure write the failures file and return 1."""
    lifeline.install()
    try:
        torchrun_main(argv)
    except ChildFailedError as error:
        target = os.environ.get(FAILURES_FILE_ENV)
        if target:
            Path(target).write_text(json.dumps(failure_records(error), indent=2))
        print(f"trainbridge: worker group failed ({len(error.failures)} rank(s) observed failing)",
              file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    exit_now(main())  # torchrun has stopped its workers and closed its store: nothing is left to tear down
