"""``ORPOTrainer`` and ``CPOTrainer``: trl's (``trl.experimental``) constructors on trainbridge's facade.

Each takes trl's arguments as they are (``ORPOConfig``/``CPOConfig``, a model object or a path with
``model_init_kwargs``, ``peft_config``, ``processing_class``), prepares the pairs with trl's own
preparation (``reference_free_data``) and hands the workers a ``reference_free_step`` factory as the
job's ``train_step``: the facade writes the prepared pairs as the job's items and each worker builds the
step over them with the loss read from the config (``ORPOLoss``/``CPOLoss``).  Neither has a reference
model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from trainbridge.trainer import Trainer
from trainbridge.trainer.facade import UnsupportedTrainerFeatureError
from trainbridge.trl.arguments import fields_read, trl_config, trl_tokenizer
from trainbridge.trl.reference_free_data import prepare_reference_free_pairs
from trainbridge.trl.reference_free_loss import CPOLoss, ORPOLoss
from trainbridge.trl.reference_free_step import ReferenceFreeStepFactory


class _ReferenceFreeTrainer(Trainer):
    """trl's ``(model, args, data_collator, train_dataset, eval_dataset, processing_class, model_init,
    callbacks, optimizers, preprocess_logits_for_metrics, peft_config, compute_metrics)``."""

    _suffix = ""

    @staticmethod
    def _trl_classes() -> tuple[type, type]:
        """(trl's config class, trl's trainer class)."""
        raise NotImplementedError

    def _loss(self, config: Any) -> ORPOLoss | CPOLoss:
        raise NotImplementedError

    def __init__(
        self,
        model: Any = None,
        args: Any = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        model_init: Any = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        preprocess_logits_for_metrics: Any = None,
        peft_config: Any = None,
        compute_metrics: Any = None,
        **kwargs: Any,
    ) -> None:
        config_cls, trl_trainer = self._trl_classes()
        name = trl_trainer.__name__
        args = trl_config(args, config_cls, model, self._suffix)
        if train_dataset is None:
            raise ValueError(f"train_dataset: {name} needs preference pairs (prompt/chosen/rejected rows)")
        if eval_dataset is not None:
            raise UnsupportedTrainerFeatureError(
                f"eval_dataset: {name} does not evaluate preference pairs yet; pass eval_dataset=None"
            )
        if data_collator is not None:
            raise UnsupportedTrainerFeatureError(
                f"data_collator: {name} packs the pairs padding-free itself; pass data_collator=None"
            )
        if args.model_init_kwargs is not None and not isinstance(model, str):
            raise ValueError(f"model_init_kwargs: given with a model object; {name} applies them only to a model path")
        loss = self._loss(args)
        processing_class, tokenizer = trl_tokenizer(processing_class, model)
        pairs = prepare_reference_free_pairs(train_dataset, tokenizer, args, trl_trainer)
        self.step_factory = ReferenceFreeStepFactory(
            None,
            loss,
            pairs_per_micro=int(args.per_device_train_batch_size),
            micro_per_step=int(args.gradient_accumulation_steps),
            seed=int(args.seed),
            disable_dropout=bool(args.disable_dropout),
        )
        super().__init__(
            model=model,
            args=args,
            data_collator=None,
            train_dataset=pairs,
            eval_dataset=None,
            processing_class=processing_class,
            model_init=model_init,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            peft_config=peft_config,
            **kwargs,
        )

    def _row_preparation(self) -> Any:
        """The prepared pairs are the job's items, written as they are (every column)."""
        return dataclasses.replace(super()._row_preparation(), items=True)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        with fields_read(self.args, READ_FIELDS):
            return super().train(*args, **kwargs)


READ_FIELDS = (
    "beta",
    "label_smoothing",
    "loss_type",
    "cpo_alpha",
    "simpo_gamma",
    "alpha",
    "max_length",
    "max_completion_length",
    "disable_dropout",
    "dataset_num_proc",
)
"""ORPO/CPO config fields (not ``TrainingArguments``') that the data preparation and the step read
(``reference_free_loss``, ``reference_free_data``): honoured, so the porting does not call them ignored."""


class ORPOTrainer(_ReferenceFreeTrainer):
    """trl's ``trl.experimental.orpo.ORPOTrainer`` on trainbridge's loop (``ORPOConfig`` as it is)."""

    _suffix = "ORPO"

    @staticmethod
    def _trl_classes() -> tuple[type, type]:
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        return ORPOConfig, ORPOTrainer

    def _loss(self, config: Any) -> ORPOLoss:
        return ORPOLoss.from_config(config)


class CPOTrainer(_ReferenceFreeTrainer):
    """trl's ``trl.experimental.cpo.CPOTrainer`` on trainbridge's loop (``CPOConfig`` as it is: ``loss_type``
    sigmoid, hinge, ipo or simpo, ``cpo_alpha``, ``simpo_gamma``, AlphaPO's ``alpha``)."""

    _suffix = "CPO"

    @staticmethod
    def _trl_classes() -> tuple[type, type]:
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        return CPOConfig, CPOTrainer

    def _loss(self, config: Any) -> CPOLoss:
        return CPOLoss.from_config(config)
