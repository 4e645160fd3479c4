"""This process's random-number generator states (Python, numpy if installed, torch CPU and CUDA): captured and
put back, for checkpoints (``checkpoint.rng``) and for reads that must leave the streams as they were."""

from __future__ import annotations

import contextlib
import importlib.util
import random
from collections.abc import Iterator
from typing import Any, cast

import torch


def capture_rng_state() -> dict[str, Any]:
    """This process's python, numpy (if installed), torch CPU and CUDA generator states."""
    python_state = random.getstate()
    state: dict[str, Any] = {
        "python": [python_state[0], list(python_state[1]), python_state[2]],
        "cpu": torch.get_rng_state(),
    }
    if importlib.util.find_spec("numpy") is not None:
        import numpy as np

        kind, keys, pos, has_gauss, cached = cast(tuple[str, Any, int, int, float], np.random.get_state())
        state["numpy"] = [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of ``capture_rng_state``."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["cpu"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def rng_states_kept() -> Iterator[None]:
    """The generators' states as they were on entry, again on exit (``capture_rng_state``/``restore_rng_state``)."""
    state = capture_rng_state()
    try:
        yield
    finally:
        restore_rng_state(state)


class SamplerDraw:
    """The torch generator state an epoch's training order was drawn from, where the sampler draws it from the
    global generator as the epoch's ``DataLoader`` starts reading (Trainer's ``LengthGroupedSampler``, after
    every draw of the earlier epochs).  Each rank's checkpoint RNG file keeps it (``checkpoint.rng``), so a run
    resumed inside that epoch draws the same order again."""

    def __init__(self) -> None:
        self.state: torch.Tensor | None = None
        """The state the running epoch's order was drawn from (None: no such draw, or not known)."""
