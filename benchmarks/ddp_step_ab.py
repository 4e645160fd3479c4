"""A/B of DDP step settings on the benchmark model, interleaved in one torchrun: CPU time per step by arm.

    python benchmarks/ddp_step_ab.py [--steps 8] [--rounds 6] [--arms bare tb tb_static ...]
    python benchmarks/ddp_step_ab.py --data variable --arms trainer padded tb tb_no_allreduce

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

``--data variable`` (``throughput.py``'s variable case: 8 samples a step, lengths uniform in 32..128) gives each
step's same 8 samples to every arm: ``tb`` arms as trainbridge plans them (tokens balanced over ranks, one
packed row per rank, per-sample sdpa), ``padded`` and ``trainer`` as a ``DistributedSampler`` and
``DataCollatorForLanguageModeling`` do (samples ``r, r + 2, ...`` of the step, right-padded to the rank's
longest, labels to the model); ``trainer`` is ``padded`` under Trainer's DDP default for a model without
gradient checkpointing (``find_unused_parameters=True``).  ``tb_no_allreduce`` is ``tb`` without the gradient
all-reduce (``no_sync``: its loss is not a training result), which measures the all-reduce's share.  Each step is
timed by phase (forward, backward with DDP's all-reduce, clip, optimizer with ``zero_grad``), and rank 0 prints
the tokens each side computes on: real tokens against padded positions, mean over ranks and the larger rank's.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import random
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

SAMPLES, LENGTH, VOCAB_FIRST, VARIABLE_MIN = 4, 128, 4, 32


@dataclass(frozen=True)
class Arm:
    """One configuration of the step."""

    name: str
    trainbridge: bool = True
    ddp: dict[str, Any] = field(default_factory=dict)
    one_group: bool = False
    set_to_none: bool = True
    padded: bool = False
    """Padded batches with an attention mask and labels to the model (``bare`` on fixed-length data is the same)."""
    allreduce: bool = True


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
        Arm("padded", trainbridge=False, padded=True),
        Arm("trainer", trainbridge=False, padded=True, ddp={"find_unused_parameters": True}),
        Arm("tb_no_allreduce", allreduce=False),
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
            self.module: Any = DistributedDataParallel(model, **arm.ddp)
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

    def step(self, batches: Batches, phases: dict[str, list[float]]) -> None:
        """One optimizer step on this rank's batch of ``batches`` (the arm's layout), timing each phase."""
        marks = [time.process_time()]
        if not self.arm.trainbridge:
            loss = self.module(**batches.padded).loss
            marks.append(time.process_time())
            loss.backward()
            self.losses.append(float(loss.detach()))
        else:
            from trainbridge.data.loss import token_loss_sum
            from trainbridge.modeling import sample_segments

            world = dist.get_world_size()
            sync = contextlib.nullcontext() if self.arm.allreduce else self.module.no_sync()
            with sync:
                with sample_segments(batches.packed):
                    loss_sum = token_loss_sum(self.module, batches.packed, num_tokens=batches.loss_tokens)[0]
                marks.append(time.process_time())
                (loss_sum * (world / batches.loss_tokens)).backward()
            self.losses.append(float(loss_sum.detach()) * world / batches.loss_tokens)
        marks.append(time.process_time())
        self.clip()
        marks.append(time.process_time())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=self.arm.set_to_none)
        marks.append(time.process_time())
        for phase, start, end in zip(PHASES, marks[:-1], marks[1:], strict=True):
            phases.setdefault(phase, []).append(end - start)


PHASES = ("forward", "backward", "clip", "optimizer")
"""What ``Runner.step`` times: the backward includes DDP's all-reduce, the optimizer its ``zero_grad``."""


@dataclass(frozen=True)
class Batches:
    """One rank's batch of one step in both layouts: trainbridge's packed row and the padded batch."""

    packed: dict[str, Any]
    padded: dict[str, torch.Tensor]
    loss_tokens: int
    """The step's loss tokens over every rank (trainbridge's normaliser)."""
    tokens: int
    """This rank's real tokens in ``packed``."""
    positions: int
    """This rank's positions in ``padded`` (padding included)."""


def step_batches(samples: list[list[int]], rank: int, world: int) -> Batches:
    """This rank's share of one step's ``samples`` (token ids) in trainbridge's layout (``plan_epoch``'s
    balanced ranks, ``collate_padding_free``) and in a ``DistributedSampler``'s (samples ``rank::world``,
    right-padded to the longest, ``-100`` labels on padding)."""
    from trainbridge.data.collate import collate_padding_free
    from trainbridge.data.plan import plan_epoch
    from trainbridge.data.types import Sample

    lengths = [len(ids) for ids in samples]
    plan = plan_epoch(
        lengths,
        [n - 1 for n in lengths],
        effective_batch_size=len(samples),
        world_size=world,
        max_batch_len=sum(lengths),
        seed=0,
        epoch=0,
        padded=False,
        shuffle=False,
    )
    step = plan.steps[0]
    mine = [samples[i] for micro in step.micro_batches[rank] for i in micro]
    packed = collate_padding_free([Sample(tuple(ids), tuple(ids)) for ids in mine])
    rows = samples[rank::world]
    width = max(len(ids) for ids in rows)
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for row, ids in enumerate(rows):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        mask[row, : len(ids)] = 1
    padded = {"input_ids": input_ids, "labels": input_ids.masked_fill(mask == 0, -100)}
    if len(set(lengths)) > 1:  # equal lengths: no mask, as bare_ddp.py's batches
        padded["attention_mask"] = mask
    return Batches(packed, padded, step.loss_tokens, sum(len(ids) for ids in mine), len(rows) * width)


