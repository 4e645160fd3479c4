"""Running the facade's jobs on a worker: in place (under the user's launcher) or as our torchrun worker.

``run_job(job, env)`` is the one function both ways call, on every rank:

- ``train``: the training loop with the run's callbacks; afterwards the final weights are written to
  ``final_model_dir`` (collective: sharded engines gather them) so the calling process can load them, and
  rank 0 writes the ``TrainerState`` of its ``HuggingFaceCallbacks`` (restored on resume, as Trainer's).
- ``evaluate``: the loop's set-up and one evaluation (``compute_metrics`` included) without training;
  launched, rank 0 writes the metrics and, for ``predict``, the gathered predictions, signed with the
  job's ``result_key`` (``launch.transport.write_signed``: the calling process verifies it before loading).

``python -m trainbridge.trainer.runner --payload PATH`` is the worker ``Trainer.train()`` launches from a
plain ``python script.py``: it reads the authenticated payload (a ``FacadeJob``) and calls ``run_job``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import record

from trainbridge.core.config import TrainingArgs
from trainbridge.core.distributed import DistributedEnv
from trainbridge.core.run_dir import FacadeDir, result_file
from trainbridge.hf.trainer_callbacks import HuggingFaceCallbacks
from trainbridge.launch.assembly import assemble_callbacks
from trainbridge.launch.process_exit import exit_now
from trainbridge.launch.transport import PAYLOAD_KEY_ENV, write_signed
from trainbridge.launch.worker import run_worker
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
class FacadeJob:
    """One job of the facade: ``kind`` is ``train`` or ``evaluate``; files go to ``run_dir``."""

    kind: str
    args: TrainingArgs
    run_dir: Path
    keep_predictions: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    result_key: str | None = None
    """Launched: the key the evaluation result is signed with (``RESULT_KEY_ENV``); in place: none is written."""


@dataclass
class JobOutcome:
    """What a job leaves on this rank (in place, the facade reads it directly)."""

    loop: TrainingLoop
    result: RunResult | None = None
    state: dict[str, Any] | None = None
    metrics: dict[str, Any] | None = None
    predictions: Any = None


def run_job(job: FacadeJob, env: DistributedEnv, callbacks: list[Any] | None = None) -> JobOutcome:
    """Run ``job`` on this rank (every rank calls it); see the module doc."""
    if job.kind == "train":
        given = callbacks if callbacks is not None else assemble_callbacks(job.args)
        run_callbacks, hf = with_trainer_state(given)
        bind_state(job.args, lambda: hf.state)  # a subclass's self.state is the run's live TrainerState
        loop = TrainingLoop(job.args, env, run_callbacks, build_run(job.args, env))
        result = loop.run()
        export_model(loop, FacadeDir(job.run_dir).final_model)
        state = hf.trainer_state() or {}
        if env.is_world_process_zero:
            result.write(result_file(job.args.ckpt_output_dir))
            FacadeDir(job.run_dir).state_file.write_text(json.dumps(state, indent=2, default=str))
        return JobOutcome(loop=loop, result=result, state=state)
    if job.kind == "evaluate":
        loop = TrainingLoop(job.args, env, callbacks or [], build_run(job.args, env))
        if job.keep_predictions and loop.predictions is None:
            raise RuntimeError("predict: the evaluation job was built without a prediction collector")
        metrics = loop.evaluate()
        predictions = loop.predictions.last if loop.predictions is not None else None
        if env.is_world_process_zero and job.result_key:
            # the launcher expects a result from every job; an evaluation trained no step
            job.args.ckpt_output_dir.mkdir(parents=True, exist_ok=True)
            RunResult(global_step=0, epoch=0.0, max_steps=0).write(result_file(job.args.ckpt_output_dir))
            write_signed(
                {"metrics": metrics, "predictions": predictions if job.keep_predictions else None},
                FacadeDir(job.run_dir).evaluation_file,
                job.result_key,
            )
        return JobOutcome(loop=loop, metrics=metrics, predictions=predictions)
    raise ValueError(f"unknown facade job kind {job.kind!r}")


def export_model(loop: TrainingLoop, folder: Path) -> None:
    """Write the loop's current weights in HF layout into ``folder`` (collective for sharded engines)."""
    state = loop.engine.full_model_state_dict()

    def write() -> None:
        if state is None:
            raise RuntimeError("the engine returned no full state dict on rank 0")
        folder.mkdir(parents=True, exist_ok=True)
        loop.engine.unwrapped.save_pretrained(folder, state_dict=state)
        if getattr(loop, "tokenizer", None) is not None:
            loop.tokenizer.save_pretrained(folder)

    loop.env.on_rank_zero(write, f"writing the model to {folder}")


RESULT_KEY_ENV = "TRAINBRIDGE_FACADE_RESULT_KEY"
"""Environment variable carrying a launched evaluation job's result key (hex) to the workers, as
``PAYLOAD_KEY_ENV`` carries the payload's: never on a command line or in a file."""
JOB_ENV = "TRAINBRIDGE_FACADE_JOB"
"""Environment variable carrying a self-launched job's kind and run folder (JSON) to the workers; the
``TrainingArgs`` themselves travel in the authenticated payload of ``run_training``."""


def job_environment(job: FacadeJob) -> str:
    """The value of ``JOB_ENV`` for ``job``."""
    return json.dumps({"kind": job.kind, "run_dir": str(job.run_dir), "keep_predictions": job.keep_predictions})


@record
def main(argv: list[str] | None = None) -> int:
    """The worker of a self-launched facade job (started by ``run_training(..., worker_module=...)``)."""
    spec = json.loads(os.environ.get(JOB_ENV, "{}"))
    if not spec or PAYLOAD_KEY_ENV not in os.environ:
        raise RuntimeError(f"{PAYLOAD_KEY_ENV}/{JOB_ENV} not set: this worker is started by trainbridge.Trainer")

    def job(args: TrainingArgs, env: DistributedEnv) -> None:
        run_job(
            FacadeJob(
                kind=spec["kind"],
                args=args,
                run_dir=Path(spec["run_dir"]),
                keep_predictions=bool(spec.get("keep_predictions")),
                result_key=os.environ.get(RESULT_KEY_ENV),
            ),
            env,
        )

    return run_worker(argv, "trainbridge.trainer.runner", job)


if __name__ == "__main__":
    exit_now(main() or 0)
