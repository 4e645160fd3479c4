"""A facade job's ``TrainingArgs``: the Trainer's arguments, its callbacks and functions, and the run folder.

``training_args`` ports a ``transformers.TrainingArguments`` (``hf.porting``; a ``TrainingArgs`` is copied)
and points it at the ``RunLayout`` the writing rank returned.  ``evaluation_args`` turns those into the
arguments of an evaluation job: no checkpoints, no best-model tracking, output into the job's folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainbridge.core.config import TrainingArgs
from trainbridge.hf.handler import is_hf_callback
from trainbridge.trainer.optimizers import script_model
from trainbridge.trainer.run_folder import RunLayout
from trainbridge.trainer.save_overrides import subclass_save
from trainbridge.trainer.script_data import dataset_transforms
from trainbridge.trainer.subclass import script_events, script_trainer, subclass_evaluation, subclass_loss
from trainbridge.trainer.subclass_data import subclass_loader

if TYPE_CHECKING:
    from trainbridge.trainer.facade import Trainer

DEFAULT_MAX_SEQ_LEN = 512
"""``max_seq_len`` of a ported run whose rows are not tokenised yet and whose arguments name no length."""


def no_metrics(eval_prediction: Any) -> dict[str, float]:
    """The ``compute_metrics`` of a ``predict()`` job without the user's own: predictions only."""
    return {}


def training_args(trainer: Trainer, layout: RunLayout, world_size: int, resume: Any) -> TrainingArgs:
    """The ``TrainingArgs`` of a job of ``trainer`` over ``layout`` on ``world_size`` ranks; ``resume`` is
    ``train(resume_from_checkpoint=...)``."""
    from trainbridge.hf.porting import training_args_from_hf

    worker = script_trainer(trainer)  # a subclass's overrides: they run in the workers (trainer.subclass)
    if worker is not None:
        worker.take_attributes(trainer, check_transport=False)  # in place: nothing travels
    events = script_events(trainer)
    fields: dict[str, Any] = {
        "model_path": layout.model_path,
        "tokenizer_path": layout.tokenizer_path,
        "data_path": layout.data_path,
        "val_data_path": layout.val_data_path,
        "callbacks": [events, *trainer.callbacks] if events is not None else list(trainer.callbacks),
        "compute_metrics": trainer.compute_metrics,
        "preprocess_logits_for_metrics": trainer.preprocess_logits_for_metrics,
        "data_collator": None if trainer._collator_choice.reproduced else trainer.data_collator,
        "trainer_methods": subclass_loss(trainer),
        "evaluation": subclass_evaluation(trainer),  # a subclass's evaluate, around each evaluation in train()
        "optimizer_factory": trainer._optimizer_factory,
        "model_init": script_model(trainer._optimizer_factory),  # optimizers= in place: the script's model
        "checkpoint_model_files": subclass_save(trainer),  # a subclass's _save / save_model
        "train_step": getattr(trainer, "step_factory", None),  # a facade subclass's own step (DPOTrainer)
        "train_stream": trainer.train_dataset if layout.data_path is None else None,  # iterated in the workers
        "train_loader": subclass_loader(trainer),  # a subclass's get_train_dataloader / _get_train_sampler
        "requires_grad": _requires_grad(trainer),
    }
    if trainer._row_preparation().items:  # Trainer's sample batches, the model's own loss, the script's collator
        fields.update(_sample_batch_fields(trainer))
    if layout.eval_data_paths:  # a dict eval_dataset: named sets, each evaluated in turn
        fields["eval_data_paths"] = dict(layout.eval_data_paths)
    if trainer._peft_config is not None:
        fields["peft_config"] = trainer._peft_config
    model_kwargs = getattr(trainer.args, "model_init_kwargs", None)  # trl configs: from_pretrained kwargs
    if trainer._model_source is not None and isinstance(model_kwargs, dict):
        fields["model_kwargs"] = _model_kwargs(model_kwargs)
    generation_fields = getattr(trainer, "generation_fields", None)  # Seq2SeqTrainer: predict_with_generate
    if generation_fields is not None:
        fields.update(generation_fields())
    if getattr(trainer, "token_metrics", False):  # trl's SFTTrainer: its logged metrics
        fields["token_metrics"] = True
    if resume is True:
        fields["resume_from_checkpoint"] = "auto"
    elif resume:
        fields["resume_from_checkpoint"] = Path(resume)
    if isinstance(trainer.args, TrainingArgs):
        data = {
            **{name: getattr(trainer.args, name) for name in TrainingArgs.model_fields},
            **trainer.args.plan.keywords(),
        }
        data.update({k: v for k, v in fields.items() if v is not None or k == "data_collator"})
        data["callbacks"] = [*trainer.args.plan.callbacks, *fields["callbacks"]]
        return TrainingArgs.model_validate(data)
    hf = trainer.args
    # Always run through HuggingFaceCallbacks, as a Trainer script expects: it adds Trainer's own printer /
    # progress bar, and each checkpoint gets trainer_state.json as under Trainer
    from transformers import TrainerCallback

    if not any(is_hf_callback(c) for c in trainer.callbacks):
        fields["callbacks"] = [*fields["callbacks"], TrainerCallback()]
    per_device = int(hf.per_device_train_batch_size)
    accumulation = int(hf.gradient_accumulation_steps)
    fields["effective_batch_size"] = per_device * accumulation * world_size
    fields["per_device_batch_size"] = per_device  # Trainer's sample batches (model_loss): accumulation follows
    max_len = getattr(hf, "max_length", None) or getattr(hf, "max_seq_length", None)
    max_seq_len = int(layout.longest or max_len or DEFAULT_MAX_SEQ_LEN)
    fields["max_seq_len"] = max_seq_len
    fields["max_batch_len"] = max(per_device * max_seq_len, max_seq_len)
    if resume is None:
        fields["resume_from_checkpoint"] = None  # Trainer's args.resume_from_checkpoint is for scripts
    return training_args_from_hf(hf, **fields)


