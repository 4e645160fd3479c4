"""The payload that carries TrainingArgs and the RunPlan (callbacks included) to the workers: authenticated."""

import os
import pickle
import stat
import subprocess
import sys
import textwrap
import threading
import types

import pytest
from transformers import EarlyStoppingCallback

from tests.run_inputs import as_run, split_run
from trainbridge.launch import transport
from trainbridge.launch.transport import (
    PAYLOAD_KEY_ENV,
    CallbackTransportError,
    PayloadIntegrityError,
    check_transportable,
    read_payload,
    register_by_value,
    write_payload,
)

UNPICKLED: list[str] = []


def _record_unpickle(tag):
    UNPICKLED.append(tag)
    return tag


class UnpickleRecorder:
    """Unpickling this object appends to UNPICKLED: proves whether a payload was ever unpickled."""

    def __reduce__(self):
        return (_record_unpickle, ("unpickled",))


@pytest.fixture
def make_args(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "1+1=2"}\n')

    def make(**fields):
        """``(args, plan)``: the settings and the code of ``fields`` (``tests.run_inputs``)."""
        return as_run(split_run(model_path=model, data_path=data, ckpt_output_dir=tmp_path / "out", **fields))

    return make


@pytest.fixture
def private_dir(tmp_path):
    directory = tmp_path / "private"
    directory.mkdir(mode=0o700)
    return directory


@pytest.fixture
def notebook_module():
    """A module that exists only in this process (like a notebook cell), sent by value."""
    module = types.ModuleType("tb_notebook_module_not_importable")
    exec(
        textwrap.dedent(
            """
            class ScaledLogger:
                def __init__(self, scale, label="loss"):
                    self.scale = scale
                    self.label = label
                    self.seen = []

                def describe(self, value):
                    return f"{self.label}={value * self.scale}"
            """
        ),
        module.__dict__,
    )
    sys.modules[module.__name__] = module
    register_by_value(module)
    yield module
    sys.modules.pop(module.__name__, None)


def test_lambda_and_closure_round_trip(make_args, private_dir):
    offset = 40

    def add_offset(context, **kwargs):
        return context + offset

    args = make_args(on_save=lambda context, **kwargs: context * 2, on_log=add_offset)
    path, key = write_payload(*args, private_dir)
    _, loaded = read_payload(path, key)
    (save_fn,) = loaded.event_functions[next(e for e in loaded.event_functions if e.value == "on_save")]
    (log_fn,) = loaded.event_functions[next(e for e in loaded.event_functions if e.value == "on_log")]
    assert save_fn(21) == 42
    assert log_fn(2) == 42


def test_class_from_non_importable_module_travels_by_value(make_args, private_dir, notebook_module):
    callback = notebook_module.ScaledLogger(3, label="eval")
    callback.seen.append(7)
    path, key = write_payload(*make_args(callbacks=[callback]), private_dir)
    sys.modules.pop(notebook_module.__name__)  # the "worker" cannot import it
    (loaded,) = read_payload(path, key)[1].callbacks
    assert (loaded.scale, loaded.label, loaded.seen) == (3, "eval", [7])
    assert loaded.describe(2) == "eval=6"


def test_payload_is_readable_in_a_fresh_interpreter(make_args, private_dir, notebook_module):
    """A real new process (like a torchrun worker) rebuilds a notebook class, a lambda and an HF callback."""
    args = make_args(
        callbacks=[notebook_module.ScaledLogger(5), EarlyStoppingCallback(early_stopping_patience=3)],
        on_evaluate=lambda value: value + 1,
    )
    path, key = write_payload(*args, private_dir)
    code = textwrap.dedent(
        f"""
        import importlib.util, os, sys
        from trainbridge.launch.transport import read_payload
        args, plan = read_payload({str(path)!r}, os.environ[{PAYLOAD_KEY_ENV!r}])
        logger, early = plan.callbacks
        (fn,) = list(plan.event_functions.values())[0]
        # rebuilt by value: the module is neither importable here nor registered by unpickling
        assert importlib.util.find_spec("tb_notebook_module_not_importable") is None
        assert "tb_notebook_module_not_importable" not in sys.modules
        print(logger.describe(2), early.early_stopping_patience, fn(1))
        """
    )
    env = {**os.environ, PAYLOAD_KEY_ENV: key}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["loss=10", "3", "2"]


