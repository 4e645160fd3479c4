"""``save_pretrained`` without importing DeepSpeed when nothing in the process uses it.

transformers' ``save_pretrained`` unwraps the model with accelerate's ``extract_model_from_parallel``, which
imports ``deepspeed`` whenever it is installed, only to test ``isinstance(model, DeepSpeedEngine)``.  That
import costs seconds per process (DeepSpeed pulls in mlflow, pandas, fastapi ... when installed).  A model
can only be a ``DeepSpeedEngine`` once ``deepspeed`` was imported, so inside ``without_deepspeed_import()``
the check asks accelerate's question only then: the unwrapped model is the same, the optional library is
imported only by the runs that use it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def _deepspeed_in_use(installed: Callable[[], bool]) -> Callable[[], bool]:
    """``installed`` narrowed to "installed and already imported" (so a ``DeepSpeedEngine`` may exist)."""

    def in_use() -> bool:
        return "deepspeed" in sys.modules and installed()

    in_use.narrows = installed  # type: ignore[attr-defined]
    return in_use


@contextmanager
def without_deepspeed_import() -> Iterator[None]:
    """Inside it, accelerate's ``extract_model_from_parallel`` (``save_pretrained``, ``unwrap_model``) imports
    DeepSpeed only if it is imported already.  Reentrant; with no accelerate installed it does nothing."""
    try:
        import accelerate.utils.other as other
    except ImportError:
        yield
        return
    installed = other.is_deepspeed_available
    if hasattr(installed, "narrows"):  # an enclosing scope (or another thread) narrowed it already
        yield
        return
    other.is_deepspeed_available = _deepspeed_in_use(installed)
    try:
        yield
    finally:
        other.is_deepspeed_available = installed
