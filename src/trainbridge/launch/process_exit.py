"""Leaving a process of a run at once, once its work is done: ``exit_now``.

Every process of a run ends this way after its last useful act: the workers (after the result is
written and the process group is torn down), the torchrun agent (after it has seen every worker
finish) and the ``trainbridge`` command (after the summary is printed).  What is skipped is the
interpreter's teardown: finalising every module and object, then C++ static destructors.  With torch,
transformers and datasets loaded that took 0.3-1.5 s per process on the shared 2-core machine
(``docs/benchmarks.md``, start-up section).  It is not what makes the exit clean: a gloo worker thread still
to release a finished collective's tensors when the interpreter finalises aborts the process ("terminate
called without an active exception"); ``DistributedEnv.teardown`` and its exit hook let those threads go
idle first (``core.distributed.wait_for_idle_gloo_threads``), as in a script run in place, which ends with
the interpreter's own exit.
What is kept: Python's exit handlers (``atexit``: reporting integrations flush and close there,
``weakref.finalize`` objects such as temporary folders are cleaned), logging's handlers and the
standard streams are flushed.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
from typing import NoReturn


def exit_now(code: int) -> NoReturn:
    """Run the exit handlers, flush logging and the standard streams, and end the process with ``code``."""
    atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):  # a closed or replaced stream
            stream.flush()
    os._exit(code)
