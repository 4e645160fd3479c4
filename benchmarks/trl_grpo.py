"""GRPO: trl's own ``scripts/grpo.py`` under trl vs with ``from trainbridge import GRPOTrainer``.

    python benchmarks/trl_grpo.py [--steps 10] [--repeats 3] [--prompts 400] [--completion-length 32]

Builds the 3.2M-parameter benchmark Llama (``trainbridge.demos.tiny_model``), conversational addition
prompts with an ``answer`` column and ``trainbridge.demos.rewards`` copied beside the script (``rewards.answer_reward``,
which reads the ``answer`` column, and ``rewards.digit_reward``, both by dotted path), then runs the script as
shipped in the trl wheel and the same script with only the trainer import changed, each under
``torchrun --nproc_per_node=2`` (gloo, CPU, ``OMP_NUM_THREADS=1`` per rank), ``--repeats`` times interleaved.
Both take ``--steps`` optimizer steps of ``per_device_train_batch_size=8`` completions (16 per step: 2 prompts
x ``num_generations=8``), sampled with ``transformers`` ``generate`` up to ``--completion-length`` tokens,
``beta=0`` (trl's default: no reference model), gradient checkpointing off, the same seed.

Measured per run (``script_probe.py``, added identically to both scripts): completions per second of
``train_runtime`` (the ``train()`` call: model and data preparation excluded for both) and per CPU second;
generation separately: completion tokens per second of the time spent in trl's ``_generate_single_turn``
(both ranks' tokens over the ranks' mean generation seconds) and generation's share of ``train()``; each
rank's peak RSS.  Prints each side's median and range, the same-repetition ratios (median and range), and
the load average before and after.  ``--profile DIR`` runs each side once under py-spy instead.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import trl

from script_probe import load, measure, pyspy_prefix, summary, top_functions
from trainbridge.demos import rewards
from trainbridge.demos.tiny_model import build_benchmark_llama, write_prompt_dataset

ORIGINAL_IMPORT = "    from trl import GRPOTrainer, get_dataset, get_peft_config, get_quantization_config\n"
PORTED_IMPORT = (
    "    from trainbridge import GRPOTrainer\n"
    "    from trl import get_dataset, get_peft_config, get_quantization_config\n"
)
PROBE = "    import script_probe\n\n    script_probe.wrap(GRPOTrainer)\n    script_probe.wrap_generation(GRPOTrainer)\n"
PER_DEVICE = 8
GENERATIONS = 8
RANKS = 2
CONFIGS = {"trl": "grpo_trl.py", "trainbridge": "grpo_trainbridge.py"}


def run(root: Path, script: str, steps: int, length: int, port: int, profile: Path | None = None) -> dict[str, float]:
    """One run: completions per second of ``train_runtime`` and per CPU second, generation tokens per second,
    generation's share of ``train()`` and the ranks' peak RSS."""
    command = [
        *([] if profile is None else pyspy_prefix(profile)),
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={RANKS}",
        f"--master_port={port}",
        str(root / script),
        *("--model_name_or_path", str(root / "model"), "--dataset_name", str(root / "prompts")),
        *("--output_dir", str(root / f"out-{port}"), "--max_steps", str(steps)),
        *("--per_device_train_batch_size", str(PER_DEVICE), "--num_generations", str(GENERATIONS)),
        *("--max_completion_length", str(length), "--logging_steps", str(steps), "--save_strategy", "no"),
        *("--bf16", "false", "--use_cpu", "true", "--report_to", "none", "--dtype", "float32"),
        *("--disable_tqdm", "true", "--gradient_checkpointing", "false", "--learning_rate", "1e-5"),
        *("--reward_funcs", "rewards.answer_reward", "rewards.digit_reward"),
    ]
    probes = root / f"probes-{port}"
    probes.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BENCH_PROBE_DIR": str(probes)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=root, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{script} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    printed = [
        ast.literal_eval(line[line.index("{") : line.rindex("}") + 1])  # the printed log dicts
        for line in done.stdout.splitlines() + done.stderr.splitlines()
        if line.lstrip().startswith("{'")
    ]
    runtime = next(float(m["train_runtime"]) for m in printed if "train_runtime" in m)
    return measure(steps * PER_DEVICE * RANKS, runtime, probes, RANKS)


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
    parser.add_argument("--only", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--profile", type=Path, default=None, help="py-spy each side once into this folder")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="trl-grpo-bench-"))
    build_benchmark_llama(root / "model")
    (root / "prompts").mkdir()
    write_prompt_dataset(root / "prompts" / "train.jsonl", args.prompts, seed=0, max_operand=999)
    shutil.copy(rewards.__file__, root / "rewards.py")
    source = (Path(trl.__file__).parent / "scripts" / "grpo.py").read_text()
    if ORIGINAL_IMPORT not in source:
        raise SystemExit("trl's grpo.py changed its import line")
    (root / "grpo_trl.py").write_text(source.replace(ORIGINAL_IMPORT, ORIGINAL_IMPORT + PROBE))
    (root / "grpo_trainbridge.py").write_text(source.replace(ORIGINAL_IMPORT, PORTED_IMPORT + PROBE))
    shutil.copy(Path(__file__).with_name("script_probe.py"), root / "script_probe.py")
    port = 29700 + os.getpid() % 200 * 10
    length = args.completion_length
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
        for name in args.only:
            port += 1
            stacks = args.profile / f"grpo-{name}.txt"
            run(root, CONFIGS[name], args.steps, length, port, profile=stacks)
            (args.profile / f"grpo-{name}-top.txt").write_text(top_functions(stacks))
            print(f"{name}: profile in {stacks}", flush=True)
        return
    before = load()
    results: dict[str, list[dict[str, float]]] = {name: [] for name in args.only}
    for _ in range(args.repeats):
        for name in args.only:
            port += 1
            results[name].append(run(root, CONFIGS[name], args.steps, length, port))
            r = results[name][-1]
            print(
                f"{name}: {r['per_s']:.2f} completions/s, {r['per_cpu_s']:.2f} completions/CPU-s, "
                f"{r['gen_tokens_per_s']:.0f} generation tokens/s ({r['generate_share']:.0%} of train()), "
                f"{r['peak_rss_mib']:.0f} MiB",
                flush=True,
            )
    print(
        f"\n{args.steps} steps, {PER_DEVICE * RANKS} completions per step ({GENERATIONS} per prompt, up to {length} "
        f"tokens), {RANKS} gloo ranks, trl {trl.__version__}"
    )
    print(f"load average before: {before}; after: {load()}")
    print("\n".join(summary(results, [("trainbridge", "trl")], "completions")))
    print("\n".join(generation_lines(results)))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
