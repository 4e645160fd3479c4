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
import ast
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import trl

from script_probe import load, measure, pyspy_prefix, summary, top_functions
from trainbridge.demos.tiny_model import build_benchmark_llama

ORIGINAL_IMPORT = "    from trl import DPOTrainer, get_dataset, get_peft_config, get_quantization_config\n"
PORTED_IMPORT = (
    "    from trainbridge import DPOTrainer\n"
    "    from trl import get_dataset, get_peft_config, get_quantization_config\n"
)
PROBE = "    import script_probe\n\n    script_probe.wrap(DPOTrainer)\n"
PER_DEVICE = 8
RANKS = 2
CONFIGS = {"trl": "dpo_trl.py", "trainbridge": "dpo_trainbridge.py"}
WORDS = "the a one two three four five six seven eight nine ten plus minus times is and or not yes no".split()  # noqa: SIM905


def write_pairs(path: Path, n: int, seed: int) -> None:
    """``n`` rows of ``prompt``/``chosen``/``rejected`` text of varied lengths."""
    rng = random.Random(seed)

    def text(low: int, high: int) -> str:
        return " ".join(rng.choices(WORDS, k=rng.randint(low, high)))

    with path.open("w") as f:
        for _ in range(n):
            f.write(json.dumps({"prompt": text(4, 40), "chosen": text(2, 30), "rejected": text(2, 30)}) + "\n")


def run(root: Path, script: str, steps: int, port: int, profile: Path | None = None) -> dict[str, float]:
    """One run: pairs per second of ``train_runtime``, pairs per CPU second and the ranks' peak RSS."""
    command = [
        *([] if profile is None else pyspy_prefix(profile)),
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={RANKS}",
        f"--master_port={port}",
        str(root / script),
        "--model_name_or_path",
        str(root / "model"),
        "--dataset_name",
        str(root / "pairs"),
        "--output_dir",
        str(root / f"out-{port}"),
        "--max_steps",
        str(steps),
        "--per_device_train_batch_size",
        str(PER_DEVICE),
        "--logging_steps",
        str(steps),
        "--save_strategy",
        "no",
        "--bf16",
        "false",
        "--use_cpu",
        "true",
        "--report_to",
        "none",
        "--max_length",
        "256",
        "--dtype",
        "float32",
        "--disable_tqdm",
        "true",
        "--gradient_checkpointing",
        "false",
        "--learning_rate",
        "1e-5",
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pairs", type=int, default=1000)
    parser.add_argument("--only", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--profile", type=Path, default=None, help="py-spy each side once into this folder")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="trl-dpo-bench-"))
    build_benchmark_llama(root / "model")
    (root / "pairs").mkdir()
    write_pairs(root / "pairs" / "train.jsonl", args.pairs, seed=0)
    source = (Path(trl.__file__).parent / "scripts" / "dpo.py").read_text()
    if ORIGINAL_IMPORT not in source:
        raise SystemExit("trl's dpo.py changed its import line")
    (root / "dpo_trl.py").write_text(source.replace(ORIGINAL_IMPORT, ORIGINAL_IMPORT + PROBE))
    (root / "dpo_trainbridge.py").write_text(source.replace(ORIGINAL_IMPORT, PORTED_IMPORT + PROBE))
    shutil.copy(Path(__file__).with_name("script_probe.py"), root / "script_probe.py")
    port = 29700 + os.getpid() % 200 * 10
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
        for name in args.only:
            port += 1
            stacks = args.profile / f"dpo-{name}.txt"
            run(root, CONFIGS[name], args.steps, port, profile=stacks)
            (args.profile / f"dpo-{name}-top.txt").write_text(top_functions(stacks))
            print(f"{name}: profile in {stacks}", flush=True)
        return
    before = load()
    results: dict[str, list[dict[str, float]]] = {name: [] for name in args.only}
    for _ in range(args.repeats):
        for name in args.only:
            port += 1
            results[name].append(run(root, CONFIGS[name], args.steps, port))
            r = results[name][-1]
            print(
                f"{name}: {r['per_s']:.2f} pairs/s, {r['per_cpu_s']:.2f} pairs/CPU-s, {r['peak_rss_mib']:.0f} MiB",
                flush=True,
            )
    print(f"\n{args.steps} steps, {PER_DEVICE * RANKS} pairs per step, {RANKS} gloo ranks, trl {trl.__version__}")
    print(f"load average before: {before}; after: {load()}")
    print("\n".join(summary(results, [("trainbridge", "trl")], "pairs")))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
