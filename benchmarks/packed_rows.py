"""Cost of one padding-free micro-batch under sdpa: one packed row vs several balanced rows.

    python benchmarks/packed_rows.py [--samples 4 8 16 48] [--row-tokens 256 512] [--repeats 3]

Without a varlen attention kernel (eager, sdpa), a packed row of ``T`` tokens costs ``T^2`` in attention
(transformers masks the packed samples apart with a block-diagonal mask over the whole row), so the
cost of ``trainbridge.data.collate.collate_padding_free`` grows quadratically with the micro-batch.
``collate_balanced_rows`` is a proposed library change, prototyped here: when a micro-batch holds more
than ``row_tokens`` tokens, spread its samples (longest first, each to the lightest row) over
``ceil(T / row_tokens)`` packed rows, right-padded to the longest row.  The padding of a row is one more
packed sequence (its own restarting ``position_ids``, labels ``-100``), so no real token attends to it
and no attention mask is needed: the loss and gradients equal the one-row layout (checked here).

For micro-batches of ``--samples`` variable-length samples (uniform ``32..128`` tokens, as in
``throughput.py``) it times forward + backward of the 3.2M-parameter benchmark Llama, one thread, CPU
seconds (best of ``--repeats``), for: one packed row (the library today), balanced rows of at most
``--row-tokens`` tokens (the prototype), and the padded layout (``collate_padded``, one row per sample).  Every layout must give the packed row's
loss sum (else it raises).
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from trainbridge.data.collate import collate_padded, collate_padding_free
from trainbridge.data.dataset import IGNORE_INDEX, Sample
from trainbridge.data.loss import token_loss_sum
from trainbridge.tiny_model import build_benchmark_llama

MIN_LEN, MAX_LEN = 32, 128
"""Sample lengths are uniform in ``MIN_LEN..MAX_LEN`` (mean 80), as the variable data of ``throughput.py``."""
FIRST_TOKEN_ID = 4
"""Token ids are drawn from ``FIRST_TOKEN_ID..vocab-1``."""

Collate = Callable[[Sequence[Sample]], dict[str, torch.Tensor]]


def collate_balanced_rows(samples: Sequence[Sample], row_tokens: int) -> dict[str, torch.Tensor]:
    """Prototype: ``collate_padding_free`` with packed rows of about ``row_tokens`` tokens at most.

    A micro-batch of ``T <= row_tokens`` tokens (or of equal-length samples) is collated as today.
    Otherwise its samples go, longest first, to the lightest of ``ceil(T / row_tokens)`` rows (at most
    one per sample); every
    row is packed like ``collate_padding_free`` and right-padded to the longest row, the padding being
    one more packed sequence (``position_ids`` restarting at 0, token ``0``, labels ``-100``).
    """
    total = sum(sample.length for sample in samples)
    if total <= row_tokens or len({sample.length for sample in samples}) == 1:
        return collate_padding_free(samples)
    num_rows = min(len(samples), math.ceil(total / row_tokens))
    heap = [(0, row) for row in range(num_rows)]
    rows: list[list[Sample]] = [[] for _ in range(num_rows)]
    for sample in sorted(samples, key=lambda s: -s.length):
        load, row = heapq.heappop(heap)
        rows[row].append(sample)
        heapq.heappush(heap, (load + sample.length, row))
    width = max(load for load, _ in heap)
    input_ids = torch.zeros((num_rows, width), dtype=torch.long)
    labels = torch.full((num_rows, width), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros((num_rows, width), dtype=torch.long)
    for row, row_samples in enumerate(rows):
        start = 0
        for sample in row_samples:
            end = start + sample.length
            input_ids[row, start:end] = torch.tensor(sample.input_ids, dtype=torch.long)
            labels[row, start + 1 : end] = torch.tensor(sample.labels[1:], dtype=torch.long)
            position_ids[row, start:end] = torch.arange(sample.length)
            start = end
        position_ids[row, start:] = torch.arange(width - start)
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def random_samples(count: int, vocab_size: int, rng: random.Random) -> list[Sample]:
    """``count`` samples of random tokens, lengths uniform in ``MIN_LEN..MAX_LEN``, labels = inputs."""
    samples = []
    for _ in range(count):
        ids = tuple(rng.randrange(FIRST_TOKEN_ID, vocab_size) for _ in range(rng.randint(MIN_LEN, MAX_LEN)))
        samples.append(Sample(ids, ids))
    return samples


def forward_backward(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
    """CPU seconds of one forward + backward of ``batch``, and its summed token loss."""
    start = time.process_time()
    loss_sum, _ = token_loss_sum(model, batch)
    loss_sum.backward()
    seconds = time.process_time() - start
    model.zero_grad(set_to_none=True)
    return seconds, loss_sum.item()


def main(argv: Sequence[str] | None = None) -> int:
    """Print one line per micro-batch size: shape and CPU milliseconds of every layout."""
    parser = argparse.ArgumentParser(prog="packed_rows.py", description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, nargs="+", default=[4, 8, 16, 48],
                        help="samples per micro-batch (one line each)")
    parser.add_argument("--row-tokens", type=int, nargs="+", default=[256, 512],
                        help="row caps of the prototype to try")
    parser.add_argument("--repeats", type=int, default=3, help="timings per layout; the best is shown")
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(options.seed)
    with tempfile.TemporaryDirectory(prefix="packed-rows-") as tmp:
        model_dir = build_benchmark_llama(Path(tmp) / "model", seed=options.seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    print(f"attention: {model.config._attn_implementation}; forward+backward CPU ms (best of {options.repeats}), "
          "1 thread", flush=True)
    layouts: list[tuple[str, Collate]] = [("one packed row", collate_padding_free)]
    layouts += [(f"rows <= {cap}", lambda s, cap=cap: collate_balanced_rows(s, cap)) for cap in options.row_tokens]
    layouts.append(("padded", lambda s: collate_padded(s, 0)))
    rng = random.Random(options.seed)
    for count in options.samples:
        samples = random_samples(count, model.config.vocab_size, rng)
        cells = []
        reference_loss: float | None = None
        for name, collate in layouts:
            batch = collate(samples)
            timings = [forward_backward(model, batch) for _ in range(options.repeats)]
            loss = timings[0][1]
            if reference_loss is None:
                reference_loss = loss
            elif not math.isclose(loss, reference_loss, rel_tol=1e-4):
                raise AssertionError(f"{name}: loss sum {loss} differs from the packed row's {reference_loss}")
            shape = "x".join(str(n) for n in batch["input_ids"].shape)
            cells.append(f"{name} [{shape}] {min(t for t, _ in timings) * 1000:7.1f}")
        total = sum(sample.length for sample in samples)
        print(f"{count:3} samples, {total:5} tokens: " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
