"""How long a checkpoint save blocks training, synchronous vs ``checkpoint_async``, and what it writes.

One process (no process group: the loop's world-size-1 path), a Llama built from a config (``--hidden``,
``--layers``; fp32 parameters whose folder records bf16, as a bf16 hub checkpoint loaded for fp32
training), AdamW state after one step.  For each mode it times ``CheckpointManager.begin_save`` (what the
training thread waits for) and ``finish_save`` (waiting for the background write, then publishing), and
reports the sizes of ``model.safetensors``, ``dcp/`` and ``optimizer.pt`` (in ``dcp/`` when written in the
background).  It measures; it never passes or fails.

    python benchmarks/checkpoint_save.py [--hidden 512] [--layers 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from trainbridge.checkpoint.manager import CheckpointManager
from trainbridge.core.config import TrainingArgs
from trainbridge.core.distributed import DistributedEnv
from trainbridge.parallel.build import build_engine


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="tb-ckpt-bench-"))
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=options.hidden,
        intermediate_size=options.hidden * 4,
        num_hidden_layers=options.layers,
        num_attention_heads=8,
        num_key_value_heads=8,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(root / "model")
    data = root / "data.jsonl"
    data.write_text('{"input_ids": [1, 2, 3]}\n')
    args = TrainingArgs(model_path=root / "model", data_path=data, ckpt_output_dir=root / "out", device="cpu")
    model = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32)
    engine = build_engine(model, args, DistributedEnv(), total_steps=10)
    ids = torch.randint(0, 32000, (1, 64))
    engine.module(input_ids=ids, labels=ids).loss.backward()
    engine.optimizer_step()
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.1f}M parameters, fp32 training, export bf16 (the folder's dtype)")
    manager = CheckpointManager(
        args.ckpt_output_dir, DistributedEnv(), save_total_limit=None, weights_dtype=torch.bfloat16, checksums=False
    )
    step = 0
    for mode in ("sync", "async"):
        blocked, total = [], []
        for _ in range(options.repeats):
            step += 1
            start = time.perf_counter()
            pending = manager.begin_save(engine, None, step, {"global_step": step}, background=mode == "async")
            blocked.append(time.perf_counter() - start)
            path = manager.finish_save(pending)
            total.append(time.perf_counter() - start)
        optimizer_file = path / "optimizer.pt"
        print(
            f"{mode:5s}: training blocked {statistics.median(blocked):.2f} s (median of {options.repeats}; "
            f"min {min(blocked):.2f}), whole save {statistics.median(total):.2f} s; "
            f"model.safetensors {(path / 'model.safetensors').stat().st_size / 2**20:.0f} MiB, "
            f"dcp/ (optimizer state in it for async) {folder_bytes(path / 'dcp') / 2**20:.0f} MiB, optimizer.pt "
            f"{optimizer_file.stat().st_size / 2**20 if optimizer_file.exists() else 0:.0f} MiB"
        )
    print(f"load average: {Path('/proc/loadavg').read_text().strip()}")


if __name__ == "__main__":
    main()
