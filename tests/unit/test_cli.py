"""The trainbridge command: arguments become validated objects; errors map to clear messages and exit codes."""

import argparse

import pytest
import yaml

from trainbridge import cli
from trainbridge.core import nproc
from trainbridge.core.config import TorchrunArgs, TrainingArgs
from trainbridge.launch import launcher
from trainbridge.launch.launcher import PreflightError, TrainingInterruptedError, WorkerFailedError
from trainbridge.loop.result import RunResult


@pytest.fixture
def config(tmp_path, run_files):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"model_path": "model", "data_path": "train.jsonl", "ckpt_output_dir": "out"}))
    return path


class FakeRunTraining:
    """Stands in for launcher.run_training: records the call, returns or raises ``outcome``."""

    def __init__(self):
        self.calls = []
        self.outcome = RunResult(
            global_step=12, epoch=1.0, max_steps=12, final_loss=1.23456, checkpoints=["out/ckpt-12"]
        )

    def __call__(self, args, torchrun_args, timeout_s=None, dry_run=False):
        self.calls.append((args, torchrun_args, timeout_s))
        self.dry_run = dry_run
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
    [
        ("max_steps=10", ("max_steps", 10)),
        ("learning_rate=0.001", ("learning_rate", 0.001)),
        ("run_name=null", ("run_name", None)),
        ("report_to=[tensorboard]", ("report_to", ["tensorboard"])),
        ("run_name=a=b", ("run_name", "a=b")),
        ("run_name=", ("run_name", "")),
    ],
)
def test_overrides_are_yaml_scalars(text, expected):
    assert cli.parse_override(text) == expected


def test_override_without_equals_is_rejected():
    with pytest.raises(argparse.ArgumentTypeError, match="key=value"):
        cli.parse_override("max_steps")


def test_train_builds_validated_objects_and_prints_a_summary(config, launches, capsys):
    code = cli.main(
        [
            "train",
            str(config),
            "--nproc-per-node",
            "3",
            "--master-port",
            "29999",
            "--set",
            "max_steps=12",
            "--set",
            "learning_rate=0.001",
            "--timeout",
            "60",
        ]
    )
    assert code == 0
    ((args, torchrun_args, timeout_s),) = launches.calls
    assert isinstance(args, TrainingArgs) and (args.max_steps, args.learning_rate) == (12, 0.001)
    assert args.data_path == config.parent / "train.jsonl"
    assert torchrun_args == TorchrunArgs(nproc_per_node=3, master_port=29999)
    assert timeout_s == 60
    out = capsys.readouterr().out
    assert "steps:           12/12 (completed)" in out and "final loss:      1.2346" in out
    assert "checkpoints:     ckpt-12 in out" in out and "wall time:" in out


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
        (
            WorkerFailedError(1, 1, "ValueError: boom", traceback="Traceback ...\nValueError: boom"),
            1,
            "training failed on rank 1 (exit code 1): ValueError: boom",
        ),
        (PreflightError("callbacks[0]: CallbackSpec 'x:Y' failed to construct"), 2, "not launched: callbacks[0]"),
        (TrainingInterruptedError(2), 130, "interrupted by SIGINT"),
    ],
)
def test_launch_errors_map_to_exit_codes(config, launches, capsys, error, code, text):
    launches.outcome = error
    assert cli.main(["train", str(config)]) == code
    assert text in capsys.readouterr().err


