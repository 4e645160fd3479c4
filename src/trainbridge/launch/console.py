"""The console of a run: one progress bar and one log line per event from rank 0, library noise once;
and ``console_to``, which sends a process's console (and its children's) to a log file.

Three sources of noise are cut here, all before the libraries are imported (their start-up messages
are printed at import time):

- transformers' own bars ("Loading weights", "Writing model shards") on every rank, through the
  ``huggingface_hub`` switch transformers reads (``HF_HUB_DISABLE_PROGRESS_BARS``); the training bar
  (ours, or transformers' ``ProgressCallback`` with HF callbacks) is not one of them;
- DeepSpeed's "Setting accelerator to CPU" banner, printed whenever transformers imports DeepSpeed on
  a machine without a GPU, also in runs that do not use DeepSpeed: ``DS_ACCELERATOR=cpu`` states
  what DeepSpeed would detect anyway (set only where no GPU is used, never over the user's value);
- library warnings and transformers' log messages, printed once per rank: ranks other than 0 keep
  errors only (rank 0 prints the same warnings);
- bitsandbytes' CPU-kernel warnings, printed on import wherever it is installed: it is imported only when
  a quantised model or an 8-bit optimizer uses it (``modeling.quantization.defer_bitsandbytes``).

Worker log lines carry ``[rankN]`` once: torchrun prefixes the teed ranks (local rank 1 and up), so
only local rank 0, which writes to the console directly, adds its own.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path

from trainbridge.core.nproc import visible_gpu_count

RANK_PREFIX_TEMPLATE = "[rank${rank}]: "
"""torchrun's prefix of a teed rank's lines (``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` unless the user set one)."""

LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"
"""A worker's log lines, after its rank prefix (``configure_worker_console``)."""

OWN_LOG_LINE = re.compile(r"^(\[rank\d+\]:? )?(DEBUG|INFO|WARNING|ERROR|CRITICAL) trainbridge(\.\w+)*: ")
"""A log line of ours on a run's console: ``LOG_FORMAT`` from a ``trainbridge.*`` logger, behind the rank prefix
(``[rank0] `` ours for local rank 0, ``[rank1]: `` torchrun's for the teed ranks).  A line of another logger,
or one the ``warnings`` module prints (``file:line: FutureWarning: ...``), is a library's."""


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
    from trainbridge.modeling.quantization import defer_bitsandbytes

    os.environ.update(quiet_environment(device))
    defer_bitsandbytes()


def whole_lines() -> None:
    """Standard output and error write each line in one ``write``, flushed at its newline.

    Workers run as ``python -u`` (``PYTHONUNBUFFERED``, torchrun's launch), which writes ``print``'s text and
    its newline separately; another rank writing to the same console or log file between the two joins their
    lines.  Line-buffered, not write-through, each line leaves whole and at once."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            with contextlib.suppress(ValueError, OSError):
                stream.reconfigure(line_buffering=True, write_through=False)


def configure_worker_console(rank: int, local_rank: int) -> None:
    """Logging and warnings of one worker; call before importing transformers."""
    from trainbridge.modeling.quantization import defer_bitsandbytes

    whole_lines()
    defer_bitsandbytes()
    if rank != 0:
        warnings.simplefilter("ignore")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    prefix = f"[rank{rank}] " if local_rank == 0 else ""  # torchrun prefixes the other local ranks
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format=prefix + LOG_FORMAT)


@contextlib.contextmanager
def console_to(path: str | Path) -> Iterator[None]:
    """Redirect this process's stdout/stderr *file descriptors* to ``path`` (appended) for the block.

    File descriptors, not ``sys.stdout``: subprocesses started inside the block (torchrun, its workers)
    inherit them, so their output lands in the same file.  Python's streams are flushed on the way in
    and out so nothing written before or inside the block is lost or misplaced.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with Path(path).open("ab") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
