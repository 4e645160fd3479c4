"""``trainbridge demo``: a two-rank CPU fine-tune of a tiny local Llama, in about a minute.

Addition data (or, with ``--chat``, the shipped chat data with assistant-only loss), evaluation and
checkpoints every few steps, an ``EarlyStoppingCallback`` agreed across ranks, a summary and a plot.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import time
from pathlib import Path

from trainbridge.core.config import CallbackSpec, TorchrunArgs, TrainingArgs
from trainbridge.core.private_files import make_private, make_run_folder
from trainbridge.demos.tiny_model import build_tiny_llama, write_arithmetic_dataset
from trainbridge.launch.launcher import run_training
from trainbridge.loop.result import RunResult
from trainbridge.loop.summary import format_run_result

DEMO_MAX_STEPS = 200
"""Optimizer steps of the demo (well under a minute of training on two CPU cores)."""

DEMO_TRAIN_SAMPLES = 2000
DEMO_VAL_SAMPLES = 200


CHAT_DATA = Path(__file__).parent / "data"
"""The shipped chat data set: ``chat_train.jsonl`` (2,000 conversations) and ``chat_val.jsonl`` (200),
written by ``tiny_model.write_chat_dataset`` (seeds 1 and 2)."""


def demo_training_args(output_dir: Path, max_steps: int = DEMO_MAX_STEPS, chat: bool = False) -> TrainingArgs:
    """Build the demo's model and data under ``output_dir`` and return its ``TrainingArgs``.

    The run directory ``output_dir/run`` is emptied first: the demo always starts from step 0.
    """
    make_run_folder(output_dir)  # private (0700) whatever the umask, as the run folder inside it
    model_dir = output_dir / "model"
    if not (model_dir / "config.json").is_file():
        build_tiny_llama(model_dir, seed=0)
    data_dir = output_dir / "data"
    if chat:
        train_file, val_file = CHAT_DATA / "chat_train.jsonl", CHAT_DATA / "chat_val.jsonl"
    else:
        train_file = write_arithmetic_dataset(data_dir / "train.jsonl", DEMO_TRAIN_SAMPLES, seed=1)
        val_file = write_arithmetic_dataset(data_dir / "val.jsonl", DEMO_VAL_SAMPLES, seed=2)
    for written in (model_dir, data_dir):  # private whatever the umask (save_pretrained and writes use it)
        if written.exists():
            make_private(written)
    run_dir = output_dir / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    interval = max(1, max_steps // 4)
    return TrainingArgs(
        model_path=model_dir,
        data_path=train_file,
        val_data_path=val_file,
        ckpt_output_dir=run_dir,
        max_seq_len=96 if chat else 32,
        max_batch_len=1024,
        effective_batch_size=32,
        max_steps=max_steps,
        learning_rate=3e-3,
        lr_scheduler="cosine",
        warmup_steps=max(1, max_steps // 10),
        device="cpu",
        distributed_backend="ddp",
        logging_steps=max(1, interval // 2),
        logging_first_step=True,
        eval_strategy="steps",
        eval_steps=interval,
        save_strategy="steps",
        save_steps=interval,
        save_total_limit=2,
        metric_for_best_model="eval_loss",
        load_best_model_at_end=True,
        report_to=["tensorboard"] if importlib.util.find_spec("tensorboard") else [],
        run_name="trainbridge-demo",
        callbacks=[  # a callback as data: an import path and its keywords, built in each worker
            CallbackSpec.model_validate(
                {"class": "transformers:EarlyStoppingCallback", "kwargs": {"early_stopping_patience": 5}}
            )
        ],
    )


def format_demo_summary(result: RunResult, wall_time_s: float) -> str:
    """The demo's closing summary (``trainbridge.loop.summary.format_run_result``)."""
    return "trainbridge demo finished\n" + format_run_result(result, wall_time_s, indent="  ")


def run_demo(
    output_dir: str | Path = "demo_output",
    nproc_per_node: int = 2,
    max_steps: int | None = None,
    chat: bool = False,
) -> RunResult:
    """Build the tiny model and data in ``output_dir``, train with ``nproc_per_node`` CPU ranks, print a summary."""
    output_dir = Path(output_dir).resolve()
    start = time.monotonic()
    args = demo_training_args(output_dir, max_steps or DEMO_MAX_STEPS, chat=chat)
    what = "chat data (assistant-only loss)" if chat else "addition data"
    print(f"trainbridge demo: tiny Llama + {what} in {output_dir}, {nproc_per_node} CPU ranks", flush=True)
    result = run_training(args, TorchrunArgs(nproc_per_node=nproc_per_node))
    if result is None:
        raise RuntimeError("the demo runs on one node, so rank 0's result must be here")
    print(format_demo_summary(result, time.monotonic() - start), flush=True)
    _plot(result)
    return result


def _plot(result: RunResult) -> None:
    """End with a picture of the run (when the ``plot`` extra, matplotlib, is installed)."""
    from trainbridge.report.plot import PlotError, plot_metrics

    if result.metrics_file is None:
        return
    try:
        print(f"  {'plot:':<17}{plot_metrics(result.metrics_file)}", flush=True)
    except PlotError as exc:
        print(f"  {'plot:':<17}not written ({exc})", file=sys.stderr, flush=True)
