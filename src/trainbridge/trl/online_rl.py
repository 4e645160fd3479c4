"""``GRPOTrainer`` and ``RLOOTrainer``: trl's own trainers, trained by trainbridge's loop.

Each is trl's class with ``trainbridge.Trainer`` beneath it (``class GRPOTrainer(trl.GRPOTrainer, Trainer)``):
trl's constructor (models by path with ``model_init_kwargs``, ``peft_config``, reward functions as callables,
dotted paths or reward models, ``reward_weights``, the reference model for ``beta``), its repeat sampler
(``get_train_dataloader``), ``_prepare_inputs`` (generation with ``transformers`` ``generate``, rewards,
advantages, the generation batch buffered over ``steps_per_generation * num_iterations`` micro-batches),
``compute_loss``, ``log`` and evaluation all run unchanged; trl's ``super()`` calls reach
``trainbridge.Trainer``, whose ``train()`` runs the loop in place on this instance (``trainer.facade``).

The one addition: a checkpoint taken in the middle of a buffered generation batch holds that batch, and
resume trains on it, so resume is exact (``generation_buffer``; trl generates anew there).
"""

from __future__ import annotations

import os
from typing import Any

import trl

from trainbridge.trainer import Trainer
from trainbridge.trl import generation_buffer


class _PendingGeneration:
    """Saves the pending generation batch with each checkpoint and restores it at resume."""

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)  # type: ignore[misc]
        folder = os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")  # type: ignore[attr-defined]
        generation_buffer.save_pending(self, folder)


class GRPOTrainer(_PendingGeneration, trl.GRPOTrainer, Trainer):  # type: ignore[misc]
    """trl's ``GRPOTrainer(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
    reward_processing_classes, callbacks, optimizers, peft_config, ...)`` on trainbridge's loop."""


class RLOOTrainer(_PendingGeneration, trl.RLOOTrainer, Trainer):  # type: ignore[misc]
    """trl's ``RLOOTrainer(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
    reward_processing_classes, callbacks, optimizers, peft_config)`` on trainbridge's loop."""
