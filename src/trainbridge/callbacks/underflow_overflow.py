"""``UnderflowOverflow``: Trainer's ``debug="underflow_overflow"``.

At ``on_train_begin`` transformers' own ``DebugUnderflowOverflow`` is attached to the model being trained (the
unwrapped one, as Trainer attaches it to ``self.model``): every module's forward is watched, and the first
``inf``/``nan`` in an activation or weight prints the frames before it and stops training with its
``ValueError``, as under Trainer.
"""

from __future__ import annotations

from typing import Any

from trainbridge.core.callback import Callback
from trainbridge.core.context import TrainingContext


class UnderflowOverflow(Callback):
    """Attaches ``transformers.debug_utils.DebugUnderflowOverflow`` to the model (see the module doc)."""

    def __init__(self) -> None:
        self.detector: Any = None

    def on_train_begin(self, context: TrainingContext, **kwargs: Any) -> None:
        from transformers.debug_utils import DebugUnderflowOverflow

        if self.detector is None and context.unwrapped_model is not None:
            self.detector = DebugUnderflowOverflow(context.unwrapped_model)
