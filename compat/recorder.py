"""What the compat suite records in a run: every callback hook (``TraceRecorder``) and which
``TrainingArguments`` / ``TrainerState`` attributes each Hugging Face callback class reads
(``AttributeAccessLog``).

Both run the same way under ``transformers.Trainer`` and under trainbridge: ``TraceRecorder`` is an
ordinary ``TrainerCallback`` put *last* in the callback list, so the control flags it records are the
flags after every other callback has run for that hook.  Each rank appends one JSON line per hook to
``trace-rank{r}.jsonl`` (line-buffered, so a run that crashes still leaves its trace up to the crash).
"""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from transformers import (
    DefaultFlowCallback,
    EarlyStoppingCallback,
    PrinterCallback,
    ProgressCallback,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)
from transformers.integrations.integration_utils import MLflowCallback, TensorBoardCallback, WandbCallback

from trainbridge import Callback
from trainbridge.core.context import TrainingContext

CONTROL_FLAGS = ("should_training_stop", "should_epoch_stop", "should_save", "should_evaluate", "should_log")
"""The ``TrainerControl`` flags, in a fixed order."""

HOOKS = tuple(sorted(name for name in vars(TrainerCallback) if name.startswith("on_")))
"""Every hook a ``TrainerCallback`` can implement."""

OBSERVED_CALLBACK_CLASSES: tuple[type[TrainerCallback], ...] = (
    DefaultFlowCallback,
    ProgressCallback,
    PrinterCallback,
    EarlyStoppingCallback,
    TensorBoardCallback,
    MLflowCallback,
    WandbCallback,
)
"""The transformers callback classes whose hooks and attribute reads the report lists."""

EPOCH_DIGITS = 4
"""``state.epoch`` is recorded rounded to this many digits (Trainer and trainbridge compute it differently)."""


def trace_path(trace_dir: str | Path, rank: int) -> Path:
    """The JSONL trace file of ``rank`` in ``trace_dir``."""
    return Path(trace_dir) / f"trace-rank{rank}.jsonl"


def read_trace(trace_dir: str | Path, rank: int) -> list[dict[str, Any]]:
    """The recorded snapshots of ``rank`` (an empty list when the rank recorded nothing)."""
    path = trace_path(trace_dir, rank)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def type_map(values: Any) -> dict[str, str] | None:
    """``{key: type name}`` of a logs/metrics dict (None when the hook got none)."""
    if values is None:
        return None
    return {str(key): type(value).__name__ for key, value in sorted(values.items())}


def relative_checkpoint(path: str | None, output_dir: str) -> str | None:
    """``best_model_checkpoint`` relative to ``output_dir`` (absolute paths differ between runners)."""
    if path is None:
        return None
    try:
        return str(Path(path).resolve().relative_to(Path(output_dir).resolve()))
    except ValueError:
        return str(path)


def snapshot(
    event: str, args: TrainingArguments, state: TrainerState, control: TrainerControl, kwargs: dict[str, Any]
) -> dict[str, Any]:
    """The normalised view of one hook call that the suite compares between runners."""
    return {
        "event": event,
        "global_step": state.global_step,
        "epoch": round(float(state.epoch), EPOCH_DIGITS) if state.epoch is not None else None,
        "max_steps": state.max_steps,
        "num_train_epochs": state.num_train_epochs,
        "logs": type_map(kwargs.get("logs")),
        "metrics": type_map(kwargs.get("metrics")),
        "best_metric": None if state.best_metric is None else type(state.best_metric).__name__,
        "best_global_step": state.best_global_step,
        "best_model_checkpoint": relative_checkpoint(state.best_model_checkpoint, args.output_dir),
        "control": {flag: bool(getattr(control, flag)) for flag in CONTROL_FLAGS},
        "kwargs": sorted(kwargs),
        "none_kwargs": sorted(name for name, value in kwargs.items() if value is None),
        "num_input_tokens_seen": state.num_input_tokens_seen,
    }


