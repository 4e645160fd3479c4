"""A Trainer subclass's ``_save`` / ``save_model`` / ``_save_checkpoint``, run at each checkpoint on every rank.

The checkpoint manager stays the one writer of the checkpoint (temporary folder, loop state, RNG, optimizer,
manifest, ``COMPLETE``, rotation); before publication ``SubclassSave.write`` calls the instance's methods as
Trainer chains them: ``_save_checkpoint(model, trial=None)``, with ``args.output_dir`` a folder whose
``checkpoint-<step>`` leads to the temporary folder (what it writes into ``output_dir`` itself is discarded,
with a warning), its ``super()`` ``self.save_model(that folder, _internal_call=True)``; ``save_model``:
``self._save(folder, state_dict=<the gathered weights on rank 0>)``; ``super()._save``: on rank 0, the default
model files and ``training_args.bin``.

Resume reads the weights kept in ``dcp/`` (``keeps_model_state``), whatever the override wrote; but a PEFT
adapter from ``adapter_model.safetensors``, which an override must leave (``super()`` or ``save_pretrained``).
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from trainbridge.core.config.plan import ModelPart
from trainbridge.core.run_dir import checkpoint_dir
from trainbridge.trainer.subclass import ScriptTrainer, overrides

if TYPE_CHECKING:
    from trainbridge.trainer.facade import LoopTrainer

logger = logging.getLogger(__name__)

SAVE_METHODS = ("_save", "save_model", "_save_checkpoint")
"""The saving methods a subclass may override (each run at every checkpoint, on every rank)."""


class SubclassSave:
    """``ModelFiles`` for a Trainer subclass overriding a method of ``SAVE_METHODS`` (see the module doc)."""

    keeps_model_state = True

    def __init__(self, worker: ScriptTrainer, whole_checkpoint: bool) -> None:
        self.worker = worker
        self.whole_checkpoint = whole_checkpoint
        """The subclass overrides ``_save_checkpoint``: that is the entry point."""

    def write(self, part: ModelPart) -> None:
        with self.worker.call(part.model, checkpoint=part) as instance:
            if self.whole_checkpoint:
                _save_checkpoint_into(instance, part.model, part.folder, part.step)
            else:
                instance.save_model(str(part.folder), _internal_call=True)


def _save_checkpoint_into(instance: LoopTrainer, model: torch.nn.Module, folder: Path, step: int) -> None:
    """``instance._save_checkpoint(model, None)`` with ``<args.output_dir>/checkpoint-<step>`` leading to ``folder``."""
    rank = int(os.environ.get("RANK", "0"))
    stage = folder / f".output-dir-{rank}"
    stage.mkdir(exist_ok=True)
    checkpoint_dir(stage, step).symlink_to("..", target_is_directory=True)
    args = instance.args
    staged = copy.copy(args)
    staged.output_dir = str(stage)
    instance.args = staged
    instance.state.global_step = step
    try:
        instance._save_checkpoint(model, None)
    finally:
        instance.args = args
        checkpoint_dir(stage, step).unlink()
        stray = sorted(p.name for p in stage.iterdir())
        if stray:
            logger.warning(
                "%s._save_checkpoint wrote %s into output_dir itself, not into the checkpoint: discarded",
                type(instance).__name__,
                stray,
            )
        shutil.rmtree(stage)


def subclass_save(trainer: LoopTrainer) -> SubclassSave | None:
    """The ``checkpoint_model_files`` of ``trainer``'s train jobs: a ``SubclassSave`` when its class overrides
    one of ``SAVE_METHODS``, else None (the checkpoint's default files)."""
    if not overrides(type(trainer), SAVE_METHODS):
        return None
    return SubclassSave(trainer._script, overrides(type(trainer), ("_save_checkpoint",)))
