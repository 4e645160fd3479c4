"""``Seq2SeqTrainer``: ``transformers.Seq2SeqTrainer``'s constructor on trainbridge's ``Trainer`` facade.

With ``Seq2SeqTrainingArguments(predict_with_generate=True)`` evaluation and ``predict`` hand
``compute_metrics`` the token ids ``model.generate`` returns (``step.generated``), with
``generation_max_length`` / ``generation_num_beams`` as ``generate``'s ``max_length`` / ``num_beams``;
otherwise it is ``Trainer``.
"""

from __future__ import annotations

from typing import Any

from trainbridge.core.config import TrainingArgs
from trainbridge.trainer.facade import Trainer


class Seq2SeqTrainer(Trainer):
    """``transformers.Seq2SeqTrainer(model, args, ...)`` on trainbridge's loop (see the module docstring)."""

    def generation_fields(self) -> dict[str, Any]:
        """The ``TrainingArgs`` fields of generated predictions this trainer's arguments ask for."""
        args = self.args
        if isinstance(args, TrainingArgs):
            return {}
        kwargs = {
            "max_length": getattr(args, "generation_max_length", None),
            "num_beams": getattr(args, "generation_num_beams", None),
        }
        return {
            "predict_with_generate": bool(getattr(args, "predict_with_generate", False)),
            "generation_kwargs": {k: v for k, v in kwargs.items() if v is not None},
        }
