"""``train()``'s ``TrainingArgs`` and ``RunPlan``: the instance's ``TrainingArguments`` ported (``hf.porting``)
and its ``run_plan()`` completed with its datasets and tokenizer (``RunPlan.script_data``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainbridge.core.config import RunPlan, TrainingArgs, check_consistent
from trainbridge.core.config.checks import check_world
from trainbridge.core.config.plan import ExistingModel
from trainbridge.data.script_data import RowPreparation, script_inputs
from trainbridge.hf.batch_shape import batch_fields
from trainbridge.hf.handler import is_hf_callback
from trainbridge.trainer.optimizers import script_model

if TYPE_CHECKING:
    from trainbridge.trainer.facade import LoopTrainer as Trainer


class LiveModel(ExistingModel):
    """``RunPlan.model_init`` of ``train()``: the instance's own model object, trained in place (the one the
    script's ``optimizers=`` step, if it gave them); not re-seeded (``ExistingModel``)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def __call__(self, *args: Any) -> Any:
        stepped = script_model(self.trainer._optimizer_factory)
        return stepped() if stepped is not None else self.trainer.model


@dataclass
class TrainerPlan(RunPlan):
    """``LoopTrainer.run_plan()``: the run's code and the settings its class decides with it, which
    ``training_job`` writes into the run's ``TrainingArgs`` (a class's override changes them here, once)."""

    rows: RowPreparation | None = None
    """How the datasets' rows reach the loop; ``rows.items``: Trainer's sample batches (a ``RunPlan.loss`` of
    those), else the token step's prepared rows.  Always set by ``run_plan()``."""
    honours_hf_fields: tuple[str, ...] = ()
    """``TrainingArguments`` fields the class applies itself through its seams, not reported ignored
    (``callbacks.neftune.NEFTune``; ``Seq2SeqTrainer``'s generation fields: ``RunPlan.predictions``)."""


def training_job(trainer: Trainer, world_size: int, resume: Any) -> tuple[TrainingArgs, RunPlan]:
    """The ``TrainingArgs`` and ``RunPlan`` of a job of ``trainer`` on ``world_size`` ranks, checked together;
    ``resume`` is ``train(resume_from_checkpoint=...)``."""
    from trainbridge.hf.porting import training_args_from_hf

    plan = trainer.run_plan()
    assert plan.rows is not None
    callbacks = plan.callbacks
    data, longest = script_inputs(
        trainer.train_dataset, trainer.eval_dataset, trainer._loop_processing_class(), plan.rows
    )
    hf = trainer.args
    fields = batch_fields(hf, world_size, longest, plan.rows.items)
    fields["ckpt_output_dir"] = trainer.output_dir  # a search's trial: <output_dir>/run-<n>
    if trainer._peft_config is not None:
        fields["peft_config"] = trainer._peft_config
    if resume is True:
        fields["resume_from_checkpoint"] = "auto"
    elif resume:
        fields["resume_from_checkpoint"] = Path(resume)
    # Always run through HuggingFaceCallbacks, as a Trainer script expects: it adds Trainer's own printer /
    # progress bar, and each checkpoint gets trainer_state.json as under Trainer
    from transformers import TrainerCallback

    if not any(is_hf_callback(c) for c in callbacks):
        callbacks = [*callbacks, TrainerCallback()]
    if resume is None:
        fields["resume_from_checkpoint"] = None  # Trainer's args.resume_from_checkpoint is for scripts
    fields["callback_error_policy"] = "fatal"  # a callback that raises fails train(), as under Trainer
    args = training_args_from_hf(hf, honoured=plan.honours_hf_fields, **fields)
    # the script's datasets and tokenizer, read in place; the TrainingArguments Hugging Face callbacks see
    run = plan.replace(script_data=data, callbacks=callbacks, hf_args=hf)
    check_consistent(args, run)
    check_world(args, world_size)
    return args, run
