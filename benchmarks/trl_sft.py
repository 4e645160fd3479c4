"""SFT on chat data: trl's own ``scripts/sft.py`` under trl vs with ``from trainbridge import SFTTrainer``.

    python benchmarks/trl_sft.py [--steps 30] [--repeats 2] [--samples 2000]

Builds the 3.2M-parameter benchmark Llama and a chat data set of arithmetic conversations
(``trainbridge.demos.tiny_model``), then runs the script as shipped in the trl wheel and the same script
with only the trainer import changed, each under ``torchrun --nproc_per_node=2`` (gloo, CPU,
``OMP_NUM_THREADS=1`` per rank), ``--repeats`` times interleaved.  Configurations: trl padded (its
default), trl ``--packing`` (bfd: padding-free packed rows), trainbridge (padding-free token budgets) and
trainbridge ``--packing`` (the same samples: trl's bins are split back into their sequences).  Every run
takes ``--steps`` optimizer steps of ``per_device_train_batch_size=8`` at the same settings (8 samples per
rank, or for trl's packing 8 bins of ``max_length`` tokens: more tokens per step); throughput is non-padding
tokens per second of ``train_runtime`` (the ``train()`` call: model and data preparation excluded for
both), tokens as each side counts them (trl's logged ``num_tokens``, trainbridge's ``tokens_seen`` in
``metrics.jsonl``); CPU-normalised, the same tokens per CPU second of the ranks' mean CPU time over the
call; each rank's peak RSS (``script_probe.py``, added identically to both scripts).  Prints each
configuration's median and range and the same-repetition ratios of trainbridge to trl padded and to trl's
bfd packing, with the load average.  ``--only`` runs some configurations; ``--profile DIR`` runs each once
under py-spy (``trl_dpo.py`` describes it).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import trl

from script_probe import RANKS, load, measure, run_configurations, run_script, summary, write_script_copies
from trainbridge.demos.tiny_model import build_benchmark_llama, write_chat_dataset

PER_DEVICE = 8
CONFIGS: dict[str, tuple[str, dict[str, str]]] = {
    "trl padded": ("trl", {}),
    "trl packing (bfd)": ("trl", {"packing": "true"}),
    "trainbridge": ("trainbridge", {}),
    "trainbridge packing (bfd)": ("trainbridge", {"packing": "true"}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--only", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--profile", type=Path, default=None, help="py-spy each configuration once into this folder")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="trl-sft-bench-"))
    build_benchmark_llama(root / "model")
    (root / "data").mkdir()
    write_chat_dataset(root / "data" / "train.jsonl", args.samples, seed=0)
    scripts = write_script_copies(root, "sft.py", "SFTTrainer")

    def run_one(name: str, number: int, profile: Path | None) -> dict[str, float]:
        """Non-padding tokens as each side counts them, per second of ``train_runtime`` and per CPU second,
        and the ranks' peak RSS."""
        side, extra = CONFIGS[name]
        out = root / f"out-{number}"
        settings = {"max_steps": args.steps, "per_device_train_batch_size": PER_DEVICE, "max_length": 128,
                    "learning_rate": "1e-4", **extra}  # fmt: skip
        printed, runtime, probes = run_script(scripts[side], root / "model", root / "data", out, settings, profile)
        if (out / "metrics.jsonl").is_file():  # trainbridge: tokens_seen
            tokens = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1]).get("tokens_seen")
            tokens = tokens or max(json.loads(line).get("tokens_seen", 0) for line in (out / "metrics.jsonl").open())
        else:  # trl: its logged num_tokens
            tokens = next(float(m["num_tokens"]) for m in printed if "num_tokens" in m)
        return measure(float(tokens), runtime, probes, RANKS)

    before = load()
    results = run_configurations(args.only, args.repeats, run_one, "tokens", args.profile)
    if results is None:
        return
    print(f"\n{args.steps} steps, per_device_train_batch_size={PER_DEVICE}, {RANKS} gloo ranks, trl {trl.__version__}")
    print(f"load average before: {before}; after: {load()}")
    comparisons = [
        ("trainbridge", "trl padded"),
        ("trainbridge", "trl packing (bfd)"),
        ("trainbridge packing (bfd)", "trl packing (bfd)"),
    ]
    print("\n".join(summary(results, comparisons, "tokens")))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
