"""``Seq2SeqTrainer``: a real ``transformers.Seq2SeqTrainer`` whose training loop is trainbridge's.

Its constructor, ``evaluate``, ``predict`` and ``prediction_step`` are transformers' own (generation with
``predict_with_generate``, ``generation_config``, the call's ``generate`` keyword arguments), at each
evaluation during ``train()`` too (``trainer.subclass.trainers_evaluation``: an encoder-decoder trains on
Trainer's sample batches), on the loop's model.
"""

from __future__ import annotations

from typing import Any

import transformers

from trainbridge.trainer.facade import Trainer


class Seq2SeqTrainer(Trainer, transformers.Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` with trainbridge's training loop (see the module docstring)."""

    def generation_kwargs(self) -> dict[str, Any]:
        """``generate``'s keyword arguments as ``Seq2SeqTrainer.evaluate`` completes them without its own:
        ``max_length`` from ``generation_max_length``, ``num_beams`` from ``generation_num_beams``."""
        kwargs = {
            "max_length": getattr(self.args, "generation_max_length", None),
            "num_beams": getattr(self.args, "generation_num_beams", None),
        }
        return {k: v for k, v in kwargs.items() if v is not None}

    def generation_fields(self) -> dict[str, Any]:
        """The ``TrainingArgs`` fields of generated predictions this trainer's arguments ask for."""
        return {
            "predict_with_generate": bool(getattr(self.args, "predict_with_generate", False)),
            "generation_kwargs": self.generation_kwargs(),
        }
