"""What writes the model part of a checkpoint: ``ModelFiles``, chosen when the run is built.

The checkpoint manager stays the one writer of the checkpoint folder (temporary folder, loop state, RNG,
optimizer, manifest, ``COMPLETE``, rotation); inside the temporary folder, before publication, it asks its
``ModelFiles`` for the model's files.  ``write`` is called on every rank, after the full weights were
gathered (``state``: on rank 0, None on the others), so an implementation may take part in collectives.

``HFModelFiles`` (the default): rank 0 writes the weights in Hugging Face layout in the export dtype
(``checkpoint.weights.write_model_files``; a PEFT model its adapter) and the run's processing class as
Trainer saves it (``save_pretrained``: a tokenizer's files; a multimodal processor's whole, its
``processor_config.json``, image processor, chat template and tokenizer).  Another
implementation (``RunPlan.checkpoint_model_files``: the facade's for a Trainer subclass overriding
``_save`` / ``save_model`` / ``_save_checkpoint``) may write them differently; its ``keeps_model_state``
then makes the checkpoint keep the model's own weights in ``dcp/`` too, so resume never depends on what it
wrote (a PEFT model's adapter is still read from its adapter files).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from trainbridge.checkpoint.layout import TRAINING_ARGS_FILE
from trainbridge.checkpoint.weights import write_model_files
from trainbridge.core.config.plan import ModelPart


class HFModelFiles:
    """Rank 0 writes the weights in Hugging Face layout and the processing class (the default)."""

    keeps_model_state = False

    def write(self, part: ModelPart) -> None:
        if not part.is_rank_zero:
            return
        if part.state is None:
            raise RuntimeError(f"the engine gave rank 0 no full state dict of {type(part.model).__name__}")
        write_model_files(part.model, part.folder, part.state, part.weights_dtype)
        if part.tokenizer is not None:
            part.tokenizer.save_pretrained(part.folder)


def trainers_save(part: ModelPart, output_dir: Path, state_dict: dict[str, torch.Tensor] | None, args: object) -> None:
    """``Trainer._save`` while ``part`` is written (a Trainer subclass's save overrides call it,
    ``trainer.save_overrides``): rank 0 writes the model's files into ``output_dir`` (``state_dict``, else the
    gathered weights) as the checkpoint would, the tokenizer and ``training_args.bin``; other ranks nothing."""
    if not part.is_rank_zero:
        return
    output_dir.mkdir(parents=True, exist_ok=True)
    state = state_dict if state_dict is not None else part.state
    HFModelFiles().write(replace(part, folder=output_dir, step=0, state=state))
    torch.save(args, output_dir / TRAINING_ARGS_FILE)
