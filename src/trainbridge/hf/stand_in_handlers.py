"""Callback handlers that stand in for a Trainer instance's own while the loop calls into it.

- ``LogCapture``: while one of the loop's logs goes through the instance's ``log``: keeps the ``logs`` Trainer's
  ``log`` hands to ``on_log`` (what the loop then logs);
- ``EvaluationEvents``: while the instance's own ``evaluate`` runs at an evaluation point of ``train()``: the
  ``on_log``/``on_evaluate`` it fires go to the loop's ``EvaluationRun``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_callback import CallbackHandler

    from trainbridge.core.config.plan import EvaluationRun
    from trainbridge.hf.trainer_callbacks import HuggingFaceCallbacks


class LogCapture:
    """The instance's ``callback_handler`` while one of the loop's logs goes through its ``log``: keeps the
    ``logs`` Trainer's ``log`` hands to ``on_log``."""

    def __init__(self, control: TrainerControl | None) -> None:
        self.control = control
        self.logs: dict[str, Any] | None = None

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs: dict[str, Any]
    ) -> Any:
        self.logs = logs
        return control


class EvaluationEvents:
    """The instance's ``callback_handler`` while its own ``evaluate`` runs at an evaluation point of ``train()``
    (an override's loop, Trainer's own on items that are not columns, trl's): the ``on_log``/``on_evaluate`` it
    fires go to the loop (``EvaluationRun.log``/``evaluate``), so every callback of the run sees them as the
    loop's own (``TrainerCallback``s through the run's handler, and the native ones: best checkpoint, metrics
    file); any other hook or attribute is the run's handler's."""

    _handler: Any
    _run: EvaluationRun
    _routed: Callable[[], AbstractContextManager[object]]
    _hf: HuggingFaceCallbacks | None

    def __init__(
        self,
        handler: CallbackHandler,
        run: EvaluationRun,
        routed: Callable[[], AbstractContextManager[object]],
        hf: HuggingFaceCallbacks | None,
    ) -> None:
        """``routed()``: the scope in which the loop's log is the instance's own (not logged again); ``hf``:
        the run's HF callbacks, whose ``control`` is handed back."""
        object.__setattr__(self, "_handler", handler)
        object.__setattr__(self, "_run", run)
        object.__setattr__(self, "_routed", routed)
        object.__setattr__(self, "_hf", hf)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handler, name)

    def __setattr__(self, name: str, value: object) -> None:
        setattr(self._handler, name, value)  # eval_dataloader, set by Trainer's evaluation_loop

    def on_log(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, logs: dict[str, Any]
    ) -> Any:
        history = state.log_history
        if history and history[-1] == {**logs, "step": state.global_step}:
            history.pop()  # Trainer.log's entry: the run's TrainerState records the loop's log itself
        with self._routed():  # the instance's own log: the loop does not call its log() again
            self._run.log(logs)
        return self._control(control)

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, metrics: dict[str, Any]
    ) -> Any:
        self._run.evaluate(metrics)
        return self._control(control)

    def _control(self, control: TrainerControl) -> TrainerControl:
        hf = self._hf
        return hf.control if hf is not None and hf.control is not None else control
