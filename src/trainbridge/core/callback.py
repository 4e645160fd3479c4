"""The native callback API: subclass ``Callback`` and override the events you need.

Every event arrives through ``run_event(event, context, **kwargs)``, which calls the hook of the same
name (keyword arguments: ``core.events.EVENT_MAP``); only the events a callback ``handles`` (by default,
the hooks it overrides) are delivered.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from trainbridge.core.callback_errors import CallbackErrorReport
from trainbridge.core.events import Event

if TYPE_CHECKING:
    from trainbridge.core.config import TrainingArgs
    from trainbridge.core.context import TrainingContext


class Callback:
    """Base class of native callbacks.  Hooks fire on every rank, in registration order.

    Class attributes:
      - ``nonblocking``: run this observer on a background worker with a snapshot of the context
        taken at the event (scalars, and deep copies of ``metrics``, ``logs`` and ``user_state``;
        no model, optimizer or dataloaders; it may not request control; its errors are isolated
        like any other).
      - ``rank_zero_only``: call this callback on global rank 0 only.
      - ``always_restore_state``: see below.
    """

    nonblocking: ClassVar[bool] = False
    rank_zero_only: ClassVar[bool] = False
    always_restore_state: ClassVar[bool] = False
    """The state is run bookkeeping (schedule, best metric, TrainerState), restored on resume even when
    ``restore_callback_states`` is off; that switch governs user callbacks' own state."""

    state_id: str | None = None
    """Tells apart several callbacks of one class in checkpoints (set it on the instance, e.g.
    ``cb.state_id = "fast"``, or in a subclass): the state is saved under ``Class[state_id]``."""

    @property
    def name(self) -> str:
        """Name used in logs, error reports and control requesters."""
        return type(self).__name__

    @property
    def state_key(self) -> str:
        """Key of this callback's state in a checkpoint (as Lightning's ``Callback.state_key``): the
        class's qualified name, plus ``[state_id]`` when one is set.  Stable when callbacks are added,
        removed or reordered between a save and a resume."""
        qualname = type(self).__qualname__
        return qualname if self.state_id is None else f"{qualname}[{self.state_id}]"

    # ---------------------------------------------------------------- dispatch
    def run_event(self, event: Event, context: TrainingContext, **kwargs: Any) -> None:
        """Deliver ``event``: call the hook of the same name with ``(context, **kwargs)``."""
        getattr(self, event)(context, **kwargs)  # an Event is the str of its method name (no .value lookup)

    def handles(self, event: Event) -> bool:
        """Whether ``event`` is delivered to this callback (the manager indexes only those): by default,
        whether this class overrides the event's hook."""
        method = getattr(type(self), event.value, None)
        return method is not None and method is not getattr(Callback, event.value)

    # ---------------------------------------------------------------- lifecycle hooks
    def on_init_end(self, context: TrainingContext, **kwargs: Any) -> None:
        """After setup, before anything trains."""

    def on_train_begin(self, context: TrainingContext, **kwargs: Any) -> None:
        """Before the first epoch."""

    def on_epoch_begin(self, context: TrainingContext, **kwargs: Any) -> None:
        """At the start of each epoch."""

    def on_step_begin(self, context: TrainingContext, **kwargs: Any) -> None:
        """Before each optimizer step's first micro-batch."""

    def on_before_forward(self, context: TrainingContext, **kwargs: Any) -> None:
        """Before each micro-batch's forward pass (``batch``)."""

    def on_after_forward(self, context: TrainingContext, **kwargs: Any) -> None:
        """After each forward pass (``batch``, ``loss``)."""

    def on_before_backward(self, context: TrainingContext, **kwargs: Any) -> None:
        """Before each backward pass (``loss``)."""

    def on_after_backward(self, context: TrainingContext, **kwargs: Any) -> None:
        """After each backward pass."""

    def on_substep_end(self, context: TrainingContext, **kwargs: Any) -> None:
        """After each micro-batch that is not the step's last."""

    def on_pre_optimizer_step(self, context: TrainingContext, **kwargs: Any) -> None:
        """Gradients complete and clipped, not yet applied (``context.grad_norm`` set)."""

    def on_optimizer_step(self, context: TrainingContext, **kwargs: Any) -> None:
        """After ``optimizer.step()``."""

    def on_step_end(self, context: TrainingContext, **kwargs: Any) -> None:
        """After each optimizer step (``context.global_step`` advanced)."""

    def on_log(self, context: TrainingContext, **kwargs: Any) -> None:
        """When values are logged (``logs``)."""

    def on_prediction_step(self, context: TrainingContext, **kwargs: Any) -> None:
        """After each validation batch (``batch``)."""

    def on_evaluate(self, context: TrainingContext, **kwargs: Any) -> None:
        """After validation (``metrics``)."""

    def on_save(self, context: TrainingContext, **kwargs: Any) -> None:
        """After a checkpoint is complete on disk (``checkpoint_path``)."""

    def on_epoch_end(self, context: TrainingContext, **kwargs: Any) -> None:
        """At the end of each epoch."""

    def on_train_end(self, context: TrainingContext, **kwargs: Any) -> None:
        """On every clean end of training."""

    def on_exception(self, context: TrainingContext, **kwargs: Any) -> None:
        """On every exit that is not clean (``exception``)."""

    # ---------------------------------------------------------------- configuration and state
    def validate(self, args: TrainingArgs) -> None:
        """Check this callback against the run's config; raise to fail the run before launch."""

    def state_dict(self) -> Mapping[str, Any] | None:
        """JSON-serialisable state saved in every checkpoint (None: stateless)."""
        return None

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the state saved by ``state_dict`` when a run resumes."""

    def close(self, context: TrainingContext) -> None:
        """Release what the callback holds (files, progress bars, clients) once the run is over, clean or
        not: called once on each rank where the callback runs, after ``on_train_end`` or ``on_exception``
        and after non-blocking observers drained (as Composer's ``Callback.close``)."""

    def checkpoint_files(self, context: TrainingContext) -> Mapping[str, str | bytes]:
        """Extra files (name -> text, or bytes for a binary file) written into each checkpoint directory,
        atomically with it."""
        return {}

    def error_reports(self, rank: int) -> list[CallbackErrorReport]:
        """Errors of callbacks this callback runs itself, isolated by it (``HuggingFaceCallbacks`` isolates
        each ``TrainerCallback`` it drives); the manager adds them to the run's error report."""
        return []


class FunctionCallback(Callback):
    """A plain function registered for one event: ``fn(context, **event_kwargs)``."""

    def __init__(self, event: Event, fn: Callable[..., Any]):
        self.event = event
        self.fn = fn
        setattr(self, event.value, fn)  # ``callback.on_save(context)`` works too

    def run_event(self, event: Event, context: TrainingContext, **kwargs: Any) -> None:
        self.fn(context, **kwargs)

    @property
    def name(self) -> str:
        return f"{self.event.value}={getattr(self.fn, '__qualname__', repr(self.fn))}"

    def handles(self, event: Event) -> bool:
        return event is self.event


def rank_zero_only(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a hook (or an event function) so it runs on global rank 0 only.

    Works on methods ``hook(self, context, ...)`` and functions ``fn(context, ...)``: the first argument
    that has ``is_world_process_zero`` decides.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        for arg in args[:2]:
            if hasattr(arg, "is_world_process_zero"):
                if not arg.is_world_process_zero:
                    return None
                break
        return fn(*args, **kwargs)

    return wrapper
