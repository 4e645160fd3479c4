"""``TrainingArgs`` holds data only; the run's code is its ``RunPlan`` (``core.config.plan``)."""

import collections.abc
import pathlib
import types
import typing

import pydantic
import pytest
from pydantic import BaseModel

from trainbridge.core.config import CallbackSpec, RunPlan, TrainingArgs, default_plan
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


def test_code_keywords_go_into_the_plan_and_never_into_a_field(base):
    def metrics(prediction):
        return {}

    callback = _Seen()
    spec = {"class": "trainbridge.callbacks.schedule:ScheduleCallback"}
    args = TrainingArgs(**base, compute_metrics=metrics, callbacks=[callback, spec], on_save=print)
    assert args.plan.compute_metrics is metrics and default_plan(args) is args.plan
    assert args.plan.event_functions == {Event.SAVE: [print]}
    assert args.plan.callbacks[0] is callback and isinstance(args.plan.callbacks[1], CallbackSpec)
    assert args.callbacks == [args.plan.callbacks[1]]  # the field keeps the spec only: it is data
    dumped = args.model_dump()
    assert "compute_metrics" not in dumped and "event_functions" not in dumped
    assert all(not callable(value) for value in dumped.values())
    assert "compute_metrics" not in args.to_yaml()


def test_plan_survives_copies_and_is_checked(base):
    args = TrainingArgs(**base, data_collator=print)
    assert args.model_copy(update={"learning_rate": 1e-3}).plan.data_collator is print
    plain = args.with_plan(args.plan.replace(data_collator=None))
    assert plain.plan.data_collator is None and args.plan.data_collator is print
    with pytest.raises(ValueError, match="packing"):
        TrainingArgs(**base, packing="padding_free").with_plan(RunPlan(data_collator=print))
