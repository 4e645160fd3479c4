"""``TrainingArgs`` holds data only; the run's code is its ``RunPlan`` (``core.config.plan``), given beside it."""

import collections.abc
import pathlib
import types
import typing

import pydantic
import pytest
from pydantic import BaseModel

from trainbridge.core.config import CallbackSpec, RunPlan, TrainingArgs, check_consistent
from trainbridge.core.events import Event

DATA_TYPES = (str, int, float, bool, type(None), pathlib.Path, BaseModel)
"""What a field's type may be made of: strings, numbers, paths, enums (``Literal``), and nested data models."""


def _code_in(annotation: typing.Any) -> list[str]:
    """The parts of a field's type that are not data: ``Any``, callables, objects."""
    if annotation is pydantic.JsonValue:  # JSON: strings, numbers, booleans, lists and dicts of them
        return []
    if annotation is typing.Any:
        return ["Any"]
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return []
    if origin in (typing.Union, types.UnionType, list, dict, tuple, set):
        return [bad for arg in typing.get_args(annotation) if arg is not Ellipsis for bad in _code_in(arg)]
    if origin is not None:  # Callable[...], Iterable[...], other generics
        return [repr(annotation)]
    if annotation is collections.abc.Callable:
        return ["Callable"]
    if isinstance(annotation, type) and (issubclass(annotation, DATA_TYPES) or issubclass(annotation, str)):
        return []
    return [repr(annotation)]


def test_every_training_args_field_is_data():
    problems = {name: bad for name, field in TrainingArgs.model_fields.items() if (bad := _code_in(field.annotation))}
    assert problems == {}, f"TrainingArgs fields typed as code (move them into RunPlan): {problems}"


def test_the_field_type_check_sees_code():
    assert _code_in(typing.Any) and _code_in(collections.abc.Callable[..., typing.Any])
    assert _code_in(collections.abc.Callable[..., int] | None) and _code_in(list[typing.Any])
    assert not _code_in(dict[str, int] | None) and not _code_in(typing.Literal["a", "b"])


@pytest.fixture
def base(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "x"}\n')
    return {"model_path": model, "data_path": data, "ckpt_output_dir": tmp_path / "out"}


class _Seen:
    def on_log(self, context, **kwargs):
        return None


def test_code_keywords_make_the_plan_beside_the_arguments(base):
    def metrics(prediction):
        return {}

    callback = _Seen()
    spec = {"class": "trainbridge.callbacks.schedule:ScheduleCallback"}
    plan = RunPlan.from_keywords(compute_metrics=metrics, callbacks=[callback, spec], on_save=print)
    assert plan.compute_metrics is metrics and plan.event_functions == {Event.SAVE: [print]}
    assert plan.callbacks[0] is callback and isinstance(plan.callbacks[1], CallbackSpec)
    args = TrainingArgs(**base, callbacks=[spec])  # import specs are data: the field keeps them
    assert args.callbacks == [plan.callbacks[1]]
    dumped = args.model_dump()
    assert all(not callable(value) for value in dumped.values())
    assert not hasattr(args, "plan") and "plan" not in dumped


@pytest.mark.parametrize(
    ("keyword", "value"),
    [("compute_metrics", print), ("on_save", print), ("model_init", print), ("data_collator", print)],
)
def test_training_args_refuses_code_naming_run_training(base, keyword, value):
    with pytest.raises(pydantic.ValidationError, match=rf"{keyword}: code, not a setting.*run_training\(args"):
        TrainingArgs(**base, **{keyword: value})


def test_training_args_refuses_a_callback_object_naming_run_training(base):
    with pytest.raises(pydantic.ValidationError, match=r"callbacks\[0\]: .* is code.*run_training\(args, torchrun"):
        TrainingArgs(**base, callbacks=[_Seen()])


def test_a_bad_code_keyword_is_named(base):
    with pytest.raises(ValueError, match="learning_rate: not a RunPlan keyword"):
        RunPlan.from_keywords(learning_rate=1.0)
    with pytest.raises(ValueError, match="on_save: expected a callable"):
        RunPlan.from_keywords(on_save=3)


def test_the_plan_is_checked_with_the_arguments_at_the_run_boundary(base):
    args = TrainingArgs(**base, packing="padding_free")
    check_consistent(args, RunPlan())
    with pytest.raises(ValueError, match="packing: 'padding_free' cannot be used with a data_collator"):
        check_consistent(args, RunPlan(data_collator=print))
    no_model = TrainingArgs(**{**base, "model_path": None}, tokenizer_path=base["model_path"])
    check_consistent(no_model, RunPlan(model_init=print))
    with pytest.raises(ValueError, match=r"model_path: None; required .* run_training\(..., model_init=fn\)"):
        check_consistent(no_model, RunPlan())


def test_the_loss_is_the_plans_and_token_metrics_is_no_setting(base):
    from trainbridge.core.config.loss import TokenLoss

    with pytest.raises(
        pydantic.ValidationError, match=r"token_metrics: .* loss=trainbridge.core.config.loss.TokenLoss"
    ):
        TrainingArgs(**base, token_metrics=True)
    assert TrainingArgs(**base, token_metrics=False) == TrainingArgs(**base)  # an older config's value loads
    plan = RunPlan.from_keywords(loss=TokenLoss(metrics=True))
    assert plan.loss == TokenLoss(metrics=True) and RunPlan.from_keywords(**plan.keywords()).loss == plan.loss
