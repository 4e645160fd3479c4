"""The facade's jobs, from the script's side: train, and evaluate (``evaluate()`` and ``predict()``).

Every job runs **in place**: on each rank of a launched script (``torchrun script.py``, or ``python script.py``
re-executed under torchrun by ``launch.script_launch``), or in the script's own process when it runs as one.
Rank 0 writes the job's inputs into the run folder and every rank gets their ``RunLayout`` or rank 0's failure
(``DistributedEnv.on_rank_zero``), then every rank runs the job (``runner.run_job``).  The launched jobs below
(``_train_launched``, ``launch``, the signed result ``evaluate`` reads) are no longer reached; they go with the
facade's rewrite (issue 29).
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainbridge.checkpoint.layout import ADAPTER_WEIGHTS_FILE
from trainbridge.core.config import TorchrunArgs
from trainbridge.core.distributed import DistributedEnv
from trainbridge.core.run_dir import FacadeDir
from trainbridge.launch.transport import read_signed
from trainbridge.loop.result import RunResult
from trainbridge.trainer import job_args, run_folder
from trainbridge.trainer.runner import (
    JOB_ENV,
    RESULT_KEY_ENV,
    FacadeJob,
    JobOutcome,
    export_model,
    job_environment,
    run_job,
)

if TYPE_CHECKING:
    from trainbridge.trainer.facade import Trainer

RUNNER_MODULE = "trainbridge.trainer.runner"
"""The worker module of a launched job."""


def train(trainer: Trainer, resume: Any) -> tuple[RunResult, dict[str, Any]]:
    """Train ``trainer``'s model -> ``(rank 0's result, the recorded TrainerState fields)``; afterwards
    ``trainer.model`` holds the trained (or, launched with ``load_best_model_at_end``, the best) weights."""
    outcome = _train_in_place(trainer, resume)  # every process trains in place (trainbridge.launch.script_launch)
    assert outcome.result is not None and outcome.state is not None
    return outcome.result, outcome.state


def evaluate(trainer: Trainer, dataset: Any, keep_predictions: bool) -> tuple[dict[str, Any], Any]:
    """One evaluation of ``trainer``'s current model on ``dataset`` (one or a dict of named sets) ->
    ``(metrics, gathered predictions or None)``."""
    folder = trainer._folder.evaluation
    env: DistributedEnv | None = trainer._start_env()  # in place: under a launcher, or one process
    trained = None
    if trainer._loop is not None:  # in place after training: the current weights, written collectively
        export_model(trainer._loop, folder.model)
        trained = folder.model

    def write() -> run_folder.RunLayout:
        model = trained if trained is not None else trainer._model_source_for_jobs()
        return run_folder.write_evaluation_inputs(folder, model, trainer._row_preparation(), dataset)

    layout = env.on_rank_zero(write, "writing the evaluation data") if env is not None else write()
    world_size = env.world_size if env is not None else world_size_of(launch_args(trainer))
    args = job_args.evaluation_args(
        job_args.training_args(trainer, layout, world_size, None), folder.job_output, keep_predictions, dataset
    )
    job = FacadeJob("evaluate", args, folder.root, keep_predictions=keep_predictions)
    if env is not None:
        outcome = run_job(job, env)
        return dict(outcome.metrics or {}), outcome.predictions
    job.result_key = secrets.token_hex(32)
    launch(job, launch_args(trainer))
    out = read_signed(folder.evaluation_file, job.result_key, RESULT_KEY_ENV)
    return dict(out["metrics"]), out["predictions"]


def launch_args(trainer: Trainer) -> TorchrunArgs:
    """How a launched job starts: the Trainer's ``torchrun_args``, else ``default_nproc_per_node`` processes
    for the Trainer's device (``use_cpu``: one, or ``$TRAINBRIDGE_NPROC_PER_NODE``)."""
    return (trainer.torchrun_args or TorchrunArgs()).for_device(trainer._device())


def world_size_of(torchrun_args: TorchrunArgs) -> int:
    """The ranks ``torchrun_args`` start (elastic ``MIN:MAX`` nodes: the most)."""
    return torchrun_args.nproc_per_node * int(str(torchrun_args.nnodes).split(":")[-1])


