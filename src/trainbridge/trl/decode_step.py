"""One decode step of a Llama-architecture model without its forward's per-call wrappers.

A decode step on a small batch is mostly per-call overhead: ``LlamaForCausalLM.forward`` goes through output
capturing, config-default merging, kwarg deprecation, mask building (``create_causal_mask``), one
``GradientCheckpointingLayer`` call and the kernel-routing wrapper per layer, and output dataclasses, ~15 % of
a step of the 3.2M-parameter benchmark model.  ``DecodeStep`` runs the same operations on the same tensors in
the same order, calling the model's own submodules (embedding, rotary embedding, norms, projections, MLP, LM
head), its module's ``apply_rotary_pos_emb``, the cache's ``update`` and ``transformers``' ``sdpa`` attention
function, so the logits are the model's bit for bit (``test_trl_decode_step``).

``for_model`` returns one only where the replay applies: ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` and
``MistralForCausalLM`` exactly (not subclasses, not wrapped), every layer of the class's own attention, MLP,
norm and decoder-layer types, full attention in every layer (no sliding window), ``sdpa`` attention (or
``modeling.prefix_attention``'s, which is sdpa for every decode step) and no module hooks.  ``Decoder`` checks
it where it runs: its first step runs both the forward and the replay (on a copy of the cache) and keeps the
replay only when the logits are equal bit for bit (a hub kernel routed inside the attention, say, would differ);
anything else decodes with the model's forward.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import torch
from torch import nn
from transformers import Cache, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from trainbridge.modeling.prefix_attention import PREFIX_SDPA

ARCHITECTURES = {
    "LlamaForCausalLM": "transformers.models.llama.modeling_llama",
    "Qwen2ForCausalLM": "transformers.models.qwen2.modeling_qwen2",
    "MistralForCausalLM": "transformers.models.mistral.modeling_mistral",
}
"""Causal LMs whose decoder layer ``DecodeStep`` replays, by class name and defining module."""


class DecodeStep:
    """``step(tokens, positions, mask, cache)``: the logits of the model's forward on one new token per row
    (``input_ids=tokens[:, None]``, ``position_ids=positions``, ``attention_mask=mask``, ``cache``), the cache
    updated as the forward updates it."""

    def __init__(self, model: Any, rotate: Any) -> None:
        self.inner = model.model
        self.head = model.lm_head
        self.layers = list(self.inner.layers[: model.config.num_hidden_layers])
        self.rotate = rotate

    def __call__(
        self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache: Cache
    ) -> torch.Tensor:
        hidden = self.inner.embed_tokens(tokens[:, None])
        cos, sin = self.inner.rotary_emb(hidden, position_ids=positions)
        # create_causal_mask's sdpa mask for one query per row: every key the row's 2D mask keeps
        keep = None if mask is None else mask.bool()[:, None, None, :]
        for layer in self.layers:
            hidden = self._layer(layer, hidden, cos, sin, keep, cache)
        return self.head(self.inner.norm(hidden))[:, -1]

    def _layer(
        self,
        layer: Any,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keep: torch.Tensor | None,
        cache: Cache,
    ) -> torch.Tensor:
        """The decoder layer's forward and its attention's, in their order of operations."""
        residual = hidden
        hidden = layer.input_layernorm(hidden)
        attention = layer.self_attn
        shape = (*hidden.shape[:-1], -1, attention.head_dim)
        query = attention.q_proj(hidden).view(shape).transpose(1, 2)
        key = attention.k_proj(hidden).view(shape).transpose(1, 2)
        value = attention.v_proj(hidden).view(shape).transpose(1, 2)
        query, key = self.rotate(query, key, cos, sin)
        key, value = cache.update(key, value, attention.layer_idx)
        out, _ = sdpa_attention_forward(
            attention,
            query,
            key,
            value,
            keep,
            dropout=0.0 if not attention.training else attention.attention_dropout,
            scaling=attention.scaling,
        )
        out = attention.o_proj(out.reshape(*hidden.shape[:-1], -1).contiguous())
        hidden = residual + out
        residual = hidden
        return residual + layer.mlp(layer.post_attention_layernorm(hidden))


def for_model(model: PreTrainedModel) -> DecodeStep | None:
    """A ``DecodeStep`` for ``model``, or None where the model's own forward must decode (module doc)."""
    name = type(model).__name__
    module = sys.modules.get(ARCHITECTURES.get(name, ""))
    if module is None or type(model) is not getattr(module, name, None):
        return None
    prefix = name.removesuffix("ForCausalLM")
    config = model.config
    exact = {
        kind: getattr(module, f"{prefix}{suffix}", None)
        for kind, suffix in (
            ("model", "Model"),
            ("layer", "DecoderLayer"),
            ("attention", "Attention"),
            ("mlp", "MLP"),
            ("norm", "RMSNorm"),
        )
    }
    inner: Any = getattr(model, "model", None)
    if None in exact.values() or type(inner) is not exact["model"] or type(inner.norm) is not exact["norm"]:
        return None
    for layer in inner.layers[: config.num_hidden_layers]:
        parts = {
            "layer": layer,
            "attention": layer.self_attn,
            "mlp": layer.mlp,
            "norm": layer.input_layernorm,
        }
        if any(type(part) is not exact[kind] for kind, part in parts.items()):
            return None
        if type(layer.post_attention_layernorm) is not exact["norm"]:
            return None
        if getattr(layer.self_attn, "sliding_window", None) is not None:
            return None
    if getattr(config, "sliding_window", None) is not None and name == "MistralForCausalLM":
        return None
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return None
    if config._attn_implementation not in ("sdpa", PREFIX_SDPA):  # PREFIX_SDPA: sdpa for every decode step
        return None
    if _hooked(model):
        return None
    return DecodeStep(model, module.apply_rotary_pos_emb)


class Decoder:
    """``decoder(tokens, positions, mask, cache)``: the logits of ``model``'s forward on one new token per row,
    through ``DecodeStep`` from the second step on where the first step's were equal bit for bit."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.step = for_model(model)
        self.checked = False

    def __call__(
        self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache: Cache
    ) -> torch.Tensor:
        if self.step is not None and self.checked:
            return self.step(tokens, positions, mask, cache)
        replayed = None
        if self.step is not None:
            try:
                replayed = self.step(tokens, positions, mask, copy.deepcopy(cache))
            except Exception:  # a layout the replay does not know (another transformers version): the forward's
                self.step = None
        ids = tokens[:, None]
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True
        )
        logits: torch.Tensor = out.logits[:, -1]
        if replayed is not None and not torch.equal(replayed, logits):
            self.step = None
        self.checked = True
        return logits


def _hooked(model: nn.Module) -> bool:
    """Whether a forward hook (global or on any module) would run inside the model's forward."""
    hooks = nn.modules.module
    if hooks._global_forward_hooks or hooks._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
