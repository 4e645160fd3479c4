"""``DPOTrainer``: trl's ``DPOTrainer`` constructor on trainbridge's ``Trainer`` facade.

It takes trl's arguments as they are (``DPOConfig``, a model object or a path with ``model_init_kwargs``,
``ref_model``, ``peft_config``, ``processing_class``), prepares the pairs with trl's own preparation
(``preference_data.prepare_preference_dataset``) and hands the workers a ``dpo_step.DPOStepFactory`` as the
job's ``train_step``: the facade writes the prepared pairs as the job's items and each worker builds the
DPO step over them (``beta``, ``loss_type``, ``label_smoothing``, ``max_length`` from the config).  With
``precompute_ref_log_probs`` the reference scores the pairs here, before launch, and the workers read the
columns.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from trainbridge.trainer import Trainer
from trainbridge.trainer.facade import UnsupportedTrainerFeatureError
from trainbridge.trl.arguments import trl_config, trl_tokenizer
from trainbridge.trl.dpo_step import DPOStepFactory
from trainbridge.trl.preference_data import precompute_reference_logps, prepare_preference_dataset
from trainbridge.trl.preference_loss import DPOLossSettings


class DPOTrainer(Trainer):
    """trl's ``DPOTrainer(model, ref_model, args, data_collator, train_dataset, eval_dataset,
    processing_class, ..., peft_config)`` on trainbridge's loop."""

    def __init__(
        self,
        model: Any,
        ref_model: Any = None,
        args: Any = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        compute_metrics: Any = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        optimizer_cls_and_kwargs: Any = None,
        preprocess_logits_for_metrics: Any = None,
        peft_config: Any = None,
        **kwargs: Any,
    ) -> None:
        from transformers import AutoModelForCausalLM
        from trl import DPOConfig

        args = trl_config(args, DPOConfig, model, "DPO")
        if eval_dataset is not None:
            raise UnsupportedTrainerFeatureError(
                "eval_dataset: DPOTrainer does not evaluate preference pairs yet; pass eval_dataset=None"
            )
        if train_dataset is None:
            raise ValueError("train_dataset: DPOTrainer needs preference pairs (prompt/chosen/rejected rows)")
        processing_class, tokenizer = trl_tokenizer(processing_class, model)
        pairs = prepare_preference_dataset(train_dataset, tokenizer, args)
        if args.precompute_ref_log_probs and "ref_chosen_logps" not in pairs.column_names:
            policy = (
                AutoModelForCausalLM.from_pretrained(str(model), **(args.model_init_kwargs or {}))
                if isinstance(model, str | Path)
                else model
            )
            pairs = precompute_reference_logps(pairs, policy, ref_model, args, args.precompute_ref_batch_size or 8)
        self.step_factory = DPOStepFactory(
            None,
            DPOLossSettings.from_config(args),
            pairs_per_micro=int(args.per_device_train_batch_size),
            micro_per_step=int(args.gradient_accumulation_steps),
            max_length=args.max_length,
            truncation_mode=args.truncation_mode,
            ref_model=None if args.precompute_ref_log_probs else ref_model,
            seed=int(args.seed),
        )
        super().__init__(
            model=model,
            args=args,
            data_collator=None,
            train_dataset=pairs,
            eval_dataset=None,
            processing_class=processing_class,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            peft_config=peft_config,
            **kwargs,
        )

    def _row_preparation(self) -> Any:
        """The prepared pairs are the job's items, written as they are (every column)."""
        return dataclasses.replace(super()._row_preparation(), items=True)