def launch(job: FacadeJob, torchrun_args: TorchrunArgs) -> RunResult | None:
    """Run ``job`` in torchrun workers started from this process (``run_training``); rank 0's result."""
    from trainbridge.launch.launcher import run_training

    variables = {JOB_ENV: job_environment(job), RESULT_KEY_ENV: job.result_key}
    previous = {name: os.environ.get(name) for name in variables}
    for name, value in variables.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        return run_training(job.args, torchrun_args, worker_module=RUNNER_MODULE)
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _write_training_inputs(trainer: Trainer) -> run_folder.RunLayout:
    return run_folder.write_training_inputs(
        trainer._folder,
        trainer._model_source_for_jobs(),
        trainer._row_preparation(),
        trainer.train_dataset,
        trainer.eval_dataset,
    )


def _train_in_place(trainer: Trainer, resume: Any) -> JobOutcome:
    env = trainer._start_env()
    layout = env.on_rank_zero(lambda: _write_training_inputs(trainer), "writing the run folder")
    args = job_args.training_args(trainer, layout, env.world_size, resume)
    outcome = run_job(FacadeJob("train", args, trainer._folder.root), env)
    trainer._loop = outcome.loop
    _take_trained_weights(trainer, outcome)
    return outcome


def _take_trained_weights(trainer: Trainer, outcome: JobOutcome) -> None:
    """In place: ``trainer.model`` gets the loop's trained weights (the same object, as under Trainer)."""
    unwrapped = outcome.loop.engine.unwrapped
    if unwrapped is trainer.model:  # optimizers= in place: the job trained the script's model itself
        return
    if trainer.model is None or not hasattr(trainer.model, "load_state_dict"):
        trainer.model = unwrapped
        return
    state = unwrapped.state_dict()
    mine = trainer.model.state_dict()
    sharded = any(type(t).__name__ == "DTensor" for t in state.values()) or any(
        key in mine and tuple(mine[key].shape) != tuple(value.shape) for key, value in state.items()
    )
    if sharded:
        trainer.model = unwrapped  # FSDP2 / ZeRO-3 shards: Trainer's model is the sharded module too
        return
    trainer.model.load_state_dict(state, strict=False)


def _train_launched(trainer: Trainer, resume: Any) -> tuple[RunResult, dict[str, Any]]:
    torchrun_args = launch_args(trainer)
    layout = _write_training_inputs(trainer)
    args = job_args.training_args(trainer, layout, world_size_of(torchrun_args), resume)
    folder: FacadeDir = trainer._folder
    result = launch(FacadeJob("train", args, folder.root), torchrun_args)
    assert isinstance(result, RunResult)
    state = json.loads(folder.state_file.read_text())
    weights = folder.final_model
    if args.load_best_model_at_end and result.best_checkpoint:
        weights = Path(result.best_checkpoint)
    _load_weights(trainer, weights)
    return result, state


def _load_weights(trainer: Trainer, folder: Path) -> None:
    """Load the weights in ``folder`` into ``trainer.model`` (the caller's object) or load the model."""
    from trainbridge.checkpoint.manager import fill_tied_weights, read_safetensors_weights

    trainer._weights_dir = folder
    adapter_file = folder / ADAPTER_WEIGHTS_FILE
    if adapter_file.is_file() and trainer.model is not None and hasattr(trainer.model, "peft_config"):
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(trainer.model, load_file(str(adapter_file)))
        return
    if trainer.model is None:
        from trainbridge.modeling.load import load_adapter, load_saved_model

        if adapter_file.is_file() and trainer._model_source is not None:  # a model path with peft_config
            base = load_saved_model(trainer._model_source, use_safetensors=True)
            trainer.model = load_adapter(base, folder, trainable=True)
            return
        trainer.model = load_saved_model(folder, use_safetensors=True)  # never a pickle; the class saved
        return
    state = read_safetensors_weights(folder)
    fill_tied_weights(state, trainer.model)
    if set(trainer.model.state_dict()) - set(state):
        # saved under transformers' checkpoint names, not the modules' (ViT in transformers 5): its loader maps them
        state = type(trainer.model).from_pretrained(str(folder)).state_dict()
    trainer.model.load_state_dict(state, strict=False)
