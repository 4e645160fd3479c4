"""``GRPOTrainer`` and ``RLOOTrainer``: trl's own trainers, trained by trainbridge's loop.

Each is trl's class with ``TrlLoop`` in front (``class GRPOTrainer(TrlLoop, trl.GRPOTrainer)``; see ``trl_loop``):
trl's constructor (models by path with ``model_init_kwargs``, ``peft_config``, reward functions as callables,
dotted paths or reward models, ``reward_weights``, the reference model for ``beta``), its repeat sampler
(``get_train_dataloader``: one generation batch of raw rows per micro-batch), ``_prepare_inputs`` (generation,
rewards, advantages, the batch buffered over ``steps_per_generation * num_iterations`` micro-batches),
``compute_loss``, ``log`` and evaluation run unchanged; ``train()`` is the loop, which calls
``self.training_step`` on each of the loader's batches.

Two steps run faster with the same results: completions are sampled with each distinct prompt prefilled once
(``sampling``: ``generate``'s draws, where trl would call ``generate`` with settings it follows), and scored,
for the loss and for the old-policy and reference log-probs, with each prompt run once for all of its
completions (``shared_prefix``: trl's values up to float summation order).  Anything else is trl's own.

The loop sums no counts over the ranks at each step (``LoopTrainer.counts_step``): the loader gives raw prompt
rows, and trl's GRPO/RLOO loss normalises by the counts its ``_prepare_inputs`` gathers, never by
``num_items_in_batch``; one collective per step fewer than a counted step, the same values.

The additions: a checkpoint taken in the middle of a buffered generation batch holds that batch, and
resume trains on it, so resume is exact (``generation_buffer``; trl generates anew there).  Under FSDP2 the
reference model (``beta`` > 0) is sharded as the policy is (``trl_loop.ShardedReference``), where trl's
accelerate path shards it with ``prepare_fsdp``; generation on the sharded policy runs with ``synced_gpus``, which
``transformers`` turns on for a module ``fully_shard`` marks.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import trl
from torch.distributed.tensor import DTensor
from trl.extras.profiling import profiling_context
from trl.models import unwrap_model_for_generation

from trainbridge.trainer.subclass import StandIn
from trainbridge.trl import generation_buffer, sampling, shared_prefix
from trainbridge.trl.trl_loop import TrlLoop


class _PendingGeneration(TrlLoop):
    """Saves the pending generation batch with each checkpoint (``_save_checkpoint``, whose folder is the
    checkpoint being written) and restores it from the checkpoint the run resumed from, before the first
    micro-batch (``generation_buffer.PendingGeneration``)."""

    def _script_callbacks(self, stand_in: StandIn) -> list[Any]:
        return [*super()._script_callbacks(stand_in), generation_buffer.PendingGeneration(self)]

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        folder = os.path.join(str(self.args.output_dir), f"checkpoint-{self.state.global_step}")
        generation_buffer.save_pending(self, folder)


class _PromptOnce(TrlLoop):
    """Scores completions with each prompt run once for all of its completions (``shared_prefix``): the
    loss's forward and backward, and the old-policy and reference log-probs, on text batches of a model that
    takes the layout exactly; anything else (images, MoE auxiliary loss, another attention) is trl's own
    padded forward."""

    def _get_per_token_logps_and_entropies(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **multimodal: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        text_only = not compute_aux_loss and all(value is None for value in multimodal.values())
        if text_only and shared_prefix.applies(self.accelerator.unwrap_model(model), input_ids.size(1)):
            return self._prompt_once_logps(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy
            )
        return super()._get_per_token_logps_and_entropies(  # type: ignore[misc,no-any-return]
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            batch_size,
            compute_entropy,
            compute_aux_loss,
            **multimodal,
        )

    def _prompt_once_logps(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None,
        compute_entropy: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """trl's chunks of ``batch_size`` rows, each laid out by prompt; a chunk not in trl's padded form (masks
        not one run of ones) goes through trl's forward for that chunk."""
        chunk = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), chunk):
            ids, mask = input_ids[start : start + chunk], attention_mask[start : start + chunk]
            packed = shared_prefix.pack_groups(ids, mask, logits_to_keep)
            if packed is None:
                chunk_logps, chunk_entropy, _ = super()._get_per_token_logps_and_entropies(  # type: ignore[misc]
                    model, ids, mask, logits_to_keep, compute_entropy=compute_entropy
                )
            else:
                with self.accelerator.autocast():
                    chunk_logps, chunk_entropy = shared_prefix.shared_prefix_logps(
                        model, packed, compute_entropy, self.accelerator.unwrap_model(model)
                    )
            logps.append(chunk_logps)
            entropies.append(chunk_entropy)
        entropy = torch.cat(entropies) if compute_entropy else None
        return torch.cat(logps), entropy, None


