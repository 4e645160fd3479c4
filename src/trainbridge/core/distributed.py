"""The distributed seam: the one place that initialises and tears down the process group.

Only this module reads the torchrun environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``...).
Everything else asks a ``DistributedEnv`` for rank, world size and device, and communicates through
the named collectives below.  Every collective in the library is one of these functions, so a reader
can count them.  They are no-ops (or identities) when the world size is 1 and no group was started.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


class RankZeroError(RuntimeError):
    """What every rank raises when rank 0 failed a step that ``DistributedEnv.on_rank_zero`` ran for all (or
    another rank, one that ``on_every_rank`` ran)."""

    def __init__(self, what: str, cause: str, rank: int = 0):
        super().__init__(f"rank {rank} failed {what}: {cause}")
        self.what = what
        self.cause = cause


LAUNCHER_ENV_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
"""Set by torchrun (and ``accelerate launch``, torchrun under ``srun``) in every worker process."""


def launched_worker() -> bool:
    """True in a process started by a launcher (``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE`` all set):
    it is one rank of a job, and training must run in place here, never launch workers of its own."""
    return all(name in os.environ for name in LAUNCHER_ENV_VARS)


CUDA_ALLOC_CONF_DEFAULT = "expandable_segments:True"
"""``PYTORCH_CUDA_ALLOC_CONF`` when the user has not set it: fewer fragmentation OOMs with varying
micro-batch shapes (what torchtitan sets)."""


def apply_cuda_defaults() -> None:
    """CUDA workers' defaults, before the device is first used: the allocator's expandable segments
    (unless ``PYTORCH_CUDA_ALLOC_CONF`` is set) and TF32 for fp32 matmuls and convolutions."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", CUDA_ALLOC_CONF_DEFAULT)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


GLOO_WORKER_THREAD = "pt_gloo"
"""The name torch gives the worker threads of a gloo process group (``pt_gloo_runloop``)."""


