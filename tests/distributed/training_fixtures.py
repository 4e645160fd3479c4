"""A tiny model and learnable data on disk, shared by the 2-rank training tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.run_inputs import split_run
from trainbridge import Callback, TrainingArgs
from trainbridge.demos.tiny_model import build_tiny_llama, write_arithmetic_dataset


def make_assets(root: Path) -> dict[str, Path]:
    """Build the tiny Llama + tokenizer and arithmetic train/val data once under ``root``."""
    model = build_tiny_llama(root / "model")
    train = write_arithmetic_dataset(root / "train.jsonl", 256, seed=1)
    val = write_arithmetic_dataset(root / "val.jsonl", 32, seed=2)
    return {"model": model, "train": train, "val": val}


def base_args(assets: dict[str, Path], out: Path, **overrides: Any) -> TrainingArgs:
    """Small, fast defaults: 2 ranks x a few micro-batches, constant LR, no checkpoints unless asked."""
    values: dict[str, Any] = dict(
        model_path=assets["model"],
        data_path=assets["train"],
        ckpt_output_dir=out,
        max_seq_len=32,
        max_batch_len=64,
        effective_batch_size=16,
        learning_rate=3e-3,
        lr_scheduler="constant",
        warmup_steps=0,
        max_steps=8,
        logging_steps=2,
        save_strategy="no",
        disable_tqdm=True,
        seed=7,
    )
    values.update(overrides)
    return split_run(**values)


class EventCounter(Callback):
    """Counts every event per rank and writes the counts to ``out/events-rank{r}.json`` at the end."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.steps_at_step_end: list[int] = []

    def _count(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1

    def on_init_end(self, context, **kw):
        self._count("on_init_end")

    def on_train_begin(self, context, **kw):
        self._count("on_train_begin")

    def on_epoch_begin(self, context, **kw):
        self._count("on_epoch_begin")

    def on_step_begin(self, context, **kw):
        self._count("on_step_begin")

    def on_before_forward(self, context, **kw):
        self._count("on_before_forward")

    def on_after_forward(self, context, **kw):
        self._count("on_after_forward")

    def on_before_backward(self, context, **kw):
        self._count("on_before_backward")

    def on_after_backward(self, context, **kw):
        self._count("on_after_backward")

    def on_substep_end(self, context, **kw):
        self._count("on_substep_end")

    def on_pre_optimizer_step(self, context, **kw):
        self._count("on_pre_optimizer_step")

    def on_optimizer_step(self, context, **kw):
        self._count("on_optimizer_step")

    def on_log(self, context, **kw):
        self._count("on_log")

    def on_prediction_step(self, context, **kw):
        self._count("on_prediction_step")

    def on_evaluate(self, context, **kw):
        self._count("on_evaluate")

    def on_save(self, context, **kw):
        self._count("on_save")

    def on_epoch_end(self, context, **kw):
        self._count("on_epoch_end")

    def on_exception(self, context, **kw):
        self._count("on_exception")

    def on_step_end(self, context, **kw):
        self._count("on_step_end")
        self.steps_at_step_end.append(context.global_step)

    def on_train_end(self, context, **kw):
        self._count("on_train_end")
        path = context.args.ckpt_output_dir / f"events-rank{context.rank}.json"
        path.write_text(
            json.dumps(
                {
                    "counts": self.counts,
                    "steps": self.steps_at_step_end,
                    "micro_batches_per_step": context.micro_steps_in_step,
                }
            )
        )


def read_rank_files(out: Path, stem: str, world_size: int = 2) -> list[dict[str, Any]]:
    return [json.loads((out / f"{stem}-rank{r}.json").read_text()) for r in range(world_size)]
