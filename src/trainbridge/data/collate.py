"""Micro-batch tensors: padding-free (packed rows) or padded (right padding).

Both collators return CPU ``int64`` tensors; the loop moves them to the device.  The padding-free
layout follows ``transformers.DataCollatorWithFlattening``: samples are concatenated into one row,
``position_ids`` restart at 0 for every sample, and the first label of every sample is ``-100`` so no
token learns to predict across a sample boundary.  Transformers detects the packed sequences from the
restarting ``position_ids`` (``masking_utils.find_packed_sequence_indices`` for eager / sdpa / flex
attention, the varlen path for flash attention), provided no ``attention_mask`` and no KV cache are
passed -- ``data.loss.token_loss_sum`` calls the model that way.

Eager and sdpa attention have no varlen kernel: they mask the packed samples apart with a
block-diagonal mask over the whole row, so a row of ``T`` tokens costs ``T^2`` in attention.  The loop
switches sdpa models to ``VARLEN_SDPA`` (``data.varlen_attention``: one causal sdpa per sample) where
that is exact; for the rest (eager, and sdpa models it does not apply to) it passes
``row_tokens=PACKED_ROW_TOKENS`` (``packed_row_tokens``) and a larger micro-batch is spread over several
balanced packed rows (``benchmarks/packed_rows.py`` measures the difference).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch

from trainbridge.data.types import IGNORE_INDEX, Sample

DUMMY_TOKEN_ID = 0
"""Token id of the single token of a dummy (empty) padding-free micro-batch."""

FLASH_ATTENTION_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""Batch entries transformers' flash attention takes for a packed row (as
``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` supplies them): given, the varlen kernel
needs no boundary computation from ``position_ids`` on the device."""


class CollatedBatch(dict[str, Any]):
    """A collated micro-batch (a ``dict`` of CPU tensors, plus flash-attention ints when asked for)
    that also carries, as plain Python, the length of every sequence of every row.

    ``seq_lens[r]`` lists the lengths of the packed sequences of row ``r`` (a padded row's tail padding
    counts as one more sequence); ``None`` when every row is one sequence (stacked equal-length rows,
    padded batches).  The loop hands it to the per-sample attention (``modeling.varlen_attention``)
    so sample boundaries never have to be read back from a device tensor.
    """

    seq_lens: tuple[tuple[int, ...], ...] | None = None


def _batch(seq_lens: tuple[tuple[int, ...], ...] | None = None, **entries: Any) -> CollatedBatch:
    batch = CollatedBatch(entries)
    batch.seq_lens = seq_lens
    return batch


def collate_padding_free(
    samples: Sequence[Sample], row_tokens: int | None = None, flash_kwargs: bool = False
) -> CollatedBatch:
    """Concatenate ``samples`` into one row: ``input_ids``, ``labels``, ``position_ids``, each ``[1, T]``.

    When every sample has the same length, they are stacked as ``[k, L]`` rows instead (no padding
    either way, the same loss): one row per sample keeps attention on the plain causal path, where a
    packed row would make eager/sdpa attention build a block-diagonal mask over all ``T`` tokens.
    With ``row_tokens`` and ``T > row_tokens``, the samples go, longest first, to the lightest of
    ``ceil(T / row_tokens)`` packed rows (at most one per sample), each right-padded to the longest:
    a row's padding is one more packed sequence (``DUMMY_TOKEN_ID``, ``position_ids`` restarting at 0,
    labels ``-100``), so no sample attends to it and the loss is the same as in one row.
    An empty ``samples`` (a dummy micro-batch) gives one token ``DUMMY_TOKEN_ID`` with label ``-100``.
    The sequence lengths of every packed row are in the result's ``seq_lens``; with ``flash_kwargs``
    a one-row result also holds ``FLASH_ATTENTION_KWARGS`` (int32 ``cu_seq_lens_*``, int ``max_length_*``).
    """
    if len(samples) > 1 and len({s.length for s in samples}) == 1:
        return _batch(
            input_ids=torch.tensor([s.input_ids for s in samples], dtype=torch.long),
            labels=torch.tensor([(IGNORE_INDEX, *s.labels[1:]) for s in samples], dtype=torch.long),
        )
    if not samples:
        return _with_flash_kwargs(
            _batch(
                ((1,),),
                input_ids=torch.tensor([[DUMMY_TOKEN_ID]], dtype=torch.long),
                labels=torch.tensor([[IGNORE_INDEX]], dtype=torch.long),
                position_ids=torch.tensor([[0]], dtype=torch.long),
            ),
            flash_kwargs,
        )
    total = sum(sample.length for sample in samples)
    num_rows = 1 if row_tokens is None else min(len(samples), math.ceil(total / row_tokens))
    rows = [_packed_row(row) for row in _balanced_rows(samples, num_rows)]
    width = max(len(input_ids) for input_ids, _, _, _ in rows)
    for input_ids, labels, position_ids, lengths in rows:
        padding = width - len(input_ids)
        input_ids.extend([DUMMY_TOKEN_ID] * padding)
        labels.extend([IGNORE_INDEX] * padding)
        position_ids.extend(range(padding))
        if padding:
            lengths.append(padding)
    return _with_flash_kwargs(
        _batch(
            tuple(tuple(lengths) for _, _, _, lengths in rows),
            input_ids=torch.tensor([input_ids for input_ids, _, _, _ in rows], dtype=torch.long),
            labels=torch.tensor([labels for _, labels, _, _ in rows], dtype=torch.long),
            position_ids=torch.tensor([position_ids for _, _, position_ids, _ in rows], dtype=torch.long),
        ),
        flash_kwargs,
    )


