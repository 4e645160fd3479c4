"""Each rank's random-number generator states in a checkpoint (``rng_state.pth`` / ``rng_state_{rank}.pth``).

Python, numpy (if installed), torch CPU and CUDA generators, as Trainer saves them, so that a resumed
run draws the same numbers (dropout, sampling) as the uninterrupted one.
"""

from __future__ import annotations

import importlib.util
import logging
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from trainbridge.checkpoint.layout import rng_state_file_name

if TYPE_CHECKING:
    from trainbridge.core.distributed import DistributedEnv

logger = logging.getLogger(__name__)


def save_rng(folder: Path, env: DistributedEnv) -> None:
    """Write this rank's RNG states into checkpoint ``folder``."""
    torch.save(capture_rng_state(), folder / rng_state_file_name(env.rank, env.world_size))


def restore_rng(folder: Path, env: DistributedEnv) -> None:
    """Restore this rank's RNG states from checkpoint ``folder`` (a warning if its file is missing, e.g.
    after a change of world size)."""
    file = Path(folder) / rng_state_file_name(env.rank, env.world_size)
    if not file.is_file():
        logger.warning("rank %d: %s not found; RNG states not restored", env.rank, file)
        return
    restore_rng_state(torch.load(file, map_location="cpu", weights_only=True))


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
