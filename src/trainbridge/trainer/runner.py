"""Running ``Trainer.train()``'s job on this rank: the loop with the run's callbacks, in place.

``run_job(args, plan, env)`` is called on every rank: the training loop with the job's callbacks, whose
``HuggingFaceCallbacks`` (the script's ``TrainerCallback``s, Trainer's printer / progress bar) hold the run's
``TrainerState``, restored on resume as Trainer restores it; the instance's methods see that state, handler
and control (``subclass.ScriptTrainer``).  Rank 0 writes the run's result file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainbridge.core.config import RunPlan, TrainingArgs
from trainbridge.core.distributed import DistributedEnv
from trainbridge.core.run_dir import result_file
from trainbridge.hf.trainer_callbacks import HuggingFaceCallbacks
from trainbridge.launch.assembly import assemble_callbacks
from trainbridge.loop.build import build_run
from trainbridge.loop.loop import TrainingLoop
from trainbridge.loop.result import RunResult
from trainbridge.trainer.subclass import bind_state


def with_trainer_state(callbacks: list[Any]) -> tuple[list[Any], HuggingFaceCallbacks]:
    """``callbacks`` and the ``HuggingFaceCallbacks`` among them, whose ``TrainerState`` is the job's state
    (restored on resume as Trainer restores it); a run without HF callbacks gets one driving none (no printer)."""
    hf = next((cb for cb in callbacks if isinstance(cb, HuggingFaceCallbacks)), None)
    if hf is None:
        hf = HuggingFaceCallbacks(progress=False)
        callbacks = [*callbacks, hf]
    return callbacks, hf


@dataclass
class JobOutcome:
    """What the job leaves on this rank."""

    loop: TrainingLoop
    hf: HuggingFaceCallbacks
    result: RunResult | None = None


def run_job(args: TrainingArgs, plan: RunPlan, env: DistributedEnv) -> JobOutcome:
    """Run ``train()``'s job of ``args`` running ``plan`` on this rank (every rank calls it); see the module doc."""
    run_callbacks, hf = with_trainer_state(assemble_callbacks(args, plan))
    hf.init_end_fired = True  # Trainer's constructor fired on_init_end on the script's callbacks
    bind_state(plan, hf)  # the instance's self.state / callback_handler / control are the run's
    loop = TrainingLoop(args, env, run_callbacks, build_run(args, plan, env))
    result = loop.run()
    if env.is_world_process_zero:
        result.write(result_file(args.resolved_run_files_dir))
    return JobOutcome(loop=loop, hf=hf, result=result)
