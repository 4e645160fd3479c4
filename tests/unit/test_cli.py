"""The trainbridge command: arguments become validated objects; errors map to clear messages and exit codes."""

import argparse

import pytest
import yaml

from trainbridge import cli
from trainbridge.core.config import TorchrunArgs, TrainingArgs
from trainbridge.launch import launcher
from trainbridge.launch.launcher import PreflightError, TrainingInterruptedError, WorkerFailedError
from trainbridge.loop.result import RunResult


@pytest.fixture
def config(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "train.jsonl").write_text('{"text": "1+1=2"}\n')
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model_path": "model", "data_path": "train.jsonl", "ckpt_output_dir": "out"}))
    return path


class FakeRunTraining:
    """Stands in for launcher.run_training: records the call, returns or raises ``outcome``."""

    def __init__(self):
        self.calls = []
        self.outcome = RunResult(global_step=12, epoch=1.0, max_steps=12, final_loss=1.23456,
                                 checkpoints=["out/ckpt-12"])

    def __call__(self, args, torchrun_args, timeout_s=None):
        self.calls.append((args, torchrun_args, timeout_s))
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


@pytest.fixture
def launches(monkeypatch):
    fake = FakeRunTraining()
    monkeypatch.setattr(launcher, "run_training", fake)
    return fake


@pytest.mark.parametrize(
    ("text", "expected"),
    [("max_steps=10", ("max_steps", 10)), ("learning_rate=0.001", ("learning_rate", 0.001)),
     ("run_name=null", ("run_name", None)), ("report_to=[tensorboard]", ("report_to", ["tensorboard"])),
     ("run_name=a=b", ("run_name", "a=b")), ("run_name=", ("run_name", ""))],
)
def test_overrides_are_yaml_scalars(text, expected):
    assert cli.parse_override(text) == expected


def test_override_without_equals_is_rejected():
    with pytest.raises(argparse.ArgumentTypeError, match="key=value"):
        cli.parse_override("max_steps")


def test_train_builds_validated_objects_and_prints_a_summary(config, launches, capsys):
    code = cli.main(["train", str(config), "--nproc-per-node", "3", "--master-port", "29999",
                     "--set", "max_steps=12", "--set", "learning_rate=0.001", "--timeout", "60"])
    assert code == 0
    ((args, torchrun_args, timeout_s),) = launches.calls
    assert isinstance(args, TrainingArgs) and (args.max_steps, args.learning_rate) == (12, 0.001)
    assert args.data_path == config.parent / "train.jsonl"
    assert torchrun_args == TorchrunArgs(nproc_per_node=3, master_port=29999)
    assert timeout_s == 60
    out = capsys.readouterr().out
    assert "steps:           12/12 (completed)" in out and "final loss:      1.2346" in out
    assert "out/ckpt-12" in out


def test_invalid_field_exits_2_naming_it(config, launches, capsys):
    assert cli.main(["train", str(config), "--set", "learning_rate=-1"]) == 2
    err = capsys.readouterr().err
    assert "invalid configuration" in err and "learning_rate" in err and "greater than 0" in err
    assert launches.calls == []


def test_unknown_field_exits_2_naming_it(config, launches, capsys):
    assert cli.main(["train", str(config), "--set", "learnig_rate=0.1"]) == 2
    assert "learnig_rate" in capsys.readouterr().err


def test_invalid_torchrun_option_exits_2(config, launches, capsys):
    assert cli.main(["train", str(config), "--nnodes", "two"]) == 2
    assert "nnodes" in capsys.readouterr().err


def test_missing_config_file_exits_2(tmp_path, launches, capsys):
    assert cli.main(["train", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("error", "code", "text"),
    [
        (WorkerFailedError(1, 1, "ValueError: boom", traceback="Traceback ...\nValueError: boom"), 1,
         "training failed on rank 1 (exit code 1): ValueError: boom"),
        (PreflightError("callbacks[0]: CallbackSpec 'x:Y' failed to construct"), 2, "not launched: callbacks[0]"),
        (TrainingInterruptedError(2), 130, "interrupted by SIGINT"),
    ],
)
def test_launch_errors_map_to_exit_codes(config, launches, capsys, error, code, text):
    launches.outcome = error
    assert cli.main(["train", str(config)]) == code
    assert text in capsys.readouterr().err