def _with_flash_kwargs(batch: CollatedBatch, flash_kwargs: bool) -> CollatedBatch:
    """Add ``FLASH_ATTENTION_KWARGS`` to a one-row packed batch (flash's varlen layout is one row)."""
    if flash_kwargs and batch.seq_lens is not None and len(batch.seq_lens) == 1:
        lengths = batch.seq_lens[0]
        cu_seq_lens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
        batch.update(
            cu_seq_lens_q=cu_seq_lens, cu_seq_lens_k=cu_seq_lens, max_length_q=max(lengths), max_length_k=max(lengths)
        )
    return batch


def _balanced_rows(samples: Sequence[Sample], num_rows: int) -> list[list[Sample]]:
    """Longest first, each sample to the row with the fewest tokens so far (ties: the lower row)."""
    if num_rows == 1:
        return [list(samples)]
    rows: list[list[Sample]] = [[] for _ in range(num_rows)]
    heap = [(0, row) for row in range(num_rows)]
    for sample in sorted(samples, key=lambda s: -s.length):
        load, row = heapq.heappop(heap)
        rows[row].append(sample)
        heapq.heappush(heap, (load + sample.length, row))
    return rows


def _packed_row(samples: Sequence[Sample]) -> tuple[list[int], list[int], list[int], list[int]]:
    """``input_ids``, ``labels`` (``-100`` on each sample's first token), restarting ``position_ids``
    and the samples' lengths."""
    input_ids: list[int] = []
    labels: list[int] = []
    position_ids: list[int] = []
    for sample in samples:
        input_ids.extend(sample.input_ids)
        labels.append(IGNORE_INDEX)
        labels.extend(sample.labels[1:])
        position_ids.extend(range(sample.length))
    return input_ids, labels, position_ids, [sample.length for sample in samples]


def collate_padded(samples: Sequence[Sample], pad_token_id: int) -> CollatedBatch:
    """Right-pad ``samples`` to the longest: ``input_ids``, ``attention_mask``, ``labels`` (``-100`` on padding).

    An empty ``samples`` (a dummy micro-batch) gives one attended ``pad_token_id`` with label ``-100``.
    """
    if not samples:
        return _batch(
            input_ids=torch.tensor([[pad_token_id]], dtype=torch.long),
            attention_mask=torch.ones(1, 1, dtype=torch.long),
            labels=torch.tensor([[IGNORE_INDEX]], dtype=torch.long),
        )
    width = max(sample.length for sample in samples)
    input_ids = torch.full((len(samples), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), width), dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)
    for row, sample in enumerate(samples):
        input_ids[row, : sample.length] = torch.tensor(sample.input_ids, dtype=torch.long)
        labels[row, : sample.length] = torch.tensor(sample.labels, dtype=torch.long)
        attention_mask[row, : sample.length] = 1
    return _batch(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
