"""Validation predictions made by ``model.generate`` (``predict_with_generate``): the predictions seam of a step.

Training is the step's own (the model's loss, or the script's ``compute_loss``).  Each validation batch whose
predictions are asked for is evaluated as ``Seq2SeqTrainer.prediction_step`` does: the forward with the labels
gives the model's own loss; ``generate`` on the batch without its labels (and without
``decoder_input_ids`` / ``decoder_attention_mask`` when they are the labels shifted) gives the predicted
token ids, with ``generation_kwargs``.  Generated ids and labels shorter than the generation config's
``max_length`` (or ``max_new_tokens + 1``) are padded to it with the pad token, so ``compute_metrics``
gets the arrays Trainer gives it (batches and ranks are then padded to one length with -100 by
``loop.predictions``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from trainbridge.step.base import EvalOutput
from trainbridge.step.model_loss import NUM_ITEMS_KEY


class Generation:
    """Generated token ids as a step's validation predictions (see the module docstring)."""

    def __init__(self, generation_kwargs: Mapping[str, Any], synced_gpus: bool) -> None:
        self.generation_kwargs = {k: v for k, v in generation_kwargs.items() if v is not None}
        self.synced_gpus = synced_gpus
        """Every rank runs as many forwards as the longest generation (sharded parameters: FSDP, ZeRO-3)."""

    def predict(self, model: torch.nn.Module, batch: dict[str, Any], evaluated: EvalOutput) -> EvalOutput:
        """``evaluated`` (the batch's loss) with the generated ids as predictions and the labels padded alike."""
        generator: Any = model if hasattr(model, "generate") else model.module  # DDP / DeepSpeed wrap it
        labels = batch.get("labels")
        dropped = {"labels", NUM_ITEMS_KEY}
        decoder_ids = batch.get("decoder_input_ids")
        if (
            isinstance(labels, torch.Tensor)
            and isinstance(decoder_ids, torch.Tensor)
            and labels.shape == decoder_ids.shape
        ):
            dropped |= {"decoder_input_ids", "decoder_attention_mask"}
        inputs = {k: v for k, v in batch.items() if k not in dropped}
        tokens = generator.generate(**inputs, **self.generation_kwargs, synced_gpus=self.synced_gpus)
        length, pad = _padded_length(generator), _pad_token_id(generator)
        tokens = _pad_to(tokens, length, pad)
        if isinstance(labels, torch.Tensor):
            labels = _pad_to(labels, length, pad)
        return evaluated._replace(predictions=tokens, labels=labels, inputs_aligned=False)


def _padded_length(model: Any) -> int | None:
    """The length ``Seq2SeqTrainer`` pads generated ids and labels to: the generation config's ``max_length``
    (its default when unset), else ``max_new_tokens + 1``."""
    config = model.generation_config
    defaults = config._get_default_generation_params() if hasattr(config, "_get_default_generation_params") else {}
    max_length = config.max_length if config.max_length is not None else defaults.get("max_length")
    max_new = config.max_new_tokens if config.max_new_tokens is not None else defaults.get("max_new_tokens")
    if max_length is not None:
        return int(max_length)
    return int(max_new) + 1 if max_new is not None else None


def _pad_token_id(model: Any) -> int:
    for config in (model.generation_config, model.config):
        for name in ("pad_token_id", "eos_token_id"):
            value = getattr(config, name, None)
            if isinstance(value, list):
                value = value[0] if value else None
            if value is not None:
                return int(value)
    raise ValueError(
        "predict_with_generate: the model's config has no pad_token_id (nor eos_token_id) to pad the generated "
        "tokens with; set model.config.pad_token_id"
    )


def _pad_to(tokens: torch.Tensor, length: int | None, pad: int) -> torch.Tensor:
    if length is None or tokens.shape[-1] >= length:
        return tokens
    out = tokens.new_full((*tokens.shape[:-1], length), pad)
    out[..., : tokens.shape[-1]] = tokens
    return out
