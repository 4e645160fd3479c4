"""What a facade job's results become in ``transformers.Trainer``'s API.

The ``TrainerState`` after ``train()``, the metrics ``train()`` returns, and an evaluation's metrics split
per named set and given the caller's ``metric_key_prefix``, each as ``transformers.Trainer`` makes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def trainer_state(recorded: dict[str, Any], train_batch_size: int | None, world_zero: bool, local_zero: bool) -> Any:
    """A ``transformers.TrainerState`` holding a train job's ``recorded`` state (that of its
    ``HuggingFaceCallbacks``, restored from the checkpoint on resume as Trainer restores it), with this
    process's rank flags."""
    from transformers import TrainerState

    state = TrainerState()
    for key, value in recorded.items():
        if hasattr(state, key):
            setattr(state, key, value)
    state.train_batch_size = train_batch_size
    state.is_world_process_zero = world_zero
    state.is_local_process_zero = local_zero
    return state


def train_metrics(log_history: list[dict[str, Any]], disable_tqdm: bool) -> dict[str, Any]:
    """The metrics ``Trainer.train()`` returns: its final log entry without ``step``. ``total_flos`` stays in
    (``train_results.json`` of example scripts has it) unless ``disable_tqdm``: then Trainer's ``PrinterCallback``
    pops it in ``on_log`` from the very dict ``train()`` returns (``ProgressCallback`` pops from a copy)."""
    metrics = dict(next((e for e in reversed(log_history) if "train_runtime" in e), {}))
    metrics.pop("step", None)
    if disable_tqdm:
        metrics.pop("total_flos", None)
    return metrics


def has_checkpoint(output_dir: Path) -> bool:
    """True when ``output_dir`` holds a complete checkpoint (``train(resume_from_checkpoint=True)`` needs one)."""
    from trainbridge.checkpoint.manager import is_complete_checkpoint

    return output_dir.is_dir() and any(is_complete_checkpoint(p) for p in output_dir.iterdir())
