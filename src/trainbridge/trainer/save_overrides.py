"""A Trainer subclass's ``_save`` / ``save_model`` run where Trainer runs them: at each checkpoint, in the
workers, and at the script's own ``trainer.save_model()``.

``SubclassSave`` is the ``TrainingArgs.checkpoint_model_files`` of such a subclass's train job
(``checkpoint.model_files.ModelFiles``).  The checkpoint manager stays the one writer of the checkpoint
folder; inside the checkpoint's temporary folder, before publication, it calls ``SubclassSave.write`` on every
rank (Trainer calls ``save_model`` on every rank too), which calls the worker-side instance's
``save_model(<temporary folder>, _internal_call=True)``: Trainer's ``save_model`` calls ``self._save(folder,
state_dict=<the gathered full weights on rank 0, None elsewhere>)`` (what Trainer passes under FSDP), and
``super()._save`` writes, on rank 0, what the checkpoint writes by default (the weights in Hugging Face layout
in the export dtype, a PEFT model's adapter, the tokenizer) and ``training_args.bin``.  Files the override
adds go into the checkpoint and its manifest; a crash leaves the previous checkpoint whole.  Because the
override may write the weights its own way, such a checkpoint also keeps the model's own weights in ``dcp/``
(``keeps_model_state``) and resume reads them there: exact whatever the override wrote.  A PEFT model's
adapter is the exception: resume reads ``adapter_model.safetensors``, so an override must leave it (calling
``super()._save`` or ``self.model.save_pretrained(output_dir)`` does).

``_save_checkpoint`` overrides are refused at construction (``REFUSED``): under Trainer ``super()`` is the
whole checkpoint and the override finds its files in ``output_dir/checkpoint-N`` afterwards; here that folder
only appears, whole, once published, so neither what it adds nor what it reads there can be honoured.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainbridge.checkpoint.layout import TRAINING_ARGS_FILE
from trainbridge.checkpoint.model_files import HFModelFiles
from trainbridge.trainer.subclass import SubclassLoss, overrides

REFUSED = {
    "_save_checkpoint": (
        "trainbridge writes each checkpoint itself, atomically (temporary folder, manifest, COMPLETE), so "
        "checkpoint-N only exists once whole; put what the override writes into a _save or save_model "
        "override (they run in the workers at every checkpoint with output_dir the checkpoint being written) "
        "or a TrainerCallback's on_save"
    )
}
"""Save overrides refused at construction, with why and what to do instead."""


@dataclass
class CheckpointWrite:
    """On the worker-side instance while a checkpoint's model files are written: what the facade's
    ``save_model`` / ``_save`` use there."""

    model: Any
    folder: Path
    state: dict[str, torch.Tensor] | None
    """The gathered full weights (rank 0), as Trainer passes ``state_dict`` under FSDP."""
    tokenizer: Any
    weights_dtype: torch.dtype | None
    is_rank_zero: bool

    def default_save(self, output_dir: Path, state_dict: dict[str, torch.Tensor] | None, args: Any) -> None:
        """``Trainer._save``: rank 0 writes the model's files (``state_dict``, else the gathered weights) as
        the checkpoint would, the tokenizer and ``training_args.bin``; other ranks nothing."""
        if not self.is_rank_zero:
            return
        output_dir.mkdir(parents=True, exist_ok=True)
        state = state_dict if state_dict is not None else self.state
        HFModelFiles().write(self.model, output_dir, state, self.tokenizer, self.weights_dtype, True)
        torch.save(args, output_dir / TRAINING_ARGS_FILE)


class SubclassSave:
    """``ModelFiles`` for a Trainer subclass overriding ``_save`` / ``save_model`` (see the module doc)."""

    keeps_model_state = True

    def __init__(self, worker: SubclassLoss) -> None:
        self.worker = worker

    def write(
        self,
        model: Any,
        folder: Path,
        state: dict[str, torch.Tensor] | None,
        tokenizer: Any,
        weights_dtype: torch.dtype | None,
        is_rank_zero: bool,
    ) -> None:
        instance = self.worker.trainer(model)
        instance.__dict__["_checkpoint_write"] = CheckpointWrite(
            model, folder, state, tokenizer, weights_dtype, is_rank_zero
        )
        try:
            instance.save_model(str(folder), _internal_call=True)
        finally:
            instance.__dict__.pop("_checkpoint_write", None)


def subclass_save(trainer: Any) -> SubclassSave | None:
    """The ``checkpoint_model_files`` of ``trainer``'s train jobs: a ``SubclassSave`` when its class overrides
    ``_save`` or ``save_model``, else None (the checkpoint's default files)."""
    if not overrides(type(trainer), ("_save", "save_model")):
        return None
    return SubclassSave(SubclassLoss(type(trainer), trainer.args, trainer.processing_class, trainer.compute_loss_func))
