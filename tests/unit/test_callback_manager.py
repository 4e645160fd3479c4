"""CallbackManager: order, lazy index, failure policies, non-blocking observers, state."""

import logging
import threading
import time
from pathlib import Path

import pytest

from trainbridge.core.agreement import ControlFlag
from trainbridge.core.callback import Callback, FunctionCallback, rank_zero_only
from trainbridge.core.config import TrainingArgs
from trainbridge.core.context import TrainingContext
from trainbridge.core.dispatch import CallbackManager, CallbackSetupError
from trainbridge.core.distributed import DistributedEnv
from trainbridge.core.events import Event


@pytest.fixture
def context(run_files: dict[str, Path]) -> TrainingContext:
    args = TrainingArgs(model_path=run_files["model"], data_path=run_files["train"], ckpt_output_dir=run_files["out"])
    return TrainingContext(args=args, env=DistributedEnv())


class Recorder(Callback):
    def __init__(self, tag, log):
        self.tag, self.log = tag, log

    def on_step_end(self, context, **kwargs):
        self.log.append((self.tag, "step_end"))

    def on_log(self, context, **kwargs):
        self.log.append((self.tag, "log", dict(kwargs["logs"])))


def test_dispatch_in_registration_order_with_kwargs(context):
    log: list = []
    manager = CallbackManager([Recorder("a", log), Recorder("b", log)])
    manager.fire(Event.STEP_END, context)
    manager.fire(Event.LOG, context, logs={"loss": 1.0})
    assert log == [("a", "step_end"), ("b", "step_end"), ("a", "log", {"loss": 1.0}), ("b", "log", {"loss": 1.0})]


def test_index_holds_only_overriding_callbacks(context):
    called = []

    class OnlySave(Callback):
        def on_save(self, context, **kwargs):
            called.append(kwargs["checkpoint_path"])

    manager = CallbackManager([OnlySave(), Recorder("r", [])])
    assert [type(c).__name__ for c in manager.handlers(Event.SAVE)] == ["OnlySave"]
    assert manager.handlers(Event.BEFORE_FORWARD) == []
    assert [type(c).__name__ for c in manager.handlers(Event.STEP_END)] == ["Recorder"]
    manager.fire(Event.SAVE, context, checkpoint_path="ckpt")
    assert called == ["ckpt"]


def test_function_callbacks_and_rank_zero_only(context):
    seen = []
    fn = FunctionCallback(Event.EVALUATE, lambda ctx, metrics: seen.append(metrics["eval_loss"]))
    gated = FunctionCallback(Event.EVALUATE, rank_zero_only(lambda ctx, metrics: seen.append("rank0")))
    manager = CallbackManager([fn, gated])
    manager.fire(Event.EVALUATE, context, metrics={"eval_loss": 0.5})
    assert seen == [0.5, "rank0"]
    context.env = DistributedEnv(rank=1, world_size=2)
    manager.fire(Event.EVALUATE, context, metrics={"eval_loss": 0.4})
    assert seen == [0.5, "rank0", 0.4]


def test_rank_zero_only_class_attribute_skips_other_ranks(context):
    # Records calls instead of raising: an exception in a hook would be isolated by the manager, so a
    # test relying on one could not fail.
    class Rank0(Callback):
        rank_zero_only = True

        def __init__(self):
            self.calls = 0

        def on_step_end(self, context, **kwargs):
            self.calls += 1

    other_rank, rank_zero = Rank0(), Rank0()
    manager = CallbackManager([other_rank], is_world_process_zero=False)
    manager.fire(Event.STEP_END, context)
    assert other_rank.calls == 0 and manager.handlers(Event.STEP_END) == []
    CallbackManager([rank_zero], is_world_process_zero=True).fire(Event.STEP_END, context)
    assert rank_zero.calls == 1


class Boom(Callback):
    def __init__(self, events):
        self.events = set(events)
        self.calls = 0

    def _maybe(self, event):
        self.calls += 1
        if event in self.events:
            raise ValueError(f"boom in {event}")

    def on_train_begin(self, context, **kwargs):
        self._maybe("train_begin")

    def on_step_end(self, context, **kwargs):
        self._maybe("step_end")


def test_setup_error_fails_before_first_step_naming_the_callback(context):
    manager = CallbackManager([Boom({"train_begin"})])
    with pytest.raises(CallbackSetupError, match=r"callback Boom failed in on_train_begin on rank 0: ValueError: boom"):
        manager.fire(Event.TRAIN_BEGIN, context)


