"""Attention for rows laid out as one shared prefix followed by segments that each see the prefix and themselves.

GRPO/RLOO score a prompt's completions in one row (``trl.shared_prefix``): the prompt once, then one segment per
completion, with a boolean ``[G, 1, T, T]`` mask that lets each segment see the prompt and itself, causally.
Under transformers' ``sdpa`` that mask costs ``T^2`` scores per head, forward and backward, most of them masked
out: with 8 completions of 32 tokens behind a 28-token prompt, 82k scores where 12k are seen.

``prefix_layout(model, mask, rows)`` routes the forward run inside it to ``PREFIX_SDPA``, registered with
transformers' ``AttentionInterface``, which for that ``mask`` computes, per row, the prefix's causal attention
and then all of the row's segments as one batch of ``[segment length, prefix + segment length]`` queries by keys,
each through transformers' ``sdpa_attention_forward`` (GQA handled there): the scores that are seen, in two calls
per row and layer.  Any other call (another mask, a KV cache) is ``sdpa_attention_forward`` unchanged.  The values
equal the masked row's up to float summation order; positions past a row's end (right pads) get finite values
that no scored token reads.

It applies to a model whose attention is ``sdpa`` and, while gradients are recorded, not under gradient
checkpointing (the recomputation in the backward would run outside the context, on the full mask).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
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


@dataclass(frozen=True)
class _Active:
    mask: torch.Tensor
    rows: tuple[_RowIndex, ...]


_active: _Active | None = None
"""The layout of the forward running inside ``prefix_layout``, and the mask that names it."""


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
    active = _active
    unusual = any(kwargs.get(name) is not None for name in ("position_bias", "softcap", "s_aux", "sliding_window"))
    if (
        active is None
        or attention_mask is not active.mask
        or unusual
        or query.shape[0] != len(active.rows)
        or query.shape[2] != key.shape[2]
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    kwargs.pop("is_causal", None)
    out = []
    for number, row in enumerate(active.rows):
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
    """Whether ``model`` (DDP and PEFT looked through by the caller) can run under ``prefix_layout`` now:
    ``sdpa`` attention, and no gradient checkpointing while gradients are recorded."""
    model = unwrap_peft(model)
    if not isinstance(model, PreTrainedModel) or model.config._attn_implementation != "sdpa":
        return False
    if not torch.is_grad_enabled():
        return True
    with warnings.catch_warnings():  # transformers 5 renames it is_activation_checkpointing
        warnings.simplefilter("ignore", FutureWarning)
        return not model.is_gradient_checkpointing


@contextmanager
def prefix_layout(model: torch.nn.Module, mask: torch.Tensor, rows: Sequence[PrefixRow]) -> Iterator[bool]:
    """Run the forward inside with ``mask``'s rows attended as ``rows`` lay them out (module doc); yields
    whether it does (``applies``), else the forward runs as it would without it."""
    global _active
    inner = unwrap_peft(model)
    if not applies(inner) or _active is not None:
        yield False
        return
    register_prefix_sdpa()
    length = mask.shape[-1]
    _active = _Active(mask, tuple(_row_index(row, length, mask.device) for row in rows))
    assert isinstance(inner, PreTrainedModel)
    inner.set_attn_implementation(PREFIX_SDPA)
    try:
        yield True
    finally:
        inner.set_attn_implementation("sdpa")
        _active = None
