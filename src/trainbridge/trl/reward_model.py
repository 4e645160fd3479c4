"""``RewardTrainer``: trl's own reward-model trainer, trained by trainbridge's loop.

trl's class with ``trainbridge.Trainer`` beneath it (``class RewardTrainer(trl.RewardTrainer, Trainer)``): trl's
constructor (a sequence classifier with one label, by path with ``model_init_kwargs``, or given; ``peft_config``),
its dataset preparation (conversational or text pairs, implicit or explicit prompt, an optional ``margin``
column), its padding collator, its pair loss with ``center_rewards_coefficient``, its ``accuracy``/``margin``
metrics and its ``evaluate`` all run unchanged; trl's ``super()`` calls reach ``trainbridge.Trainer``, whose
``train()`` runs the loop in place on this instance (``trainer.facade``).
"""

from __future__ import annotations

import trl

from trainbridge.trainer import Trainer


class RewardTrainer(trl.RewardTrainer, Trainer):  # type: ignore[misc]
    """trl's ``RewardTrainer(model, args, data_collator, train_dataset, eval_dataset, processing_class,
    compute_metrics, callbacks, optimizers, optimizer_cls_and_kwargs, preprocess_logits_for_metrics,
    peft_config)`` on trainbridge's loop."""
