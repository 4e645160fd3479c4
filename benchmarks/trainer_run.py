"""``transformers.Trainer`` benchmark worker, launched by ``benchmarks/throughput.py`` under torchrun.

    torchrun --nproc_per_node=2 benchmarks/trainer_run.py --model DIR --data FILE.jsonl --out DIR \
        --steps 40 --collator padding|flattening [--tuned]

Trains the model on pre-tokenized JSONL (``input_ids`` per line) with a stock ``Trainer`` on CPU
(``use_cpu=True``, gloo DDP set up by accelerate), 4 samples per rank per optimizer step, no gradient
accumulation, ``report_to="none"``, no checkpoints, a log every 10 steps.

``--collator padding`` is what users write for causal-LM fine-tuning,
``DataCollatorForLanguageModeling(tokenizer, mlm=False)``: pad to the longest row of the batch, labels
are the inputs with ``-100`` on padding.  ``--collator flattening`` is
``DataCollatorWithFlattening`` (one packed row with restarting ``position_ids``, no padding).
``--tuned`` sets ``ddp_find_unused_parameters=False`` and ``dataloader_pin_memory=False``.

This module also defines ``StepClock``, the ``TrainerCallback`` every Trainer and trainbridge run of the
benchmark carries (so trainbridge runs with a real HF callback attached, driven by its adapter).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    DataCollatorWithFlattening,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

LOGGING_STEPS = 10
"""Every runner that logs (Trainer, trainbridge) logs every this many steps."""
PROFILE_ENV = "BENCH_PROFILE"
"""When this environment variable is ``1``, ``StepClock`` runs cProfile on rank 0 from train begin to
train end and writes ``profile-rank0.pstats`` next to the clock (for diagnosis; it slows the run)."""


def clock_file(out_dir: str | Path, rank: int) -> Path:
    """Where rank ``rank`` of a run writes its step clock (``clock-rank{rank}.json``)."""
    return Path(out_dir) / f"clock-rank{rank}.json"


def write_clock(out_dir: str | Path, rank: int, record: dict[str, Any]) -> None:
    """Write one rank's clock record (step end times, token counts) as JSON."""
    path = clock_file(out_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))


class StepClock(TrainerCallback):
    """Records ``time.time()`` and ``time.process_time()`` at every ``on_step_end`` and the run's token
    counters; every rank writes them at train end (``clock-rank{r}.json`` in ``out_dir``).

    ``state.num_input_tokens_seen`` is read at every ``on_step_begin`` and at ``on_train_end`` (trainbridge
    keeps it up to date; a Trainer run without ``include_num_input_tokens_seen`` leaves it 0 and counts
    tokens with ``CountingCollator`` instead, whose per-batch counts are passed as ``local_tokens``).
    """

    def __init__(self, out_dir: str, local_tokens: list[int] | None = None) -> None:
        self.out_dir = out_dir
        self.local_tokens = local_tokens
        self.step_end_times: list[float] = []
        self.step_end_cpu_times: list[float] = []
        self.tokens_seen_at_step_begin: list[int] = []
        self.profiler: cProfile.Profile | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if os.environ.get(PROFILE_ENV) == "1" and state.is_world_process_zero:
            self.profiler = cProfile.Profile()
            self.profiler.enable()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.tokens_seen_at_step_begin.append(int(state.num_input_tokens_seen))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.step_end_times.append(time.time())
        self.step_end_cpu_times.append(time.process_time())

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        if self.profiler is not None:
            self.profiler.disable()
            self.profiler.dump_stats(Path(self.out_dir) / f"profile-rank{rank}.pstats")
        write_clock(
            self.out_dir,
            rank,
            {
                "rank": rank,
                "step_end_times": self.step_end_times,
                "step_end_cpu_times": self.step_end_cpu_times,
                "tokens_seen_at_step_begin": self.tokens_seen_at_step_begin,
                "tokens_seen_at_train_end": int(state.num_input_tokens_seen),
                "local_tokens": self.local_tokens,
                "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                **({"peak_cuda_mib": torch.cuda.max_memory_allocated() / 2**20} if torch.cuda.is_available() else {}),
            },
        )


class CountingCollator:
    """Wraps a collator and appends each batch's non-padding token count to ``counts``.

    Non-padding tokens: the ``attention_mask`` sum when the batch has one, else every input token
    (a flattened batch has no padding).
    """

    def __init__(self, collate: Callable[[Sequence[dict[str, Any]]], dict[str, torch.Tensor]]) -> None:
        self.collate = collate
        self.counts: list[int] = []

    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self.collate(features)
        mask = batch.get("attention_mask")
        self.counts.append(int(mask.sum()) if mask is not None else int(batch["input_ids"].numel()))
        return batch


class JsonlTokens(torch.utils.data.Dataset):
    """Pre-tokenized samples, one ``{"input_ids": [...]}`` per JSONL line (other keys are ignored)."""

    def __init__(self, path: Path) -> None:
        self.rows = [{"input_ids": json.loads(line)["input_ids"]} for line in path.read_text().splitlines() if line]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, list[int]]:
        return self.rows[index]


@dataclass(frozen=True)
class TrainerRunOptions:
    """Command-line options of one Trainer benchmark run."""

    model: Path
    data: Path
    out: Path
    steps: int
    learning_rate: float
    seed: int
    collator: str
    tuned: bool

    @classmethod
    def parse(cls, argv: Sequence[str] | None = None) -> TrainerRunOptions:
        """Parse the command line."""
        parser = argparse.ArgumentParser(prog="trainer_run.py", description=__doc__.splitlines()[0])
        parser.add_argument("--model", type=Path, required=True)
        parser.add_argument("--data", type=Path, required=True)
        parser.add_argument("--out", type=Path, required=True)
        parser.add_argument("--steps", type=int, default=40)
        parser.add_argument("--learning-rate", type=float, default=1e-4)
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--collator", choices=["padding", "flattening"], default="padding")
        parser.add_argument("--tuned", action="store_true")
        ns = parser.parse_args(argv)
        return cls(ns.model, ns.data, ns.out, ns.steps, ns.learning_rate, ns.seed, ns.collator, ns.tuned)


def main(argv: Sequence[str] | None = None) -> None:
    """Run one Trainer benchmark configuration."""
    options = TrainerRunOptions.parse(argv)
    tokenizer = AutoTokenizer.from_pretrained(options.model)
    model = AutoModelForCausalLM.from_pretrained(options.model, dtype=torch.float32)
    if options.collator == "padding":
        inner: Any = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    else:
        inner = DataCollatorWithFlattening()
    collator = CountingCollator(inner)
    tuning: dict[str, Any] = (
        {"ddp_find_unused_parameters": False, "dataloader_pin_memory": False} if options.tuned else {}
    )
    training_args = TrainingArguments(
        output_dir=str(options.out / "trainer-output"),
        use_cpu=True,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        max_steps=options.steps,
        learning_rate=options.learning_rate,
        lr_scheduler_type="constant",
        seed=options.seed,
        report_to="none",
        save_strategy="no",
        logging_steps=LOGGING_STEPS,
        **tuning,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=JsonlTokens(options.data),
        data_collator=collator,
        processing_class=tokenizer,
        callbacks=[StepClock(str(options.out), collator.counts)],
    )
    trainer.train()


if __name__ == "__main__":
    main()
