"""An engine's training state in a checkpoint folder: model shards, optimizer and scheduler.

Engines give and take state dicts (``parallel.engine.TrainingEngine``); this module decides where they
go and writes and reads them (every function is collective: every rank calls it):

* a replicated optimizer (one process, DDP) is written once, by rank 0, as ``optimizer.pt``;
* a sharded optimizer (FSDP2), the model's own weights when the checkpoint keeps them (``model_state``),
  and with ``background`` (``checkpoint_async``) the optimizer of every engine go into one
  ``torch.distributed.checkpoint`` folder ``dcp/``, each rank writing its own shards (DCP de-duplicates
  replicated tensors, so rank 0 writes them once);
* a backend with its own format (DeepSpeed) writes it into ``deepspeed/state/``;
* the LR scheduler, ``scheduler.pt``, by rank 0.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from trainbridge.checkpoint.layout import (
    DCP_METADATA_FILE,
    DEEPSPEED_DIR,
    DEEPSPEED_TAG,
    OPTIMIZER_FILE,
    SCHEDULER_FILE,
    SHARDED_STATE_DIR,
)

if TYPE_CHECKING:
    from trainbridge.core.distributed import DistributedEnv
    from trainbridge.parallel.engine import TrainingEngine


def save_engine_state(engine: TrainingEngine, directory: Path, model_state: bool = False,
                      background: bool = False) -> Future[Any] | None:
    """Write ``engine``'s optimizer and scheduler state into checkpoint folder ``directory``; with
    ``model_state`` also the model's own weights, in their training dtype, into ``dcp/``.

    ``background`` (``checkpoint_async``): ``dcp/`` (then holding the optimizer state too) is written by
    ``dcp.async_save`` (staged to CPU memory first, so training may go on); the returned future completes
    when this rank's part is on disk.  None when nothing is left to write.  DeepSpeed's own format is
    always written synchronously (its partitions hold the fp32 master weights: ``model_state`` asks nothing
    more)."""
    env = engine.env
    state: dict[str, Any] = {}
    if engine.native_checkpoint:
        engine.save_native_state(directory / DEEPSPEED_DIR / DEEPSPEED_TAG)
    else:
        if model_state:
            state["model"] = engine.sharded_model_state_dict()
        if engine.sharded_optimizer or background:
            state["optimizer"] = engine.sharded_optimizer_state_dict()
        elif env.is_world_process_zero:
            torch.save(engine.optimizer_state_dict(), directory / OPTIMIZER_FILE)
    if env.is_world_process_zero:
        torch.save(engine.scheduler_state_dict(), directory / SCHEDULER_FILE)
    return write_dcp(state, directory / SHARDED_STATE_DIR, env, background) if state else None


def has_model_state(engine: TrainingEngine, directory: Path) -> bool:
    """Whether checkpoint ``directory`` holds the model's own weights for ``engine`` in ``dcp/`` (never
    for DeepSpeed: its resume loads the HF-layout weights first, then its own folder overwrites the module
    and its fp32 master partitions, so resume is exact whatever the export)."""
    return not engine.native_checkpoint and dcp_has(directory / SHARDED_STATE_DIR, "model")


def load_model_state(engine: TrainingEngine, directory: Path) -> bool:
    """Load the model's own weights from checkpoint ``directory``'s ``dcp/`` when it holds them (each rank
    reads its own shards) and return True; False (nothing loaded) otherwise: then the HF-layout weights
    are the model's."""
    if not has_model_state(engine, directory):
        return False
    state = {"model": engine.sharded_model_state_dict()}
    read_dcp(state, directory / SHARDED_STATE_DIR, engine.env)  # only the model's entries
    engine.load_sharded_model_state_dict(state["model"])
    return True


def load_engine_state(engine: TrainingEngine, directory: Path) -> None:
    """Restore the optimizer and scheduler state ``save_engine_state`` wrote into ``directory``:
    DeepSpeed's folder, the optimizer's entries in ``dcp/``, or ``optimizer.pt``."""
    env = engine.env
    sharded = directory / SHARDED_STATE_DIR
    if engine.native_checkpoint:
        engine.load_native_state(_require(directory / DEEPSPEED_DIR / DEEPSPEED_TAG))
    elif engine.sharded_optimizer or dcp_has(sharded, "optimizer"):
        state = {"optimizer": engine.sharded_optimizer_state_dict()}
        read_dcp(state, _require(sharded), env)  # each rank reads the shards it owns
        engine.load_sharded_optimizer_state_dict(state["optimizer"])
    else:
        optimizer = torch.load(_require(directory / OPTIMIZER_FILE), map_location=env.device, weights_only=True)
        engine.load_optimizer_state_dict(optimizer)
    scheduler = torch.load(_require(directory / SCHEDULER_FILE), map_location="cpu", weights_only=True)
    engine.load_scheduler_state_dict(scheduler)


# ---------------------------------------------------------------------- torch.distributed.checkpoint
def write_dcp(state: dict[str, Any], path: Path, env: DistributedEnv, background: bool) -> Future[Any] | None:
    """``dcp.save`` of ``state`` into ``path``, or with ``background`` ``dcp.async_save`` over the checkpoint
    process group (``DistributedEnv.checkpoint_group``): returns its future."""
    import torch.distributed.checkpoint as dcp

    if background:
        # collective (staging and planning start here); the write goes on in DCP's writer thread
        return cast(Future[Any], dcp.async_save(state, checkpoint_id=path, no_dist=not env.is_distributed,
                                                process_group=env.checkpoint_group()))
    with _single_process_quiet():
        dcp.save(state, checkpoint_id=path, no_dist=not env.is_distributed)
    return None


def read_dcp(state: dict[str, Any], path: Path, env: DistributedEnv) -> None:
    """``dcp.load`` of ``state``'s entries from the DCP folder ``path``, in place (each rank reads the
    entries, or shards, it holds)."""
    import torch.distributed.checkpoint as dcp

    with _single_process_quiet():
        dcp.load(state, checkpoint_id=path, no_dist=not env.is_distributed)


def dcp_has(path: Path, entry: str) -> bool:
    """Whether the DCP folder ``path`` exists and holds entries under ``entry`` (``model``, ``optimizer``)."""
    if not (path / DCP_METADATA_FILE).is_file():
        return False
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    return any(key.startswith(f"{entry}.") for key in metadata.state_dict_metadata)


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every save and load without a process group; one process is what we mean then."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _require(path: Path) -> Path:
    if not path.exists():
        raise FileNotFoundError(f"training state file {str(path)!r} is missing (not written by this backend?)")
    return path
