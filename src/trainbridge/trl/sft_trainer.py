"""``SFTTrainer``: trl's own ``SFTTrainer``, trained by trainbridge's loop.

trl's class with ``TrlLoop`` in front (``class SFTTrainer(TrlLoop, trl.SFTTrainer)``; see ``trl_loop``): trl's
constructor (``SFTConfig``, a model object or a path with ``model_init_kwargs``, ``peft_config``,
``formatting_func``, the tokenizer from the model), its dataset preparation (tokenisation, EOS, completion and
assistant masks as ``labels``, truncation, ``bfd``/``wrapped`` packing), its collator, ``evaluate`` (its
``compute_loss`` on its own evaluation batches: ``eval_entropy``, ``eval_mean_token_accuracy``,
``eval_num_tokens``) and ``log`` run unchanged; ``train()`` is the loop.

The step: where the instance's ``compute_loss``/``training_step`` are trl's own (``stands_in_for``), the
loop trains trl's prepared rows (``input_ids``, ``labels``, a packed bin's ``seq_lengths`` as one
multi-sequence sample) with its padding-free token step, which gives trl's loss (the mean over every rank's
loss tokens of a step) and logs trl's ``entropy``, ``mean_token_accuracy`` and ``num_tokens``
(``TokenLoss(metrics=True)``).  A script's subclass overriding one of them, a ``compute_loss_func``, or a
config whose loss is not the plain token mean (``loss_type="dft"``, label smoothing, a MoE router loss,
activation offloading, vision rows, a collator of the script's) steps through trl's own ``training_step``
on trl's collated micro-batches instead.
"""

from __future__ import annotations

from typing import Any

import trl

from trainbridge.core.config.loss import Loss, TokenLoss
from trainbridge.trainer.facade import UnsupportedTrainerFeatureError
from trainbridge.trainer.subclass import StandIn
from trainbridge.trl.trl_loop import STEP_STAND_IN, TrlLoop


class SFTTrainer(TrlLoop, trl.SFTTrainer):  # type: ignore[misc]
    """trl's ``SFTTrainer(model, args, data_collator, train_dataset, eval_dataset, processing_class,
    compute_loss_func, compute_metrics, callbacks, optimizers, optimizer_cls_and_kwargs,
    preprocess_logits_for_metrics, peft_config, formatting_func)`` on trainbridge's loop."""

    stands_in_for: tuple[str, ...] = STEP_STAND_IN
    """Only ``_save_checkpoint`` on a ``train()`` through trl's own step (``TrlLoop._stand_in``)."""

    def _loss_seam(self, items: bool, instance_step: bool, stand_in: StandIn) -> Loss:
        """Trainer's choice; trainbridge's token loss, where it stands in for trl's ``compute_loss``, also logs
        trl's ``entropy``, ``mean_token_accuracy`` and ``num_tokens`` (trl's own step logs them itself)."""
        loss = super()._loss_seam(items, instance_step, stand_in)
        return TokenLoss(metrics=True) if loss == TokenLoss() and stand_in.loss else loss

    def __init__(self, *args: Any, quantization_config: Any = None, **kwargs: Any) -> None:
        if quantization_config is not None:
            raise UnsupportedTrainerFeatureError(
                "quantization_config: quantized (k-bit) base models are not supported by trainbridge's loop; train "
                "in full or bf16 precision (model_init_kwargs dtype), with a LoRA adapter (peft_config) for memory."
            )
        super().__init__(*args, **kwargs)

    def _reproduces_trl(self) -> bool:
        """The token step gives trl's loss: the token mean of a plain text config with trl's own collator."""
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

        args: Any = self.args
        return (
            not self._is_vision_dataset
            and args.loss_type == "nll"
            and self.label_smoother is None
            and not self.aux_loss_enabled
            and not args.activation_offloading
            and type(self.data_collator) is DataCollatorForLanguageModeling
        )
