"""``AttributingCallbackHandler``: transformers' ``CallbackHandler`` calling each ``TrainerCallback`` on its own.

Trainer's handler calls every callback in turn and hands back one ``TrainerControl``.  This one does the
same (same keyword arguments, the flag resets of ``CallbackHandler.on_*`` inherited) and also notes who
turned each flag on, isolates a callback that raises, and skips the callbacks switched off after too many
errors.  Which flags become native requests, and the failure policy, are ``hf.trainer_callbacks``' business.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from typing import Any

from transformers import TrainerCallback, TrainerControl
from transformers.trainer_callback import CallbackHandler

CONTROL_FLAGS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(TrainerControl))
"""``TrainerControl``'s flags (``should_training_stop``, ``should_epoch_stop``, ``should_save``...)."""

SETUP_HOOKS = frozenset({"on_init_end", "on_train_begin"})
"""Hooks where an HF callback's error fails the run before the first step (as any callback's does)."""


class HuggingFaceCallbackError(RuntimeError):
    """A ``transformers.TrainerCallback`` raised; the message names the callback and the hook."""


class AttributingCallbackHandler(CallbackHandler):
    """transformers' ``CallbackHandler`` that isolates each callback and records who turned a flag on.

    Only ``call_event`` is replaced; it calls each callback with the same arguments as transformers'
    ``call_event`` and notes, per flag, the first callback that switched it from False to True
    (``flag_setters``, reset at every event).

    Isolation: an exception of one callback is handed to ``on_error(position, callback, event, exc)`` and
    the next callbacks still run; a callback at a position in ``switched_off`` is skipped;
    ``on_success(position)`` follows a hook a callback implements and ran without error (ending its run of
    consecutive errors).  Without ``on_error`` the exception propagates as a ``HuggingFaceCallbackError``,
    as does one raised in ``on_init_end``/``on_train_begin``.
    """

    flag_setters: dict[str, TrainerCallback]
    on_error: Callable[[int, TrainerCallback, str, Exception], None] | None = None
    on_success: Callable[[int], None] | None = None
    switched_off: AbstractSet[int] = frozenset()

    def call_event(self, event: str, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.flag_setters = {}
        switched_off = self.switched_off
        for position, callback in enumerate(self.callbacks):
            if position in switched_off:
                continue
            before = control_flags(control)
            try:
                result = getattr(callback, event)(
                    args,
                    state,
                    control,
                    model=self.model,
                    processing_class=self.processing_class,
                    optimizer=self.optimizer,
                    lr_scheduler=self.lr_scheduler,
                    train_dataloader=self.train_dataloader,
                    eval_dataloader=self.eval_dataloader,
                    **kwargs,
                )
            except Exception as exc:
                if self.on_error is None or event in SETUP_HOOKS:
                    raise HuggingFaceCallbackError(
                        f"transformers callback {type(callback).__name__}.{event} raised {type(exc).__name__}: {exc}"
                    ) from exc
                self.on_error(position, callback, event, exc)
                continue
            if self.on_success is not None and implements(callback, event):
                self.on_success(position)
            # A callback can skip returning `control` if it doesn't change it.
            if result is not None:
                control = result
            for name, value in control_flags(control).items():
                if value and not before[name]:
                    self.flag_setters.setdefault(name, callback)
        return control


def is_hf_callback(obj: Any) -> bool:
    """A ``transformers.TrainerCallback`` instance or subclass."""
    return isinstance(obj, TrainerCallback) or (isinstance(obj, type) and issubclass(obj, TrainerCallback))


_IMPLEMENTS: dict[tuple[type, str], bool] = {}


def implements(callback: Any, hook: str) -> bool:
    """Whether ``callback``'s class (or ``callback``, a class) implements ``hook`` itself (not
    ``TrainerCallback``'s no-op)."""
    cls = callback_class(callback)
    key = (cls, hook)
    known = _IMPLEMENTS.get(key)
    if known is None:
        known = _IMPLEMENTS[key] = getattr(cls, hook, None) is not getattr(TrainerCallback, hook, None)
    return known


def callback_class(cb: Any) -> type:
    """``cb`` itself when it is a class, else its class."""
    return cb if isinstance(cb, type) else type(cb)


def control_flags(control: TrainerControl) -> dict[str, bool]:
    """Every flag of ``control`` and whether it is on."""
    return {name: bool(getattr(control, name)) for name in CONTROL_FLAGS}
