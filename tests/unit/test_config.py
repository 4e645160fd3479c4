"""TrainingArgs validation names the field at fault; YAML round trips; callback specs are checked early."""

import pytest
import yaml
from pydantic import ValidationError

from tests.run_inputs import split_run
from trainbridge.core.config import CallbackSpec, RunPlan, TorchrunArgs, TrainingArgs
from trainbridge.core.events import Event


@pytest.fixture
def base(run_files):
    return {
        "model_path": run_files["model"],
        "data_path": run_files["train"],
        "val_data_path": run_files["val"],
        "ckpt_output_dir": run_files["out"],
    }


def _error(fields):
    with pytest.raises(ValidationError) as info:
        split_run(**fields)
    return str(info.value)


def test_missing_model_directory_is_named(base, tmp_path):
    message = _error({**base, "model_path": tmp_path / "no_such_model"})
    assert "model_path" in message and "no_such_model" in message and "does not exist" in message


def test_model_directory_without_config_is_named(base, tmp_path):
    (tmp_path / "empty").mkdir()
    message = _error({**base, "model_path": tmp_path / "empty"})
    assert "model_path" in message and "no config.json" in message


def test_missing_data_file_is_named(base, tmp_path):
    message = _error({**base, "data_path": tmp_path / "missing.jsonl"})
    assert "data_path" in message and "missing.jsonl" in message and "does not exist" in message


def test_negative_learning_rate_is_named(base):
    message = _error({**base, "learning_rate": -1e-4})
    assert "learning_rate" in message and "greater than 0" in message


def test_eval_strategy_steps_needs_eval_steps(base):
    message = _error({**base, "eval_strategy": "steps"})
    assert "eval_steps: required when eval_strategy='steps'" in message


def test_unknown_event_keyword_is_named(base):
    with pytest.raises(ValueError) as info:
        RunPlan.from_keywords(on_foo=print)
    message = str(info.value)
    assert "on_foo: unknown event 'on_foo'" in message and "on_save" in message


def test_non_callable_event_function_is_named(base):
    with pytest.raises(ValueError) as info:
        RunPlan.from_keywords(on_save=3)
    message = str(info.value)
    assert "on_save: expected a callable, got int 3" in message


def test_unknown_top_level_key_is_named(base):
    message = _error({**base, "learnig_rate": 1e-4})
    assert "learnig_rate" in message and "Extra inputs are not permitted" in message


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("nopkg_xyz.callbacks:Thing", "cannot import module 'nopkg_xyz.callbacks'"),
        ("transformers:NoSuchCallback", "module 'transformers' has no attribute 'NoSuchCallback'"),
        ("NoDots", "'NoDots' is not an import path"),
    ],
)
def test_callback_spec_with_bad_import_path_is_named(base, path, expected):
    message = _error({**base, "callbacks": [{"class": path, "kwargs": {}}]})
    assert "callbacks" in message and expected in message


def test_flat_event_keywords_are_collected(base):
    def on_log(context, **kwargs):
        return None

    args = split_run(**base, on_save=print, on_log=[on_log, print])
    assert args.plan.event_functions == {Event.SAVE: [print], Event.LOG: [on_log, print]}


def test_yaml_round_trip_keeps_fields_and_callback_specs(base, tmp_path):
    args = split_run(
        **base,
        learning_rate=3e-4,
        eval_strategy="steps",
        eval_steps=5,
        report_to=["tensorboard"],
        resume_from_checkpoint="auto",
        callbacks=[{"class": "transformers:EarlyStoppingCallback", "kwargs": {"early_stopping_patience": 3}}],
    )
    path = tmp_path / "configs" / "run.yaml"
    path.parent.mkdir()
    args.to_yaml(path)
    loaded = TrainingArgs.from_yaml(path)
    assert loaded == args
    assert loaded.callbacks == [
        CallbackSpec.model_validate(
            {"class": "transformers:EarlyStoppingCallback", "kwargs": {"early_stopping_patience": 3}}
        )
    ]
    assert loaded.callbacks[0].build().early_stopping_patience == 3


def test_yaml_relative_paths_resolve_against_the_yaml_folder(base, tmp_path, monkeypatch):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "data.jsonl").write_text('{"text": "1"}\n')
    (folder / "run.yaml").write_text(
        yaml.safe_dump(
            {
                "model_path": "../model",
                "data_path": "data.jsonl",
                "ckpt_output_dir": "out",
                "learning_rate": 1e-3,
            }
        )
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    args = TrainingArgs.from_yaml(folder / "run.yaml", max_steps=4)
    assert args.data_path.resolve() == (folder / "data.jsonl").resolve()
    assert args.model_path.resolve() == base["model_path"].resolve()
    assert args.ckpt_output_dir.resolve() == (folder / "out").resolve()
    assert args.max_steps == 4


def test_yaml_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model_path: [unclosed\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: not valid YAML"):
        TrainingArgs.from_yaml(bad)
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        TrainingArgs.from_yaml(listing)


def test_torchrun_args_validation():
    assert TorchrunArgs(nnodes="2").nnodes == 2
    assert TorchrunArgs(nnodes="1:4").nnodes == "1:4"
    with pytest.raises(ValidationError, match="nnodes"):
        TorchrunArgs(nnodes="two")
    with pytest.raises(ValidationError, match="nproc_per_node"):
        TorchrunArgs(nproc_per_node=0)
    with pytest.raises(ValidationError, match="master_port"):
        TorchrunArgs(master_port=70000)
