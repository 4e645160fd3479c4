"""How many worker processes a launch starts per node when none is given (``default_nproc_per_node``).

Light on purpose (no torch unless a GPU driver is present, no pydantic): the CLI's ``--help`` reads it.
"""

from __future__ import annotations

import os
from pathlib import Path

NPROC_ENV = "TRAINBRIDGE_NPROC_PER_NODE"
"""Environment variable overriding the default number of worker processes per node (any launch)."""


def visible_gpu_count() -> int:
    """CUDA devices this process can use; 0 without importing torch where no GPU driver is present."""
    if not any(Path(p).exists() for p in ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd")):
        return 0
    import torch

    return int(torch.cuda.device_count())


def default_nproc_per_node(device: str = "auto") -> int:
    """Worker processes per node when none is given, for a run on ``device`` (``TrainingArgs.device``):
    ``$TRAINBRIDGE_NPROC_PER_NODE``, else one per visible GPU (none are counted for ``cpu``), else 1.

    The one default of ``TorchrunArgs``, ``trainbridge train`` and ``trainbridge.Trainer``."""
    value = os.environ.get(NPROC_ENV)
    if value:
        if not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"{NPROC_ENV}={value!r}: expected a positive number of worker processes")
        return int(value)
    gpus = 0 if device == "cpu" else visible_gpu_count()
    return gpus or 1


def threads_per_worker(nproc: int) -> int:
    """``OMP_NUM_THREADS`` of each of ``nproc`` workers on this node when the user set none: the cores this
    process may use, shared out (torchrun's own default is 1)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, nproc))
