"""Attention over a packed row without a varlen kernel: per-sample sdpa calls vs gathered padded batches.

    python benchmarks/varlen_layouts.py [--repeats 30]

``modeling.varlen_attention`` runs one causal ``scaled_dot_product_attention`` per sample of a packed row
where torch's varlen flash kernel does not run (CPU, fp32).  The alternatives timed here: gather the row's
samples into one right-padded ``[samples, longest]`` batch for a single sdpa call and scatter the result
back (under the causal mask a real query never sees a pad key, so it is exact); the same with the samples
split into length buckets (the split minimising ``samples x longest^2 / 2 + call_cost`` per bucket, for two
call costs).  FlexAttention with a document mask is not among them: on torch 2.13 it has no backward on
CPU (``NotImplementedError: FlexAttention does not support backward on CPU``).

One thread, CPU milliseconds of forward + backward of the attention alone (``[1, 4 heads, T, 64]``, the
benchmark Llama's shape), median of ``--repeats``, for the sample-length distributions of the benchmarks
(``throughput.py``'s 4 samples of 32..128 per rank, ``trl_dpo.py``'s 16 sequences of 30..256) and rows of
many short samples.  Every layout's output is checked against the per-sample one.
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from trainbridge.modeling.varlen_attention import _per_sample_forward

HEADS, HEAD_DIM = 4, 64
DISTRIBUTIONS = [(4, 32, 128), (8, 32, 128), (16, 30, 256), (48, 32, 128), (32, 60, 64), (64, 8, 12), (200, 2, 20)]
"""``(samples, shortest, longest)`` of the rows timed (uniform lengths)."""

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[int]], torch.Tensor]


def length_buckets(lengths: Sequence[int], call_cost: float) -> list[list[int]]:
    """Sample indices grouped into padded batches: consecutive runs of the length-sorted samples minimising
    ``sum(samples x longest^2 / 2 + call_cost)`` (exact dynamic programme)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    best, cut = [0.0] + [math.inf] * len(order), [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        for start in range(end):
            cost = best[start] + (end - start) * lengths[order[start]] ** 2 / 2 + call_cost
            if cost < best[end]:
                best[end], cut[end] = cost, start
    groups, end = [], len(order)
    while end > 0:
        groups.append(order[cut[end] : end])
        end = cut[end]
    return groups[::-1]


def gathered(call_cost: float) -> Attention:
    """Gather the samples into right-padded batches (``length_buckets``), one causal sdpa call per batch,
    scatter back.  Index tensors are built per call here (the library would build them once per forward)."""

    def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        _, heads, length, head_dim = query.shape
        starts = [0, *itertools.accumulate(lengths)][:-1]
        flat = [t[0].transpose(0, 1) for t in (query, key, value)]  # [T, H, D] views
        slot = [0] * length
        pieces, offset = [], 0
        for group in length_buckets(lengths, call_cost):
            width = max(lengths[i] for i in group)
            index = []
            for i in group:
                index.extend(starts[i] + min(j, lengths[i] - 1) for j in range(width))
                slot[starts[i] : starts[i] + lengths[i]] = range(offset, offset + lengths[i])
                offset += width
            where = torch.tensor(index)
            q, k, v = (t.index_select(0, where).view(len(group), width, heads, head_dim).transpose(1, 2) for t in flat)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            pieces.append(out.transpose(1, 2).reshape(len(group) * width, heads, head_dim))
        return torch.cat(pieces).index_select(0, torch.tensor(slot)).unsqueeze(0)

    return attention


def per_sample(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """The library's path (``varlen_attention._per_sample_forward``)."""
    return _per_sample_forward(query, key, value, [[0, *itertools.accumulate(lengths)]], 0.0, None, False)


def time_layout(attention: Attention, lengths: list[int], repeats: int) -> tuple[float, torch.Tensor]:
    """Median CPU ms of forward + backward, and the output of the first run."""
    total = sum(lengths)
    generator = torch.Generator().manual_seed(0)
    tensors = [torch.randn(1, HEADS, total, HEAD_DIM, generator=generator, requires_grad=True) for _ in range(3)]
    timings, first = [], None
    for _ in range(repeats):
        start = time.process_time()
        output = attention(*tensors, lengths)
        output.sum().backward()
        timings.append(time.process_time() - start)
        first = output.detach() if first is None else first
    assert first is not None
    return statistics.median(timings) * 1000, first


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="varlen_layouts.py", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    layouts: dict[str, Attention] = {
        "per-sample sdpa (library)": per_sample,
        "gathered, one call": gathered(math.inf),
        "gathered, buckets c=4096": gathered(4096),
        "gathered, buckets c=16384": gathered(16384),
    }
    rng = random.Random(0)
    print("| samples x length | tokens | " + " | ".join(layouts) + " |")
    print("|---|---:|" + "---:|" * len(layouts))
    for count, low, high in DISTRIBUTIONS:
        lengths = [rng.randint(low, high) for _ in range(count)]
        cells, reference = [], None
        for attention in layouts.values():
            milliseconds, output = time_layout(attention, lengths, options.repeats)
            if reference is None:
                reference = output
            torch.testing.assert_close(output, reference, rtol=1e-5, atol=1e-5)
            cells.append(f"{milliseconds:.2f}")
        print(f"| {count} x {low}..{high} | {sum(lengths)} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
