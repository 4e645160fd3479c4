"""``Seq2SeqTrainer``: a real ``transformers.Seq2SeqTrainer`` whose training loop is trainbridge's.

Its ``evaluate``, ``predict`` and ``prediction_step`` are transformers' own (generation with
``predict_with_generate``), at each evaluation during ``train()`` too, on the loop's model.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import transformers

from trainbridge.core.config.plan import Generate
from trainbridge.trainer.facade import Trainer
from trainbridge.trainer.job_args import TrainerPlan

GENERATION_FIELDS = ("predict_with_generate", "generation_max_length", "generation_num_beams", "generation_config")
"""``Seq2SeqTrainingArguments``' fields that ``Seq2SeqTrainer`` applies (``RunPlan.predictions``)."""


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

    def _generates(self) -> bool:
        return bool(getattr(self.args, "predict_with_generate", False))

    def run_plan(self) -> TrainerPlan:
        """``Trainer``'s plan, with generated predictions where the arguments ask for them."""
        predictions = Generate(self.generation_kwargs()) if self._generates() else None
        plan = super().run_plan()
        return replace(plan, predictions=predictions, honours_hf_fields=(*plan.honours_hf_fields, *GENERATION_FIELDS))
