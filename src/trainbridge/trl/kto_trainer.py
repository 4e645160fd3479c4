"""``KTOTrainer``: trl's own ``KTOTrainer``, trained by trainbridge's loop.

trl's class with ``TrlLoop`` in front (``class KTOTrainer(TrlLoop, trl.KTOTrainer)``; see ``trl_loop``): trl's
constructor (``KTOConfig``, a model object or a path with ``model_init_kwargs``, ``ref_model`` or trl's default
reference, ``peft_config``, the tokenizer from the model, ``sync_ref_model``'s callback), its dataset preparation
(prompt extraction, paired rows unpaired, EOS, tokenisation, rows whose prompt fills ``max_length`` dropped, the
mismatched ``KL_completion_ids``), ``precompute_ref_log_probs`` (the reference's ``ref_logps``/``ref_KL_logps``
columns, scored in the constructor), ``evaluate``, ``log`` and ``compute_metrics`` run unchanged; ``train()`` is
the loop.

The step: where the instance's ``compute_loss``/``training_step`` are trl's own (``stands_in_for``), the loop
trains trl's prepared rows with the KTO step (``kto_step.KTOStep``: each row with its mismatched completion in
one padding-free forward, scored against trl's reference model, its PEFT base or the precomputed columns), which
gives trl's loss and logs trl's ``kl``, ``rewards/*``, ``logps/*``, ``logits/*``, ``entropy`` and ``num_tokens``.
A script's subclass overriding one of them, a collator of the script's, or a config the step does not reproduce
(vision rows, activation offloading, Liger kernels, a MoE router loss) steps through trl's own
``training_step`` on trl's collated micro-batches instead.
"""

from __future__ import annotations

from typing import Any

import trl

from trainbridge.trl.kto_loss import KTOLoss
from trainbridge.trl.kto_step import KTOStepFactory
from trainbridge.trl.trl_loop import STEP_STAND_IN, TrlLoop


class KTOTrainer(TrlLoop, trl.KTOTrainer):  # type: ignore[misc]
    """trl's ``KTOTrainer(model, ref_model, args, data_collator, train_dataset, eval_dataset, processing_class,
    compute_metrics, callbacks, optimizers, quantization_config, peft_config)`` on trainbridge's loop."""

    stands_in_for: tuple[str, ...] = STEP_STAND_IN
    """Only ``_save_checkpoint`` on a ``train()`` through trl's own step (``TrlLoop._stand_in``)."""

    rows_are_items = True  # trl's prepared rows, every column

    def _reproduces_trl(self) -> bool:
        from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

        args: Any = self.args
        return (
            not self._is_vision_dataset
            and not args.activation_offloading
            and not args.use_liger_kernel
            and not self.aux_loss_enabled
            and type(self.data_collator) is DataCollatorForUnpairedPreference
        )

    def _packed_step(self) -> KTOStepFactory:
        """The KTO step: the rows packed padding-free, trl's collator not called."""
        args: Any = self.args
        return KTOStepFactory(
            KTOLoss.from_config(args),
            rows_per_micro=int(args.per_device_train_batch_size),
            micro_per_step=int(args.gradient_accumulation_steps),
            max_length=args.max_length,
            ref_model=self.ref_model,  # trl's (None: the PEFT base, or the precomputed columns)
            seed=int(args.seed),
            sequential=args.train_sampling_strategy == "sequential",
        )