class _PrefillOnce(TrlLoop):
    """Samples completions with each distinct prompt prefilled once (``sampling``) where that samples as trl's
    ``generate`` does: text prompts, ``transformers`` generation (not vLLM, not continuous batching), a model
    whose forward needs no collective (not FSDP- or ZeRO-3-sharded) and a generation config ``sampling``
    follows; trl's own generation otherwise."""

    def _sampled(self, prompt_ids: list[list[int]], images: Any, multimodal_fields: Any) -> list[list[int]] | None:
        """The completions of ``prompt_ids``, or None where trl's own generation runs instead."""
        trainer: Any = self  # trl's attributes, set by its constructor
        model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        plain = not (trainer.use_vllm or trainer.use_transformers_continuous_batching or trainer.is_fsdp_enabled)
        pad = trainer._tokenizer.pad_token_id
        if not plain or trainer.is_deepspeed_enabled or multimodal_fields or trainer.pad_to_multiple_of is not None:
            return None
        if pad is None or (images is not None and any(image is not None for image in images)):
            return None
        if any(isinstance(p, DTensor) or p.numel() == 0 for p in model.parameters()):
            return None
        with (
            profiling_context(trainer, "transformers.generate"),
            unwrap_model_for_generation(
                trainer.model_wrapped,
                trainer.accelerator,
                gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
                generation_kwargs=trainer.generation_kwargs,
                gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
            ) as unwrapped_model,
            torch.no_grad(),
        ):
            if not sampling.supported(trainer.generation_config, unwrapped_model.generation_config):
                return None
            return sampling.sample_completions(
                unwrapped_model, prompt_ids, trainer.generation_config, pad, trainer.eos_token_ids
            )


class GRPOTrainer(_PrefillOnce, _PromptOnce, _PendingGeneration, trl.GRPOTrainer):  # type: ignore[misc]
    """trl's ``GRPOTrainer(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
    reward_processing_classes, callbacks, optimizers, peft_config, ...)`` on trainbridge's loop."""

    counts_step = False  # raw prompt rows; trl's loss reads its own counts, not num_items_in_batch

    def _generate_single_turn(
        self,
        prompt_ids: list[list[int]],
        images: Any,
        multimodal_fields: Any,
        num_generations: int,
        has_tool_images: bool = False,
    ) -> tuple[list[list[int]], Any]:
        completions = None if has_tool_images else self._sampled(prompt_ids, images, multimodal_fields)
        if completions is not None:
            return completions, None
        return super()._generate_single_turn(  # type: ignore[no-any-return]
            prompt_ids, images, multimodal_fields, num_generations, has_tool_images
        )


class RLOOTrainer(_PrefillOnce, _PromptOnce, _PendingGeneration, trl.RLOOTrainer):  # type: ignore[misc]
    """trl's ``RLOOTrainer(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
    reward_processing_classes, callbacks, optimizers, peft_config)`` on trainbridge's loop."""

    counts_step = False  # as GRPOTrainer's

    def _generate_single_turn(self, prompt_ids: list[list[int]], images: Any, multimodal_fields: Any) -> Any:
        completions = self._sampled(prompt_ids, images, multimodal_fields)
        if completions is not None:
            return completions
        return super()._generate_single_turn(prompt_ids, images, multimodal_fields)
