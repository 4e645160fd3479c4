"""The bare DDP loop: the floor any training framework is measured against.

    torchrun --nproc_per_node=2 benchmarks/bare_ddp.py --model DIR --data FILE.jsonl --out DIR --steps 40

Plain ``torch.nn.parallel.DistributedDataParallel`` (gloo on CPU, defaults: no unused-parameter
search, buffers broadcast), ``torch.optim.AdamW(fused=True)`` (the kernel Trainer's default
``adamw_torch_fused`` and trainbridge's DDP engine use), gradient clipping to 1.0 (the same arithmetic as
the Trainer and trainbridge runs), no scheduler, no logging, no callbacks.  The batches are built
before the loop: rank ``r`` takes samples ``r, r + 2, ...`` four at a time, so every step is 4 x
``len`` tokens per rank (the data must be fixed-length).  Rank ``r`` writes ``clock-rank{r}.json``
(step end wall and CPU times and its tokens per step) to ``--out``; with ``BENCH_PROFILE=1`` (``throughput.py
--profile``) rank 0 also writes ``profile-rank0.pstats``: cProfile of the step loop, as ``trainer_run.py``'s
``StepClock`` profiles Trainer's and trainbridge's steps.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import json
import os
import resource
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModelForCausalLM

SAMPLES_PER_RANK = 4
"""Rows of every batch on every rank."""


def rank_batches(path: Path, rank: int, world_size: int, steps: int) -> list[torch.Tensor]:
    """This rank's ``[SAMPLES_PER_RANK, len]`` input batches for ``steps`` steps (fixed-length samples)."""
    rows = [json.loads(line)["input_ids"] for line in path.read_text().splitlines() if line]
    needed = steps * SAMPLES_PER_RANK * world_size
    if len(rows) < needed:
        raise ValueError(f"{path}: {len(rows)} samples, {steps} steps x {world_size} ranks need {needed}")
    if len({len(row) for row in rows[:needed]}) != 1:
        raise ValueError(f"{path}: bare_ddp.py needs fixed-length samples")
    mine = rows[rank:needed:world_size]
    return [torch.tensor(mine[i : i + SAMPLES_PER_RANK]) for i in range(0, len(mine), SAMPLES_PER_RANK)]


def main(argv: Sequence[str] | None = None) -> None:
    """Train ``--steps`` optimizer steps with the bare loop and write this rank's clock."""
    parser = argparse.ArgumentParser(prog="bare_ddp.py", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    options = parser.parse_args(argv)

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(options.seed)
    batches = rank_batches(options.data, rank, world_size, options.steps)
    model = DistributedDataParallel(AutoModelForCausalLM.from_pretrained(options.model, dtype=torch.float32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=options.learning_rate, fused=True)
    step_end_times: list[float] = []
    step_end_cpu_times: list[float] = []
    profiler = cProfile.Profile() if os.environ.get("BENCH_PROFILE") == "1" and rank == 0 else None
    if profiler is not None:
        profiler.enable()
    for input_ids in batches:
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_end_times.append(time.time())
        step_end_cpu_times.append(time.process_time())
    if profiler is not None:
        profiler.disable()
        options.out.mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(options.out / "profile-rank0.pstats")
    # Same record as trainer_run.write_clock (not imported: that module pulls in transformers.Trainer,
    # which would lengthen this runner's start-up).
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / f"clock-rank{rank}.json").write_text(
        json.dumps(
            {
                "rank": rank,
                "step_end_times": step_end_times,
                "step_end_cpu_times": step_end_cpu_times,
                "local_tokens": [int(batch.numel()) for batch in batches],
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
        )
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
