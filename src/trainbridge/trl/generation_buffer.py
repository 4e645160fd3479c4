"""The generation batch a GRPO/RLOO checkpoint falls in the middle of: saved with the checkpoint, restored at resume.

trl's ``GRPOTrainer`` and ``RLOOTrainer`` generate once every ``steps_per_generation * num_iterations``
micro-batches and train on the buffered batch in between (``_prepare_inputs``: ``_buffered_inputs``, indexed by
the micro-batch counter ``_step``).  A checkpoint between two generations is taken while part of that batch is
still to be trained on.  trl resumes there with ``_step`` back at 0 and no buffer, so it generates anew from the
resumed micro-batch's prompts: new completions, and the steps after the checkpoint differ from the run that was
not interrupted.

Here the checkpoint holds the pending batch: each rank writes its ``_step``, its buffered batch and the
generation metrics not yet logged (``_metrics["train"]``) into ``pending_generation_rank<r>.pt``, and resume
loads them back, so the steps after the checkpoint train on the same completions, and log the same values, as
the run that was not interrupted.  A checkpoint at a generation boundary with nothing left to log holds no such
file: trl's files exactly.  The file holds tensors, lists and numbers only and is read with
``torch.load(weights_only=True)``: nothing in it runs as code.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from trainbridge.core.callback import Callback
from trainbridge.core.context import TrainingContext

logger = logging.getLogger(__name__)

PENDING_FILE = "pending_generation_rank{rank}.pt"
"""Each rank's pending generation batch in a checkpoint folder."""


def generate_every(trainer: Any) -> int:
    """Micro-batches per generation: ``steps_per_generation * num_iterations``."""
    return int(trainer.args.steps_per_generation * trainer.num_iterations)


def pending(trainer: Any) -> dict[str, Any] | None:
    """What of ``trainer``'s generation is not yet trained on or logged, or None when nothing is."""
    buffered = trainer._buffered_inputs is not None and trainer._step % generate_every(trainer) != 0
    metrics = {key: list(values) for key, values in trainer._metrics["train"].items()}
    if not buffered and not metrics:
        return None
    return {
        "step": int(trainer._step),
        "world_size": int(trainer.accelerator.num_processes),
        "buffered_inputs": trainer._buffered_inputs if buffered else None,
        "metrics": metrics,
    }


def save_pending(trainer: Any, checkpoint: str | os.PathLike[str]) -> None:
    """This rank's part: write ``pending(trainer)`` into ``checkpoint`` when there is one."""
    state = pending(trainer)
    if state is None:
        return
    path = Path(checkpoint) / PENDING_FILE.format(rank=trainer.accelerator.process_index)
    torch.save(_to_cpu(state), path)


def load_pending(trainer: Any, checkpoint: str | os.PathLike[str]) -> None:
    """Put this rank's pending generation of ``checkpoint`` back into ``trainer`` (``_step``, the buffer and
    the metrics to log); none there: ``_step`` 0 and no buffer, as trl starts every run."""
    trainer._step, trainer._buffered_inputs = 0, None
    path = Path(checkpoint) / PENDING_FILE.format(rank=trainer.accelerator.process_index)
    if not path.is_file():
        return
    state = torch.load(path, map_location=trainer.accelerator.device, weights_only=True)
    if state["world_size"] != trainer.accelerator.num_processes:
        logger.warning(
            "%s was written by %d ranks, this run has %d: its pending generation batch is dropped and the "
            "resumed step generates anew, as trl resumes",
            path,
            state["world_size"],
            trainer.accelerator.num_processes,
        )
        return
    if state["buffered_inputs"] is not None:
        trainer._step, trainer._buffered_inputs = state["step"], state["buffered_inputs"]
    for key, values in state["metrics"].items():
        trainer._metrics["train"][key].extend(values)


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_to_cpu(item) for item in value)
    return value


class PendingGeneration(Callback):
    """At ``on_train_begin`` of a resumed run (before its first micro-batch), the pending generation batch of the
    checkpoint the loop resumed from (``TrainingContext.resumed_from``) back into ``trainer`` (``load_pending``)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_train_begin(self, context: TrainingContext, **kwargs: Any) -> None:
        if context.resumed_from is not None:
            load_pending(self.trainer, context.resumed_from)
