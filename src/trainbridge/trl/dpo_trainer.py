"""``DPOTrainer``: trl's own ``DPOTrainer``, trained by trainbridge's loop.

trl's class with ``TrlLoop`` in front (``class DPOTrainer(TrlLoop, trl.DPOTrainer)``; see ``trl_loop``): trl's
constructor (``DPOConfig``, a model object or a path with ``model_init_kwargs``, ``ref_model`` or trl's default
reference, ``peft_config``, the tokenizer from the model, ``precompute_ref_log_probs``, ``sync_ref_model``'s
callback), its dataset preparation (``prompt_ids``/``chosen_ids``/``rejected_ids``), ``evaluate`` (its
``compute_loss`` on its own padded evaluation batches), ``log`` and ``compute_metrics`` run unchanged;
``train()`` is the loop.

The step: where the instance's ``compute_loss``/``training_step`` are trl's own (``stands_in_for``), the loop
trains trl's prepared pairs with the DPO step (``dpo_step.PreferenceStep``: each micro-batch's chosen and
rejected sequences in one padding-free forward, scored against trl's reference model, its PEFT base or the
precomputed columns), which gives trl's loss and logs trl's ``rewards/*``, ``logps/*``, ``logits/*``,
``entropy``, ``mean_token_accuracy`` and ``num_tokens``.  A script's subclass overriding one of them, or a
config the step does not reproduce (vision rows, activation offloading, Liger's loss, a MoE router loss),
steps through trl's own ``training_step`` on trl's collated micro-batches instead.
"""

from __future__ import annotations

from typing import Any

import trl

from trainbridge.trl.dpo_step import DPOStepFactory
from trainbridge.trl.preference_loss import DPOLossSettings
from trainbridge.trl.trl_loop import STEP_STAND_IN, TrlLoop


class DPOTrainer(TrlLoop, trl.DPOTrainer):  # type: ignore[misc]
    """trl's ``DPOTrainer(model, ref_model, args, data_collator, train_dataset, eval_dataset, processing_class,
    compute_metrics, callbacks, optimizers, optimizer_cls_and_kwargs, preprocess_logits_for_metrics,
    peft_config)`` on trainbridge's loop."""

    stands_in_for: tuple[str, ...] = STEP_STAND_IN
    """Only ``_save_checkpoint`` on a ``train()`` through trl's own step (``TrlLoop._stand_in``)."""

    rows_are_items = True  # trl's prepared pairs, every column

    def _reproduces_trl(self) -> bool:
        args: Any = self.args
        return not (
            self._is_vision_dataset or args.activation_offloading or args.use_liger_kernel or self.aux_loss_enabled
        )

    def _packed_step(self) -> DPOStepFactory:
        """The DPO step: the pairs packed padding-free, trl's collator not called."""
        args: Any = self.args
        return DPOStepFactory(
            None,
            DPOLossSettings.from_config(args),
            pairs_per_micro=int(args.per_device_train_batch_size),
            micro_per_step=int(args.gradient_accumulation_steps),
            max_length=args.max_length,
            truncation_mode=args.truncation_mode,
            ref_model=self.ref_model,  # trl's (None: the PEFT base, or the precomputed columns)
            seed=int(args.seed),
            eval_pairs_per_micro=int(args.per_device_eval_batch_size),
            shared_reference=True,  # trl's own object: what its evaluation and SyncRefModelCallback hold
        )
