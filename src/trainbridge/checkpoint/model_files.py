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

from pathlib import Path
from typing import Any

import torch

from trainbridge.checkpoint.weights import write_model_files


class HFModelFiles:
    """Rank 0 writes the weights in Hugging Face layout and the processing class (the default)."""

    keeps_model_state = False

    def write(
        self,
        model: Any,
        folder: Path,
        step: int,
        state: dict[str, torch.Tensor] | None,
        tokenizer: Any,
        weights_dtype: torch.dtype | None,
        is_rank_zero: bool,
    ) -> None:
        if not is_rank_zero:
            return
        if state is None:
            raise RuntimeError(f"the engine gave rank 0 no full state dict of {type(model).__name__}")
        write_model_files(model, folder, state, weights_dtype)
        if tokenizer is not None:
            tokenizer.save_pretrained(folder)
