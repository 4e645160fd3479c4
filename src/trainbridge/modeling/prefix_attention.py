"""Attention for rows laid out as one shared prefix followed by segments that each see the prefix and themselves.

GRPO/RLOO score a prompt's completions in one row (``trl.shared_prefix``): the prompt once, then one segment per
completion, with a boolean ``[G, 1, T, T]`` mask that lets each segment see the prompt and itself, causally.
Under transformers' ``sdpa`` that mask costs ``T^2`` scores per head, forward and backward, most of them masked
out: with 8 completions of 32 tokens behind a 28-token prompt, 82k scores where 12k are seen.

``prefix_layout(model, mask, rows)`` gives ``mask`` its rows' layout for as long as the mask lives, and switches the
model (once, for good) to ``PREFIX_SDPA``, registered with transformers' ``AttentionInterface``: for that ``mask``
it computes, per row, the prefix's causal attention and then all of the row's segments as one batch of
``[segment length, prefix + segment length]`` queries by keys, each through transformers' ``sdpa_attention_forward``
(GQA handled there): the scores that are seen, in two calls per row and layer.  Every other call (another mask, a
KV cache, generation) is ``sdpa_attention_forward`` unchanged, so ``PREFIX_SDPA`` is ``sdpa`` wherever no layout
is given.  The layout is found by the mask the model passes to its attention, so a gradient-checkpointed layer's
recomputation in the backward attends as its forward did.  The values equal the masked row's up to float
summation order; positions past a row's end (right pads) get finite values that no scored token reads.

It applies to a model whose attention is ``sdpa`` (or already ``PREFIX_SDPA``).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from trainbridge.modeling.load import unwrap_peft

PREFIX_SDPA = "trainbridge_prefix_sdpa"
"""The attention implementation ``prefix_layout`` switches a model to for one forward."""


@dataclass(frozen=True)
class PrefixRow:
    """One row: ``prefix`` shared tokens, then ``segments`` as ``(start, length)`` in the row, in order and
    adjacent, the first starting at ``prefix``; positions past the last segment are padding."""

    prefix: int
    segments: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class _RowIndex:
    """Index tensors of one row: the segments' queries ``[S, L]`` and keys ``[S, prefix + L]`` (``L`` the
    longest segment; short segments repeat their last position), their mask ``[1, 1, L, prefix + L]`` and
    where each of the row's positions from ``prefix`` on lies in the flattened ``[S * L]`` segment output."""

    prefix: int
    queries: torch.Tensor
    keys: torch.Tensor
    mask: torch.Tensor
    order: torch.Tensor


def _row_index(row: PrefixRow, length: int, device: torch.device) -> _RowIndex:
    longest = max(size for _, size in row.segments)
    queries: list[list[int]] = []
    order: list[int] = []
    for number, (start, size) in enumerate(row.segments):
        queries.append([start + min(i, size - 1) for i in range(longest)])
        order.extend(number * longest + i for i in range(size))
    order.extend([0] * (length - row.prefix - len(order)))  # right pads: any finite value
    query_index = torch.tensor(queries, dtype=torch.long)
    key_index = torch.cat([torch.arange(row.prefix).expand(len(queries), -1), query_index], dim=1)
    return _RowIndex(
        prefix=row.prefix,
        queries=query_index.to(device),
        keys=key_index.to(device),
        # every segment: the whole prefix, itself causally (a real query never sees the repeated positions after it)
        mask=torch.ones(longest, row.prefix + longest, dtype=torch.bool).tril(row.prefix)[None, None].to(device),
        order=torch.tensor(order, dtype=torch.long, device=device),
    )


_layouts: dict[int, tuple[weakref.ref[torch.Tensor], tuple[_RowIndex, ...]]] = {}
"""By ``id`` of each live mask given to ``prefix_layout``: the mask (weakly) and its rows' index tensors."""


def _rows_of(mask: torch.Tensor | None) -> tuple[_RowIndex, ...] | None:
    entry = _layouts.get(id(mask)) if mask is not None else None
    return entry[1] if entry is not None and entry[0]() is mask else None


def prefix_sdpa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers attention function (module doc): ``[G, T, H, D]`` and no weights."""
    rows = _rows_of(attention_mask)
    unusual = any(kwargs.get(name) is not None for name in ("position_bias", "softcap", "s_aux", "sliding_window"))
    if rows is None or unusual or query.shape[0] != len(rows) or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    kwargs.pop("is_causal", None)
    out = []
    for number, row in enumerate(rows):
        q, k, v = query[number], key[number], value[number]  # [H, T, D]
        pieces = []
        if row.prefix:
            head = slice(0, row.prefix)
            prefix_out, _ = sdpa_attention_forward(
                module, q[None, :, head], k[None, :, head], v[None, :, head], None,
                dropout=dropout, scaling=scaling, is_causal=True, **kwargs,
            )  # fmt: skip
            pieces.append(prefix_out[0])
        segments_out, _ = sdpa_attention_forward(
            module,
            q[:, row.queries].transpose(0, 1),
            k[:, row.keys].transpose(0, 1),
            v[:, row.keys].transpose(0, 1),
            row.mask,
            dropout=dropout,
            scaling=scaling,
            **kwargs,
        )  # [S, L, H, D]
        pieces.append(segments_out.flatten(0, 1)[row.order])
        out.append(torch.cat(pieces) if len(pieces) > 1 else pieces[0])
    return torch.stack(out), None


def register_prefix_sdpa() -> None:
    """Register ``PREFIX_SDPA`` (idempotent); its masks are sdpa's (a 4D mask is passed through as given)."""
    AttentionInterface.register(PREFIX_SDPA, prefix_sdpa_attention_forward)
    AttentionMaskInterface.register(PREFIX_SDPA, sdpa_mask)


def applies(model: torch.nn.Module) -> bool:
    """Whether ``model`` (DDP and PEFT looked through by the caller) attends with ``sdpa`` or ``PREFIX_SDPA``."""
    model = unwrap_peft(model)
    return isinstance(model, PreTrainedModel) and model.config._attn_implementation in ("sdpa", PREFIX_SDPA)


def prefix_layout(model: torch.nn.Module, mask: torch.Tensor, rows: Sequence[PrefixRow]) -> bool:
    """Give ``mask`` the layout ``rows`` for as long as it lives, so the model's forward on it (and a
    checkpointed layer's recomputation in its backward) attends as ``rows`` lay it out (module doc); switch the
    model to ``PREFIX_SDPA`` the first time.  Say whether it applies (``applies``); else nothing changes."""
    inner = unwrap_peft(model)
    if not applies(inner):
        return False
    if inner.config._attn_implementation != PREFIX_SDPA:
        register_prefix_sdpa()
        inner.set_attn_implementation(PREFIX_SDPA)
    key = id(mask)
    _layouts[key] = (weakref.ref(mask), tuple(_row_index(row, mask.shape[-1], mask.device) for row in rows))
    weakref.finalize(mask, _layouts.pop, key, None)
    return True