def test_isolate_logs_once_counts_and_disables_after_consecutive_errors(context, caplog):
    boom = Boom({"step_end"})
    manager = CallbackManager([boom], max_consecutive_errors=3)
    with caplog.at_level(logging.ERROR):
        for _ in range(5):
            manager.fire(Event.STEP_END, context)
    assert boom.calls == 3  # switched off after the third consecutive error
    assert sum("failed in on_step_end" in r.message for r in caplog.records) == 1
    assert any("switched off" in r.message for r in caplog.records)
    (report,) = manager.error_reports(rank=0)
    assert report.callback == "Boom" and report.count == 3 and report.disabled
    assert report.first_error == "ValueError: boom in step_end"
    assert not context.requests.pending


def test_isolate_resets_consecutive_count_on_success(context):
    class Flaky(Callback):
        n = 0

        def on_step_end(self, context, **kwargs):
            self.n += 1
            if self.n % 2:
                raise RuntimeError("odd")

    flaky = Flaky()
    manager = CallbackManager([flaky], max_consecutive_errors=2)
    for _ in range(6):
        manager.fire(Event.STEP_END, context)
    assert flaky.n == 6
    assert not manager.error_reports(0)[0].disabled


def test_fatal_policy_requests_abort_naming_the_source(context):
    manager = CallbackManager([Recorder("ok", []), Boom({"step_end"})], error_policy="fatal")
    manager.fire(Event.STEP_END, context)
    assert context.requests.pending == {ControlFlag.ABORT: 2}
    assert manager.source_names[2] == "Boom"


def test_requests_are_attributed_to_the_calling_callback(context):
    class Stopper(Callback):
        def on_step_end(self, context, **kwargs):
            context.request_stop_training("enough")

    manager = CallbackManager([Recorder("a", []), Stopper()])
    manager.fire(Event.STEP_END, context)
    assert context.requests.pending == {ControlFlag.STOP_TRAINING: 2}
    assert context.requests.reasons[ControlFlag.STOP_TRAINING] == "enough"
    assert context.current_source == 0


class SlowObserver(Callback):
    nonblocking = True

    def __init__(self):
        self.seen = []
        self.thread_names = set()
        self.release = threading.Event()

    def on_log(self, context, **kwargs):
        self.release.wait(5)
        self.thread_names.add(threading.current_thread().name)
        self.seen.append((context.global_step, kwargs["logs"]["loss"], context.model, dict(context.user_state)))
        try:
            context.request_stop_training()
        except RuntimeError as exc:
            self.seen.append(str(exc))


def test_nonblocking_observer_gets_a_snapshot_and_cannot_request_control(context):
    observer = SlowObserver()
    manager = CallbackManager([observer])
    context.model = object()
    logs = {"loss": 1.0}
    context.global_step = 7
    context.user_state["k"] = 1
    context.user_state["history"] = [1.0]
    context.user_state["lock"] = threading.Lock()  # cannot be copied: shared, not an error
    start = time.perf_counter()
    manager.fire(Event.LOG, context, logs=logs)
    assert time.perf_counter() - start < 1.0  # dispatch did not wait for the slow observer
    # the loop goes on mutating its state; the observer must see the values of the event time
    context.global_step = 8
    logs["loss"] = 99.0
    context.user_state["k"] = 2
    context.user_state["history"].append(2.0)  # nested values are copied too
    observer.release.set()
    assert manager.drain()
    step, loss, model, user_state = observer.seen[0]
    assert (step, loss, model) == (7, 1.0, None)
    assert user_state["k"] == 1 and user_state["history"] == [1.0]
    assert user_state["lock"] is context.user_state["lock"]
    assert "cannot request control" in observer.seen[1]
    assert observer.thread_names == {"trainbridge-observers"}
    assert not context.requests.pending


def test_full_observer_queue_drops_and_counts(context):
    observer = SlowObserver()
    manager = CallbackManager([observer], queue_size=1)
    for _ in range(4):
        manager.fire(Event.LOG, context, logs={"loss": 1.0})
    observer.release.set()
    assert manager.drain()
    assert manager.dropped_observer_events >= 2


class Counter(Callback):
    def __init__(self):
        self.n = 0

    def on_step_end(self, context, **kwargs):
        self.n += 1

    def state_dict(self):
        return {"n": self.n}

    def load_state_dict(self, state):
        self.n = state["n"]


def test_state_round_trip_by_state_key(context):
    first = CallbackManager([Recorder("x", []), Counter()])
    for _ in range(3):
        first.fire(Event.STEP_END, context)
    saved = first.state_dict()
    assert saved == {"Counter": {"n": 3}}
    fresh = Counter()
    assert CallbackManager([Recorder("x", []), fresh]).load_state_dict(saved) == ["Counter"]
    assert fresh.n == 3


