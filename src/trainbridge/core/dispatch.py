"""``CallbackManager``: dispatch, failure policy, non-blocking observers and callback state.

- Dispatch: an index built once maps each event to the callbacks that override it, in registration
  order; an event nobody handles costs one dictionary lookup and one branch.
- Failure policy: an error in ``on_init_end``/``on_train_begin`` fails the run before the first step
  (``CallbackSetupError``, naming the callback, with its traceback).  Later errors are *isolated* by
  default: logged once with the traceback, counted, reported in the result, and a callback failing
  ``callback_max_consecutive_errors`` times in a row is switched off.  Under the ``fatal`` policy any
  error requests ``ControlFlag.ABORT``: at the next decision point every rank stops cleanly and the
  run fails with ``CallbackFatalError``.
- Non-blocking observers (``Callback.nonblocking = True``) run on a background thread with a
  snapshot of the context, fed by a bounded queue drained at train end with a timeout; they cannot
  request control.
- State: each callback's ``state_dict`` is saved under its ``state_key`` (class qualname, plus
  ``[state_id]`` when set), so adding, removing or reordering callbacks between a save and a resume
  keeps every state with its callback; a missing or unclaimed state is a warning naming the key.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
import traceback
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trainbridge.core.agreement import ControlFlag, ControlRequests
from trainbridge.core.callback import Callback
from trainbridge.core.callback_errors import CallbackErrorLedger, CallbackErrorReport
from trainbridge.core.context import TrainingContext
from trainbridge.core.events import Event

if TYPE_CHECKING:
    from trainbridge.core.config import TrainingArgs

logger = logging.getLogger(__name__)

SETUP_EVENTS = frozenset({Event.INIT_END, Event.TRAIN_BEGIN})


class CallbackSetupError(RuntimeError):
    """A callback failed in ``on_init_end`` or ``on_train_begin``: the run fails before the first step."""


class CallbackFatalError(RuntimeError):
    """A callback failed under ``callback_error_policy='fatal'``; every rank stopped."""


class _NoControlRequests(ControlRequests):
    """The requests object a non-blocking observer's snapshot carries: requesting control is an error."""

    def request(self, flag: ControlFlag, source_index: int = 0, reason: str = "") -> None:
        raise RuntimeError("non-blocking observers cannot request control (they run after the fact)")


@dataclass
class _Entry:
    index: int
    callback: Callback


@dataclass
class _Observers:
    """A background thread running non-blocking observers from a bounded queue."""

    maxsize: int
    work: queue.Queue[Any] = field(init=False)
    thread: threading.Thread | None = None
    dropped: int = 0

    def __post_init__(self) -> None:
        self.work = queue.Queue(self.maxsize)


