"""The summed token cross entropy of one micro-batch.

``token_loss_sum`` returns the *sum* of the per-token losses and the number of tokens summed, never a
mean: the loop normalises by the step's global loss-token count, known locally from the step plan
(``data.batching``)::

    loss = loss_sum / step.loss_tokens * world_size

DDP (and FSDP / DeepSpeed) average gradients over ranks, so the ``* world_size`` makes the reduced
gradient the gradient of ``sum over all tokens of the step / step.loss_tokens`` -- the same whatever
the split into ranks and micro-batches, and whatever the samples' lengths.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainbridge.data.dataset import IGNORE_INDEX

MODEL_INPUT_KEYS = ("input_ids", "attention_mask", "position_ids")
"""Batch entries passed to the model (``labels`` never is: the loss is computed here)."""


def token_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Forward ``batch`` and return ``(sum of token cross entropies, number of loss tokens)``.

    The model gets ``input_ids`` and ``position_ids`` (padding-free) or ``attention_mask`` (padded),
    with ``use_cache=False`` (a KV cache would stop transformers from detecting packed sequences).
    Logits at ``t`` are scored against ``labels`` at ``t + 1``, in float32, skipping ``-100``.  For a
    dummy micro-batch (no loss token) the sum is a zero that still depends on every parameter used by
    the forward, so ``backward`` runs and gradient hooks / collectives fire as on the other ranks.
    """
    return logits_loss_sum(forward_logits(model, batch), batch["labels"])


def forward_logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's logits for ``batch`` (only ``MODEL_INPUT_KEYS`` are passed, ``use_cache=False``)."""
    return model(**{key: batch[key] for key in MODEL_INPUT_KEYS if key in batch}, use_cache=False).logits


def logits_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(sum of shifted token cross entropies, number of loss tokens)`` of ``logits`` against ``labels``."""
    shifted_labels = labels[:, 1:]
    shifted_logits = logits[:, :-1, :]
    num_tokens = int((shifted_labels != IGNORE_INDEX).sum())
    if num_tokens == 0:
        return logits.sum() * 0.0, 0
    loss_sum = F.cross_entropy(
        shifted_logits.reshape(-1, shifted_logits.shape[-1]).float(),
        shifted_labels.reshape(-1).to(logits.device),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return loss_sum, num_tokens
