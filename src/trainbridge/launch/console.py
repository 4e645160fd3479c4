"""The console of a run: one progress bar and one log line per event from rank 0, library noise once.

Three sources of noise are cut here, all before the libraries are imported (their start-up messages
are printed at import time):

- transformers' own bars ("Loading weights", "Writing model shards") on every rank, through the
  ``huggingface_hub`` switch transformers reads (``HF_HUB_DISABLE_PROGRESS_BARS``); the training bar
  (ours, or transformers' ``ProgressCallback`` with HF callbacks) is not one of them;
- DeepSpeed's "Setting accelerator to CPU" banner, printed whenever transformers imports DeepSpeed on
  a machine without a GPU, also in runs that do not use DeepSpeed: ``DS_ACCELERATOR=cpu`` states
  what DeepSpeed would detect anyway (set only where no GPU is used, never over the user's value);
- library warnings and transformers' log messages, printed once per rank: ranks other than 0 keep
  errors only (rank 0 prints the same warnings).

Worker log lines carry ``[rankN]`` once: torchrun prefixes the teed ranks (local rank 1 and up), so
only local rank 0, which writes to the console directly, adds its own.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping
from pathlib import Path


def visible_gpu_count() -> int:
    """CUDA devices this process can use; 0 without importing torch where no GPU driver is present."""
    if not any(Path(p).exists() for p in ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/kfd")):
        return 0
    import torch

    return int(torch.cuda.device_count())


def quiet_environment(device: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Variables to add to ``base`` (default ``os.environ``) so libraries stay quiet in a run on
    ``device`` (``TrainingArgs.device``); variables ``base`` already sets are left to the user."""
    base = os.environ if base is None else base
    env = {"HF_HUB_DISABLE_PROGRESS_BARS": "1"}
    if device == "cpu" or visible_gpu_count() == 0:
        env["DS_ACCELERATOR"] = "cpu"
    return {key: value for key, value in env.items() if key not in base}


def quiet_this_process(device: str) -> None:
    """``quiet_environment`` applied to this process (the parent, before it imports transformers)."""
    os.environ.update(quiet_environment(device))


def configure_worker_console(rank: int, local_rank: int) -> None:
    """Logging and warnings of one worker; call before importing transformers."""
    if rank != 0:
        warnings.simplefilter("ignore")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    prefix = f"[rank{rank}] " if local_rank == 0 else ""  # torchrun prefixes the other local ranks
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"{prefix}%(levelname)s %(name)s: %(message)s",
    )
