"""Configuration errors read as one short line each: field, value, where it came from, why, the fix."""

import pytest
import yaml
from pydantic import ValidationError

from trainbridge.core.config import TorchrunArgs, TrainingArgs
from trainbridge.core.config_errors import (
    check_constructor_kwargs,
    closest,
    describe_validation_error,
    format_validation_error,
)
from trainbridge.hf.porting import RENAMED, trainer_field_hint, training_args_from_hf


@pytest.fixture
def base(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "1+1=2"}\n')
    return {"model_path": model, "data_path": data, "ckpt_output_dir": tmp_path / "out"}


def _lines(fields, **kwargs):
    with pytest.raises(ValidationError) as info:
        TrainingArgs(**fields)
    return describe_validation_error(info.value, TrainingArgs, **kwargs)


def _one(fields, **kwargs):
    (line,) = _lines(fields, **kwargs)
    return line


def test_misspelled_field_gets_the_nearest_name(base):
    assert _one({**base, "max_step": 10}) == ("max_step = 10: not a TrainingArgs field. Did you mean 'max_steps'?")


def test_misspelled_choice_gets_the_choices_and_the_nearest(base):
    assert _one({**base, "eval_strategy": "step"}) == (
        "eval_strategy = 'step': must be one of 'no', 'steps', 'epoch'. Did you mean 'steps'?"
    )


@pytest.mark.parametrize(
    ("name", "ours"),
    [
        ("num_train_epochs", "num_epochs"),
        ("output_dir", "ckpt_output_dir"),
        ("lr_scheduler_type", "lr_scheduler"),
        ("per_device_train_batch_size", "effective_batch_size"),
        ("gradient_accumulation_steps", "effective_batch_size"),
        ("bf16", "mixed_precision: bf16"),
    ],
)
def test_trainer_names_say_which_field_of_ours_they_are(base, name, ours):
    line = _one({**base, name: 3}, foreign_hint=trainer_field_hint)
    assert line.startswith(f"{name} = 3: not a TrainingArgs field. {name} is transformers.TrainingArguments' name")
    assert ours in line and "Did you mean" not in line


def test_renamed_trainer_fields_are_what_porting_carries_over(tmp_path, base):
    """The hint's facts are porting's facts: each renamed TrainingArguments field lands in the named field."""
    from transformers import TrainingArguments

    hf = TrainingArguments(
        output_dir=str(tmp_path / "hf_out"),
        num_train_epochs=3,
        lr_scheduler_type="cosine",
        bf16=False,
        use_cpu=True,
        ddp_timeout=77,
        restore_callback_states_from_checkpoint=True,
        torch_compile_mode="max-autotune",
        enable_jit_checkpoint=True,
        debug="underflow_overflow",
    )
    ported = training_args_from_hf(hf, model_path=base["model_path"], data_path=base["data_path"])
    expected = {
        "output_dir": tmp_path / "hf_out",
        "num_train_epochs": 3,
        "lr_scheduler_type": "cosine",
        "bf16": "no",
        "use_cpu": "cpu",
        "ddp_timeout": 77.0,
        "restore_callback_states_from_checkpoint": True,
        "fp16": "no",
        "torch_compile": True,
        "torch_compile_backend": "inductor",
        "torch_compile_mode": "max-autotune",
        "enable_jit_checkpoint": True,
        "debug": True,
    }
    assert set(RENAMED) == set(expected)
    for name, ours in RENAMED.items():
        field = ours.split(":")[0]
        assert field in TrainingArgs.model_fields
        assert getattr(ported, field) == expected[name], name


def test_a_name_of_neither_library_gets_no_trainer_hint():
    assert trainer_field_hint("max_step") is None


def test_set_values_are_reported_as_coming_from_set(base):
    line = _one({**base, "learning_rate": -1}, source="run.yaml", overrides={"learning_rate": -1})
    assert line == "learning_rate = -1 (from --set learning_rate=-1): must be greater than 0."


def test_yaml_values_are_reported_with_their_file(base):
    line = _one({**base, "learning_rate": -1}, source="run.yaml", overrides={"max_steps": 3})
    assert line == "learning_rate = -1 (in run.yaml): must be greater than 0."


def test_misspelled_callback_class_gets_the_nearest_name(base):
    line = _one({**base, "callbacks": [{"class": "transformers:EarlyStopingCallback"}]})
    assert line == (
        "callbacks[0].class = 'transformers:EarlyStopingCallback': module 'transformers' has no "
        "attribute 'EarlyStopingCallback'. Did you mean 'EarlyStoppingCallback'?"
    )