class TraceRecorder(TrainerCallback):
    """Appends a ``snapshot`` of every hook to ``trace_dir/trace-rank{r}.jsonl`` (put it last)."""

    def __init__(self, trace_dir: str) -> None:
        self.trace_dir = str(trace_dir)
        self._file: IO[str] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"trace_dir": self.trace_dir, "_file": None}

    def _record(
        self, event: str, args: TrainingArguments, state: TrainerState, control: TrainerControl, kwargs: dict[str, Any]
    ) -> None:
        if self._file is None:
            path = trace_path(self.trace_dir, args.process_index)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = path.open("a", buffering=1)
        self._file.write(json.dumps(snapshot(event, args, state, control, kwargs)) + "\n")

    def on_init_end(self, args, state, control, **kwargs):
        self._record("on_init_end", args, state, control, kwargs)

    def on_train_begin(self, args, state, control, **kwargs):
        self._record("on_train_begin", args, state, control, kwargs)

    def on_train_end(self, args, state, control, **kwargs):
        self._record("on_train_end", args, state, control, kwargs)
        if self._file is not None:
            self._file.close()
            self._file = None

    def on_epoch_begin(self, args, state, control, **kwargs):
        self._record("on_epoch_begin", args, state, control, kwargs)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._record("on_epoch_end", args, state, control, kwargs)

    def on_step_begin(self, args, state, control, **kwargs):
        self._record("on_step_begin", args, state, control, kwargs)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._record("on_pre_optimizer_step", args, state, control, kwargs)

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._record("on_optimizer_step", args, state, control, kwargs)

    def on_substep_end(self, args, state, control, **kwargs):
        self._record("on_substep_end", args, state, control, kwargs)

    def on_step_end(self, args, state, control, **kwargs):
        self._record("on_step_end", args, state, control, kwargs)

    def on_evaluate(self, args, state, control, **kwargs):
        self._record("on_evaluate", args, state, control, kwargs)

    def on_predict(self, args, state, control, **kwargs):
        self._record("on_predict", args, state, control, kwargs)

    def on_save(self, args, state, control, **kwargs):
        self._record("on_save", args, state, control, kwargs)

    def on_log(self, args, state, control, **kwargs):
        self._record("on_log", args, state, control, kwargs)

    def on_prediction_step(self, args, state, control, **kwargs):
        self._record("on_prediction_step", args, state, control, kwargs)

    def on_push_begin(self, args, state, control, **kwargs):
        self._record("on_push_begin", args, state, control, kwargs)


# ============================================================================ attribute access
def overridden_hooks(cls: type) -> list[str]:
    """The hooks ``cls`` implements itself (differ from ``TrainerCallback``'s no-op)."""
    return [hook for hook in HOOKS if getattr(cls, hook) is not getattr(TrainerCallback, hook)]


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    """``code`` and every code object nested in it (comprehensions, lambdas, inner functions)."""
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


def _functions_of(cls: type) -> Iterator[types.FunctionType]:
    for value in vars(cls).values():
        if isinstance(value, staticmethod | classmethod):
            value = value.__func__
        if isinstance(value, property):
            yield from (f for f in (value.fget, value.fset) if isinstance(f, types.FunctionType))
        elif isinstance(value, types.FunctionType):
            yield value


