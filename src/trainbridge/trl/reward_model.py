"""``RewardTrainer``: trl's own reward-model trainer, trained by trainbridge's loop.

trl's class with ``TrlLoop`` in front (``class RewardTrainer(TrlLoop, trl.RewardTrainer)``): trl's constructor
(a sequence classifier with one label, by path with ``model_init_kwargs``, or given; ``peft_config``), its
dataset preparation (conversational or text pairs, implicit or explicit prompt, an optional ``margin`` column),
its padding collator, its pair loss with ``center_rewards_coefficient``, its ``accuracy``/``margin`` metrics and
its ``evaluate`` run unchanged; ``train()`` is the loop, which calls ``self.training_step`` on each micro-batch.
"""

from __future__ import annotations

import trl

from trainbridge.trl.trl_loop import TrlLoop


class RewardTrainer(TrlLoop, trl.RewardTrainer):  # type: ignore[misc]
    """trl's ``RewardTrainer(model, args, data_collator, train_dataset, eval_dataset, processing_class,
    compute_metrics, callbacks, optimizers, optimizer_cls_and_kwargs, preprocess_logits_for_metrics,
    peft_config)`` on trainbridge's loop."""
