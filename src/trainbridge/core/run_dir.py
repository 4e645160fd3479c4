"""The names of what a run writes into ``ckpt_output_dir``, each written down once.

``checkpoint-{global_step}/`` folders (``trainbridge.checkpoint``), the run result rank 0 writes for the
launcher (``result.json``, ``trainbridge.loop.result``), the default metrics file (``metrics.jsonl``)
and the launcher's log (``logs/launch.log``: torchrun's own report and every failure in full).
"""

from __future__ import annotations

from pathlib import Path

CHECKPOINT_PREFIX = "checkpoint-"
"""A checkpoint folder is ``CHECKPOINT_PREFIX`` followed by its global step (Trainer's layout)."""
RESULT_FILE = "result.json"
"""The run's ``RunResult``, written by rank 0 when training ends cleanly."""
METRICS_FILE = "metrics.jsonl"
"""The default JSONL metrics file (``TrainingArgs.metrics_file`` overrides it)."""
LOGS_DIR = "logs"
"""Folder of the run's logs."""


def checkpoint_dir(output_dir: str | Path, global_step: int) -> Path:
    """The folder of the checkpoint taken at ``global_step``: ``output_dir/checkpoint-{global_step}``."""
    return Path(output_dir) / f"{CHECKPOINT_PREFIX}{global_step}"


def result_file(output_dir: str | Path) -> Path:
    """Where rank 0 writes the run's result: ``output_dir/result.json``."""
    return Path(output_dir) / RESULT_FILE


def launch_log_file(output_dir: str | Path, node: str | None = None) -> Path:
    """The launcher's log, appended by every launch into ``output_dir``: ``logs/launch.log``, or
    ``logs/launch-{node}.log`` for one node of a multi-node job (each node's launcher writes its own)."""
    return Path(output_dir) / LOGS_DIR / (f"launch-{node}.log" if node else "launch.log")


def results_file(output_dir: str | Path, split: str | None = None) -> Path:
    """Metrics ``Trainer.save_metrics`` writes (the facade too): ``{split}_results.json``, or with no split the
    combined ``all_results.json``."""
    return Path(output_dir) / f"{split or 'all'}_results.json"
