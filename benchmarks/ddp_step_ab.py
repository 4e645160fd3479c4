"""A/B of DDP step settings on the benchmark model, interleaved in one torchrun: CPU time per step by arm.

    python benchmarks/ddp_step_ab.py [--steps 8] [--rounds 6] [--arms bare tb tb_static ...]

Wall-clock ratios of whole runs move 10-15 % on a shared 2-core machine; this measures the step alone.
Each arm is its own copy of the 3.2M-parameter benchmark Llama (same seed, same weights) in its own
``DistributedDataParallel`` with its own optimizer, trained on the same fixed-length batches (4 x 128 tokens
per rank). Rounds run every arm ``--steps`` steps in turn, so a slow phase of the machine hits every arm;
each step records this process's CPU seconds (``time.process_time``: every thread, gloo's included) and wall
seconds. Rank 0 prints each arm's median over all steps but each block's first, the ratio to ``bare``,
and each arm's loss after its last step (the arms train the same model on the same data, so the exact ones
agree with ``bare`` to float32 rounding).

Arms: ``bare`` is ``bare_ddp.py``'s loop (DDP defaults, one fused AdamW group, torch's clip, labels to the
model); ``tb`` is trainbridge's DDP engine step (``parallel.ddp``: ``gradient_as_bucket_view``, no forward
buffer broadcast, the two weight-decay groups, the CPU clip; ``data.loss.token_loss_sum``); the others are
``tb`` with one setting changed (see ``ARMS``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

SAMPLES, LENGTH, VOCAB_FIRST = 4, 128, 4


@dataclass(frozen=True)
class Arm:
    """One configuration of the step."""

    name: str
    trainbridge: bool = True
    ddp: dict[str, Any] = field(default_factory=dict)
    one_group: bool = False
    set_to_none: bool = True


ARMS = {
    arm.name: arm
    for arm in (
        Arm("bare", trainbridge=False),
        Arm("tb"),
        Arm("tb_static", ddp={"static_graph": True}),  # not a default: with no_sync (pytorch#187732)
        Arm("tb_one_bucket", ddp={"bucket_cap_mb": 64}),
        Arm("tb_one_group", one_group=True),
        Arm("tb_zero_fill", set_to_none=False),
        Arm("tb_batched_copy", ddp={"batched_grad_copy": True}),
        Arm("tb_all", ddp={"static_graph": True, "bucket_cap_mb": 64}, one_group=True),
    )
}


class Runner:
    """One arm's model, wrapper, optimizer and step."""

    def __init__(self, arm: Arm, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        from trainbridge.parallel.ddp import _DDP, clip_cpu_grads
        from trainbridge.parallel.optim import decay_parameter_names

        self.arm = arm
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.losses: list[float] = []
        if not arm.trainbridge:
            self.module: Any = DistributedDataParallel(model)
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
            self.clip: Callable[[], Any] = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            return
        from trainbridge.modeling import enable_varlen_sdpa

        enable_varlen_sdpa(model, LENGTH)
        options = {"find_unused_parameters": False, "forward_sync_buffers": False, **arm.ddp}
        self.module = _DDP(model, gradient_as_bucket_view=True, **options)
        decay = decay_parameter_names(model)
        named = [(n, p) for n, p in model.named_parameters()]
        groups = (
            [{"params": [p for _, p in named], "weight_decay": 0.0}]
            if arm.one_group
            else [
                {"params": [p for n, p in named if n in decay], "weight_decay": 0.0},
                {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
            ]
        )
        self.optimizer = torch.optim.AdamW(groups, lr=1e-4, fused=True)
        params = list(model.parameters())
        self.clip = lambda: clip_cpu_grads(params, 1.0)

    def step(self, input_ids: torch.Tensor) -> None:
        """One optimizer step on ``input_ids`` ``[SAMPLES, LENGTH]``."""
        if not self.arm.trainbridge:
            loss = self.module(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
            self.losses.append(float(loss.detach()))
        else:
            from trainbridge.data.loss import token_loss_sum
            from trainbridge.modeling import sample_segments

            labels = input_ids.clone()
            labels[:, 0] = -100
            batch = {"input_ids": input_ids, "labels": labels}
            tokens = SAMPLES * (LENGTH - 1) * dist.get_world_size()
            with sample_segments(batch):
                loss_sum = token_loss_sum(self.module, batch, num_tokens=tokens // dist.get_world_size())[0]
            (loss_sum * (dist.get_world_size() / tokens)).backward()
            self.losses.append(float(loss_sum.detach()) / (tokens / dist.get_world_size()))
        self.clip()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=self.arm.set_to_none)


def main(argv: Sequence[str] | None = None) -> int:
    """Parent: build the model and start torchrun on this file; worker (``--worker``): run the arms."""
    parser = argparse.ArgumentParser(prog="ddp_step_ab.py", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="steps per arm per round (the first is not counted)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--arms", nargs="*", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.worker is None:
        return launch(options)
    return work(options)


def launch(options: argparse.Namespace) -> int:
    """Build the model once and run the worker under 2 gloo ranks (``OMP_NUM_THREADS=1`` each)."""
    import subprocess

    from trainbridge.demos.tiny_model import build_benchmark_llama
    from trainbridge.launch.launcher import free_port

    folder = Path(tempfile.mkdtemp(prefix="ddp-ab-"))
    model = build_benchmark_llama(folder / "model", seed=0)
    os.environ.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node=2",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        __file__,
        "--worker",
        str(model),
        f"--steps={options.steps}",
        f"--rounds={options.rounds}",
        "--arms",
        *options.arms,
    ]
    code = subprocess.run(command).returncode
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    return code


def work(options: argparse.Namespace) -> int:
    """Every arm ``--steps`` steps per round, ``--rounds`` rounds; rank 0 prints the medians."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    runners = [Runner(ARMS[name], options.worker) for name in options.arms]
    generator = torch.Generator().manual_seed(1)
    total = options.steps * options.rounds
    data = torch.randint(VOCAB_FIRST, 76, (total, world, SAMPLES, LENGTH), generator=generator)
    cpu: dict[str, list[float]] = {r.arm.name: [] for r in runners}
    wall: dict[str, list[float]] = {r.arm.name: [] for r in runners}
    for round_index in range(options.rounds):
        for runner in runners:
            for k in range(options.steps):
                dist.barrier()
                c0, w0 = time.process_time(), time.perf_counter()
                runner.step(data[round_index * options.steps + k, rank])
                if k:
                    cpu[runner.arm.name].append(time.process_time() - c0)
                    wall[runner.arm.name].append(time.perf_counter() - w0)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, cpu)
    if rank == 0:
        reference = {"cpu": statistics.median([x for g in gathered for x in g["bare"]]) if "bare" in cpu else None}
        reference["wall"] = statistics.median(wall["bare"]) if "bare" in wall else None
        print(f"{'arm':18} {'CPU ms/step (both ranks)':>25} {'vs bare':>8} {'wall ms':>8} {'vs bare':>8}  last loss")
        for runner in runners:
            name = runner.arm.name
            c = statistics.median([x for g in gathered for x in g[name]])
            w = statistics.median(wall[name])
            rc = f"{reference['cpu'] / c:.3f}" if reference["cpu"] else "-"
            rw = f"{reference['wall'] / w:.3f}" if reference["wall"] else "-"
            print(f"{name:18} {c * 1e3:25.1f} {rc:>8} {w * 1e3:8.1f} {rw:>8}  {runner.losses[-1]:.6f}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
