"""An engine's training state in a checkpoint folder: model shards, optimizer and scheduler.

Engines give and take state dicts (``parallel.engine.TrainingEngine``); this module decides where they
go and writes and reads them (every function is collective: every rank calls it):

* a replicated optimizer (one process, DDP) is written once, by rank 0, as ``optimizer.pt``;
* a sharded optimizer (FSDP2), the model's own weights when the checkpoint keeps them (``model_state``),
  and with ``background`` (``checkpoint_async``) the optimizer of every engine go into one
  ``torch.distributed.checkpoint`` folder ``dcp/``, each rank writing its own shards (DCP de-duplicates
  replicated tensors, so rank 0 writes them once);
* a backend with its own format (DeepSpeed) writes it into ``deepspeed/state/`` (read back by DeepSpeed's
  own loader, which unpickles: resume warns that such a checkpoint must be trusted);
* the LR scheduler, ``scheduler.pt``, by rank 0.

``torch.distributed.checkpoint`` (and the elastic agent it imports: ~0.15 s) is imported only when a ``dcp/``
folder is written or read, not by ``from trainbridge import Trainer``: a DDP run that never does pays nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainbridge.checkpoint.layout import (
    DCP_METADATA_FILE,
    DEEPSPEED_DIR,
    DEEPSPEED_TAG,
    OPTIMIZER_FILE,
    SCALER_FILE,
    SCHEDULER_FILE,
    SHARDED_STATE_DIR,
)

if TYPE_CHECKING:
    from trainbridge.parallel.engine import TrainingEngine

logger = logging.getLogger(__name__)

NATIVE_RESUME_TRUST = (
    "resuming from %s with DeepSpeed: DeepSpeed reads its own checkpoint files with "
    "torch.load(weights_only=False), which runs any code a pickle in them holds. The manifest "
    "checks that the files are the ones written, not who wrote them: resume only from "
    "checkpoints you trust (docs/faults.md, C11)"
)
"""Warned by rank 0 at every DeepSpeed resume."""


def save_engine_state(
    engine: TrainingEngine, directory: Path, model_state: bool = False, background: bool = False
) -> Future[Any] | None:
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
        scaler = engine.grad_scaler_state_dict()
        if scaler is not None:
            torch.save(scaler, directory / SCALER_FILE)
    if not state:
        return None
    from trainbridge.checkpoint.dcp_io import write_dcp

    return write_dcp(state, directory / SHARDED_STATE_DIR, env, background)


def has_model_state(engine: TrainingEngine, directory: Path) -> bool:
    """Whether checkpoint ``directory`` holds the model's own weights for ``engine`` in ``dcp/`` (never
    for DeepSpeed: its resume loads the HF-layout weights first, then its own folder overwrites the module
    and its fp32 master partitions, so resume is exact whatever the export)."""
    return not engine.native_checkpoint and _dcp_holds(directory / SHARDED_STATE_DIR, "model")


def load_model_state(engine: TrainingEngine, directory: Path) -> bool:
    """Load the model's own weights from checkpoint ``directory``'s ``dcp/`` when it holds them (each rank
    reads its own shards) and return True; False (nothing loaded) otherwise: then the HF-layout weights
    are the model's."""
    if not has_model_state(engine, directory):
        return False
    from trainbridge.checkpoint.dcp_io import read_dcp

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
        if env.is_world_process_zero:
            logger.warning(NATIVE_RESUME_TRUST, directory)
        engine.load_native_state(_require(directory / DEEPSPEED_DIR / DEEPSPEED_TAG))
    elif engine.sharded_optimizer or _dcp_holds(sharded, "optimizer"):
        from trainbridge.checkpoint.dcp_io import read_dcp

        state = {"optimizer": engine.sharded_optimizer_state_dict()}
        with torch.serialization.safe_globals(optimizer_state_classes(engine.optimizer)):
            read_dcp(state, _require(sharded), env)  # each rank reads the shards it owns
        engine.load_sharded_optimizer_state_dict(state["optimizer"])
    else:
        with torch.serialization.safe_globals(optimizer_state_classes(engine.optimizer)):
            optimizer = torch.load(_require(directory / OPTIMIZER_FILE), map_location=env.device, weights_only=True)
        engine.load_optimizer_state_dict(optimizer)
    scheduler = torch.load(_require(directory / SCHEDULER_FILE), map_location="cpu", weights_only=True)
    engine.load_scheduler_state_dict(scheduler)
    if engine.grad_scaler_state_dict() is not None and (directory / SCALER_FILE).exists():
        engine.load_grad_scaler_state_dict(torch.load(directory / SCALER_FILE, map_location="cpu", weights_only=True))


STATE_CLASSES = {
    "galore_torch": (("galore_torch.galore_projector", "GaLoreProjector"),),
    "apollo_torch": (
        ("apollo_torch.random_projector", "GradientProjector"),
        ("apollo_torch.svd_projector", "GaLoreProjector"),
    ),
}
"""By an optimizer's package, the classes it keeps in its state beside tensors and numbers: GaLore's and APOLLO's
gradient projectors (plain attribute holders)."""


def optimizer_state_classes(optimizer: object) -> list[Callable[..., Any] | tuple[Callable[..., Any], str]]:
    """The classes ``torch.load(weights_only=True)`` may rebuild (from their attributes, running no code of theirs)
    in ``optimizer``'s saved state, by its package (``STATE_CLASSES``): the run's own optimizer chose them, so a
    GaLore or APOLLO run resumes (Trainer's ``weights_only`` load refuses them)."""
    import importlib

    package = type(optimizer).__module__.split(".")[0]
    return [getattr(importlib.import_module(module), name) for module, name in STATE_CLASSES.get(package, ())]


def _require(path: Path) -> Path:
    if not path.exists():
        raise FileNotFoundError(f"training state file {str(path)!r} is missing (not written by this backend?)")
    return path


def _dcp_holds(path: Path, entry: str) -> bool:
    """``dcp_io.dcp_has(path, entry)``, importing ``torch.distributed.checkpoint`` only when ``path`` is a DCP
    folder (its metadata file exists)."""
    if not (path / DCP_METADATA_FILE).is_file():
        return False
    from trainbridge.checkpoint.dcp_io import dcp_has

    return dcp_has(path, entry)