class CallbackManager:
    """Owns the callbacks of one worker and dispatches events to them."""

    def __init__(
        self,
        callbacks: Iterable[Callback],
        *,
        error_policy: str = "isolate",
        max_consecutive_errors: int = 3,
        is_world_process_zero: bool = True,
        queue_size: int = 256,
        drain_timeout_s: float = 30.0,
    ):
        self.callbacks: list[Callback] = list(callbacks)
        for cb in self.callbacks:
            if not isinstance(cb, Callback):
                raise TypeError(f"{cb!r} is not a trainbridge.Callback")
        self.error_policy = error_policy
        self.max_consecutive_errors = max_consecutive_errors
        self.drain_timeout_s = drain_timeout_s
        self._errors = CallbackErrorLedger(error_policy, max_consecutive_errors)
        self._observers = _Observers(queue_size)
        self._state_keys = _unique_state_keys(self.callbacks)
        self._active = [cb for cb in self.callbacks if is_world_process_zero or not cb.rank_zero_only]
        self._closed = False
        self._index: dict[Event, list[_Entry]] = {event: [] for event in Event}
        for i, cb in enumerate(self.callbacks, start=1):
            if cb.rank_zero_only and not is_world_process_zero:
                continue
            for event in Event:
                if cb.handles(event):
                    self._index[event].append(_Entry(i, cb))

    @classmethod
    def of_run(cls, callbacks: Iterable[Callback], args: TrainingArgs, is_world_process_zero: bool) -> CallbackManager:
        """The manager of a run of ``args`` (its callback error policy and non-blocking queue settings)."""
        return cls(
            callbacks,
            error_policy=args.callback_error_policy,
            max_consecutive_errors=args.callback_max_consecutive_errors,
            is_world_process_zero=is_world_process_zero,
            queue_size=args.nonblocking_queue_size,
            drain_timeout_s=args.nonblocking_drain_timeout_s,
        )

    # ------------------------------------------------------------------ naming
    @property
    def source_names(self) -> list[str]:
        """Names by source index: 0 is the loop itself, ``i`` the i-th registered callback."""
        return ["loop", *(cb.name for cb in self.callbacks)]

    def handlers(self, event: Event) -> list[Callback]:
        """Callbacks called for ``event``, in order (disabled ones excluded)."""
        return [e.callback for e in self._index[event]]

    # ------------------------------------------------------------------ dispatch
    def fire(self, event: Event, context: TrainingContext, **kwargs: Any) -> None:
        """Call every callback that handles ``event`` with ``(context, **kwargs)``, in order."""
        entries = self._index[event]
        if not entries:
            return
        for entry in list(entries):
            if entry.callback.nonblocking:
                self._enqueue(entry, event, context, kwargs)
                continue
            context.current_source = entry.index
            try:
                entry.callback.run_event(event, context, **kwargs)
            except Exception as exc:
                self._on_error(entry, event, context, exc)
            else:
                self._errors.succeeded(entry.index)
            finally:
                context.current_source = 0

    def _on_error(
        self, entry: _Entry, event: Event, context: TrainingContext, exc: Exception, observer: bool = False
    ) -> None:
        """Apply the failure policy.  Observer errors (background thread) are always isolated."""
        name = entry.callback.name
        if event in SETUP_EVENTS and not observer:
            raise CallbackSetupError(
                f"callback {name} failed in {event.value} on rank {context.rank}: "
                f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            ) from exc
        action = self._errors.failed(entry.index, name, event.value, exc, context.rank, fatal_allowed=not observer)
        if action == "abort":
            context.requests.request(ControlFlag.ABORT, entry.index, f"{name} raised in {event.value}: {exc}")
        elif action == "disable":
            for entries in self._index.values():
                entries[:] = [e for e in entries if e.index != entry.index]

    # ------------------------------------------------------------------ non-blocking observers
    def _enqueue(self, entry: _Entry, event: Event, context: TrainingContext, kwargs: dict[str, Any]) -> None:
        if self._observers.thread is None:
            self._observers.thread = threading.Thread(target=self._observe, name="trainbridge-observers", daemon=True)
            self._observers.thread.start()
        snapshot = self._snapshot(context)
        try:
            self._observers.work.put_nowait((entry, event, snapshot, _plain(kwargs)))
        except queue.Full:
            self._observers.dropped += 1
            if self._observers.dropped == 1:
                logger.warning(
                    "non-blocking observer queue full (%d): dropping events (counted)", self._observers.maxsize
                )

    @staticmethod
    def _snapshot(context: TrainingContext) -> TrainingContext:
        """A copy of the context safe to read later from another thread: scalars and dicts copied,
        live objects (model, optimizer...) left out, control requests refused."""
        snap = copy.copy(context)
        snap.metrics = _detached_copy(context.metrics)
        snap.logs = _detached_copy(context.logs)
        snap.checkpoints = list(context.checkpoints)
        snap.user_state = _detached_copy(context.user_state)
        snap.requests = _NoControlRequests()
        for name in (
            "model",
            "unwrapped_model",
            "optimizer",
            "lr_scheduler",
            "train_dataloader",
            "eval_dataloader",
            "restore_model_weights",
        ):
            setattr(snap, name, None)
        return snap

    def _observe(self) -> None:
        while True:
            item = self._observers.work.get()
            if item is None:
                self._observers.work.task_done()
                return
            entry, event, snapshot, kwargs = item
            try:
                if not any(e.index == entry.index for e in self._index[event]):
                    continue
                entry.callback.run_event(event, snapshot, **kwargs)
            except Exception as exc:
                self._on_error(entry, event, snapshot, exc, observer=True)
            finally:
                self._observers.work.task_done()

    def drain(self) -> bool:
        """Wait (up to the drain timeout) for non-blocking observers to finish; True if drained."""
        thread = self._observers.thread
        if thread is None:
            return True
        try:
            self._observers.work.put(None, timeout=self.drain_timeout_s)
        except queue.Full:
            return False
        thread.join(self.drain_timeout_s)
        self._observers.thread = None if not thread.is_alive() else thread
        if thread.is_alive():
            logger.error("non-blocking observers did not drain within %.0fs", self.drain_timeout_s)
            return False
        return True

    def close(self, context: TrainingContext) -> None:
        """Call every callback's ``close`` that runs on this rank, once, in order; an error is logged and
        the others still close (the run's outcome is already decided)."""
        if self._closed:
            return
        self._closed = True
        for cb in self._active:
            try:
                cb.close(context)
            except Exception:
                logger.exception("callback %s failed in close on rank %d", cb.name, context.rank)

    # ------------------------------------------------------------------ state and checks
    @property
    def state_keys(self) -> list[str]:
        """Each callback's key in a checkpoint's callback states, in registration order."""
        return list(self._state_keys)

    def state_dict(self) -> dict[str, Any]:
        """Every stateful callback's state, keyed by its ``state_key``."""
        out: dict[str, Any] = {}
        for key, cb in zip(self._state_keys, self.callbacks):
            state = cb.state_dict()
            if state is not None:
                out[key] = dict(state)
        return out

    def load_state_dict(self, states: Mapping[str, Any], restore_user_states: bool = True) -> list[str]:
        """Restore callback states saved by ``state_dict``, matched by state key; returns the keys restored.

        With ``restore_user_states=False`` only callbacks marked ``always_restore_state`` are restored.  A
        stateful callback without a saved state starts fresh and a saved state no callback claims is
        ignored, each with a warning naming the key.
        """
        restored = []
        for key, cb in zip(self._state_keys, self.callbacks):
            if not (restore_user_states or cb.always_restore_state):
                continue
            if key in states:
                cb.load_state_dict(states[key])
                restored.append(key)
            elif _is_stateful(cb):
                logger.warning(
                    "the checkpoint holds no state for callback %s (state key %r): it starts fresh", cb.name, key
                )
        for key in states:
            if key not in self._state_keys:
                logger.warning(
                    "the checkpoint holds a state for %r, which no configured callback has as its state_key: ignored",
                    key,
                )
        return restored

    def checkpoint_files(self, context: TrainingContext) -> dict[str, str | bytes]:
        """Extra files every callback wants written into a checkpoint."""
        files: dict[str, str | bytes] = {}
        for cb in self.callbacks:
            files.update(cb.checkpoint_files(context))
        return files

    def error_reports(self, rank: int) -> list[CallbackErrorReport]:
        """Isolated errors on this rank, for the run result."""
        reports = self._errors.reports(rank)
        for cb in self.callbacks:
            reports += cb.error_reports(rank)  # callbacks that isolate callbacks of their own (HuggingFaceCallbacks)
        return reports

    @property
    def dropped_observer_events(self) -> int:
        """Events a full observer queue dropped."""
        return self._observers.dropped


