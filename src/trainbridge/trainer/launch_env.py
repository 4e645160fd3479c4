"""Which way ``Trainer.train()`` runs: in place under a launcher, or launching its own workers.

``in_launched_worker()`` (``RANK``/``LOCAL_RANK``/``WORLD_SIZE`` set, read by ``core.distributed``): run in
place.  Otherwise the facade launches ``self_launch_nproc()`` torchrun workers on this machine.
"""

from __future__ import annotations

import os

import torch

from trainbridge.core.distributed import launched_worker

NPROC_ENV = "TRAINBRIDGE_NPROC_PER_NODE"
"""Number of worker processes ``python script.py`` launches; default: every visible GPU, else 1 (CPU)."""


def in_launched_worker() -> bool:
    """True when this process is one rank of a launched job."""
    return launched_worker()


def self_launch_nproc() -> int:
    """Worker processes for a self-launched run: ``$TRAINBRIDGE_NPROC_PER_NODE``, else the visible GPUs,
    else 1."""
    value = os.environ.get(NPROC_ENV)
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{NPROC_ENV}={value!r}: expected a positive number of processes")
        return int(value)
    return torch.cuda.device_count() if torch.cuda.is_available() else 1
