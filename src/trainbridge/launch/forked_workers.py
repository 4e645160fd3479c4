"""Workers forked from the process that runs the script (``launch.script_launch``): ``fork_workers``.

A forked worker goes on with the program from the Trainer import, with what the process imported so far: no
second interpreter start-up, no second import of torch and transformers (``python script.py`` then costs
what ``torchrun script.py`` costs, or less).  What torchrun gives its workers, they get here too:

- their own sessions, as torchrun starts its workers (Ctrl-C at a terminal reaches this process, which forwards
  SIGTERM; the scheduler shares the machine per session);
- torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``...) and
  ``OMP_NUM_THREADS`` (applied to torch, which read it at import);
- the objects this process made so far are frozen (``gc.freeze``): the workers' collections, their final
  one included, do not walk them, which would copy every page they share with this process;
- local rank 0 writes to this console, the others' lines come through pipes prefixed as torchrun prefixes
  its teed ranks (``[rank1]: ``), each line whole (``console.whole_lines``);
- this process waits for them, forwards SIGINT/SIGTERM, stops the others when one fails (torchrun's
  policy), names the first failing rank and exits with the job's status; each worker dies with it
  (``script_workers.become_worker``).

``release_openmp`` comes first: a child forked after torch ran a parallel region waits forever on its
parent's OpenMP threads, so every OpenMP runtime loaded here frees its thread pool
(``omp_pause_resource_all(omp_pause_hard)``, OpenMP 5.0); each process starts a new one when it needs it.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import re
import selectors
import shutil
import signal
import string
import sys
import time
from pathlib import Path
from typing import Any

from trainbridge.launch.console import RANK_PREFIX_TEMPLATE
from trainbridge.launch.script_workers import MASTER_ADDR, become_worker, exit_with, report, worker_environment
from trainbridge.launch.supervise import SHUTDOWN_GRACE_S, free_port

_OPENMP_RUNTIME = re.compile(r"/lib(gomp|iomp5|omp)[^/]*\.so[^/]*$")
_OMP_PAUSE_HARD = 2  # omp_pause_resource_t: omp_pause_soft = 1, omp_pause_hard = 2
_DRAIN_S = 2.0
"""After the last worker exited, how long its output may still arrive (a process it started may hold a pipe)."""


def openmp_runtimes() -> list[str]:
    """The OpenMP runtimes mapped into this process (Linux ``/proc/self/maps``; none elsewhere)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    return sorted({line.split()[-1] for line in maps if _OPENMP_RUNTIME.search(line)})


def release_openmp() -> str | None:
    """Free the thread pool of every OpenMP runtime loaded here; why one could not (None: all did)."""
    for path in openmp_runtimes():
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            return f"the OpenMP runtime {path} cannot release its threads (no omp_pause_resource_all)"
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        if pause(_OMP_PAUSE_HARD) != 0:
            return f"the OpenMP runtime {path} could not release its threads"
    return None


def fork_workers(nproc: int) -> None:
    """Fork ``nproc`` workers; returns in each of them (one rank each).  This process waits for them and exits
    with the job's status (module doc)."""
    from trainbridge.launch.transport import make_payload_folder

    private = make_payload_folder()
    env = worker_environment(nproc, "fork")
    env.update(MASTER_ADDR=MASTER_ADDR, MASTER_PORT=str(free_port(MASTER_ADDR)), WORLD_SIZE=str(nproc))
    env.update(LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", ROLE_WORLD_SIZE=str(nproc), GROUP_WORLD_SIZE="1")
    template = string.Template(env.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE") or RANK_PREFIX_TEMPLATE)
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()  # what was imported stays shared: no collection in a worker walks (and so copies) its pages
    output = RankOutput()
    children: dict[int, int] = {}
    for rank in range(nproc):
        pipes = (os.pipe(), os.pipe()) if rank > 0 else None
        pid = os.fork()
        if pid == 0:
            os.setsid()  # as torchrun starts a worker: its own session (a terminal's Ctrl-C reaches this process only)
            output.close()  # the other ranks' pipes
            if pipes is not None:
                for (read, write), target in zip(pipes, (1, 2), strict=True):
                    os.dup2(write, target)
                    os.close(write)
                    os.close(read)
            os.environ.clear()
            os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank))
            os.environ["TORCHELASTIC_ERROR_FILE"] = str(private / f"error-{rank}.json")
            _as_torchrun_starts_a_worker()
            become_worker()
            return
        children[pid] = rank
        if pipes is not None:
            prefix = template.safe_substitute(rank=rank, local_rank=rank, role_name="default").encode()
            for (read, write), sink in zip(pipes, (1, 2), strict=True):
                os.close(write)
                output.add(read, prefix, sink)
    try:
        code = _wait_for(children, private, output)
    finally:
        output.drain(time.monotonic() + _DRAIN_S)
        output.close()
        shutil.rmtree(private, ignore_errors=True)
    exit_with(code)