def all_batches(kind: str, steps: int, rank: int, world: int) -> list[Batches]:
    """Every step's batches of this rank: ``fixed`` (``SAMPLES`` x ``LENGTH`` per rank) or ``variable``
    (``SAMPLES * world`` samples a step, lengths uniform in ``VARIABLE_MIN``..``LENGTH``), the same on every rank."""
    rng = random.Random(1)
    batches = []
    for _ in range(steps):
        count = SAMPLES * world
        lengths = [LENGTH] * count if kind == "fixed" else [rng.randint(VARIABLE_MIN, LENGTH) for _ in range(count)]
        samples = [[rng.randrange(VOCAB_FIRST, 76) for _ in range(n)] for n in lengths]
        batches.append(step_batches(samples, rank, world))
    return batches


def main(argv: Sequence[str] | None = None) -> int:
    """Parent: build the model and start torchrun on this file; worker (``--worker``): run the arms."""
    parser = argparse.ArgumentParser(prog="ddp_step_ab.py", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="steps per arm per round (the first is not counted)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--arms", nargs="*", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--data", choices=["fixed", "variable"], default="fixed")
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
        f"--data={options.data}",
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
    data = all_batches(options.data, options.steps * options.rounds, rank, world)
    cpu: dict[str, dict[str, list[float]]] = {r.arm.name: {} for r in runners}
    wall: dict[str, list[float]] = {r.arm.name: [] for r in runners}
    for round_index in range(options.rounds):
        for runner in runners:
            for k in range(options.steps):
                dist.barrier()
                phases: dict[str, list[float]] = {}
                w0 = time.perf_counter()
                runner.step(data[round_index * options.steps + k], phases)
                if k:
                    for phase, seconds in phases.items():
                        cpu[runner.arm.name].setdefault(phase, []).extend(seconds)
                    wall[runner.arm.name].append(time.perf_counter() - w0)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, cpu)
    sizes: list[Any] = [None] * world
    dist.all_gather_object(sizes, [(b.tokens, b.positions) for b in data])
    if rank == 0:
        report(options.arms, gathered, wall, {r.arm.name: r.losses[-1] for r in runners}, sizes)
    dist.destroy_process_group()
    return 0


def report(
    arms: list[str],
    gathered: list[dict[str, dict[str, list[float]]]],
    wall: dict[str, list[float]],
    losses: dict[str, float],
    sizes: list[list[tuple[int, int]]],
) -> None:
    """Rank 0's table: per arm the median CPU ms of each phase and of the step (both ranks' steps pooled),
    the wall ms per step, both as ratios to the first arm, and the arm's last loss."""

    def median_ms(name: str, phase: str | None) -> float:
        per_step = [
            sum(values[i] for key, values in g[name].items() if phase in (None, key))
            for g in gathered
            for i in range(len(g[name]["forward"]))
        ]
        return statistics.median(per_step) * 1e3

    first = arms[0]
    cpu0, wall0 = median_ms(first, None), statistics.median(wall[first]) * 1e3
    header = " ".join(f"{phase:>9}" for phase in PHASES)
    print(f"CPU ms per step by phase (median, both ranks); ratios: {first} / arm")
    print(f"{'arm':16} {header} {'CPU ms':>8} {'ratio':>6} {'wall ms':>8} {'ratio':>6}  last loss")
    for name in arms:
        phases = " ".join(f"{median_ms(name, phase):9.1f}" for phase in PHASES)
        c, w = median_ms(name, None), statistics.median(wall[name]) * 1e3
        print(f"{name:16} {phases} {c:8.1f} {cpu0 / c:6.3f} {w:8.1f} {wall0 / w:6.3f}  {losses[name]:.6f}")
    tokens = [sum(rank[k][0] for rank in sizes) for k in range(len(sizes[0]))]
    positions = [sum(rank[k][1] for rank in sizes) for k in range(len(sizes[0]))]
    top_tokens = sum(max(rank[k][0] for rank in sizes) for k in range(len(sizes[0])))
    top_positions = sum(max(rank[k][1] for rank in sizes) for k in range(len(sizes[0])))
    print(
        f"padded positions / real tokens: {sum(positions) / sum(tokens):.3f} over both ranks, "
        f"{top_positions / top_tokens:.3f} on the larger rank of each step"
    )


if __name__ == "__main__":
    sys.exit(main())
