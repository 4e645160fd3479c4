"""``EvaluationPoint``: what the run plan's ``evaluation`` seam (a Trainer's own ``evaluate``) gets at each
evaluation point of the loop (``core.config.plan.EvaluationRun``)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from trainbridge.core.context import TrainingContext
from trainbridge.core.dispatch import CallbackManager
from trainbridge.core.events import Event
from trainbridge.parallel.engine import TrainingEngine


class EvaluationPoint:
    """Calling it runs the loop's own evaluation of the run's sets (``run_sets``); ``log``/``evaluate`` hand
    the loop what an evaluation of the seam's own (Trainer's ``evaluate``, an override's loop, trl's) logs and
    evaluates, fired to every callback as the loop fires its own:
    best-checkpoint tracking, the metrics file, ``TrainerCallback``s (through ``HuggingFaceCallbacks``), native
    callbacks.  ``model`` is the engine's model (DDP's wrapper, the FSDP2-sharded module...), the one such an
    evaluation runs, in the engine's precision (``autocast``)."""

    def __init__(
        self,
        run_sets: Callable[[], dict[str, float]],
        callbacks: CallbackManager,
        context: TrainingContext,
        engine: TrainingEngine,
    ) -> None:
        self._run_sets, self._callbacks, self._context = run_sets, callbacks, context
        self._engine = engine
        self.model: Any = engine.module
        self.evaluated = False
        """Whether ``on_evaluate`` fired during this evaluation (the loop's own, or handed to ``evaluate``)."""

    def __call__(self) -> dict[str, float]:
        self.evaluated = True
        return self._run_sets()

    def autocast(self) -> AbstractContextManager[Any]:
        """The engine's forward precision (bf16/fp16 autocast, or nothing)."""
        return self._engine.autocast()

    def log(self, logs: dict[str, Any]) -> None:
        """``on_log`` with ``logs`` (completed in place by the callbacks, as the loop's own logs are)."""
        self._callbacks.fire(Event.LOG, self._context, logs=logs)

    def evaluate(self, metrics: dict[str, Any]) -> None:
        """``on_evaluate`` with ``metrics``, which become the context's latest metrics."""
        self.evaluated = True
        self._context.metrics = dict(metrics)
        self._callbacks.fire(Event.EVALUATE, self._context, metrics=metrics)
