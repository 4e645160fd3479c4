"""Hugging Face's side: ``transformers.TrainerCallback``s and ``report_to`` integrations, unchanged.

- ``HuggingFaceCallbacks``: one native callback driving every HF callback with a real
  ``TrainingArguments`` / ``TrainerState`` / ``TrainerControl`` (``trainbridge.hf.trainer_callbacks``; the
  handler in ``hf.handler``, the ``TrainerState`` in ``hf.trainer_state``).
- ``build_training_arguments``: the run's ``TrainingArguments``, without touching device or
  distributed set-up (``trainbridge.hf.arguments``).
- ``training_args_from_hf``: port an existing ``TrainingArguments`` to ``TrainingArgs``
  (``trainbridge.hf.porting``).
- ``split_callbacks``: separate HF callbacks from the others.
- ``native_callbacks``: trainbridge's own callbacks held by a ``Trainer``'s ``CallbackHandler`` (silent there).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from trainbridge.hf.arguments import build_training_arguments
from trainbridge.hf.handler import HuggingFaceCallbackError, is_hf_callback
from trainbridge.hf.porting import HFPortingWarning, training_args_from_hf
from trainbridge.hf.trainer_callbacks import HuggingFaceCallbacks


def split_callbacks(callbacks: Iterable[Any]) -> tuple[list[Any], list[Any]]:
    """``(others, hf)``: ``transformers.TrainerCallback`` instances and subclasses go to ``hf``, everything
    else (native callbacks, specs...) to ``others``; both keep their relative order."""
    others: list[Any] = []
    hf: list[Any] = []
    for callback in callbacks:
        (hf if is_hf_callback(callback) else others).append(callback)
    return others, hf


__all__ = [
    "HFPortingWarning",
    "HuggingFaceCallbackError",
    "HuggingFaceCallbacks",
    "build_training_arguments",
    "is_hf_callback",
    "split_callbacks",
    "training_args_from_hf",
]
