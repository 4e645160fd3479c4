"""The names of what a run writes into ``ckpt_output_dir``, each written down once.

``checkpoint-{global_step}/`` folders (``trainbridge.checkpoint``) go into ``ckpt_output_dir``; the run's own
files go into its run-files folder (``TrainingArgs.resolved_run_files_dir``: ``ckpt_output_dir`` itself unless
``run_files_dir`` names another): the run result rank 0 writes for the launcher (``result.json``,
``trainbridge.loop.result``), the default metrics file (``metrics.jsonl``), the ``control/`` requests of
``trainbridge control`` and the launcher's log (``logs/launch.log``: torchrun's own report and every failure
in full).  A ported ``TrainingArguments`` (``trainbridge.Trainer``) puts them in ``output_dir/OWN_FILES_DIR``,
so that ``output_dir`` holds what Trainer writes there.
"""

from __future__ import annotations

from pathlib import Path

OWN_FILES_DIR = "trainbridge"
"""The folder inside a ported ``TrainingArguments``' ``output_dir`` that holds the run's own files."""
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


def result_file(run_files_dir: str | Path) -> Path:
    """Where rank 0 writes the run's result: ``run_files_dir/result.json``."""
    return Path(run_files_dir) / RESULT_FILE


def run_files_in(output_dir: str | Path) -> Path:
    """The run-files folder of a run in ``output_dir``: ``output_dir/OWN_FILES_DIR`` when it exists (a ported
    ``TrainingArguments``' run), else ``output_dir``."""
    own = Path(output_dir) / OWN_FILES_DIR
    return own if own.is_dir() else Path(output_dir)


def launch_log_file(run_files_dir: str | Path, node: str | None = None) -> Path:
    """The launcher's log, appended by every launch into ``run_files_dir``: ``logs/launch.log``, or
    ``logs/launch-{node}.log`` for one node of a multi-node job (each node's launcher writes its own)."""
    return Path(run_files_dir) / LOGS_DIR / (f"launch-{node}.log" if node else "launch.log")


def results_file(output_dir: str | Path, split: str | None = None) -> Path:
    """Metrics ``Trainer.save_metrics`` writes (the facade too): ``{split}_results.json``, or with no split the
    combined ``all_results.json``."""
    return Path(output_dir) / f"{split or 'all'}_results.json"
