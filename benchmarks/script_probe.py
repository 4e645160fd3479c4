"""What ``trl_dpo.py`` and ``trl_sft.py`` add to trl's scripts, identically on both sides: per rank, the
wall and CPU seconds of the ``train()`` call and the peak memory.

The benchmark copies this file beside the script and adds ``import script_probe;
script_probe.wrap(Trainer class)`` after the script's trainer import.  When ``train()`` returns, each rank
prints one ``BENCH_PROBE {json}`` line: ``rank``, ``train_wall_s``, ``train_cpu_s`` (this process and any
children it waited for, over the call), ``peak_rss_mib`` (``ru_maxrss`` of this process, and of its
largest child if it ran any) and, on CUDA, ``peak_cuda_mib`` (``torch.cuda.max_memory_allocated``).
With ``BENCH_PYSPY_DIR`` set, nothing more is done here: the benchmark samples the ranks with py-spy.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import time
from typing import Any


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def wrap(trainer_class: Any) -> None:
    """Time ``trainer_class.train`` and report this rank's probe line when it returns."""
    train = trainer_class.train

    @functools.wraps(train)
    def timed_train(self: Any, *args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.time(), _cpu_seconds()
        result = train(self, *args, **kwargs)
        record = {
            "rank": int(os.environ.get("RANK", "0")),
            "train_wall_s": time.time() - wall,
            "train_cpu_s": _cpu_seconds() - cpu,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "children_peak_rss_mib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        }
        import torch

        if torch.cuda.is_available():
            record["peak_cuda_mib"] = torch.cuda.max_memory_allocated() / 2**20
        print("BENCH_PROBE " + json.dumps(record), flush=True)
        return result

    trainer_class.train = timed_train
