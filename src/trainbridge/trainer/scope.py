"""``LoopScope``: the loop's presence in one call it makes into the script's Trainer instance.

``ScriptTrainer.call`` (``trainer.subclass``) installs it as the instance's ``_in_loop`` for the call and restores
the one around it afterwards (as Lightning's ``_call_lightning_module_hook``); None: the script itself is calling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState

    from trainbridge.core.config.plan import EvaluationRun, ModelPart
    from trainbridge.hf.stand_in_handlers import LogCapture


@dataclass(frozen=True)
class LoopScope:
    """What the loop hands the instance for one call; ``state``, ``handler``, ``control`` and ``model`` are set
    on it (``model`` as ``model_wrapped``) for the call, as Trainer's own code reads them there."""

    state: TrainerState | None = None
    """The run's live ``TrainerState`` (None before the run's HF callbacks have one)."""
    handler: Any = None
    """The run's callback handler, or what stands in for it (``EvaluationEvents``, a ``LogCapture``)."""
    control: TrainerControl | None = None
    model: Any = None
    """The engine's model (``model_wrapped``); None: the one of the scope around, else unchanged."""
    evaluation: EvaluationRun | None = None
    """At an evaluation point, with the run's own sets: ``evaluate()`` is the loop's evaluation."""
    log: LogCapture | None = None
    """While ``log()`` runs for one of the loop's logs: what it hands to ``on_log`` is kept here."""
    routed: bool = False
    """While a log of the instance's own evaluation goes to the loop: the loop does not call ``log()`` again."""
    checkpoint: ModelPart | None = None
    """While a checkpoint's model files are written (``trainer.save_overrides``)."""
