"""The callback list of a run, in dispatch order: built-ins, the user's callbacks, event functions.

Used by the worker (to run them) and by the launcher's preflight (to validate them in the parent
before launch), so both see exactly the same callbacks.  ``HuggingFaceCallbacks`` is imported only
when there is an HF callback or a ``report_to`` integration.
"""

from __future__ import annotations

import sys
from typing import Any

from trainbridge.callbacks import (
    BestCheckpointTracker,
    ExternalControl,
    MetricsFileCallback,
    ProgressBarCallback,
    SaveOnInterrupt,
    ScheduleCallback,
)
from trainbridge.core.callback import Callback, FunctionCallback
from trainbridge.core.config import CallbackSpec, TrainingArgs, resolve_import_path


class NotACallbackError(TypeError):
    """A ``CallbackSpec`` names something that is not a callback class; it was not called."""


def is_callback_class(cls: Any) -> bool:
    """Whether ``cls`` is a ``trainbridge.Callback`` or ``transformers.TrainerCallback`` subclass (the latter
    recognised by its bases' names, without importing transformers)."""
    if not isinstance(cls, type):
        return False
    return issubclass(cls, Callback) or any(
        base.__name__ == "TrainerCallback" and base.__module__ == "transformers.trainer_callback"
        for base in cls.__mro__
    )


def build_spec(spec: CallbackSpec) -> Any:
    """Instantiate a ``CallbackSpec``'s class with its kwargs, once it is known to be a callback class: a
    config naming any other class or function (``subprocess:Popen``) never gets it called (``NotACallbackError``)."""
    target = resolve_import_path(spec.class_path)
    if not is_callback_class(target):
        what = f"the class {target.__module__}.{target.__qualname__}" if isinstance(target, type) else repr(target)
        raise NotACallbackError(f"class: {spec.class_path!r} is {what}, not a subclass of trainbridge.Callback or "
                        "transformers.TrainerCallback; it was not called")
    return target(**spec.kwargs)


def assemble_callbacks(args: TrainingArgs) -> list[Callback]:
    """The worker's callback list, in dispatch order.

    ``ScheduleCallback`` first (like transformers' DefaultFlowCallback), then the user's callbacks in
    registration order — all Hugging Face ones driven by one ``HuggingFaceCallbacks`` placed where the first of them
    was — then event functions, then best-checkpoint tracking, the metrics file, outside control
    (``trainbridge control``), saving on SIGTERM (``save_on_interrupt``) and, when no ``HuggingFaceCallbacks`` brings
    transformers' own progress callback, the native progress bar.
    """
    user = [build_spec(c) if isinstance(c, CallbackSpec) else c for c in args.callbacks]
    hf = _hf_callbacks(user)
    hf_driver = None
    if hf or args.report_to:
        from trainbridge.hf import HuggingFaceCallbacks

        hf_driver = HuggingFaceCallbacks(hf, report_to=args.report_to)
    ordered: list[Callback] = []
    for item in user:
        if any(item is h for h in hf):
            if hf_driver is not None and hf_driver not in ordered:
                ordered.append(hf_driver)
            continue
        if not isinstance(item, Callback):
            raise TypeError(f"callback {item!r} is neither a trainbridge.Callback nor a transformers.TrainerCallback")
        ordered.append(item)
    if hf_driver is not None and hf_driver not in ordered:
        ordered.append(hf_driver)
    functions: list[Callback] = [FunctionCallback(e, fn) for e, fns in args.event_functions.items() for fn in fns]
    tail: list[Callback] = [BestCheckpointTracker(), MetricsFileCallback()]
    if args.external_control:
        tail.append(ExternalControl())
    if args.save_on_interrupt:
        tail.append(SaveOnInterrupt())
    if hf_driver is None:
        tail.append(ProgressBarCallback())
    return [ScheduleCallback(), *ordered, *functions, *tail]


def _hf_callbacks(user: list[Any]) -> list[Any]:
    """The ``transformers.TrainerCallback``s among ``user``.  An HF callback (instance or class) exists
    only once ``transformers.trainer_callback`` is imported, so without it the answer is known without
    importing ``trainbridge.hf`` (and transformers, peft, DeepSpeed behind it): the launcher's start-up."""
    if "transformers.trainer_callback" not in sys.modules:
        return []
    from trainbridge.hf import split_callbacks

    return split_callbacks(user)[1]
