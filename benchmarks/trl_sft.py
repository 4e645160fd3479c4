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
import ast
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import trl

from script_probe import load, measure, pyspy_prefix, summary, top_functions
from trainbridge.demos.tiny_model import build_benchmark_llama, write_chat_dataset

ORIGINAL_IMPORT = "    from trl import SFTTrainer, get_dataset, get_peft_config, get_quantization_config\n"
PORTED_IMPORT = (
    "    from trainbridge import SFTTrainer\n"
    "    from trl import get_dataset, get_peft_config, get_quantization_config\n"
)
PROBE = "    import script_probe\n\n    script_probe.wrap(SFTTrainer)\n"
RANKS = 2
PER_DEVICE = 8
CONFIGS = {
    "trl padded": ("sft_trl.py", []),
    "trl packing (bfd)": ("sft_trl.py", ["--packing", "true"]),
    "trainbridge": ("sft_trainbridge.py", []),
    "trainbridge packing (bfd)": ("sft_trainbridge.py", ["--packing", "true"]),
}


def run(
    root: Path, script: str, extra: list[str], steps: int, port: int, profile: Path | None = None
) -> dict[str, float]:
    out = root / f"out-{port}"
    command = [
        *([] if profile is None else pyspy_prefix(profile)),
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={port}",
        str(root / script),
        "--model_name_or_path",
        str(root / "model"),
        "--dataset_name",
        str(root / "data"),
        "--output_dir",
        str(out),
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
        "128",
        "--dtype",
        "float32",
        "--disable_tqdm",
        "true",
        "--gradient_checkpointing",
        "false",
        "--learning_rate",
        "1e-4",
        *extra,
    ]
    probes = root / f"probes-{port}"
    probes.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BENCH_PROBE_DIR": str(probes)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=root, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{script} {extra} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    printed = [
        ast.literal_eval(line[line.index("{") : line.rindex("}") + 1])  # the printed log dicts
        for line in done.stdout.splitlines() + done.stderr.splitlines()
        if line.lstrip().startswith("{'")
    ]
    runtime = next(float(m["train_runtime"]) for m in printed if "train_runtime" in m)
    if (out / "metrics.jsonl").is_file():  # trainbridge
        tokens = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1]).get("tokens_seen")
        tokens = tokens or max(json.loads(line).get("tokens_seen", 0) for line in (out / "metrics.jsonl").open())
    else:
        tokens = next(float(m["num_tokens"]) for m in printed if "num_tokens" in m)
    return measure(float(tokens), runtime, probes, RANKS)


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
    source = (Path(trl.__file__).parent / "scripts" / "sft.py").read_text()
    (root / "sft_trl.py").write_text(source.replace(ORIGINAL_IMPORT, ORIGINAL_IMPORT + PROBE))
    (root / "sft_trainbridge.py").write_text(source.replace(ORIGINAL_IMPORT, PORTED_IMPORT + PROBE))
    shutil.copy(Path(__file__).with_name("script_probe.py"), root / "script_probe.py")
    port = 29600 + os.getpid() % 200 * 10
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
        for name in args.only:
            port += 1
            script, extra = CONFIGS[name]
            stacks = args.profile / f"sft-{name.replace(' ', '_')}.txt"
            run(root, script, extra, args.steps, port, profile=stacks)
            stacks.with_name(stacks.stem + "-top.txt").write_text(top_functions(stacks))
            print(f"{name}: profile in {stacks}", flush=True)
        return
    before = load()
    results: dict[str, list[dict[str, float]]] = {name: [] for name in args.only}
    for _ in range(args.repeats):
        for name in args.only:
            port += 1
            script, extra = CONFIGS[name]
            results[name].append(run(root, script, extra, args.steps, port))
            r = results[name][-1]
            print(f"{name}: {r['per_s']:.0f} tokens/s, {r['per_cpu_s']:.0f} tokens/CPU-s, {r['peak_rss_mib']:.0f} MiB")
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
