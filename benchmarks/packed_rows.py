"""Cost of one padding-free micro-batch under sdpa: the layouts and attention paths the library has.

    python benchmarks/packed_rows.py [--samples 4 8 16 48] [--row-tokens 256 512] [--repeats 3]

Without a varlen attention kernel, transformers' sdpa masks the samples of a packed row apart with a
block-diagonal mask over the whole row, so a row of ``T`` tokens costs ``T^2`` in attention.  The library
has two answers: ``collate_padding_free(row_tokens=...)`` spreads a long micro-batch over balanced packed
rows (for eager attention, and sdpa models the second does not apply to), and ``data.varlen_attention``
(``TrainingArgs.varlen_sdpa``, on by default) runs one causal sdpa per sample of a row, with no mask.

For micro-batches of ``--samples`` variable-length samples (uniform ``32..128`` tokens, as in
``throughput.py``) it times forward + backward of the 3.2M-parameter benchmark Llama, one thread, CPU
seconds (best of ``--repeats``), for: one packed row under masked sdpa, balanced rows of at most
``--row-tokens`` tokens under masked sdpa, one packed row under the per-sample varlen sdpa (the library
default for sdpa models), and the padded layout (``collate_padded``, one row per sample).  Every layout
must give the first one's loss sum (else it raises).
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from trainbridge.data import Sample, collate_padded, collate_padding_free
from trainbridge.data.loss import token_loss_sum
from trainbridge.demos.tiny_model import build_benchmark_llama
from trainbridge.modeling import enable_varlen_sdpa

MIN_LEN, MAX_LEN = 32, 128
"""Sample lengths are uniform in ``MIN_LEN..MAX_LEN`` (mean 80), as the variable data of ``throughput.py``."""
FIRST_TOKEN_ID = 4
"""Token ids are drawn from ``FIRST_TOKEN_ID..vocab-1``."""

Collate = Callable[[Sequence[Sample]], dict[str, torch.Tensor]]


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
    parser.add_argument(
        "--samples", type=int, nargs="+", default=[4, 8, 16, 48], help="samples per micro-batch (one line each)"
    )
    parser.add_argument(
        "--row-tokens", type=int, nargs="+", default=[256, 512], help="row caps of the prototype to try"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timings per layout; the best is shown")
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    torch.manual_seed(options.seed)
    with tempfile.TemporaryDirectory(prefix="packed-rows-") as tmp:
        model_dir = build_benchmark_llama(Path(tmp) / "model", seed=options.seed)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    print(
        f"attention: {model.config._attn_implementation}; forward+backward CPU ms (best of {options.repeats}), "
        "1 thread",
        flush=True,
    )
    varlen = copy.deepcopy(model)
    if not enable_varlen_sdpa(varlen, max_seq_len=MAX_LEN):
        raise RuntimeError("varlen sdpa does not apply to the benchmark model")
    layouts: list[tuple[str, torch.nn.Module, Collate]] = [("one packed row", model, collate_padding_free)]
    layouts += [
        (f"rows <= {cap}", model, lambda s, cap=cap: collate_padding_free(s, row_tokens=cap))
        for cap in options.row_tokens
    ]
    layouts.append(("varlen sdpa, one row", varlen, collate_padding_free))
    layouts.append(("padded", model, lambda s: collate_padded(s, 0)))
    rng = random.Random(options.seed)
    for count in options.samples:
        samples = random_samples(count, model.config.vocab_size, rng)
        cells = []
        reference_loss: float | None = None
        for name, layout_model, collate in layouts:
            batch = collate(samples)
            timings = [forward_backward(layout_model, batch) for _ in range(options.repeats)]
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
