"""DPO on preference pairs: trl's own ``scripts/dpo.py`` under trl vs with ``from trainbridge import DPOTrainer``.

    python benchmarks/trl_dpo.py [--steps 20] [--repeats 3] [--pairs 1000]

Builds the 3.2M-parameter benchmark Llama (``trainbridge.demos.tiny_model``) and preference pairs of
varied lengths (a prompt of 4-40 words, chosen and rejected completions of 2-30 words each), then runs the
script as shipped in the trl wheel and the same script with only the trainer import changed, each under
``torchrun --nproc_per_node=2`` (gloo, CPU, ``OMP_NUM_THREADS=1`` per rank), ``--repeats`` times
interleaved.  Both take ``--steps`` optimizer steps of ``per_device_train_batch_size=8`` pairs (16 pairs
per step), the reference a frozen copy of the policy, sigmoid loss, ``max_length=256``.  trl pads chosen and
rejected into one ``[16, T]`` batch per rank; trainbridge packs them into one padding-free row.
Throughput is pairs per second of ``train_runtime`` (the ``train()`` call: model and data preparation
excluded for both); CPU-normalised, pairs per CPU second of the ranks' mean CPU time over the same call; and
each rank's peak RSS (``script_probe.py``, added identically to both scripts).  Prints each side's median
and range, the ratio of medians, and the same-repetition ratios (median and range), wall clock and
CPU-normalised, with the load average before and after.

``--profile DIR`` runs each side once under ``py-spy record --subprocesses --format raw`` (both ranks
sampled; slower, not for timing) and writes the collapsed stacks and a top-functions summary to ``DIR``.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path

import trl

from script_probe import RANKS, load, measure, run_configurations, run_script, summary, write_script_copies
from trainbridge.demos.tiny_model import build_benchmark_llama

PER_DEVICE = 8
CONFIGS = ("trl", "trainbridge")
WORDS = "the a one two three four five six seven eight nine ten plus minus times is and or not yes no".split()  # noqa: SIM905


def write_pairs(path: Path, n: int, seed: int) -> None:
    """``n`` rows of ``prompt``/``chosen``/``rejected`` text of varied lengths."""
    rng = random.Random(seed)

    def text(low: int, high: int) -> str:
        return " ".join(rng.choices(WORDS, k=rng.randint(low, high)))

    with path.open("w") as f:
        for _ in range(n):
            f.write(json.dumps({"prompt": text(4, 40), "chosen": text(2, 30), "rejected": text(2, 30)}) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=1000)
    parser.add_argument("--only", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--profile", type=Path, default=None, help="py-spy each side once into this folder")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="trl-dpo-bench-"))
    build_benchmark_llama(root / "model")
    (root / "pairs").mkdir()
    write_pairs(root / "pairs" / "train.jsonl", args.pairs, seed=0)
    scripts = write_script_copies(root, "dpo.py", "DPOTrainer")
    settings = {"max_steps": args.steps, "per_device_train_batch_size": PER_DEVICE, "max_length": 256,
                "learning_rate": "1e-5"}  # fmt: skip

    def run_one(name: str, number: int, profile: Path | None) -> dict[str, float]:
        """Pairs per second of ``train_runtime``, pairs per CPU second and the ranks' peak RSS."""
        out = root / f"out-{number}-{name}"
        _, runtime, probes = run_script(scripts[name], root / "model", root / "pairs", out, settings, profile)
        return measure(args.steps * PER_DEVICE * RANKS, runtime, probes, RANKS)

    before = load()
    results = run_configurations(args.only, args.repeats, run_one, "pairs", args.profile)
    if results is None:
        return
    print(f"\n{args.steps} steps, {PER_DEVICE * RANKS} pairs per step, {RANKS} gloo ranks, trl {trl.__version__}")
    print(f"load average before: {before}; after: {load()}")
    print("\n".join(summary(results, [("trainbridge", "trl")], "pairs")))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
