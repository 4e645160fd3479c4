"""The events ``Trainer.evaluate()``/``predict()``/``log()`` fire outside training, in the script's process.

During ``train()`` the loop fires every event on every rank (``trainbridge.hf.trainer_callbacks``).  Outside it,
``transformers.Trainer`` still calls its callbacks: ``log()`` fires ``on_log``, ``evaluate()`` logs its
metrics and fires ``on_evaluate``, ``predict()`` fires ``on_predict``.  ``ScriptEvents`` does the same for
the script's ``TrainerCallback``s, where the script runs: in the calling process when the Trainer launched
its own workers, on every rank when the script runs under a launcher.  Callbacks get the Trainer's real
``args`` (its ``TrainingArguments``), its ``state`` (``is_world_process_zero`` of this process, so a
callback gates on rank 0 as under Trainer) and its ``control``, through transformers' own
``CallbackHandler`` with Trainer's default callbacks (``DefaultFlowCallback``, then the script's, then
``PrinterCallback`` under ``disable_tqdm`` or ``ProgressCallback``).

Not here: ``report_to`` integrations (they live in the training workers) and trainbridge's native
``Callback``s (they receive a ``TrainingContext``, which exists only inside a run).
"""

from __future__ import annotations

from typing import Any

from transformers import (
    DefaultFlowCallback,
    PrinterCallback,
    ProgressCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)
from transformers.trainer_callback import CallbackHandler

from trainbridge.hf.handler import is_hf_callback


class ScriptEvents:
    """Fires Trainer's out-of-training events on the script's ``TrainerCallback``s (see module doc)."""

    def __init__(self) -> None:
        self.control = TrainerControl()
        self._handler: CallbackHandler | None = None
        self._built_from: list[Any] = []

    def fire(
        self,
        hook: str,
        args: Any,
        state: TrainerState,
        callbacks: list[Any],
        model: Any,
        processing_class: Any,
        **kwargs: Any,
    ) -> TrainerControl:
        """Call ``hook`` (``on_log``, ``on_evaluate``, ``on_predict``) on every ``TrainerCallback`` in
        ``callbacks`` with ``args``, ``state`` and ``control``; returns the control they leave.  ``args`` that
        are not ``TrainingArguments`` (trainbridge's own) have no Trainer callbacks to serve: nothing fires."""
        if not isinstance(args, TrainingArguments):
            return self.control
        handler = self._handler_for(args, callbacks, model, processing_class)
        self.control = getattr(handler, hook)(args, state, self.control, **kwargs)
        return self.control

    def _handler_for(
        self, args: TrainingArguments, callbacks: list[Any], model: Any, processing_class: Any
    ) -> CallbackHandler:
        """transformers' handler over Trainer's default callbacks and the script's (rebuilt when the script
        added or removed one: instances are kept, classes instantiated once per build)."""
        if self._handler is None or self._built_from != list(callbacks):
            hf = [c for c in callbacks if is_hf_callback(c)]
            handler = CallbackHandler([DefaultFlowCallback, *hf], model, processing_class, None, None)
            handler.add_callback(PrinterCallback if args.disable_tqdm else ProgressCallback)
            self._handler, self._built_from = handler, list(callbacks)
        self._handler.model = model
        self._handler.processing_class = processing_class
        return self._handler
