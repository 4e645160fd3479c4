"""Sending a process's console (and its children's: torchrun and its workers) to a log file."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path


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