def _gloo_worker_threads() -> dict[str, tuple[str, int]]:
    """State letter and context-switch count of each gloo worker thread of this process (``/proc``; empty
    where there is none or no ``/proc``)."""
    threads: dict[str, tuple[str, int]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return threads
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/status") as fh:
                fields = dict(line.split(":", 1) for line in fh.read().splitlines() if ":" in line)
            if fields["Name"].strip().startswith(GLOO_WORKER_THREAD):
                switches = int(fields["voluntary_ctxt_switches"]) + int(fields["nonvoluntary_ctxt_switches"])
                threads[tid] = (fields["State"].strip()[:1], switches)
        except (OSError, KeyError, ValueError):  # a thread that ended meanwhile
            continue
    return threads


def wait_for_idle_gloo_threads(timeout_s: float = 10.0, interval_s: float = 0.02) -> bool:
    """Wait, without the GIL, until every gloo worker thread of this process is idle; False on timeout.

    Why: a gloo worker thread releases each finished collective's tensors itself, after the rank that waited
    for it has moved on, and releasing a tensor Python created takes the GIL.  When the interpreter has begun
    to finalise by then, CPython ends that thread on the spot (``PyThread_exit_thread`` in ``take_gil``),
    which unwinds through a C++ destructor: ``std::terminate``, "terminate called without an active
    exception", exit code -6 for a run whose work was done.  On a loaded machine the thread may wait long
    enough for the GIL to lose that race.  ``destroy_process_group`` joins the threads only when nothing else
    holds the group (a DDP model, a device mesh, a script's handle), so it is no guarantee alone.

    Idle: every worker thread asleep with the same context-switch count over one ``interval_s`` while this
    thread sleeps (GIL released): a thread waiting for the GIL wakes at least every 5 ms (CPython's switch
    interval) and takes it once free, so it shows as switching or runnable until it has finished.
    """
    before = _gloo_worker_threads()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(interval_s)
        now = _gloo_worker_threads()
        if now == before and all(state == "S" for state, _ in now.values()):
            return True
        before = now
    return False


_AT_EXIT: list[weakref.ref[DistributedEnv]] = []
"""The environments with a process group, for ``_at_exit``."""


def _leave_at_exit(env: DistributedEnv) -> None:
    """Have ``_at_exit`` see ``env`` (registered with ``atexit`` by the first call)."""
    if not _AT_EXIT:
        atexit.register(_at_exit)
    _AT_EXIT.append(weakref.ref(env))


def _at_exit() -> None:
    """At interpreter exit, before it finalises: in place (a script under its own launcher) the script's end
    is the process's end.  A group an environment started and nobody tore down is destroyed (no barrier: a
    peer may have failed); whoever started it, gloo's worker threads are let go idle first
    (``wait_for_idle_gloo_threads``).  After ``teardown`` there is little left to do.  Last, every object is
    frozen (``gc.freeze``): the interpreter's final collections and module teardown skip the ~500k objects
    torch, transformers and datasets made (14.4 s -> 1.0 s of exit under load, ``docs/benchmarks.md``), as a
    worker's ``os._exit`` skips them; exit handlers registered after this one have run, streams are still
    flushed, and Python never promised ``__del__`` for objects alive at exit."""
    for ref in _AT_EXIT:
        env = ref()
        if env is not None and env.started_group:
            env.teardown(clean=False)
    if dist.is_available():
        wait_for_idle_gloo_threads()
    gc.freeze()


@dataclass
class DistributedEnv:
    """Rank, world size and device of this worker, with the process group it started."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None
    started_group: bool = False
    _checkpoint_group: Any = field(default=None, repr=False, compare=False)

    @property
    def is_distributed(self) -> bool:
        """True when a process group spans more than one rank."""
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    @property
    def is_world_process_zero(self) -> bool:
        """Global rank 0 (writes metrics, progress, reports)."""
        return self.rank == 0

    @property
    def is_local_process_zero(self) -> bool:
        """Rank 0 of this node."""
        return self.local_rank == 0

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def initialize(cls, device: str = "auto", timeout_s: float = 600.0) -> DistributedEnv:
        """Read torchrun's environment, pick the device, start the process group (gloo on CPU, NCCL on CUDA)."""
        rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
        use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        if use_cuda:
            if not torch.cuda.is_available():
                raise RuntimeError("device='cuda' was requested but CUDA is not available on this worker")
            apply_cuda_defaults()
            torch.cuda.set_device(local_rank)
            dev = torch.device("cuda", local_rank)
        else:
            dev = torch.device("cpu")
        env = cls(rank, local_rank, world_size, local_world_size, dev)
        if world_size > 1 and not dist.is_initialized():
            env.backend = "nccl" if use_cuda else "gloo"
            dist.init_process_group(
                backend=env.backend,
                timeout=datetime.timedelta(seconds=timeout_s),
                device_id=dev if use_cuda else None,
            )
            env.started_group = True
            if dist.get_world_size() != world_size or dist.get_rank() != rank:
                raise RuntimeError(
                    f"process group disagrees with torchrun: rank {dist.get_rank()}/{dist.get_world_size()} "
                    f"vs RANK={rank} WORLD_SIZE={world_size}"
                )
        elif dist.is_initialized():
            env.backend = dist.get_backend()
        if env.backend is not None:
            _leave_at_exit(env)
        return env

    def teardown(self, clean: bool = True) -> None:
        """Destroy the process group if this env started it, then wait for gloo's worker threads to be idle.

        On a clean exit every rank first meets at a barrier (collective), so no rank tears its gloo/NCCL
        connections down while a peer is still using them (an early-exiting peer can make the other's
        communication threads abort the process).  After a failure there is no barrier: a peer may be gone.
        The wait (``wait_for_idle_gloo_threads``) is what lets the process exit 0 whatever holds the group.
        """
        if self.started_group and dist.is_initialized():
            if clean:
                dist.barrier()
            dist.destroy_process_group()
        self.started_group = False
        self._checkpoint_group = None
        if self.backend is not None:
            wait_for_idle_gloo_threads()

    def shutdown(self) -> None:
        """Leave the process group whoever started it (``Trainer.end()`` at the end of a script whose
        ``TrainingArguments`` already started it): a barrier (collective), then destroy it."""
        self.started_group = self.started_group or (dist.is_available() and dist.is_initialized())
        self.teardown(clean=True)

    def checkpoint_group(self) -> Any:
        """The process group of background checkpoint writes (``dcp.async_save``), None on one process.

        A second gloo group over every rank, created once by the first call (collective: every rank makes
        the call at the same point, the first asynchronous save).  DCP's writer thread runs its planning
        collectives on it while the training thread goes on using the default group: two threads must
        never interleave collectives on one group, and DCP's background write needs a CPU backend.
        """
        if not self.is_distributed:
            return None
        if self._checkpoint_group is None:
            self._checkpoint_group = dist.new_group(backend="gloo")  # collective: once per run
        return self._checkpoint_group

    # ------------------------------------------------------------------ named collectives
    def barrier(self) -> None:
        """Collective ``barrier``: every rank waits for all (used around checkpoint writes)."""
        if self.is_distributed:
            dist.barrier()

    def on_rank_zero(
        self, action: Callable[[], T], what: str, error: Callable[[str], BaseException] | None = None
    ) -> T:
        """Rank 0 runs ``action``; every rank returns its (picklable) result or raises (collective).

        The one pattern for "rank 0 writes or decides, the others wait": the outcome, value or failure,
        is broadcast, so a failure on rank 0 fails every rank at once instead of leaving them waiting in a
        barrier until the collective timeout.  Rank 0 re-raises its own exception; the other ranks raise
        ``error(message)`` (default ``RankZeroError``), the message naming rank 0, ``what`` and the cause.
        """
        outcome: dict[str, Any] = {}
        own: BaseException | None = None
        if self.is_world_process_zero:
            try:
                outcome["value"] = action()
            except Exception as exc:
                own = exc
                outcome["error"] = f"{type(exc).__name__}: {exc}"
        outcome = self.broadcast_object(outcome)
        if "error" in outcome:
            if own is not None and error is None:
                raise own
            message = str(RankZeroError(what, outcome["error"]))
            raise (error(message) if error is not None else RankZeroError(what, outcome["error"])) from own
        return outcome["value"]

    def on_every_rank(self, action: Callable[[], T], what: str) -> T:
        """Every rank runs ``action`` and returns its own result, or every rank raises (collective): a rank that
        failed re-raises its exception, the others ``RankZeroError`` naming the first failing rank and the cause
        (rather than waiting in the next collective until its timeout)."""
        own: BaseException | None = None
        try:
            value = action()
        except Exception as exc:
            own = exc
        outcomes = self.all_gather_objects(None if own is None else f"{type(own).__name__}: {own}")
        if own is not None:
            raise own
        failed = next((rank for rank, error in enumerate(outcomes) if error is not None), None)
        if failed is not None:
            raise RankZeroError(what, str(outcomes[failed]), failed)
        return value

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Collective ``all_reduce(SUM)`` in place; returns the tensor (identity on one rank)."""
        if self.is_distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """Collective ``all_reduce(MAX)`` in place; returns the tensor (identity on one rank)."""
        if self.is_distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor

    def gather_rows(self, row: torch.Tensor) -> list[list[float]]:
        """Collective ``all_gather`` of one 1-D float64 row per rank: ``world_size`` rows of ``n`` floats.

        Implemented as one ``all_reduce(SUM)`` over a zero matrix holding this rank's row, which works on
        every backend (gloo has no ``all_gather_into_tensor`` on CPU for all dtypes) and costs one call.
        The result is read back to the host once (``tolist``: on a GPU, the one synchronisation).
        """
        matrix = torch.zeros(self.world_size, row.numel(), dtype=torch.float64, device=self.device)
        matrix[self.rank] = row.to(device=self.device, dtype=torch.float64, non_blocking=True)
        if self.is_distributed:
            dist.all_reduce(matrix, op=dist.ReduceOp.SUM)
        return matrix.tolist()

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Collective ``broadcast_object_list``: rank ``src``'s Python object on every rank."""
        if not self.is_distributed:
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src=src, device=self.device if self.device.type == "cuda" else None)
        return holder[0]

    def scatter_objects(self, objects: list[Any] | None, src: int = 0) -> Any:
        """Collective ``scatter_object_list``: ``objects[i]`` of rank ``src`` on rank ``i`` (the others pass None)."""
        if not self.is_distributed:
            return objects[0] if objects else None
        out: list[Any] = [None]
        dist.scatter_object_list(out, objects if self.rank == src else None, src=src)
        return out[0]

    def all_gather_objects(self, obj: Any) -> list[Any]:
        """Collective ``all_gather_object``: every rank's Python object, in rank order."""
        if not self.is_distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def sum_floats(self, values: Sequence[float]) -> list[float]:
        """Collective ``all_reduce(SUM)`` of a few Python floats (float64) in one call."""
        tensor = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        return [float(v) for v in self.all_reduce_sum(tensor).cpu()]

    def memory_bytes(self) -> int:
        """Memory in use by this worker: CUDA allocated bytes on GPU, else the process's resident set size."""
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        try:
            with open("/proc/self/statm") as fh:
                return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:  # pragma: no cover - non-Linux
            import resource

            return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
