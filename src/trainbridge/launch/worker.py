"""The torchrun worker entry point: ``python -m trainbridge.launch.worker --payload PATH``.

The composition root of a worker: it reads the HMAC-checked payload (``trainbridge.launch.transport``),
starts the distributed seam, assembles the callbacks (``trainbridge.launch.assembly``), runs the loop,
and has rank 0 write ``result.json``; ``run_worker`` is that start and end around the job.  ``@record`` makes
torchrun write this rank's error (type, message, traceback) to an error file the launcher reads.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from torch.distributed.elastic.multiprocessing.errors import record

from trainbridge.core.config import RunPlan, TrainingArgs
from trainbridge.core.distributed import DistributedEnv
from trainbridge.core.run_dir import result_file
from trainbridge.launch import lifeline
from trainbridge.launch.console import configure_worker_console
from trainbridge.launch.process_exit import exit_now
from trainbridge.launch.transport import PAYLOAD_KEY_ENV

# The loop, the callbacks and transformers are imported inside the functions below, after
# ``configure_worker_console``: warnings and log levels must be set before those libraries load.


@record
def main(argv: list[str] | None = None) -> int:
    """Run one worker of a ``run_training`` job."""
    return run_worker(argv, "trainbridge.launch.worker", _train_and_write_result)


def _train_and_write_result(args: TrainingArgs, plan: RunPlan, env: DistributedEnv) -> None:
    from trainbridge.launch.assembly import assemble_callbacks
    from trainbridge.loop.loop import train

    result = train(args, plan, env, assemble_callbacks(args, plan))
    if env.is_world_process_zero:
        result.write(result_file(args.resolved_run_files_dir))


def run_worker(
    argv: list[str] | None, module: str, job: Callable[[TrainingArgs, RunPlan, DistributedEnv], None]
) -> int:
    """A torchrun worker's start and end around ``job(args, plan, env)``: read the authenticated payload named
    by ``--payload``, start the distributed seam (console configured per rank first), and tear the group
    down (after a barrier only when ``job`` returned).  ``--dry-run`` builds the run and prints its plan
    instead."""
    lifeline.install()  # die with torchrun and with the launcher
    parser = argparse.ArgumentParser(prog=f"python -m {module}")
    parser.add_argument("--payload", required=True, help="payload file written by run_training")
    parser.add_argument("--dry-run", action="store_true", help="build the run, print its plan, do not train")
    options = parser.parse_args(argv)
    payload_path = options.payload
    key = os.environ.pop(PAYLOAD_KEY_ENV, None)
    if not key:
        raise RuntimeError(f"{PAYLOAD_KEY_ENV} is not set: workers are started by trainbridge.run_training")
    configure_worker_console(int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0")))
    from trainbridge.launch.transport import read_payload
    from trainbridge.loop.build import build_run
    from trainbridge.loop.loop import TrainingInterrupted
    from trainbridge.loop.summary import announce_run

    args, plan = read_payload(payload_path, key)  # unpickling the callbacks may import transformers
    env = DistributedEnv.initialize(args.device, args.collective_timeout_s)
    if os.environ.get(lifeline.LAUNCHER_ENV):
        sys.excepthook = _one_line_excepthook(env.rank)
    clean = False
    try:
        if options.dry_run:
            announce_run(args, env, build_run(args, plan, env))
        else:
            job(args, plan, env)
        clean = True
    except TrainingInterrupted as exc:
        # @record writes error files for Exceptions only; the interruption must reach the launcher too
        raise RuntimeError(f"worker interrupted: {exc}") from exc
    except SystemExit as exc:
        # sys.exit() from a callback would end this rank "successfully" mid-run and leave the others
        # waiting in a collective: it is a failure of this rank.
        raise RuntimeError(
            f"sys.exit({exc.code!r}) was called during training on rank {env.rank}; a rank may not leave "
            "mid-run: raise an exception, or call context.request_stop_training() to stop every rank"
        ) from exc
    finally:
        env.teardown(clean)
    return 0


def _one_line_excepthook(rank: int):  # type: ignore[no-untyped-def]
    """Print a failing worker's error as one line: the launcher reports the root cause once, with its
    traceback, instead of every rank printing it with doubled ``[rankN]: [rankN]:`` prefixes."""

    def hook(exc_type, exc, tb):  # type: ignore[no-untyped-def]
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        sys.stderr.write(f"trainbridge worker rank {rank} failed: {exc_type.__name__}: {first}\n")
        sys.stderr.flush()

    return hook


if __name__ == "__main__":
    exit_now(main() or 0)  # @record types main() as returning int | None
