"""``NEFTune``: noise on the input embeddings while training (NEFTune, https://arxiv.org/abs/2310.05914).

transformers' own hook (``transformers.integrations.neftune``) on the model being trained, attached at
``on_train_begin`` and removed at ``close`` (clean end or not), as ``Trainer.train`` attaches it for
``TrainingArguments.neftune_noise_alpha``.
"""

from __future__ import annotations

from typing import Any

import torch

from trainbridge.core.callback import Callback
from trainbridge.core.context import TrainingContext


class NEFTune(Callback):
    """Uniform noise of magnitude ``alpha / sqrt(positions * hidden size)`` on the input embeddings' output in
    training mode (a PEFT model's base embeddings)."""

    honours_hf_fields = ("neftune_noise_alpha",)
    """The ``TrainingArguments`` field it applies (``hf.porting`` does not report it ignored)."""

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self._hook: torch.utils.hooks.RemovableHandle | None = None

    @staticmethod
    def _model(context: TrainingContext) -> Any:
        return context.unwrapped_model if context.unwrapped_model is not None else context.model

    def on_train_begin(self, context: TrainingContext, **kwargs: Any) -> None:
        if self._hook is None:
            from transformers.integrations.neftune import activate_neftune

            self._hook = activate_neftune(self._model(context), self.alpha)

    def close(self, context: TrainingContext) -> None:
        if self._hook is not None:
            from transformers.integrations.neftune import deactivate_neftune

            deactivate_neftune(self._model(context), self._hook)
            self._hook = None
