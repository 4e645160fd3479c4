"""``Seq2SeqTrainer``: ``transformers.Seq2SeqTrainer``'s constructor on trainbridge's loop.

With ``Seq2SeqTrainingArguments(predict_with_generate=True)`` evaluation and ``predict`` hand
``compute_metrics`` the token ids ``model.generate`` returns (``step.generated``).  ``generate`` gets what
``Seq2SeqTrainer`` gives it: the keyword arguments of ``evaluate(...)`` / ``predict(...)`` (``max_length``,
``num_beams``, any other ``generate`` argument), else ``generation_max_length`` / ``generation_num_beams``;
the model's ``generation_config`` (replaced by ``Seq2SeqTrainingArguments.generation_config`` when that is
set, as ``Seq2SeqTrainer.__init__`` does) travels with the model to the workers and gives the rest.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from trainbridge.core.config import TrainingArgs
from trainbridge.step.generated import GeneratedPredictions
from trainbridge.trainer.facade import Trainer


class Seq2SeqTrainer(Trainer):
    """``transformers.Seq2SeqTrainer(model, args, ...)`` on trainbridge's loop (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._gen_kwargs: dict[str, Any] = {}
        """The ``generate`` keyword arguments of the ``evaluate``/``predict`` call under way."""
        config = getattr(self.args, "generation_config", None)
        if config is not None and self.model is not None and hasattr(self.model, "generation_config"):
            from transformers import Seq2SeqTrainer as HFSeq2SeqTrainer

            self.model.generation_config = HFSeq2SeqTrainer.load_generation_config(config)

    def evaluate(
        self,
        eval_dataset: Any = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
        **gen_kwargs: Any,
    ) -> dict[str, float]:
        """``Trainer.evaluate``, generating with ``gen_kwargs`` (``max_length``, ``num_beams``, ...)."""
        with self._generating(gen_kwargs):
            return super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def predict(
        self,
        test_dataset: Any,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "test",
        **gen_kwargs: Any,
    ) -> Any:
        """``Trainer.predict``, generating with ``gen_kwargs`` (``max_length``, ``num_beams``, ...)."""
        with self._generating(gen_kwargs):
            return super().predict(test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    @contextlib.contextmanager
    def _generating(self, gen_kwargs: dict[str, Any]) -> Iterator[None]:
        """``gen_kwargs`` for the jobs started inside, and for the in-place loop's step after training."""
        self._gen_kwargs = dict(gen_kwargs)
        step = getattr(self._loop, "step", None)
        if not isinstance(step, GeneratedPredictions):
            step = None
        previous = step.generation_kwargs if step is not None else {}
        if step is not None:
            step.generation_kwargs = self.generation_kwargs()
        try:
            yield
        finally:
            self._gen_kwargs = {}
            if step is not None:
                step.generation_kwargs = previous

    def generation_kwargs(self) -> dict[str, Any]:
        """``generate``'s keyword arguments as ``Seq2SeqTrainer.evaluate``/``predict`` complete them: the
        call's own, ``max_length`` from ``generation_max_length`` unless the call names ``max_length`` or
        ``max_new_tokens``, ``num_beams`` from ``generation_num_beams``; None values dropped."""
        kwargs = dict(self._gen_kwargs)
        max_length = getattr(self.args, "generation_max_length", None)
        if kwargs.get("max_length") is None and kwargs.get("max_new_tokens") is None and max_length is not None:
            kwargs["max_length"] = max_length
        num_beams = getattr(self.args, "generation_num_beams", None)
        if kwargs.get("num_beams") is None and num_beams is not None:
            kwargs["num_beams"] = num_beams
        return {k: v for k, v in kwargs.items() if v is not None}

    def generation_fields(self) -> dict[str, Any]:
        """The ``TrainingArgs`` fields of generated predictions this trainer's arguments ask for."""
        if isinstance(self.args, TrainingArgs):
            return {}
        return {
            "predict_with_generate": bool(getattr(self.args, "predict_with_generate", False)),
            "generation_kwargs": self.generation_kwargs(),
        }