class AttributeAccessLog:
    """Records the ``TrainingArguments`` / ``TrainerState`` attributes read by code of given classes.

    ``install()`` replaces ``__getattribute__`` of both classes (class-level, so the objects callbacks
    receive stay real instances); every access whose *calling frame* is a function defined in one of
    ``classes`` (methods, and code nested in them) is logged under that class.  ``restore()`` puts
    the original ``__getattribute__`` back.  Only direct reads count: what ``args.to_dict()`` reads
    internally is not the callback's read, ``to_dict`` is.
    """

    TARGETS: tuple[tuple[str, type], ...] = (("args", TrainingArguments), ("state", TrainerState))

    def __init__(self, classes: Iterable[type]) -> None:
        self.owners: dict[types.CodeType, str] = {}
        for cls in classes:
            for function in _functions_of(cls):
                for code in _code_objects(function.__code__):
                    self.owners.setdefault(code, cls.__name__)
        self.reads: dict[str, dict[str, set[str]]] = {}
        self._saved: list[tuple[type, Any]] = []

    def install(self) -> None:
        """Start recording (idempotent)."""
        if self._saved:
            return
        for kind, target in self.TARGETS:
            previous = target.__dict__.get("__getattribute__")
            self._saved.append((target, previous))
            target.__getattribute__ = self._recording(kind, target.__getattribute__)  # type: ignore[method-assign]

    def restore(self) -> None:
        """Stop recording and restore both classes exactly."""
        for target, previous in self._saved:
            if previous is None:
                del target.__getattribute__
            else:
                target.__getattribute__ = previous  # type: ignore[method-assign]
        self._saved = []

    def _recording(self, kind: str, original: Any) -> Any:
        owners, reads = self.owners, self.reads

        def __getattribute__(obj: Any, name: str) -> Any:
            owner = owners.get(sys._getframe(1).f_code)
            if owner is not None:
                reads.setdefault(owner, {"args": set(), "state": set()})[kind].add(name)
            return original(obj, name)

        return __getattribute__

    def as_json(self) -> dict[str, dict[str, list[str]]]:
        """``{class name: {"args": [...], "state": [...]}}`` with sorted attribute names."""
        return {
            owner: {kind: sorted(names) for kind, names in kinds.items()} for owner, kinds in sorted(self.reads.items())
        }

    def write(self, path: str | Path) -> None:
        """Write ``as_json()`` to ``path``."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.as_json(), indent=1, sort_keys=True))


def access_path(trace_dir: str | Path, rank: int) -> Path:
    """Where ``rank`` writes its attribute-access log."""
    return Path(trace_dir) / f"access-rank{rank}.json"


class AttributeAccessProbe(Callback):
    """trainbridge-side installer of ``AttributeAccessLog``: a *native* callback placed before the HF
    ones, so recording covers every HF ``on_init_end``; its ``closer()`` goes after them and ends the
    recording once every HF ``on_train_end`` has run (or on ``on_exception``)."""

    def __init__(self, classes: Iterable[type], trace_dir: str) -> None:
        self.class_paths = [f"{cls.__module__}:{cls.__qualname__}" for cls in classes]
        self.trace_dir = str(trace_dir)
        self._log: AttributeAccessLog | None = None
        self._rank = 0

    def __getstate__(self) -> dict[str, Any]:
        return {"class_paths": self.class_paths, "trace_dir": self.trace_dir, "_log": None, "_rank": 0}

    def closer(self) -> AttributeAccessProbeCloser:
        """The callback to put after the HF callbacks."""
        return AttributeAccessProbeCloser(self)

    def on_init_end(self, context: TrainingContext, **kwargs: Any) -> None:
        from trainbridge.core.config import resolve_import_path

        self._rank = context.rank
        self._log = AttributeAccessLog(resolve_import_path(p) for p in self.class_paths)
        self._log.install()

    def on_exception(self, context: TrainingContext, **kwargs: Any) -> None:
        self.finish()

    def finish(self) -> None:
        """Restore the classes and write the log (safe to call twice)."""
        if self._log is not None:
            self._log.restore()
            self._log.write(access_path(self.trace_dir, self._rank))
            self._log = None


class AttributeAccessProbeCloser(Callback):
    """Ends an ``AttributeAccessProbe``'s recording at ``on_train_end`` (placed after the HF callbacks)."""

    def __init__(self, probe: AttributeAccessProbe) -> None:
        self.probe = probe

    def on_train_end(self, context: TrainingContext, **kwargs: Any) -> None:
        self.probe.finish()