def _requires_grad(trainer: Trainer) -> dict[str, bool] | None:
    """Which of the script's model's parameters train, by name (``TrainingArgs.requires_grad``): the workers
    rebuild the model from its ``save_pretrained`` folder, which keeps no ``requires_grad`` (frozen layers)."""
    model = trainer.model
    if trainer._peft_config is not None or not isinstance(model, torch.nn.Module):
        return None  # a model path, or an adapter applied in the workers: their loading decides
    return {name: parameter.requires_grad for name, parameter in model.named_parameters()}


def _sample_batch_fields(trainer: Trainer) -> dict[str, Any]:
    """The ``model_loss`` fields of a job whose workers train on the datasets' items (``RowPreparation.items``)."""
    hf = trainer.args
    fields: dict[str, Any] = {
        "training_step": "model_loss",
        "data_collator": trainer.data_collator,
        "dataset_transforms": dataset_transforms(trainer.train_dataset, trainer.eval_dataset),
    }
    if not isinstance(hf, TrainingArgs):
        fields["per_device_batch_size"] = int(hf.per_device_train_batch_size)
        fields["per_device_eval_batch_size"] = int(hf.per_device_eval_batch_size)
        fields["remove_unused_columns"] = bool(getattr(hf, "remove_unused_columns", True))
        label_names = getattr(hf, "label_names", None)
        if label_names:
            fields["label_names"] = list(label_names)
    return fields


def evaluation_args(args: TrainingArgs, output_dir: Path, keep_predictions: bool, dataset: Any = None) -> TrainingArgs:
    """``args`` for one evaluation of ``dataset`` (no training, checkpoints, callbacks or reports, no optimizer
    of the script's: the model the run folder holds) writing into ``output_dir``; ``keep_predictions``
    (``predict()``) with no ``compute_metrics`` gets ``no_metrics``."""
    updates: dict[str, Any] = {
        "dataset_transforms": dataset_transforms(None, dataset),
        "optimizer_factory": None,
        "model_init": None,
        "checkpoint_model_files": None,
        "eval_strategy": "no",
        "save_strategy": "no",
        "load_best_model_at_end": False,
        "metric_for_best_model": None,
        "callbacks": [],
        "report_to": [],
        "eval_on_start": False,
        "ckpt_output_dir": output_dir,
        "resume_from_checkpoint": None,
        "train_stream": None,
        "train_loader": None,
        "evaluation": None,  # the script's evaluate override is what called this job
    }
    if keep_predictions and args.plan.compute_metrics is None:
        updates["compute_metrics"] = no_metrics
    data = {**{name: getattr(args, name) for name in TrainingArgs.model_fields}, **args.plan.keywords()}
    data.update(updates)
    return TrainingArgs.model_validate(data)


def _model_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """trl's ``model_init_kwargs`` as ``TrainingArgs.model_kwargs`` (None values dropped, dtypes as names)."""
    out = {k: v for k, v in kwargs.items() if v is not None}
    dtype = out.get("dtype", out.pop("torch_dtype", None))
    if dtype is not None:
        out["dtype"] = str(dtype).removeprefix("torch.")
    return out
