"""``Trainer.train()``'s job: trainbridge's loop, in place, on every rank of the script.

Every process trains in place: each rank of a launched script (``torchrun script.py``, or ``python script.py``
re-executed under torchrun by ``launch.script_launch``), or the script's own process when it runs as one.
Each rank hands the loop the script's own objects: its datasets and tokenizer (``RunPlan.script_data``,
nothing written), its model (``RunPlan.model_init``); then every rank runs the loop (``runner.run_job``).
Afterwards the instance's ``model`` is the trained model and its ``state`` the run's ``TrainerState``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from trainbridge.core.config import TorchrunArgs
from trainbridge.loop.result import RunResult
from trainbridge.trainer import job_args
from trainbridge.trainer.runner import run_job

if TYPE_CHECKING:
    from trainbridge.trainer.facade import LoopTrainer as Trainer


def world_size_of(torchrun_args: TorchrunArgs) -> int:
    """The ranks ``torchrun_args`` start (elastic ``MIN:MAX`` nodes: the most)."""
    return torchrun_args.nproc_per_node * int(str(torchrun_args.nnodes).split(":")[-1])


def train(trainer: Trainer, resume: str | bool | None) -> tuple[RunResult, Any]:
    """Train ``trainer``'s model in place -> ``(this rank's result, the run's TrainerState)``."""
    env = trainer._start_env()
    # every rank reads the script's data itself; one that fails fails every rank at once
    args, plan = env.on_every_rank(lambda: job_args.training_job(trainer, env.world_size, resume), "preparing its data")
    handler, control = trainer.callback_handler, trainer.control
    if not trainer.accelerator._models:  # as in Trainer's train(): the model counts as prepared from here on
        trainer.accelerator._models.append(trainer.model)
    try:
        outcome = run_job(args, plan, env)
    finally:
        trainer.callback_handler, trainer.control = handler, control
    trainer._loop = outcome.loop
    trainer.model = outcome.loop.engine.unwrapped  # the trained model (the script's object; PEFT-wrapped if asked)
    trainer.model_wrapped = outcome.loop.engine.module
    trainer.optimizer = outcome.loop.engine.optimizer
    trainer.lr_scheduler = outcome.loop.engine.lr_scheduler
    assert outcome.hf.state is not None
    trainer.state = outcome.hf.state
    # evaluate()/predict() use the model as it is, as after Trainer's own train()
    trainer.accelerator._models[:] = [trainer.model_wrapped]  # type: ignore[list-item]
    if trainer.is_deepspeed_enabled:
        trainer.deepspeed = trainer.model_wrapped  # type: ignore[assignment]
    assert outcome.result is not None
    return outcome.result, trainer.state