def test_states_come_back_when_a_callback_is_added_or_the_order_changes(context, caplog):
    class Other(Counter):
        pass

    counter, other = Counter(), Other()
    counter.n, other.n = 3, 5
    saved = CallbackManager([counter, Recorder("x", []), other]).state_dict()
    assert set(saved) == {"Counter", Other.__qualname__}
    added = Counter()
    added.state_id = "new"  # a new callback of an existing class, told apart by its state_id
    restored_counter, restored_other = Counter(), Other()
    with caplog.at_level(logging.WARNING, logger="trainbridge.core.dispatch"):
        manager = CallbackManager([added, restored_other, Recorder("y", []), restored_counter])
        keys = manager.load_state_dict(saved)
    assert sorted(keys) == sorted(["Counter", Other.__qualname__])
    assert (restored_counter.n, restored_other.n, added.n) == (3, 5, 0)
    assert [r.getMessage() for r in caplog.records] == [
        "the checkpoint holds no state for callback Counter (state key 'Counter[new]'): it starts fresh"
    ]


def test_a_state_no_callback_claims_is_a_warning_naming_its_key(context, caplog):
    saved = {"Counter": {"n": 1}, "Gone": {"x": 1}}
    with caplog.at_level(logging.WARNING, logger="trainbridge.core.dispatch"):
        assert CallbackManager([Counter()]).load_state_dict(saved) == ["Counter"]
    assert [r.getMessage() for r in caplog.records] == [
        "the checkpoint holds a state for 'Gone', which no configured callback has as its state_key: ignored"
    ]


def test_duplicate_state_keys_get_an_occurrence_suffix_and_a_warning(caplog):
    first, second = Counter(), Counter()
    first.n, second.n = 1, 2
    with caplog.at_level(logging.WARNING, logger="trainbridge.core.dispatch"):
        manager = CallbackManager([first, second])
    assert manager.state_keys == ["Counter", "Counter#2"]
    assert "2 stateful callbacks share the state key 'Counter'" in caplog.text and "state_id" in caplog.text
    assert manager.state_dict() == {"Counter": {"n": 1}, "Counter#2": {"n": 2}}
    caplog.clear()
    first.state_id, second.state_id = "a", "b"
    with caplog.at_level(logging.WARNING, logger="trainbridge.core.dispatch"):
        assert CallbackManager([first, second]).state_keys == ["Counter[a]", "Counter[b]"]
    assert caplog.records == []
    # stateless callbacks of one class (two recorders) share a key without a warning
    with caplog.at_level(logging.WARNING, logger="trainbridge.core.dispatch"):
        CallbackManager([Recorder("a", []), Recorder("b", [])])
    assert caplog.records == []


def test_manager_rejects_non_callbacks():
    with pytest.raises(TypeError, match=r"not a trainbridge\.Callback"):
        CallbackManager([object()])


def test_switching_off_restore_keeps_run_bookkeeping_state(context):
    class UserState(Callback):
        def __init__(self):
            self.value = None

        def state_dict(self):
            return {"v": 1}

        def load_state_dict(self, state):
            self.value = state["v"]

    class Bookkeeping(UserState):
        always_restore_state = True

    saved = CallbackManager([UserState(), Bookkeeping()]).state_dict()
    user, bookkeeping = UserState(), Bookkeeping()
    restored = CallbackManager([user, bookkeeping]).load_state_dict(saved, restore_user_states=False)
    assert restored == [Bookkeeping.__qualname__]
    assert user.value is None and bookkeeping.value == 1


def test_close_runs_once_per_callback_on_this_rank_and_isolates_errors(context, caplog):
    closed: list[str] = []

    class Closing(Callback):
        def __init__(self, tag):
            self.tag = tag

        def close(self, context):
            closed.append(self.tag)
            if self.tag == "broken":
                raise OSError("disk gone")

    class RankZero(Closing):
        rank_zero_only = True

    manager = CallbackManager([Closing("broken"), RankZero("zero"), Closing("last")], is_world_process_zero=False)
    with caplog.at_level(logging.ERROR, logger="trainbridge.core.dispatch"):
        manager.close(context)
        manager.close(context)
    assert closed == ["broken", "last"]  # once each; the rank-zero-only callback does not run on rank 1
    assert "callback Closing failed in close on rank 0" in caplog.text and "disk gone" in caplog.text