def _is_stateful(cb: Callback) -> bool:
    """The callback's class overrides ``state_dict`` (it may still return None, e.g. before set-up)."""
    return type(cb).state_dict is not Callback.state_dict


def _unique_state_keys(callbacks: list[Callback]) -> list[str]:
    """Each callback's ``state_key``; a key several callbacks share gets ``#2``, ``#3``... on its later
    occurrences (their order then matters: a warning names them when they are stateful)."""
    keys: list[str] = []
    seen: dict[str, int] = {}
    for cb in callbacks:
        key = cb.state_key
        seen[key] = seen.get(key, 0) + 1
        keys.append(key if seen[key] == 1 else f"{key}#{seen[key]}")
    for key, count in seen.items():
        sharing = [cb for cb in callbacks if cb.state_key == key]
        if count > 1 and any(_is_stateful(cb) for cb in sharing):
            logger.warning(
                "%d stateful callbacks share the state key %r: their states are matched by order "
                "among them; set state_id on each (e.g. cb.state_id = 'a') to key them stably",
                count,
                key,
            )
    return keys


def _detached_copy(values: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``values`` the loop's later changes cannot reach: deep for every value that can be
    deep-copied (nested lists, dicts, numbers), the same object for one that cannot (a lock, a client)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        try:
            out[key] = copy.deepcopy(value)
        except Exception:  # an uncopyable value (a lock, a client) is shared
            out[key] = value
    return out


def _plain(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Event kwargs an observer may keep: tensors and batches are detached summaries, dicts copied;
    every value is new or immutable, so the loop's later changes cannot reach it."""
    out: dict[str, Any] = {}
    for key, value in kwargs.items():
        scalars = isinstance(value, dict) and all(
            isinstance(v, int | float | str | bool | None) for v in value.values()
        )
        if scalars:
            out[key] = dict(value)
        elif hasattr(value, "detach"):
            out[key] = float(value.detach().float().mean()) if value.numel() else None
        elif isinstance(value, int | float | str | bool) or value is None:
            out[key] = value
        elif isinstance(value, dict):
            out[key] = {k: list(v.shape) if hasattr(v, "shape") else str(v) for k, v in value.items()}
        else:
            out[key] = str(value)
    return out
