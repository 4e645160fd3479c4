"""GPU benchmark: trainbridge vs ``transformers.Trainer`` on a 1B-class Llama, one command.

    python benchmarks/gpu.py --out docs/gpu.md                  # on a CUDA machine (all GPUs of the node)
    python benchmarks/gpu.py --smoke                            # CPU: tiny model, 3 steps, gloo (checks it runs)

Builds a Llama from a config (no download): ``--size 1b`` is Llama-3.2-1B's shape (hidden 2048, 16
layers, 32 heads / 8 KV heads, MLP 8192, vocabulary 128,256, untied: ~1.5B parameters), random weights,
saved with ``save_pretrained``; variable-length pre-tokenized samples (uniform 256..4096 tokens), packed
into micro-batches of ``--batch-tokens`` (4,096) tokens per GPU, bf16, one micro-batch per optimizer step.

Configurations (``--only`` picks some), each a fresh ``torchrun`` over ``--nproc`` GPUs:

- ``tb_ddp``: ``run_training``, DDP, defaults: ``mixed_precision='auto'`` (bf16),
  ``loss_implementation='auto'`` (Liger if installed, else chunked), padding-free rows with
  flash-attention kwargs
- ``tb_ddp_chunked``: the same with ``loss_implementation='chunked'`` (torch, no Liger)
- ``tb_fsdp``: ``run_training``, FSDP2 (units: embeddings, layers, norm+lm_head; reduce-scatter per
  micro-batch)
- ``trainer_flat``: ``Trainer`` (bf16, ``DataCollatorWithFlattening``, same attention kernel), batch size
  tuned to the same tokens per step, DDP
- ``trainer_flat_liger``: the same with ``use_liger_kernel=True`` (if Liger-Kernel is installed)

Measured on rank 0 (``GpuClock``, a ``TrainerCallback`` every run carries): step-end times after a
``torch.cuda.synchronize()`` (tokens/s per GPU over steps 3..N, step time p50/p95), non-padding tokens,
``torch.cuda.max_memory_allocated`` (peak memory), MFU = 6 x parameters x tokens/s per GPU / peak bf16
FLOP/s (``--peak-tflops``, 989 for an H100 SXM dense bf16), and synchronising CUDA calls per step
(``torch.cuda.set_sync_debug_mode('warn')`` warnings between step ends, minus the clock's own).
``--attn`` picks ``flash_attention_2`` (default when ``flash_attn`` is importable) or ``sdpa``.

``--smoke`` runs every configuration on CPU with 2 gloo ranks, a 2-layer 64-wide Llama, 5 steps,
sdpa, fp32: it checks the script and its runners work, it measures nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

SIZES: dict[str, dict[str, Any]] = {
    "1b": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=512,
    ),
}
CONFIGS = ("tb_ddp", "tb_ddp_chunked", "tb_fsdp", "trainer_flat", "trainer_flat_liger")
HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None
HAS_FLASH = importlib.util.find_spec("flash_attn") is not None


@dataclass
class Options:
    """The run's settings (also handed to the Trainer worker as JSON)."""

    smoke: bool
    size: str
    steps: int
    batch_tokens: int
    min_len: int
    max_len: int
    nproc: int
    attn: str
    peak_tflops: float
    workdir: str


