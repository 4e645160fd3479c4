"""The event map covers transformers' TrainerCallback, and the native API has a hook per event."""

import inspect

import pytest
from transformers import TrainerCallback

from trainbridge.core.callback import Callback
from trainbridge.core.events import EVENT_MAP, HF_EVENTS, HF_HOOKS_NOT_FIRED, Event, event_from_name


def hf_hooks() -> set[str]:
    return {name for name, _ in inspect.getmembers(TrainerCallback, inspect.isfunction) if name.startswith("on_")}


def test_event_map_covers_every_trainer_callback_hook():
    mapped = {event.value for event in HF_EVENTS}
    missing = hf_hooks() - mapped - set(HF_HOOKS_NOT_FIRED)
    assert not missing, f"transformers.TrainerCallback hooks with no trainbridge event: {sorted(missing)}"


def test_events_with_an_hf_twin_are_trainer_callback_hooks_and_the_others_are_not():
    for event, spec in EVENT_MAP.items():
        assert (event.value in hf_hooks()) is spec.hf_twin, event
        assert (event in HF_EVENTS) is spec.hf_twin, event
    assert set(HF_HOOKS_NOT_FIRED) <= hf_hooks()
    assert not {e.value for e in HF_EVENTS} & set(HF_HOOKS_NOT_FIRED)


def test_every_event_has_a_spec_and_a_base_hook():
    assert set(EVENT_MAP) == set(Event)
    for event in Event:
        assert callable(getattr(Callback, event.method)), event
        assert EVENT_MAP[event].fires


def test_run_event_calls_the_hook_of_the_same_name_and_handles_lists_overridden_hooks():
    calls = []

    class Saver(Callback):
        def on_save(self, context, **kwargs):
            calls.append((context, kwargs))

    saver = Saver()
    saver.run_event(Event.SAVE, "ctx", checkpoint_path="p")
    assert calls == [("ctx", {"checkpoint_path": "p"})]
    assert [e for e in Event if saver.handles(e)] == [Event.SAVE]


def test_event_from_name_accepts_both_forms_and_rejects_typos():
    assert event_from_name("save") is Event.SAVE
    assert event_from_name("on_save") is Event.SAVE
    with pytest.raises(ValueError, match=r"unknown event 'on_sav'.*on_save"):
        event_from_name("on_sav")
