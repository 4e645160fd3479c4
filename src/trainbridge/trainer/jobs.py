"""``Trainer.train()``'s job: trainbridge's loop, in place, on every rank of the script.

Each rank hands the loop the script's own datasets, tokenizer (``RunPlan.script_data``) and model
(``RunPlan.model_init``) and runs it with the job's callbacks, whose ``HuggingFaceCallbacks`` hold the run's
``TrainerState`` (restored on resume as Trainer restores it).  Afterwards the instance's ``model`` is the trained
model and its ``state`` the run's.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Any

from trainbridge.core.run_dir import result_file
from trainbridge.hf.batch_size_search import Searching, find_batch_size, with_batch_size
from trainbridge.hf.trainer_callbacks import HuggingFaceCallbacks, with_trainer_state
from trainbridge.launch.assembly import assemble_callbacks
from trainbridge.loop.build import build_run
from trainbridge.loop.loop import TrainingLoop
from trainbridge.loop.result import RunResult
from trainbridge.trainer import job_args

if TYPE_CHECKING:
    from trainbridge.trainer.facade import LoopTrainer as Trainer


def train(trainer: Trainer, resume: str | bool | None) -> tuple[RunResult, Any]:
    """Train ``trainer``'s model in place -> ``(this rank's result, the run's TrainerState)``."""
    env = trainer._start_env()
    # every rank reads the script's data itself; one that fails fails every rank at once
    args, plan = env.on_every_rank(lambda: job_args.training_job(trainer, env.world_size, resume), "preparing its data")
    handler, control = trainer.callback_handler, trainer.control
    if not trainer.accelerator._models:  # as in Trainer's train(): the model counts as prepared from here on
        trainer.accelerator._models.append(trainer.model)
    hf: HuggingFaceCallbacks | None = None

    def attempt(batch_size: int, searching: Searching) -> tuple[TrainingLoop, RunResult]:
        """One run of the loop with ``batch_size`` items per micro-batch (Trainer's ``_inner_training_loop``):
        its out-of-memory errors agreed by the ranks; resumed, from the checkpoint's size (``hf.batch_size_search``)."""
        nonlocal hf
        run_args = with_batch_size(args, batch_size, env.world_size)
        run_callbacks, hf = with_trainer_state(assemble_callbacks(run_args, plan))
        hf.init_end_fired = True  # Trainer's constructor fired on_init_end on the script's callbacks
        trainer._script.bind_state(hf)  # the instance's self.state / callback_handler / control in the loop's calls
        if search:  # as Trainer's release_memory before each attempt: a failed attempt's engine is gone before
            gc.collect()  # the model is wrapped again (a DDP reducer left expecting a backward would reduce into it)
        components = build_run(run_args, plan, env)
        loop = TrainingLoop(run_args, env, [*run_callbacks, *searching(components)], components)
        return loop, loop.run()

    from transformers import TrainingArguments

    search = isinstance(trainer.args, TrainingArguments) and bool(trainer.args.auto_find_batch_size)
    try:  # auto_find_batch_size: Trainer's own search (accelerate's), on an out-of-memory error, agreed by the ranks
        loop, result = find_batch_size(attempt, args, env, search)
    finally:
        trainer.callback_handler, trainer.control = handler, control
    if env.is_world_process_zero:
        result.write(result_file(args.resolved_run_files_dir))
    trainer._loop = loop
    trainer.model = loop.engine.unwrapped  # the trained model (the script's object; PEFT-wrapped if asked)
    trainer.model_wrapped = loop.engine.module
    trainer.optimizer = loop.engine.optimizer
    trainer.lr_scheduler = loop.engine.lr_scheduler
    assert hf is not None and hf.state is not None
    trainer.state = hf.state
    # evaluate()/predict() use the model as it is, as after Trainer's own train()
    trainer.accelerator._models[:] = [trainer.model_wrapped]  # type: ignore[list-item]
    if trainer.is_deepspeed_enabled:
        trainer.deepspeed = trainer.model_wrapped  # type: ignore[assignment]
    return result, trainer.state