# ----------------------------------------------------------------------------- the clock every run carries
class GpuClock(TrainerCallback):
    """Rank 0: step-end times (after a device synchronisation), tokens, peak memory, syncs per step."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir
        self.times: list[float] = []
        self.syncs: list[int] = []
        self._caught: Any = None
        self._records: list[Any] = []

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            self._caught = warnings.catch_warnings(record=True)
            self._records = self._caught.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")  # the clock's own synchronisation is not counted
            self.syncs.append(sum("synchroniz" in str(r.message) for r in self._records))
            self._records.clear()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        self.times.append(time.perf_counter())

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        peak = 0
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
            self._caught.__exit__(None, None, None)
            peak = torch.cuda.max_memory_allocated()
        rank = int(os.environ.get("RANK", "0"))
        record = {
            "times": self.times,
            "syncs": self.syncs,
            "peak_memory_bytes": peak,
            "tokens_seen": getattr(state, "num_input_tokens_seen", 0),
        }
        Path(self.out_dir).mkdir(parents=True, exist_ok=True)
        (Path(self.out_dir) / f"gpu-clock-rank{rank}.json").write_text(json.dumps(record))


# ----------------------------------------------------------------------------- assets
def build_assets(options: Options) -> tuple[Path, Path, int]:
    """The model folder, the JSONL data (enough samples for every step on every rank) and parameters."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from trainbridge.demos.tiny_model import build_tokenizer

    root = Path(options.workdir)
    model_dir = root / f"llama-{options.size}"
    if not (model_dir / "config.json").exists():
        tokenizer = build_tokenizer(model_dir)
        torch.manual_seed(0)
        config = LlamaConfig(
            **SIZES[options.size],
            tie_word_embeddings=False,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16 if not options.smoke else torch.float32)
        model.save_pretrained(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    vocab = config["vocab_size"]
    rng = random.Random(0)
    mean = (options.min_len + options.max_len) / 2
    count = int(options.steps * options.nproc * options.batch_tokens / mean * 1.3) + 8
    data = root / f"data-{options.size}-{options.min_len}-{options.max_len}-{count}.jsonl"
    if not data.exists():
        with data.open("w") as fh:
            for _ in range(count):
                ids = [rng.randrange(4, vocab) for _ in range(rng.randint(options.min_len, options.max_len))]
                fh.write(json.dumps({"input_ids": ids}) + "\n")
    parameters = sum(_parameter_counts(config).values())
    return model_dir, data, parameters


def _parameter_counts(config: dict[str, Any]) -> dict[str, int]:
    h, i, n, v = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = h // heads
    attention = h * heads * head_dim * 2 + h * kv * head_dim * 2
    return {"embeddings": v * h, "layers": n * (attention + 3 * h * i + 2 * h), "norm": h, "lm_head": v * h}


# ----------------------------------------------------------------------------- runners
def run_trainbridge(key: str, options: Options, model_dir: Path, data: Path, out: Path) -> None:
    from trainbridge import TorchrunArgs, TrainingArgs, run_training

    args = TrainingArgs(
        model_path=model_dir,
        data_path=data,
        ckpt_output_dir=out,
        max_seq_len=options.max_len,
        max_batch_len=options.batch_tokens,
        effective_batch_size=max(options.nproc, 1) * _samples_per_rank(options),
        max_steps=options.steps,
        learning_rate=1e-5,
        lr_scheduler="constant",
        seed=0,
        device="cpu" if options.smoke else "cuda",
        logging_steps=10,
        save_strategy="no",
        save_final_checkpoint=False,
        disable_tqdm=True,
        distributed_backend="fsdp" if key == "tb_fsdp" else "ddp",
        loss_implementation="chunked" if key == "tb_ddp_chunked" else "auto",
        model_kwargs={"attn_implementation": options.attn} if not options.smoke else {},
    )
    run_training(args, TorchrunArgs(nproc_per_node=options.nproc), timeout_s=3600, callbacks=[GpuClock(str(out))])


def _samples_per_rank(options: Options) -> int:
    """Samples per rank per step so that a rank's micro-batch is about ``batch_tokens`` tokens."""
    return max(1, int(options.batch_tokens / ((options.min_len + options.max_len) / 2)))


def run_trainer_worker(key: str, options: Options, model_dir: Path, data: Path, out: Path) -> None:
    """Inside torchrun: ``Trainer`` with ``DataCollatorWithFlattening`` (one packed row per rank)."""
    from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, Trainer, TrainingArguments

    rows = [json.loads(line) for line in data.read_text().splitlines() if line]
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, **({} if options.smoke else {"attn_implementation": options.attn})
    )
    training_args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=_samples_per_rank(options),
        max_steps=options.steps,
        learning_rate=1e-5,
        lr_scheduler_type="constant",
        bf16=not options.smoke,
        use_cpu=options.smoke,
        logging_steps=10,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
        dataloader_pin_memory=not options.smoke,
        use_liger_kernel=key == "trainer_flat_liger",
        include_num_input_tokens_seen=True,
        optim="adamw_torch_fused",
        remove_unused_columns=False,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=rows,
        data_collator=DataCollatorWithFlattening(return_flash_attn_kwargs=options.attn.startswith("flash")),
        callbacks=[GpuClock(str(out))],
    )
    trainer.train()


def run_config(key: str, options: Options, model_dir: Path, data: Path, out: Path) -> None:
    if key.startswith("tb_"):
        run_trainbridge(key, options, model_dir, data, out)
        return
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={options.nproc}",
        __file__,
        "--worker",
        key,
        "--options",
        json.dumps(asdict(options)),
        "--model-dir",
        str(model_dir),
        "--data",
        str(data),
        "--run-out",
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if options.smoke else dict(os.environ)
    subprocess.run(command, check=True, env=env, timeout=3600)