# ----------------------------------------------------------------------------- issue 17: hints and flags
def test_version_names_trainbridge_and_its_stack(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("trainbridge 0.1.0 (torch ") and "transformers" in out


def test_help_imports_neither_torch_nor_pydantic():
    """``trainbridge train --help`` is fast because the command imports nothing heavy up front."""
    import subprocess
    import sys

    code = (
        "import sys, contextlib, io\nimport trainbridge.cli as c\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    c.main(['train', '--help'])\n"
        "heavy = [m for m in ('torch', 'transformers', 'pydantic', 'yaml') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_program_ends_its_process_at_once_keeping_exit_handlers_and_output(tmp_path):
    """``main()`` run as the program (no argv) leaves through ``exit_now``: the exit code is the command's,
    exit handlers ran and buffered output was flushed, and nothing after ``main()`` runs (the interpreter's
    slow teardown of torch and transformers is skipped)."""
    import subprocess
    import sys

    code = (
        "import atexit, sys\n"
        "atexit.register(lambda: print('exit handler ran'))\n"
        "from trainbridge.cli import main\n"
        f"sys.argv = ['trainbridge', 'plot', {str(tmp_path / 'no-such-run')!r}]\n"
        "print('buffered before the end')\n"
        "main()\n"
        "print('after main')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == cli.EXIT_INVALID, done.stderr
    assert done.stdout.splitlines() == ["buffered before the end", "exit handler ran"]
    assert "no-such-run" in done.stderr


def test_torchrun_spelling_of_nproc_per_node_is_accepted(config, launches):
    assert cli.main(["train", str(config), "--nproc_per_node", "3", "--master_port", "29998"]) == 0
    assert launches.calls[0][1] == TorchrunArgs(nproc_per_node=3, master_port=29998)


def test_nproc_per_node_defaults_to_one_with_a_note_without_gpus(config, launches, capsys, monkeypatch):
    monkeypatch.setattr(nproc, "visible_gpu_count", lambda: 0)
    assert cli.main(["train", str(config)]) == 0
    assert launches.calls[0][1].nproc_per_node == 1
    assert "note: no GPU in use: 1 worker process (give --nproc-per-node N" in capsys.readouterr().err


def test_nproc_per_node_defaults_to_every_visible_gpu(config, launches, capsys, monkeypatch):
    monkeypatch.setattr(nproc, "visible_gpu_count", lambda: 4)
    assert cli.main(["train", str(config)]) == 0
    assert launches.calls[0][1].nproc_per_node == 4
    assert "note" not in capsys.readouterr().err


def test_nproc_per_node_default_follows_the_environment_variable(config, launches, capsys, monkeypatch):
    monkeypatch.setattr(nproc, "visible_gpu_count", lambda: 0)
    monkeypatch.setenv("TRAINBRIDGE_NPROC_PER_NODE", "3")
    assert cli.main(["train", str(config)]) == 0
    assert launches.calls[0][1].nproc_per_node == 3
    assert "note" not in capsys.readouterr().err


def test_resume_flag_means_resume_from_checkpoint_auto(config, launches):
    assert cli.main(["train", str(config), "--resume"]) == 0
    assert launches.calls[0][0].resume_from_checkpoint == "auto"


def test_explicit_set_resume_path_wins_over_resume_flag(config, launches, tmp_path):
    assert cli.main(["train", str(config), "--resume", "--set", f"resume_from_checkpoint={tmp_path}"]) == 0
    assert launches.calls[0][0].resume_from_checkpoint == tmp_path


def test_bad_set_value_is_reported_as_a_set_value(config, launches, capsys):
    assert cli.main(["train", str(config), "--set", "max_steps=ten"]) == 2
    err = capsys.readouterr().err
    assert "- max_steps = 'ten' (from --set max_steps=ten): must be a valid integer" in err
    assert "Traceback" not in err and "http" not in err


def test_misspelled_set_key_gets_the_nearest_name(config, launches, capsys):
    assert cli.main(["train", str(config), "--set", "max_step=5"]) == 2
    assert (
        "- max_step = 5 (from --set max_step=5): not a TrainingArgs field. Did you mean 'max_steps'?"
        in capsys.readouterr().err
    )


def test_trainer_name_in_yaml_says_which_field_it_is(config, launches, capsys):
    config.write_text(config.read_text() + "num_train_epochs: 3\nper_device_train_batch_size: 8\n")
    assert cli.main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert (
        f"- num_train_epochs = 3 (in {config}): not a TrainingArgs field. num_train_epochs is "
        "transformers.TrainingArguments' name; here it is num_epochs." in err
    )
    assert "per_device_train_batch_size = 8" in err and "effective_batch_size" in err


def test_invalid_yaml_in_set_is_an_argument_error(config, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["train", str(config), "--set", "report_to=[a"])
    assert info.value.code == 2
    assert "--set 'report_to=[a': the value is not valid YAML" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["file", "inside_file", "read_only"])
def test_unusable_output_folder_is_one_line_exit_2(config, capsys, tmp_path, kind, monkeypatch):
    """Checked once, by run_training (the real one here), before anything is locked or launched."""
    monkeypatch.setattr(launcher, "preflight", lambda args: pytest.fail("preflight ran"))
    monkeypatch.setattr(launcher.subprocess, "Popen", lambda *a, **k: pytest.fail("launched"))
    blocker = tmp_path / "blocker"
    if kind == "read_only":
        blocker.mkdir(mode=0o500)
        target = blocker / "out"
    else:
        blocker.write_text("x")
        target = blocker if kind == "file" else blocker / "out"
    import os

    if kind == "read_only" and os.access(blocker, os.W_OK):
        pytest.skip("running as root: permissions are not enforced")
    assert cli.main(["train", str(config), "--nproc-per-node", "1", "--set", f"ckpt_output_dir={target}"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert err.startswith(f"trainbridge: not launched: ckpt_output_dir = '{target}'")


def test_callback_module_next_to_the_config_imports_by_name(config, launches, monkeypatch, tmp_path):
    import sys

    (config.parent / "my_callbacks.py").write_text(
        "from trainbridge import Callback\n\nclass Marker(Callback):\n    def __init__(self, tag):\n"
        "        self.tag = tag\n"
    )
    config.write_text(config.read_text() + "callbacks:\n  - class: my_callbacks:Marker\n    kwargs: {tag: x}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(config.parent))])
    assert cli.main(["train", str(config)]) == 0
    assert launches.calls[0][0].callbacks[0].class_path == "my_callbacks:Marker"
    assert sys.path[-1] == str(config.parent)  # after site-packages; the working directory holds no such module
    assert str(elsewhere) not in sys.path


def test_set_paths_resolve_against_the_working_directory(config, launches, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "other.jsonl").write_text('{"text": "2+2=4"}\n')
    assert cli.main(["train", str(config), "--set", "data_path=other.jsonl"]) == 0
    assert launches.calls[0][0].data_path.resolve() == tmp_path / "other.jsonl"


def test_dry_run_prints_the_resolved_config_and_trains_nothing(config, launches, capsys):
    assert cli.main(["train", str(config), "--dry-run", "--set", "max_steps=7"]) == 0
    assert launches.dry_run is True
    out = capsys.readouterr().out
    assert "resolved configuration" in out and "max_steps: 7" in out and "nothing was trained" in out
    assert "training finished" not in out