def _as_torchrun_starts_a_worker() -> None:
    """What a worker's fresh interpreter would have read from its environment: ``OMP_NUM_THREADS`` (torch read
    this process's at import); ``become_worker`` makes its output line-buffered."""
    torch = sys.modules.get("torch")
    if torch is not None:
        with contextlib.suppress(ValueError, RuntimeError):
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


class RankOutput:
    """The pipes of ranks 1 and up, copied to this process's stdout/stderr with a prefix at each line start."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._at_line_start: dict[int, bool] = {}

    def add(self, fd: int, prefix: bytes, sink: int) -> None:
        self._selector.register(fd, selectors.EVENT_READ, (prefix, sink))
        self._at_line_start[fd] = True

    def pump(self, timeout: float) -> None:
        """Copy what arrived within ``timeout`` seconds (sleep that long when no pipe is left)."""
        if not self._selector.get_map():
            time.sleep(timeout)
            return
        for key, _ in self._selector.select(timeout):
            fd, (prefix, sink) = key.fd, key.data
            try:
                data = os.read(fd, 65536)
            except OSError:
                data = b""
            if not data:
                self._selector.unregister(fd)
                os.close(fd)
                continue
            text, self._at_line_start[fd] = prefixed(data, prefix, self._at_line_start[fd])
            with contextlib.suppress(OSError):  # a closed console (`| head`) must not stop the wait
                _write_all(sink, text)

    def drain(self, deadline: float) -> None:
        """Copy what is left until every pipe is closed or ``deadline`` (``time.monotonic``) passes."""
        while self._selector.get_map() and time.monotonic() < deadline:
            self.pump(0.05)

    def close(self) -> None:
        for key in list(self._selector.get_map().values()):
            self._selector.unregister(key.fd)
            os.close(key.fd)
        self._selector.close()


def prefixed(data: bytes, prefix: bytes, at_line_start: bool) -> tuple[bytes, bool]:
    """``data`` with ``prefix`` at the start of each line; whether the next byte starts a line."""
    out = bytearray()
    lines = data.split(b"\n")
    for index, line in enumerate(lines):
        last = index == len(lines) - 1
        if last and not line:
            break
        if at_line_start:
            out += prefix
        out += line
        at_line_start = not last
        if not last:
            out += b"\n"
    return bytes(out), at_line_start


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _wait_for(children: dict[int, int], private: Path, output: RankOutput) -> int:
    from trainbridge.launch.errors import TrainingInterruptedError
    from trainbridge.launch.failures import root_cause

    records: list[dict[str, Any]] = []
    received: list[int] = []
    stop_at: float | None = None

    def forward(signum: int, frame: Any) -> None:
        received.append(signum)
        _signal_all(children, signal.SIGTERM)

    previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                if stop_at is None and received:
                    stop_at = time.monotonic() + SHUTDOWN_GRACE_S
                if stop_at is not None and time.monotonic() > stop_at:
                    _signal_all(children, signal.SIGKILL)
                output.pump(0.1)
                continue
            rank = children.pop(pid, None)
            code = os.waitstatus_to_exitcode(status)
            if rank is None or code == 0:
                continue
            error_file = private / f"error-{rank}.json"
            records.append(
                {
                    "rank": rank,
                    "local_rank": rank,
                    "pid": pid,
                    "exitcode": code,
                    "signal": signal.Signals(-code).name if code < 0 else None,
                    "error_file": str(error_file) if error_file.is_file() else None,
                    "timestamp": int(time.time()),
                    "message": "",
                }
            )
            if stop_at is None:  # the first failure: torchrun's policy, stop the others
                _signal_all(children, signal.SIGTERM)
                stop_at = time.monotonic() + SHUTDOWN_GRACE_S
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    output.drain(time.monotonic() + _DRAIN_S)  # the failing rank's traceback before the report
    if received:
        return report(TrainingInterruptedError(received[0]))
    return report(root_cause(records)) if records else 0


def _signal_all(children: dict[int, int], signum: int) -> None:
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