# ----------------------------------------------------------------------------- results
def summarise(key: str, out: Path, options: Options, parameters: int) -> dict[str, Any]:
    clock = json.loads((out / "gpu-clock-rank0.json").read_text())
    times = clock["times"]
    warmup = 2 if len(times) > 4 else 1  # the first steps include compilation / allocator warm-up
    steps = [b - a for a, b in itertools.pairwise(times)][warmup:] or [float("nan")]
    world_tokens_per_step = options.batch_tokens * options.nproc  # planned; see "tokens" for the counted
    counted = clock.get("tokens_seen") or 0
    tokens_per_s_gpu = (
        (counted / len(times) if counted else world_tokens_per_step) / statistics.median(steps) / options.nproc
    )
    syncs = clock["syncs"][warmup:] or [0]
    return {
        "key": key,
        "tokens_per_s_per_gpu": tokens_per_s_gpu,
        "mfu": 6 * parameters * tokens_per_s_gpu / (options.peak_tflops * 1e12),
        "peak_memory_gib": clock["peak_memory_bytes"] / 2**30,
        "step_p50_s": statistics.median(steps),
        "step_p95_s": sorted(steps)[max(0, round(0.95 * len(steps)) - 1)],
        "syncs_per_step": statistics.median(syncs),
    }


def report(rows: list[dict[str, Any]], options: Options, command: str) -> str:
    lines = [
        f"```\n{command}\n```",
        "",
        f"- {options.nproc} x "
        f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU rank (smoke)'}, "
        f"torch {torch.__version__}, attention {options.attn}, Liger {'yes' if HAS_LIGER else 'no'}",
        f"- Llama {options.size}, {options.steps} steps, {options.batch_tokens} tokens per micro-batch per GPU",
        "",
        "| configuration | tokens/s per GPU | MFU | peak memory (GiB) | step p50 (s) | step p95 (s) | syncs/step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['key']} | failed: {r['error']} | | | | | |")
            continue
        lines.append(
            f"| {r['key']} | {r['tokens_per_s_per_gpu']:,.0f} | {r['mfu']:.1%} | {r['peak_memory_gib']:.1f} | "
            f"{r['step_p50_s']:.3f} | {r['step_p95_s']:.3f} | {r['syncs_per_step']:g} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu.py", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, 3 steps: check that it runs")
    parser.add_argument("--size", choices=sorted(SIZES), default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch-tokens", type=int, default=None)
    parser.add_argument("--nproc", type=int, default=None, help="GPUs (default: all visible; smoke: 2 CPU ranks)")
    parser.add_argument("--attn", default=None, help="flash_attention_2 (default if installed) or sdpa")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="peak dense bf16 TFLOP/s of one GPU")
    parser.add_argument("--only", nargs="*", choices=CONFIGS, default=None)
    parser.add_argument("--workdir", default="/tmp/trainbridge-gpu-bench")
    parser.add_argument("--out", type=Path, default=None, help="append the results table to this markdown file")
    # internal: the Trainer worker under torchrun
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--options", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--data", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run-out", default=None, help=argparse.SUPPRESS)
    ns = parser.parse_args(argv)
    if ns.worker:
        run_trainer_worker(
            ns.worker, Options(**json.loads(ns.options)), Path(ns.model_dir), Path(ns.data), Path(ns.run_out)
        )
        return 0
    if not ns.smoke and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU machine, or use --smoke for the CPU check")
    options = Options(
        smoke=ns.smoke,
        size=ns.size or ("tiny" if ns.smoke else "1b"),
        steps=ns.steps or (5 if ns.smoke else 30),
        batch_tokens=ns.batch_tokens or (256 if ns.smoke else 4096),
        min_len=32 if ns.smoke else 256,
        max_len=128 if ns.smoke else 4096,
        nproc=ns.nproc or (2 if ns.smoke else torch.cuda.device_count()),
        attn=ns.attn or ("sdpa" if ns.smoke or not HAS_FLASH else "flash_attention_2"),
        peak_tflops=ns.peak_tflops,
        workdir=ns.workdir,
    )
    keys = [k for k in (ns.only or CONFIGS) if k != "trainer_flat_liger" or HAS_LIGER or ns.only]
    Path(options.workdir).mkdir(parents=True, exist_ok=True)
    model_dir, data, parameters = build_assets(options)
    print(f"model {model_dir} ({parameters / 1e9:.2f}B parameters), data {data}", flush=True)
    rows = []
    for key in keys:
        out = Path(options.workdir) / f"run-{key}-{int(time.time())}"
        print(f"== {key}", flush=True)
        try:
            run_config(key, options, model_dir, data, out)
            rows.append(summarise(key, out, options, parameters))
        except Exception as exc:  # one failed configuration is reported, the others still run
            rows.append({"key": key, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
        print(json.dumps(rows[-1]), flush=True)
    text = report(rows, options, "python " + " ".join(sys.argv))
    print(text)
    if ns.out is not None:
        with ns.out.open("a") as fh:
            fh.write("\n" + text)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