def test_misspelled_callback_kwarg_gets_the_nearest_name(base):
    line = _one(
        {
            **base,
            "callbacks": [{"class": "transformers:EarlyStoppingCallback", "kwargs": {"early_stopping_patiense": 3}}],
        }
    )
    assert line.startswith(
        "callbacks[0].kwargs = {'early_stopping_patiense': 3}: EarlyStoppingCallback has no "
        "argument 'early_stopping_patiense'. Did you mean 'early_stopping_patience'?"
    )


def test_callback_missing_a_required_kwarg_is_named(base, tmp_path, monkeypatch):
    (tmp_path / "needs_arg.py").write_text(
        "from trainbridge import Callback\n\n\nclass NeedsArg(Callback):\n"
        "    def __init__(self, threshold):\n        pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    line = _one({**base, "callbacks": [{"class": "needs_arg:NeedsArg"}]})
    assert line == "callbacks[0].kwargs: NeedsArg needs 'threshold' in its kwargs."


def test_every_bad_callback_is_reported_once_without_pydantic_noise(base):
    lines = _lines(
        {
            **base,
            "callbacks": [
                {"class": "transformers:EarlyStopingCallback"},
                3,
                {"clas": "transformers:EarlyStoppingCallback"},
            ],
        }
    )
    assert lines[1] == "callbacks[1]: 3 is not a callback object, class or spec."
    assert (
        "callbacks[2].clas = 'transformers:EarlyStoppingCallback': not a CallbackSpec field. Did you mean "
        "'class'?" in lines
    )
    text = "\n".join(lines)
    assert "CallbackSpec\n" not in text and "validation error" not in text and "pydantic" not in text


def test_misspelled_event_function_gets_the_nearest_event(base):
    assert _one({**base, "on_sve": print}) == "on_sve: not an event. Did you mean 'on_save'?"


def test_missing_field_says_what_it_is(tmp_path):
    with pytest.raises(ValidationError) as info:
        TrainingArgs(model_path=tmp_path, data_path=tmp_path)
    lines = describe_validation_error(info.value, TrainingArgs)
    assert any(line.startswith("ckpt_output_dir: required -- Where checkpoints") for line in lines)


def test_a_cross_field_rule_names_its_field_and_value(base):
    assert _one({**base, "eval_strategy": "steps", "validation_split": 0.1}) == (
        "eval_steps: required when eval_strategy='steps'."
    )


def test_a_union_field_is_one_line(base):
    assert _one({**base, "resume_from_checkpoint": 3}) == "resume_from_checkpoint = 3: must be 'auto' or a path."


def test_report_has_no_urls_and_no_config_dump(base):
    with pytest.raises(ValidationError) as info:
        TrainingArgs(**{**base, "max_step": 10, "eval_strategy": "step"})
    text = format_validation_error(info.value, TrainingArgs, source="run.yaml")
    assert text.splitlines()[0] == "invalid configuration in run.yaml (2 problems); nothing was launched:"
    assert "http" not in text and "input_value" not in text and str(base["model_path"]) not in text
    assert all(line.startswith("- ") for line in text.splitlines()[1:])


def test_torchrun_args_errors_use_the_same_form():
    with pytest.raises(ValidationError) as info:
        TorchrunArgs(nproc_per_node=0)
    assert describe_validation_error(info.value, TorchrunArgs) == ["nproc_per_node = 0: must be greater than 0."]


def test_closest_folds_case_and_dashes():
    assert closest("Max-Steps", ["max_steps", "seed"]) == ["max_steps"]
    assert closest("zzz", ["max_steps"]) == []


def test_constructor_check_accepts_var_keyword_and_unreadable_signatures():
    class Open:
        def __init__(self, **kwargs):
            pass

    check_constructor_kwargs(Open, {"anything": 1})
    check_constructor_kwargs(dict, {"anything": 1})


def test_yaml_file_errors_name_the_yaml(base, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({k: str(v) for k, v in base.items()} | {"max_step": 5}))
    with pytest.raises(ValidationError) as info:
        TrainingArgs.from_yaml(path)
    assert describe_validation_error(info.value, TrainingArgs, source="run.yaml") == [
        "max_step = 5 (in run.yaml): not a TrainingArgs field. Did you mean 'max_steps'?"
    ]
