"""``ORPOTrainer`` and ``CPOTrainer``: trl's own (``trl.experimental``) trainers, trained by trainbridge's loop.

Each is trl's class with ``TrlLoop`` in front (``class ORPOTrainer(TrlLoop, trl.experimental.orpo.ORPOTrainer)``;
see ``trl_loop``): trl's constructor (``ORPOConfig``/``CPOConfig``, a model object or a path with
``model_init_kwargs``, ``peft_config``, the tokenizer from the model), its data preparation (the prompt extracted,
the chat template, ``tokenize_row``: ``chosen_input_ids``/``chosen_labels``/``rejected_*``), its evaluation
(``evaluation_loop``, ``prediction_step``, ``generate_during_eval``), ``log`` and ``compute_metrics`` run
unchanged; ``train()`` is the loop.  Neither has a reference model.

The step: where the instance's ``compute_loss``/``training_step`` are trl's own (``stands_in_for``), the loop
trains trl's prepared pairs with ``reference_free_step.ReferenceFreeStep`` (chosen and rejected in one
padding-free forward) and the loss read from the config (``ORPOLoss``/``CPOLoss``: trl's loss and metrics; its
``logits/*`` over the completion tokens, where trl's include its batch's padding).  A script's subclass
overriding one of them, a collator of the script's, an encoder-decoder or a MoE router loss steps through trl's
own ``training_step`` on trl's collated micro-batches instead.
"""

from __future__ import annotations

from typing import Any

from trl.experimental import cpo, orpo

from trainbridge.trl.reference_free_loss import CPOLoss, ORPOLoss
from trainbridge.trl.reference_free_step import ReferenceFreeStepFactory
from trainbridge.trl.trl_loop import STEP_STAND_IN, TrlLoop


class _ReferenceFree(TrlLoop):
    """The packed ORPO/CPO step standing in for trl's ``compute_loss`` where it applies (``stands_in_for``, declared
    on each class below trl's: ``trainer.subclass.overrides``)."""

    rows_are_items = True  # trl's prepared pairs, every column

    def _loss(self) -> ORPOLoss | CPOLoss:
        raise NotImplementedError

    def _reproduces_trl(self) -> bool:
        return bool(
            self.use_dpo_data_collator  # type: ignore[attr-defined]
            and not self.is_encoder_decoder  # type: ignore[attr-defined]
            and not (self.aux_loss_enabled and self.aux_loss_coef)  # type: ignore[attr-defined]
        )

    def _packed_step(self) -> ReferenceFreeStepFactory:
        """The packed ORPO/CPO step: trl's collator not called."""
        args: Any = self.args
        return ReferenceFreeStepFactory(
            self._loss(),
            pairs_per_micro=int(args.per_device_train_batch_size),
            micro_per_step=int(args.gradient_accumulation_steps),
            seed=int(args.seed),
        )


class ORPOTrainer(_ReferenceFree, orpo.ORPOTrainer):  # type: ignore[misc]
    """trl's ``trl.experimental.orpo.ORPOTrainer(model, args, data_collator, train_dataset, eval_dataset,
    processing_class, model_init, callbacks, optimizers, preprocess_logits_for_metrics, peft_config,
    compute_metrics)`` on trainbridge's loop."""

    stands_in_for: tuple[str, ...] = STEP_STAND_IN
    """Only ``_save_checkpoint`` on a ``train()`` through trl's own step (``TrlLoop._stand_in``)."""

    def _loss(self) -> ORPOLoss:
        return ORPOLoss.from_config(self.args)


class CPOTrainer(_ReferenceFree, cpo.CPOTrainer):  # type: ignore[misc]
    """trl's ``trl.experimental.cpo.CPOTrainer`` (``loss_type`` sigmoid, hinge, ipo or simpo, ``cpo_alpha``,
    ``simpo_gamma``, AlphaPO's ``alpha``) on trainbridge's loop, with ``ORPOTrainer``'s arguments."""

    stands_in_for: tuple[str, ...] = STEP_STAND_IN
    """Only ``_save_checkpoint`` on a ``train()`` through trl's own step (``TrlLoop._stand_in``)."""

    def _loss(self) -> CPOLoss:
        return CPOLoss.from_config(self.args)
