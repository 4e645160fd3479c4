"""Memory of a LoRA run vs full fine-tuning of the same model: optimizer-state bytes and peak RSS.

    python benchmarks/peft_memory.py [--steps 10] [--hidden 512] [--layers 8] [--out docs/benchmarks.md]

Each configuration runs in its own fresh process (so peak RSS is that run's alone): the real
``build_run`` + ``TrainingLoop`` on one rank (world size 1: what each DDP rank holds; FSDP2/ZeRO shard
it further), fp32 weights, AdamW, ``--steps`` optimizer steps of 4 x 128-token samples.  Measured:
trainable parameters; optimizer-state bytes (every tensor in ``optimizer.state``, after the run);
resident memory after the build (model loaded and wrapped, before the first step); peak RSS of the
process (``ru_maxrss``); and the wall time per step.  Nothing passes or fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {
    "full": {},
    "lora": {"peft_config": {"r": 16, "lora_alpha": 32, "target_modules": "all-linear", "lora_dropout": 0.0}},
    "lora_gc": {
        "peft_config": {"r": 16, "lora_alpha": 32, "target_modules": "all-linear", "lora_dropout": 0.0},
        "gradient_checkpointing": True,
    },
}
BEGIN, END = (
    "<!-- peft memory results: begin (written by benchmarks/peft_memory.py) -->",
    "<!-- peft memory results: end -->",
)


def child(config: str, workdir: Path, steps: int) -> dict:
    """One run in this process; returns the measurements."""
    import psutil
    import torch

    from trainbridge.core.config import RunPlan, TrainingArgs
    from trainbridge.core.distributed import DistributedEnv
    from trainbridge.loop.build import build_run
    from trainbridge.loop.loop import TrainingLoop

    torch.set_num_threads(1)
    args = TrainingArgs(
        model_path=workdir / "model",
        data_path=workdir / "train.jsonl",
        ckpt_output_dir=workdir / f"out-{config}",
        max_seq_len=128,
        max_batch_len=512,
        effective_batch_size=4,
        max_steps=steps,
        learning_rate=1e-4,
        lr_scheduler="constant",
        save_strategy="no",
        save_final_checkpoint=False,
        disable_tqdm=True,
        **CONFIGS[config],
    )
    env = DistributedEnv()
    components = build_run(args, RunPlan(), env)
    rss_built = psutil.Process().memory_info().rss
    start = time.perf_counter()
    TrainingLoop(args, env, [], components).run()
    seconds = time.perf_counter() - start
    engine = components.engine
    optimizer_bytes = sum(
        t.numel() * t.element_size()
        for state in engine.optimizer.state.values()
        for t in state.values()
        if torch.is_tensor(t)
    )
    model = engine.unwrapped
    return {
        "config": config,
        "parameters": sum(p.numel() for p in model.parameters()),
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "optimizer_state_bytes": optimizer_bytes,
        "rss_after_build_bytes": rss_built,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "seconds_per_step": seconds / steps,
    }


def build_assets(workdir: Path, hidden: int, layers: int, steps: int) -> None:
    from trainbridge.demos.tiny_model import build_tiny_llama

    build_tiny_llama(
        workdir / "model",
        hidden_size=hidden,
        num_layers=layers,
        num_heads=8,
        intermediate_size=hidden * 11 // 4,
        max_position_embeddings=256,
    )
    import random

    rng = random.Random(0)
    with (workdir / "train.jsonl").open("w") as handle:
        for _ in range(4 * steps):
            handle.write(json.dumps({"input_ids": [rng.randrange(4, 70) for _ in range(128)]}) + "\n")


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f}"


def report(results: list[dict], command: str, hidden: int, layers: int, steps: int) -> str:
    import torch
    import transformers

    full = next(r for r in results if r["config"] == "full")
    lines = [
        "```",
        command,
        "```",
        "",
        f"- date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} CPU cores, "
        f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}",
        f"- Llama, hidden {hidden}, {layers} layers, {full['parameters']:,} parameters, fp32, AdamW; one rank; "
        f"{steps} steps of 4 x 128 tokens; each configuration in a fresh process",
        "",
        "| run | trainable params | optimizer state (MiB) | RSS after build (MiB) | peak RSS (MiB) | s/step |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['config']} | {r['trainable']:,} ({100 * r['trainable'] / r['parameters']:.2f}%) | "
            f"{mib(r['optimizer_state_bytes'])} | {mib(r['rss_after_build_bytes'])} | {mib(r['peak_rss_bytes'])} | "
            f"{r['seconds_per_step']:.3f} |"
        )
    lora = next(r for r in results if r["config"] == "lora")
    gc = next((r for r in results if r["config"] == "lora_gc"), None)
    lines += [
        "",
        f"Optimizer state: LoRA holds {lora['optimizer_state_bytes'] / max(full['optimizer_state_bytes'], 1):.2%} "
        f"of full fine-tuning's ({mib(lora['optimizer_state_bytes'])} vs {mib(full['optimizer_state_bytes'])} MiB): "
        f"AdamW keeps 2 fp32 tensors per trainable parameter, 8 bytes x {lora['trainable']:,} = "
        f"{mib(8 * lora['trainable'])} MiB, and nothing for the frozen base.",
        "",
        f"Peak RSS: {mib(lora['peak_rss_bytes'])} (LoRA) vs {mib(full['peak_rss_bytes'])} MiB (full), "
        f"{mib(full['peak_rss_bytes'] - lora['peak_rss_bytes'])} MiB less.  Much of the peak is activations, alive "
        "at the end of a forward pass (gradients replace them during the backward pass), so the difference is "
        "roughly the AdamW moments of the base weights, less the extra activations of the LoRA layers."
        + (f"  With gradient checkpointing the LoRA run peaks at {mib(gc['peak_rss_bytes'])} MiB." if gc else ""),
        "",
        "s/step is wall time on 2 CPU cores shared with other work while this ran: not a speed comparison.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tb-peft-memory"))
    parser.add_argument("--out", type=Path, default=None, help="Markdown file whose results section is replaced")
    parser.add_argument("--child", choices=sorted(CONFIGS), help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        print(json.dumps(child(options.child, options.workdir, options.steps)))
        return
    options.workdir.mkdir(parents=True, exist_ok=True)
    build_assets(options.workdir, options.hidden, options.layers, options.steps)
    results = []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    for config in CONFIGS:
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--child",
                config,
                "--workdir",
                str(options.workdir),
                "--steps",
                str(options.steps),
            ],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
        print(results[-1], flush=True)
    command = "python benchmarks/peft_memory.py " + " ".join(sys.argv[1:])
    text = report(results, command.strip(), options.hidden, options.layers, options.steps)
    print(text)
    if options.out is not None:
        doc = options.out.read_text() if options.out.exists() else ""
        section = f"{BEGIN}\n\n{text}\n\n{END}"
        if BEGIN in doc and END in doc:
            doc = doc[: doc.index(BEGIN)] + section + doc[doc.index(END) + len(END) :]
        else:
            doc = doc.rstrip() + "\n\n## PEFT memory: LoRA vs full fine-tuning\n\n" + section + "\n"
        options.out.write_text(doc)


if __name__ == "__main__":
    main()
