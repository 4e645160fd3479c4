"""``GRPOTrainer`` and ``RLOOTrainer``: trl's own trainers, trained by trainbridge's loop.

Each is trl's class with ``TrlLoop`` in front (``class GRPOTrainer(TrlLoop, trl.GRPOTrainer)``; see ``trl_loop``):
trl's constructor (models by path with ``model_init_kwargs``, ``peft_config``, reward functions as callables,
dotted paths or reward models, ``reward_weights``, the reference model for ``beta``), its repeat sampler
(``get_train_dataloader``: one generation batch of raw rows per micro-batch), ``_prepare_inputs`` (generation
with ``transformers`` ``generate``, rewards, advantages, the batch buffered over ``steps_per_generation *
num_iterations`` micro-batches), ``compute_loss``, ``log`` and evaluation run unchanged; ``train()`` is the
loop, which calls ``self.training_step`` on each of the loader's batches.

The additions: a checkpoint taken in the middle of a buffered generation batch holds that batch, and
resume trains on it, so resume is exact (``generation_buffer``; trl generates anew there).  Under FSDP2 the
reference model (``beta`` > 0) is sharded as the policy is (``trl_loop.ShardedReference``), where trl's
accelerate path shards it with ``prepare_fsdp``; generation on the sharded policy runs with ``synced_gpus``, which
``transformers`` turns on for a module ``fully_shard`` marks.
"""

from __future__ import annotations

import os
from typing import Any

import trl

from trainbridge.trl import generation_buffer
from trainbridge.trl.trl_loop import TrlLoop


class _PendingGeneration(TrlLoop):
    """Saves the pending generation batch with each checkpoint (``_save_checkpoint``, whose folder is the
    checkpoint being written) and restores it at resume, before the first micro-batch (``training_step``: the
    loop restored ``state.global_step`` by then, which names the checkpoint when ``resume_from_checkpoint`` is
    ``True``)."""

    _resuming_from: Any = None
    """``train(resume_from_checkpoint=...)`` until the first micro-batch restored its pending generation."""

    def train(self, resume_from_checkpoint: Any = None, *args: Any, **kwargs: Any) -> Any:
        self._resuming_from = resume_from_checkpoint or None
        try:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self._resuming_from = None

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        resume, self._resuming_from = self._resuming_from, None
        if resume is not None:
            folder = resume if resume is not True else self._checkpoint_folder()
            generation_buffer.load_pending(self, folder)
        return super().training_step(model, inputs, num_items_in_batch)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        generation_buffer.save_pending(self, self._checkpoint_folder())

    def _checkpoint_folder(self) -> str:
        return os.path.join(str(self.args.output_dir), f"checkpoint-{self.state.global_step}")


class GRPOTrainer(_PendingGeneration, trl.GRPOTrainer):  # type: ignore[misc]
    """trl's ``GRPOTrainer(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
    reward_processing_classes, callbacks, optimizers, peft_config, ...)`` on trainbridge's loop."""


class RLOOTrainer(_PendingGeneration, trl.RLOOTrainer):  # type: ignore[misc]
    """trl's ``RLOOTrainer(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
    reward_processing_classes, callbacks, optimizers, peft_config)`` on trainbridge's loop."""
