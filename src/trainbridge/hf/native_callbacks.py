"""trainbridge's own callbacks in a ``Trainer``'s ``callbacks=`` / ``add_callback``.

Trainer's ``CallbackHandler`` calls every callback it holds with ``(args, state, control)``; a native
``trainbridge.Callback`` (or a plain function, a ``CallbackSpec``) takes a ``TrainingContext``.  So the
handler holds each native one inside a ``NativeCallback``, a ``TrainerCallback`` that does nothing on
Trainer's events, and ``train()`` hands the loop the native callback itself (``unwrapped``), where it gets
every event with its context.  ``pop_callback``/``remove_callback`` find it by its object or its class.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, TypeAlias

from transformers import TrainerCallback, TrainingArguments
from transformers.trainer_callback import CallbackHandler

from trainbridge.core.callback import Callback
from trainbridge.hf.handler import is_hf_callback

AnyCallback: TypeAlias = "TrainerCallback | type[TrainerCallback] | Callback | type[Callback] | Callable[..., Any]"
"""What ``callbacks=`` / ``add_callback`` take: a ``TrainerCallback`` or a native callback, object or class."""


class NativeCallback(TrainerCallback):
    """A native callback held by Trainer's ``CallbackHandler`` (silent there; the loop runs ``native``)."""

    def __init__(self, native: AnyCallback) -> None:
        self.native = native

    def __repr__(self) -> str:
        return f"NativeCallback({self.native!r})"


_HOLDERS: dict[Any, type[NativeCallback]] = {}


def held(callback: AnyCallback) -> Any:
    """``callback`` as Trainer's handler may hold it: a ``TrainerCallback`` as it is, anything else (a class
    instantiated, as Trainer's handler does) wrapped in a ``NativeCallback`` subclass named after it (the
    handler warns when one class is added twice)."""
    if is_hf_callback(callback) or isinstance(callback, NativeCallback):
        return callback
    if isinstance(callback, type):
        callback = callback()  # a class is instantiated, as Trainer's handler does
    kind = callback if inspect.isfunction(callback) else type(callback)
    holder = _HOLDERS.get(kind)
    if holder is None:
        holder = _HOLDERS[kind] = type(f"Native[{kind.__qualname__}]", (NativeCallback,), {})
    return holder(callback)


def held_all(callbacks: list[AnyCallback] | None) -> list[Any] | None:
    """A ``callbacks=`` argument with each native callback wrapped (None stays None)."""
    return None if callbacks is None else [held(cb) for cb in callbacks]


def unwrapped(callback: AnyCallback) -> AnyCallback:
    """What the loop runs for a callback of Trainer's handler."""
    return callback.native if isinstance(callback, NativeCallback) else callback


def matches(holder: TrainerCallback, callback: AnyCallback) -> bool:
    """Whether the handler's ``holder`` is ``callback`` (an object, or a class: any of its instances)."""
    native = unwrapped(holder)
    if isinstance(callback, type):
        return isinstance(native, callback) or native is callback
    return native is callback or holder is callback


def find(handler: CallbackHandler, callback: AnyCallback) -> TrainerCallback | None:
    """The first callback of ``handler`` that ``matches`` ``callback``, or None."""
    return next((cb for cb in handler.callbacks if matches(cb, callback)), None)


def held_in_arguments(
    init: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``init``'s (a Trainer class's constructor) arguments with each native callback of ``callbacks`` held
    in a ``TrainerCallback`` (``held``), which Trainer's handler can call."""
    bound = inspect.signature(init).bind_partial(*args, **kwargs)
    if bound.arguments.get("callbacks") is None:
        return args, kwargs
    bound.arguments["callbacks"] = held_all(bound.arguments["callbacks"])
    return bound.args, bound.kwargs


def script_callbacks(handler: CallbackHandler, hf_args: TrainingArguments) -> list[AnyCallback]:
    """The callbacks ``handler`` (a Trainer's) holds that are the script's (``callbacks=``, ``add_callback``),
    unwrapped, not the ones Trainer adds itself (flow, ``report_to``'s, ``enable_jit_checkpoint``'s: the loop has
    its own, ``save_on_interrupt``); its printer or progress bar stays in its place, so a callback added after
    it sees what its ``on_log`` left, as under Trainer."""
    from transformers import DefaultFlowCallback
    from transformers.integrations import get_reporting_integration_callbacks

    own: tuple[type, ...] = (DefaultFlowCallback,)
    if getattr(hf_args, "enable_jit_checkpoint", False):
        from transformers.trainer_jit_checkpoint import JITCheckpointCallback

        own = (*own, JITCheckpointCallback)
    reporting = tuple(get_reporting_integration_callbacks(hf_args.report_to))
    return [unwrapped(cb) for cb in handler.callbacks if type(cb) not in own and type(cb) not in reporting]
