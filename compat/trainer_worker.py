"""The ``transformers.Trainer`` side of compat runs, one process per rank under torchrun::

    python -m torch.distributed.run --nproc-per-node N -m compat.trainer_worker --assets JSON --jobs JSON

Each job is one scenario phase (``{"scenario", "world_size", "out", "trace", "resume_from", "env",
"status"}``); jobs run one after another in this process (several scenarios per launch save the
interpreter and torchrun start-up, which dominates these tiny runs).  A job builds the scenario's
``TrainingArguments`` (``use_cpu=True``; accelerate sets up gloo), the tiny model and the fixed-length
data of ``compat.assets``, the scenario's callbacks followed by the ``TraceRecorder``, and trains with a
stock ``Trainer`` while ``AttributeAccessLog`` records what the transformers callbacks read.  Rank 0
writes ``{"status": "completed"}`` to the job's status file; a failing job ends the process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer

from compat.assets import CompatAssets, TokenizedJsonl, collate_fixed_length
from compat.recorder import OBSERVED_CALLBACK_CLASSES, AttributeAccessLog, TraceRecorder, access_path
from compat.scenarios import scenario


def run_job(job: dict[str, Any], assets: CompatAssets) -> None:
    """Train one scenario phase with ``transformers.Trainer``."""
    spec = scenario(job["scenario"])
    os.environ.update(job["env"])
    log = AttributeAccessLog(OBSERVED_CALLBACK_CLASSES)
    log.install()
    rank = 0
    try:
        args = spec.arguments_class()(**spec.training_arguments(job["out"], job["world_size"]))
        rank = args.process_index
        trainer = Trainer(
            model=AutoModelForCausalLM.from_pretrained(assets.model),
            args=args,
            train_dataset=TokenizedJsonl(assets.train),
            eval_dataset=TokenizedJsonl(assets.val),
            data_collator=collate_fixed_length,
            processing_class=AutoTokenizer.from_pretrained(assets.model),
            callbacks=[*spec.callbacks(), TraceRecorder(job["trace"])],
        )
        resume = job["resume_from"]
        trainer.train(resume_from_checkpoint=None if resume is None else str(Path(job["out"]) / f"checkpoint-{resume}"))
    finally:
        log.restore()
        log.write(access_path(job["trace"], rank))
    if rank == 0:
        Path(job["status"]).write_text(json.dumps({"status": "completed"}))


def main(argv: list[str] | None = None) -> int:
    """Run every job of the command line, in order."""
    parser = argparse.ArgumentParser(prog="python -m compat.trainer_worker")
    parser.add_argument("--assets", required=True, help="JSON of compat.assets.CompatAssets paths")
    parser.add_argument("--jobs", required=True, help="JSON list of jobs (see the module docstring)")
    options = parser.parse_args(argv)
    assets = CompatAssets.from_json(json.loads(options.assets))
    for job in json.loads(options.jobs):
        run_job(job, assets)
    return 0


if __name__ == "__main__":
    sys.exit(main())
