"""GRPO: trl's own ``scripts/grpo.py`` under trl vs with ``from trainbridge import GRPOTrainer``.

    python benchmarks/trl_grpo.py [--steps 10] [--repeats 3] [--prompts 400] [--completion-length 32]

Builds the 3.2M-parameter benchmark Llama (``trainbridge.demos.tiny_model``), conversational addition
prompts with an ``answer`` column and ``trainbridge.demos.rewards`` copied beside the script (``rewards.answer_reward``,
which reads the ``answer`` column, and ``rewards.digit_reward``, both by dotted path), then runs the script as
shipped in the trl wheel and the same script with only the trainer import changed, each under
``torchrun --nproc_per_node=2`` (gloo, CPU, ``OMP_NUM_THREADS=1`` per rank), ``--repeats`` times interleaved
(``script_probe.run_script``: the settings every trl benchmark shares).
Both take ``--steps`` optimizer steps of ``per_device_train_batch_size=8`` completions (16 per step: 2 prompts
x ``num_generations=8``), sampled up to ``--completion-length`` tokens (trl: ``transformers`` ``generate``;
trainbridge: ``trl.sampling``, the same draws), ``beta=0`` (trl's default: no reference model), gradient
checkpointing off, the same seed.

Measured per run (``script_probe.py``, added identically to both scripts): completions per second of
``train_runtime`` (the ``train()`` call: model and data preparation excluded for both) and per CPU second;
generation separately: completion tokens per second of the time spent in ``_generate_single_turn``
(both ranks' tokens over the ranks' mean generation seconds) and generation's share of ``train()``; each
rank's peak RSS.  Prints each side's median and range, the same-repetition ratios (median and range), and
the load average before and after.  ``--profile DIR`` runs each side once under py-spy instead.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

import trl

from script_probe import RANKS, load, measure, run_configurations, run_script, summary, write_script_copies
from trainbridge.demos import rewards
from trainbridge.demos.tiny_model import build_benchmark_llama, write_prompt_dataset

PER_DEVICE = 8
GENERATIONS = 8
CONFIGS = ("trl", "trainbridge")


def generation_lines(results: dict[str, list[dict[str, float]]]) -> list[str]:
    """Generation tokens per second and generation's share of ``train()``, per side, and the ratio."""
    lines = ["| configuration | generation tokens/s (median) | range | generation share of train() (median) |"]
    lines.append("| --- | --- | --- | --- |")
    for name, runs in results.items():
        rates = [r["gen_tokens_per_s"] for r in runs]
        share = statistics.median(r["generate_share"] for r in runs)
        lines.append(f"| {name} | {statistics.median(rates):.0f} | {min(rates):.0f}-{max(rates):.0f} | {share:.0%} |")
    if {"trainbridge", "trl"} <= results.keys():
        ratios = [
            a["gen_tokens_per_s"] / b["gen_tokens_per_s"]
            for a, b in zip(results["trainbridge"], results["trl"], strict=False)
        ]
        lines.append(
            f"trainbridge / trl, generation tokens/s: same-repetition median {statistics.median(ratios):.2f}x "
            f"(range {min(ratios):.2f}-{max(ratios):.2f})"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=400)
    parser.add_argument("--completion-length", type=int, default=32)
    parser.add_argument("--only", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--profile", type=Path, default=None, help="py-spy each side once into this folder")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="trl-grpo-bench-"))
    build_benchmark_llama(root / "model")
    (root / "prompts").mkdir()
    write_prompt_dataset(root / "prompts" / "train.jsonl", args.prompts, seed=0, max_operand=999)
    shutil.copy(rewards.__file__, root / "rewards.py")
    scripts = write_script_copies(root, "grpo.py", "GRPOTrainer", probes=("wrap", "wrap_generation"))
    settings = {"max_steps": args.steps, "per_device_train_batch_size": PER_DEVICE, "num_generations": GENERATIONS,
                "max_completion_length": args.completion_length, "learning_rate": "1e-5",
                "reward_funcs": ["rewards.answer_reward", "rewards.digit_reward"]}  # fmt: skip

    def run_one(name: str, number: int, profile: Path | None) -> dict[str, float]:
        """Completions per second of ``train_runtime`` and per CPU second, generation tokens per second,
        generation's share of ``train()`` and the ranks' peak RSS."""
        out = root / f"out-{number}-{name}"
        _, runtime, probes = run_script(scripts[name], root / "model", root / "prompts", out, settings, profile)
        return measure(args.steps * PER_DEVICE * RANKS, runtime, probes, RANKS)

    before = load()
    results = run_configurations(args.only, args.repeats, run_one, "completions", args.profile)
    if results is None:
        return
    print(
        f"\n{args.steps} steps, {PER_DEVICE * RANKS} completions per step ({GENERATIONS} per prompt, up to "
        f"{args.completion_length} tokens), {RANKS} gloo ranks, trl {trl.__version__}"
    )
    print(f"load average before: {before}; after: {load()}")
    print("\n".join(summary(results, [("trainbridge", "trl")], "completions")))
    print("\n".join(generation_lines(results)))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