def test_hf_callback_keeps_its_constructor_arguments(make_args, private_dir):
    callback = EarlyStoppingCallback(early_stopping_patience=3, early_stopping_threshold=0.25)
    callback.early_stopping_patience_counter = 2
    path, key = write_payload(*make_args(callbacks=[callback]), private_dir)
    (loaded,) = read_payload(path, key)[1].callbacks
    assert isinstance(loaded, EarlyStoppingCallback)
    assert loaded.early_stopping_patience == 3
    assert loaded.early_stopping_threshold == 0.25
    assert loaded.early_stopping_patience_counter == 2


def test_untampered_payload_is_unpickled(make_args, private_dir):
    """Control for the tamper test: a valid payload does reach the unpickler."""
    UNPICKLED.clear()
    path, key = write_payload(*make_args(callbacks=[UnpickleRecorder()]), private_dir)
    assert read_payload(path, key)[1].callbacks == ["unpickled"]
    assert UNPICKLED == ["unpickled"]


@pytest.mark.parametrize("position", [-1, -200, 30])
def test_tampered_payload_is_rejected_before_unpickling(make_args, private_dir, monkeypatch, position):
    UNPICKLED.clear()
    path, key = write_payload(*make_args(callbacks=[UnpickleRecorder()]), private_dir)
    data = bytearray(path.read_bytes())
    data[position] ^= 0x01
    path.write_bytes(bytes(data))

    def must_not_unpickle(*args, **kwargs):
        raise AssertionError("a tampered payload reached pickle.loads")

    monkeypatch.setattr(transport.pickle, "loads", must_not_unpickle)
    with pytest.raises(PayloadIntegrityError, match=r"refusing to unpickle|not a trainbridge payload"):
        read_payload(path, key)
    assert UNPICKLED == []


def test_wrong_key_is_rejected(make_args, private_dir):
    UNPICKLED.clear()
    path, _ = write_payload(*make_args(callbacks=[UnpickleRecorder()]), private_dir)
    with pytest.raises(PayloadIntegrityError, match=PAYLOAD_KEY_ENV):
        read_payload(path, "0" * 64)
    with pytest.raises(PayloadIntegrityError):
        read_payload(path, "")
    assert UNPICKLED == []


def test_foreign_file_is_rejected(private_dir):
    foreign = private_dir / "foreign.pkl"
    foreign.write_bytes(pickle.dumps(UnpickleRecorder()))
    UNPICKLED.clear()
    with pytest.raises(PayloadIntegrityError, match="not a trainbridge payload"):
        read_payload(foreign, "a" * 64)
    assert UNPICKLED == []


def test_payload_file_is_private_and_exclusive(make_args, private_dir):
    path, key = write_payload(*make_args(), private_dir)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(key) == 64 and int(key, 16) >= 0
    with pytest.raises(FileExistsError):
        write_payload(*make_args(), private_dir)


def test_payload_directory_must_be_private(make_args, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    with pytest.raises(PermissionError, match="must be private"):
        write_payload(*make_args(), shared)


class HoldsALock:
    def __init__(self):
        self.threshold = 1.0
        self.lock = threading.Lock()


def test_callback_holding_a_lock_is_named(make_args):
    args = make_args(callbacks=[EarlyStoppingCallback(), HoldsALock()])
    with pytest.raises(CallbackTransportError) as info:
        check_transportable(*args)
    message = str(info.value)
    assert "callbacks[1]" in message
    assert "HoldsALock" in message
    assert "attribute 'lock'" in message
    assert "holds a thread lock" in message


def test_event_function_holding_an_open_file_is_named(make_args, tmp_path):
    handle = (tmp_path / "log.txt").open("w")
    try:

        def write_line(context, **kwargs):
            handle.write("saved\n")

        args = make_args(on_save=[lambda context, **kwargs: None, write_line])
        with pytest.raises(CallbackTransportError) as info:
            check_transportable(*args)
    finally:
        handle.close()
    message = str(info.value)
    assert "on_save[1]" in message
    assert "write_line" in message
    assert "captured variable 'handle' holds an open file handle" in message


def test_transportable_args_pass(make_args, notebook_module):
    check_transportable(*make_args(callbacks=[notebook_module.ScaledLogger(1), EarlyStoppingCallback], on_log=print))
