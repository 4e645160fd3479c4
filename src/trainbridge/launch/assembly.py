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
    EmptyDeviceCache,
    ExternalControl,
    MetricScheduleStepper,
    MetricsFileCallback,
    ProgressBarCallback,
    SaveOnInterrupt,
    ScheduleCallback,
    UnderflowOverflow,
)
from trainbridge.core.callback import Callback, FunctionCallback
from trainbridge.core.config import CallbackSpec, RunPlan, TrainingArgs


def assemble_callbacks(args: TrainingArgs, plan: RunPlan) -> list[Callback]:
    """The worker's callback list for ``args`` running ``plan``, in dispatch order.

    ``ScheduleCallback`` first (like transformers' DefaultFlowCallback), then the user's callbacks (the
    arguments' ``CallbackSpec``s, then the plan's) in registration order — all Hugging Face ones driven by one
    ``HuggingFaceCallbacks`` placed where the first of them was — then event functions, then best-checkpoint
    tracking, the metrics file, outside control (``trainbridge control``), saving on SIGTERM
    (``save_on_interrupt``), emptying the device cache (``torch_empty_cache_steps``) and, when no
    ``HuggingFaceCallbacks`` brings transformers' own progress callback, the native progress bar.
    """
    user = [c.build() if isinstance(c, CallbackSpec) else c for c in (*args.callbacks, *plan.callbacks)]
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
    functions: list[Callback] = [FunctionCallback(e, fn) for e, fns in plan.event_functions.items() for fn in fns]
    tail: list[Callback] = [MetricScheduleStepper(), BestCheckpointTracker(), MetricsFileCallback()]
    if args.external_control:
        tail.append(ExternalControl())
    if args.save_on_interrupt:
        tail.append(SaveOnInterrupt())
    if args.torch_empty_cache_steps is not None:
        tail.append(EmptyDeviceCache())
    if args.debug_underflow_overflow:
        tail.append(UnderflowOverflow())
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
