"""The event map: every event the loop fires, where, its keyword arguments, and its Hugging Face twin.

The loop fires each event at one visible place; ``Callback.run_event`` dispatches it by name; ``HuggingFaceCallbacks``
routes every ``hf_twin`` event to the ``TrainerCallback`` hook of the same name.
``tests/unit/test_events.py`` fails when transformers adds a hook that is neither here nor in
``HF_HOOKS_NOT_FIRED``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Event(str, Enum):
    """Every event of the training lifecycle.  The value is the callback method name."""

    INIT_END = "on_init_end"
    TRAIN_BEGIN = "on_train_begin"
    EPOCH_BEGIN = "on_epoch_begin"
    STEP_BEGIN = "on_step_begin"
    BEFORE_FORWARD = "on_before_forward"
    AFTER_FORWARD = "on_after_forward"
    BEFORE_BACKWARD = "on_before_backward"
    AFTER_BACKWARD = "on_after_backward"
    SUBSTEP_END = "on_substep_end"
    PRE_OPTIMIZER_STEP = "on_pre_optimizer_step"
    OPTIMIZER_STEP = "on_optimizer_step"
    STEP_END = "on_step_end"
    LOG = "on_log"
    PREDICTION_STEP = "on_prediction_step"
    EVALUATE = "on_evaluate"
    SAVE = "on_save"
    EPOCH_END = "on_epoch_end"
    TRAIN_END = "on_train_end"
    EXCEPTION = "on_exception"

    @property
    def method(self) -> str:
        """The callback method name for this event (same as the value)."""
        return self.value


@dataclass(frozen=True)
class EventSpec:
    """Where an event fires, the keyword arguments it carries, and whether ``transformers.TrainerCallback``
    has a hook of the same name that ``HuggingFaceCallbacks`` calls for it (``hf_twin``)."""

    event: Event
    fires: str
    kwargs: tuple[str, ...] = ()
    hf_twin: bool = False


EVENT_MAP: dict[Event, EventSpec] = {
    spec.event: spec
    for spec in (
        EventSpec(
            Event.INIT_END,
            "once per worker, after model, optimizer, data and callbacks are built, before any step; "
            "an exception here fails the run before the first step",
            hf_twin=True,
        ),
        EventSpec(
            Event.TRAIN_BEGIN,
            "once, after resume state is restored, before the first epoch; an exception here fails "
            "the run before the first step",
            hf_twin=True,
        ),
        EventSpec(Event.EPOCH_BEGIN, "at the start of every epoch (also a resumed partial one)", hf_twin=True),
        EventSpec(Event.STEP_BEGIN, "once per optimizer step, before its first micro-batch", hf_twin=True),
        EventSpec(Event.BEFORE_FORWARD, "every micro-batch, before the forward pass", ("batch",)),
        EventSpec(Event.AFTER_FORWARD, "every micro-batch, after the forward pass, loss known", ("batch", "loss")),
        EventSpec(Event.BEFORE_BACKWARD, "every micro-batch, before backward", ("loss",)),
        EventSpec(Event.AFTER_BACKWARD, "every micro-batch, after backward (gradients accumulated)"),
        EventSpec(Event.SUBSTEP_END, "after every micro-batch except the last of an optimizer step", hf_twin=True),
        EventSpec(
            Event.PRE_OPTIMIZER_STEP,
            "after gradients are complete and clipped (grad_norm known), before optimizer.step()",
            hf_twin=True,
        ),
        EventSpec(
            Event.OPTIMIZER_STEP, "after optimizer.step(), before zero_grad and the scheduler step", hf_twin=True
        ),
        EventSpec(
            Event.STEP_END,
            "after the optimizer step and scheduler step, global_step advanced; followed by the "
            "step's control agreement",
            hf_twin=True,
        ),
        EventSpec(
            Event.LOG,
            "when logging is agreed (steps, epoch end, train end, evaluation metrics)",
            ("logs",),
            hf_twin=True,
        ),
        EventSpec(Event.PREDICTION_STEP, "every validation batch", ("batch",), hf_twin=True),
        EventSpec(Event.EVALUATE, "after a validation pass, metrics reduced across ranks", ("metrics",), hf_twin=True),
        EventSpec(Event.SAVE, "after a checkpoint is complete on disk", ("checkpoint_path",), hf_twin=True),
        EventSpec(Event.EPOCH_END, "at the end of every epoch (also one cut short by a stop)", hf_twin=True),
        EventSpec(Event.TRAIN_END, "once on every clean exit: end of data, max_steps, agreed stop", hf_twin=True),
        EventSpec(
            Event.EXCEPTION,
            "once on every exit that is not clean: an exception, SIGTERM, a fatal callback error",
            ("exception",),
        ),
    )
}

# transformers hooks with no event of ours, and why (the coverage test accepts these).
HF_HOOKS_NOT_FIRED: dict[str, str] = {
    "on_predict": "fired by Trainer.predict(), a separate inference entry point; training never calls it",
    "on_push_begin": "fired by Trainer.push_to_hub(); trainbridge never pushes to a hub",
}

HF_EVENTS: frozenset[Event] = frozenset(event for event, spec in EVENT_MAP.items() if spec.hf_twin)
"""The events with a ``transformers.TrainerCallback`` twin: ``HuggingFaceCallbacks`` handles exactly these."""


def event_from_name(name: str) -> Event:
    """Parse ``on_save`` / ``save`` into an ``Event``; raises ``ValueError`` listing the valid names."""
    key = name if name.startswith("on_") else f"on_{name}"
    try:
        return Event(key)
    except ValueError:
        valid = ", ".join(e.value for e in Event)
        raise ValueError(f"unknown event {name!r}; valid events: {valid}") from None
