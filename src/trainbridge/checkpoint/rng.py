"""Each rank's random-number generator states in a checkpoint (``rng_state.pth`` / ``rng_state_{rank}.pth``).

Python, numpy (if installed), torch CPU and CUDA generators, as Trainer saves them, so that a resumed
run draws the same numbers (dropout, sampling) as the uninterrupted one.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from trainbridge.checkpoint.layout import rng_state_file_name
from trainbridge.core.random_state import SamplerDraw, capture_rng_state, restore_rng_state

if TYPE_CHECKING:
    from trainbridge.core.distributed import DistributedEnv

logger = logging.getLogger(__name__)


SAMPLER_KEY = "sampler"
"""The entry holding the running epoch's ``SamplerDraw`` (Trainer's readers of the file ignore it)."""


def save_rng(folder: Path, env: DistributedEnv, sampler: SamplerDraw | None = None) -> None:
    """Write this rank's RNG states into checkpoint ``folder``, with the state ``sampler`` drew its epoch's
    order from, if any."""
    state = capture_rng_state()
    if sampler is not None and sampler.state is not None:
        state[SAMPLER_KEY] = sampler.state
    torch.save(state, folder / rng_state_file_name(env.rank, env.world_size))


def restore_rng(folder: Path, env: DistributedEnv, sampler: SamplerDraw | None = None) -> None:
    """Restore this rank's RNG states from checkpoint ``folder`` (a warning if its file is missing, e.g.
    after a change of world size), and ``sampler``'s state."""
    file = Path(folder) / rng_state_file_name(env.rank, env.world_size)
    if not file.is_file():
        logger.warning("rank %d: %s not found; RNG states not restored", env.rank, file)
        return
    state = torch.load(file, map_location="cpu", weights_only=True)
    restore_rng_state(state)
    if sampler is not None:
        sampler.state = state.get(SAMPLER_KEY)
