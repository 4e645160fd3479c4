"""``DPOTrainer``: trl's ``DPOTrainer`` constructor on trainbridge's ``Trainer`` facade.

It takes trl's arguments as they are (``DPOConfig``, a model object or a path with ``model_init_kwargs``,
``ref_model``, ``peft_config``, ``processing_class``), prepares the pairs with trl's own preparation
(``preference_data.prepare_preference_dataset``) and hands the workers a ``dpo_step.DPOStepFactory`` as the
job's ``train_step``: the facade writes the prepared pairs as the job's items and each worker builds the
DPO step over them (``beta``, ``loss_type``, ``label_smoothing``, ``max_length`` from the config); an
``eval_dataset`` (one, or a dict of named sets) is prepared the same way and evaluated with trl's metrics.
With ``precompute_ref_log_probs`` the reference scores the pairs here, before launch, and the workers
read the columns.
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
        if compute_metrics is not None:
            raise UnsupportedTrainerFeatureError(
                "compute_metrics: DPOTrainer evaluates trl's loss and metrics (eval_loss, eval_rewards/*, "
                "eval_logps/*, eval_logits/*); pass compute_metrics=None"
            )
        if train_dataset is None:
            raise ValueError("train_dataset: DPOTrainer needs preference pairs (prompt/chosen/rejected rows)")
        if args.sync_ref_model:
            if args.precompute_ref_log_probs or peft_config is not None or hasattr(model, "peft_config"):
                raise ValueError(
                    "sync_ref_model=True: the reference must be a model of its own (not precomputed log-probs "
                    "or a PEFT base); set sync_ref_model=False, or train without PEFT / precompute_ref_log_probs"
                )
            from trl.trainer.callbacks import SyncRefModelCallback

            # as trl adds it; the workers' DPO step hands it the reference it scores with
            callbacks = [*(callbacks or []), SyncRefModelCallback(ref_model=None, accelerator=None)]  # type: ignore[arg-type]
        processing_class, tokenizer = trl_tokenizer(processing_class, model)
        policy: Any = None

        def prepared(dataset: Any, name: str, batch_size: int) -> Any:
            nonlocal policy
            pairs = prepare_preference_dataset(dataset, tokenizer, args, name)
            if not args.precompute_ref_log_probs or "ref_chosen_logps" in pairs.column_names:
                return pairs
            if policy is None:
                policy = (
                    AutoModelForCausalLM.from_pretrained(str(model), **(args.model_init_kwargs or {}))
                    if isinstance(model, str | Path)
                    else model
                )
            return precompute_reference_logps(
                pairs, policy, ref_model, args, args.precompute_ref_batch_size or batch_size
            )

        self._prepared = prepared
        pairs = prepared(train_dataset, "train", 8)
        eval_batch = int(args.per_device_eval_batch_size)
        if isinstance(eval_dataset, dict):
            eval_dataset = {name: prepared(data, str(name), eval_batch) for name, data in eval_dataset.items()}
        elif eval_dataset is not None:
            eval_dataset = prepared(eval_dataset, "eval", eval_batch)
        self.step_factory = DPOStepFactory(
            None,
            DPOLossSettings.from_config(args),
            pairs_per_micro=int(args.per_device_train_batch_size),
            micro_per_step=int(args.gradient_accumulation_steps),
            max_length=args.max_length,
            truncation_mode=args.truncation_mode,
            ref_model=None if args.precompute_ref_log_probs else ref_model,
            seed=int(args.seed),
            eval_pairs_per_micro=eval_batch,
        )
        super().__init__(
            model=model,
            args=args,
            data_collator=None,
            train_dataset=pairs,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            compute_metrics=compute_metrics,
            callbacks=callbacks,
            optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
            peft_config=peft_config,
            **kwargs,
        )

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """Train; then, as trl's DPOTrainer writes at each checkpoint, its model card in ``output_dir``."""
        result = super().train(*args, **kwargs)
        if any(self.output_dir.glob("checkpoint-*")):
            self.create_model_card(model_name=self.output_dir.name)
        return result

    def evaluate(
        self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval", **kwargs: Any
    ) -> Any:
        """Evaluate the Trainer's pairs, or ``eval_dataset`` (rows prepared by trl's code first, as trl does)."""
        factory = self.step_factory
        own_reference = factory.ref_model is not None or "ref_chosen_logps" in factory.columns
        if self.state.global_step > 0 and not own_reference and not hasattr(self.model, "peft_config"):
            # the default reference is the untrained policy: after training, loaded again from its folder
            if self._model_source is None:
                raise UnsupportedTrainerFeatureError(
                    "evaluate() after train(): the reference (a copy of the untrained model object) is gone; "
                    "pass ref_model= to DPOTrainer, or give the model as a path"
                )
            from transformers import AutoModelForCausalLM

            factory.ref_model = AutoModelForCausalLM.from_pretrained(
                str(self._model_source), **(getattr(self.args, "model_init_kwargs", None) or {})
            )
        batch = int(self.args.per_device_eval_batch_size or 8)
        if isinstance(eval_dataset, dict):
            eval_dataset = {name: self._prepared(data, str(name), batch) for name, data in eval_dataset.items()}
        elif eval_dataset is not None:
            eval_dataset = self._prepared(eval_dataset, "eval", batch)
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)

    def _row_preparation(self) -> Any:
        """The prepared pairs are the job's items, written as they are (every column)."""
        return dataclasses.replace(super()._row_preparation(), items=True)
