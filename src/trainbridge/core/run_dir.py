"""The names of what a run writes into ``ckpt_output_dir``, each written down once.

``checkpoint-{global_step}/`` folders (``trainbridge.checkpoint``), the run result rank 0 writes for the
launcher (``result.json``, ``trainbridge.loop.result``) and the default metrics file (``metrics.jsonl``).
"""

from __future__ import annotations

from pathlib import Path

CHECKPOINT_PREFIX = "checkpoint-"
"""A checkpoint folder is ``CHECKPOINT_PREFIX`` followed by its global step (Trainer's layout)."""
RESULT_FILE = "result.json"
"""The run's ``RunResult``, written by rank 0 when training ends cleanly."""
METRICS_FILE = "metrics.jsonl"
"""The default JSONL metrics file (``TrainingArgs.metrics_file`` overrides it)."""


def checkpoint_dir(output_dir: str | Path, global_step: int) -> Path:
    """The folder of the checkpoint taken at ``global_step``: ``output_dir/checkpoint-{global_step}``."""
    return Path(output_dir) / f"{CHECKPOINT_PREFIX}{global_step}"


def result_file(output_dir: str | Path) -> Path:
    """Where rank 0 writes the run's result: ``output_dir/result.json``."""
    return Path(output_dir) / RESULT_FILE
