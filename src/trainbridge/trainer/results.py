"""What a facade job's results become in ``transformers.Trainer``'s API.

The metrics ``train()`` returns, and whether ``train(resume_from_checkpoint=True)`` has a checkpoint to resume.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


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
