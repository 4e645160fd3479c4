"""Fixtures shared by every test tier."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama and its character tokenizer saved once per session (``demos.tiny_model``); read-only."""
    from trainbridge.demos.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama") / "model")
