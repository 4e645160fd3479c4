"""The ``transformers.Trainer`` side of compat runs, one process per rank under torchrun::

    python -m torch.distributed.run --nproc-per-node N -m compat.trainer_worker --assets JSON --jobs JSON

Each job is one scenario phase (``{"scenario", "world_size", "out", "trace", "resume_from", "env",
"status", "trainer"}``); jobs run one after another in this process (several scenarios per launch save
the interpreter and torchrun start-up, which dominates these tiny runs), on one process group: the first
job's ``TrainingArguments`` creates it (accelerate), later jobs find it and reuse it, and only the last job
ends it (``Trainer.end()``, as a script's end).  A group destroyed and created again in one torchrun launch
rendezvouses under the same store keys as the first (torch resets its group counter), so a rank may read a
peer's stale address and wait forever in ``init_process_group``: a job that leaves no group behind fails
the launch instead.  Rank 0 writes ``{"status": "started"}`` to the job's status file as the job begins
(the runner's per-job deadline and its report name the job).  A job builds the scenario's
``TrainingArguments`` (``use_cpu=True``; accelerate sets up gloo), the model and data of
``compat.assets`` (the tiny Llama on fixed-length problems; for a ``classification`` scenario the tiny
BERT classifier on tokenized texts, ``DataCollatorWithPadding`` and ``compute_metrics`` accuracy; for a
``dpo`` scenario preference pairs and trl's ``DPOTrainer``; for a ``grpo`` scenario prompts, two reward
functions and trl's ``GRPOTrainer``), the
scenario's callbacks followed by the ``TraceRecorder``, and trains with a stock ``Trainer`` while
``AttributeAccessLog`` records what the transformers callbacks read.  ``"trainer": "trainbridge"`` runs
the same job with ``trainbridge.Trainer`` (``trainbridge.DPOTrainer``, ``trainbridge.GRPOTrainer``; the
facade, in place under this torchrun): the script with only its import changed.  ``"trainer": "run_training"``
runs a causal-LM scenario with trainbridge's ``run_training`` in place (``run_training_job``).  Rank 0 writes
``{"status": "completed"}`` to the job's status file at its end; a failing job ends the process.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorWithPadding, Trainer

from compat.assets import (
    EVAL_SAMPLES,
    TRAIN_SAMPLES,
    CompatAssets,
    TokenizedJsonl,
    accuracy,
    classification_data,
    classification_model,
    collate_fixed_length,
    preference_data,
    prompt_data,
)
from compat.recorder import OBSERVED_CALLBACK_CLASSES, AttributeAccessLog, TraceRecorder, access_path
from compat.scenarios import scenario
from trainbridge.core.distributed import wait_for_idle_gloo_threads


def run_job(job: dict[str, Any], assets: CompatAssets, *, last: bool = True) -> None:
    """Train one scenario phase with ``transformers.Trainer``; ``last``: the launch's last job, which ends the
    process group (``Trainer.end()``, the script's end); an earlier job leaves it to the next."""
    spec = scenario(job["scenario"])
    os.environ.update(job["env"])
    if int(os.environ.get("RANK", "0")) == 0:
        Path(job["status"]).write_text(json.dumps({"status": "started"}))
    if job.get("trainer") == "run_training":
        run_training_job(job, assets, last=last)
        return
    log = AttributeAccessLog(OBSERVED_CALLBACK_CLASSES)
    log.install()
    rank = 0
    try:
        args = spec.arguments_class()(**spec.training_arguments(job["out"], job["world_size"]))
        rank = args.process_index
        tokenizer = AutoTokenizer.from_pretrained(assets.model)
        trainer_class = Trainer
        if job.get("trainer") == "trainbridge":
            from trainbridge import Trainer as trainer_class  # the facade: the script with its import changed
        callbacks = [*spec.callbacks(), TraceRecorder(job["trace"])]
        if spec.task == "dpo":
            from trl import DPOTrainer as dpo_trainer_class

            if job.get("trainer") == "trainbridge":
                from trainbridge import DPOTrainer as dpo_trainer_class  # the script with its import changed
            trainer = dpo_trainer_class(
                model=AutoModelForCausalLM.from_pretrained(assets.model),
                args=args,
                train_dataset=preference_data(TRAIN_SAMPLES, seed=1),
                eval_dataset=preference_data(EVAL_SAMPLES, seed=2),
                processing_class=tokenizer,
                callbacks=callbacks,
            )
        elif spec.task == "grpo":
            from trl import GRPOTrainer as grpo_trainer_class

            from trainbridge.demos.rewards import answer_reward, digit_reward

            if job.get("trainer") == "trainbridge":
                from trainbridge import GRPOTrainer as grpo_trainer_class  # the script with its import changed
            trainer = grpo_trainer_class(
                model=AutoModelForCausalLM.from_pretrained(assets.model),
                reward_funcs=[answer_reward, digit_reward],
                args=args,
                train_dataset=prompt_data(TRAIN_SAMPLES, seed=1),
                processing_class=tokenizer,
                callbacks=callbacks,
            )
        elif spec.task == "classification":
            trainer = trainer_class(
                model=classification_model(tokenizer),
                args=args,
                train_dataset=classification_data(tokenizer, TRAIN_SAMPLES, seed=1),
                eval_dataset=classification_data(tokenizer, EVAL_SAMPLES, seed=2),
                data_collator=DataCollatorWithPadding(tokenizer),
                processing_class=tokenizer,
                compute_metrics=accuracy,
                callbacks=callbacks,
            )
        else:
            trainer = trainer_class(
                model=AutoModelForCausalLM.from_pretrained(assets.model),
                args=args,
                train_dataset=TokenizedJsonl(assets.train),
                eval_dataset=TokenizedJsonl(assets.val),
                data_collator=collate_fixed_length,
                processing_class=tokenizer,
                callbacks=callbacks,
            )
        resume = job["resume_from"]
        trainer.train(resume_from_checkpoint=None if resume is None else str(Path(job["out"]) / f"checkpoint-{resume}"))
        end = getattr(trainer, "end", None)  # Trainer's (transformers >= 5.2x) or the facade's: the group's end
        if last and end is not None:
            end()
    finally:
        log.restore()
        log.write(access_path(job["trace"], rank))
    # Before the job's objects are released (its DDP reducer's group joins gloo's threads holding the GIL), let
    # a gloo thread still releasing a collective's tensors take the GIL: under load that join once waited
    # forever for a thread waiting for the GIL (gdb, issue 32), hanging every later job of the launch.
    wait_for_idle_gloo_threads()
    if rank == 0:
        Path(job["status"]).write_text(json.dumps({"status": "completed"}))


def run_training_job(job: dict[str, Any], assets: CompatAssets, *, last: bool = True) -> None:
    """Train one causal-LM scenario phase with trainbridge's ``run_training`` called on this rank, in place
    (as from a ``torchrun script.py``): ``TrainingArgs`` ported by ``training_args_from_hf``, the callbacks
    between ``AttributeAccessProbe`` and the ``TraceRecorder`` (``compat.runners.trainbridge_arguments``).
    On 2 ranks the first job starts the process group and later ones use it (``run_training`` in place leaves
    a group it found or started to the script); ``last`` ends it, as a script's end.  Rank 0's status file
    gets ``RunResult.callback_errors``'s classes."""
    from compat.runners import trainbridge_arguments
    from trainbridge import TorchrunArgs, run_training

    spec = scenario(job["scenario"])
    world_size = job["world_size"]
    args, code, _ = trainbridge_arguments(
        spec, world_size, assets, Path(job["out"]), Path(job["trace"]), job["resume_from"]
    )
    result = run_training(args, TorchrunArgs(nproc_per_node=world_size), **code)
    if last and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    wait_for_idle_gloo_threads()  # as ``run_job``: before the job's objects are released
    if int(os.environ.get("RANK", "0")) == 0:
        errors = sorted({report.callback for report in result.callback_errors}) if result is not None else []
        Path(job["status"]).write_text(json.dumps({"status": "completed", "callback_errors": errors}))


def main(argv: list[str] | None = None) -> int:
    """Run every job of the command line, in order."""
    parser = argparse.ArgumentParser(prog="python -m compat.trainer_worker")
    parser.add_argument("--assets", required=True, help="JSON of compat.assets.CompatAssets paths")
    parser.add_argument("--jobs", required=True, help="JSON list of jobs (see the module docstring)")
    options = parser.parse_args(argv)
    assets = CompatAssets.from_json(json.loads(options.assets))
    jobs = json.loads(options.jobs)
    for number, job in enumerate(jobs, 1):
        run_job(job, assets, last=number == len(jobs))
        gc.collect()  # the job's trainer and DDP reducer, with gloo's threads idle (``run_job``'s end)
        if number < len(jobs) and int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            raise RuntimeError(
                f"compat.trainer_worker: job {number} ({job['scenario']}) destroyed the process group; the next "
                "job would create it again on this launch's store, where a rank can read a peer's stale address "
                "and hang in init_process_group"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
