"""The torchrun worker entry point: ``python -m trainbridge.worker --payload PATH``.

The composition root of a worker: it reads the HMAC-checked payload (``trainbridge.transport``),
starts the distributed seam, assembles the callbacks (built-ins, user callbacks, event functions,
and all Hugging Face callbacks behind one adapter), runs the loop, and has rank 0 write
``result.json``.  ``@record`` makes torchrun write this rank's error (type, message, traceback) to an
error file the launcher reads.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from torch.distributed.elastic.multiprocessing.errors import record

from trainbridge.callbacks.base import Callback, FunctionCallback
from trainbridge.callbacks.builtin import (
    BestCheckpointTracker,
    MetricsFileCallback,
    ProgressBarCallback,
    ScheduleCallback,
)
from trainbridge.config import CallbackSpec, TrainingArgs
from trainbridge.distributed import DistributedEnv
from trainbridge.hf import HuggingFaceCallbackAdapter, split_callbacks
from trainbridge.loop import train
from trainbridge.transport import PAYLOAD_KEY_ENV, read_payload


def assemble_callbacks(args: TrainingArgs) -> list[Callback]:
    """The worker's callback list, in dispatch order.

    ``ScheduleCallback`` first (like transformers' DefaultFlowCallback), then the user's callbacks in
    registration order — all Hugging Face ones driven by one adapter placed where the first of them
    was — then event functions, then best-checkpoint tracking, the metrics file and, when no adapter
    brings transformers' own progress callback, the native progress bar.
    """
    user = [c.build() if isinstance(c, CallbackSpec) else c for c in args.callbacks]
    _, hf = split_callbacks(user)
    adapter = HuggingFaceCallbackAdapter(hf, report_to=args.report_to) if (hf or args.report_to) else None
    ordered: list[Callback] = []
    for item in user:
        if any(item is h for h in hf):
            if adapter is not None and adapter not in ordered:
                ordered.append(adapter)
            continue
        if not isinstance(item, Callback):
            raise TypeError(f"callback {item!r} is neither a trainbridge.Callback nor a transformers.TrainerCallback")
        ordered.append(item)
    if adapter is not None and adapter not in ordered:
        ordered.append(adapter)
    functions: list[Callback] = [FunctionCallback(e, fn) for e, fns in args.event_functions.items() for fn in fns]
    tail: list[Callback] = [BestCheckpointTracker(), MetricsFileCallback()]
    if adapter is None:
        tail.append(ProgressBarCallback())
    return [ScheduleCallback(), *ordered, *functions, *tail]


@record
def main(argv: list[str] | None = None) -> int:
    """Run one worker of a ``run_training`` job."""
    parser = argparse.ArgumentParser(prog="python -m trainbridge.worker")
    parser.add_argument("--payload", required=True, help="payload file written by run_training")
    payload_path = parser.parse_args(argv).payload
    key = os.environ.pop(PAYLOAD_KEY_ENV, None)
    if not key:
        raise RuntimeError(f"{PAYLOAD_KEY_ENV} is not set: workers are started by trainbridge.run_training")
    args = read_payload(payload_path, key)
    env = DistributedEnv.initialize(args.device, args.collective_timeout_s)
    logging.basicConfig(
        level=logging.INFO if env.is_world_process_zero else logging.WARNING,
        format=f"[rank{env.rank}] %(levelname)s %(name)s: %(message)s",
    )
    try:
        result = train(args, env, assemble_callbacks(args))
        if env.is_world_process_zero:
            result.write(args.ckpt_output_dir / "result.json")
    finally:
        env.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
