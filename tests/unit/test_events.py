"""The event map covers transformers' TrainerCallback, and the native API has a hook per event."""

import inspect

import pytest
from transformers import TrainerCallback

from trainbridge.core.callback import Callback
from trainbridge.core.events import EVENT_MAP, HF_HOOKS_NOT_FIRED, Event, event_from_name, hf_hook_for


def hf_hooks() -> set[str]:
    return {name for name, _ in inspect.getmembers(TrainerCallback, inspect.isfunction) if name.startswith("on_")}


def test_event_map_covers_every_trainer_callback_hook():
    mapped = {spec.hf_hook for spec in EVENT_MAP.values() if spec.hf_hook}
    missing = hf_hooks() - mapped - set(HF_HOOKS_NOT_FIRED)
    assert not missing, f"transformers.TrainerCallback hooks with no trainbridge event: {sorted(missing)}"


def test_mapped_hf_hooks_exist_on_trainer_callback():
    for spec in EVENT_MAP.values():
        if spec.hf_hook:
            assert spec.hf_hook in hf_hooks(), spec
    assert set(HF_HOOKS_NOT_FIRED) <= hf_hooks()


def test_every_event_has_a_spec_and_a_base_hook():
    assert set(EVENT_MAP) == set(Event)
    for event in Event:
        assert callable(getattr(Callback, event.method)), event
        assert EVENT_MAP[event].fires


def test_hf_hook_names_match_event_names_where_mapped():
    for event in Event:
        hook = hf_hook_for(event)
        assert hook is None or hook == event.value


def test_event_from_name_accepts_both_forms_and_rejects_typos():
    assert event_from_name("save") is Event.SAVE
    assert event_from_name("on_save") is Event.SAVE
    with pytest.raises(ValueError, match=r"unknown event 'on_sav'.*on_save"):
        event_from_name("on_sav")
