"""Which checkpoint a run resumes from, and loading it into the live engine.

``choose_resume`` answers ``resume_from_checkpoint``: ``auto`` is the newest complete checkpoint whose
files verify against its manifest (corrupt ones skipped with a warning); a path must be a complete
checkpoint that verifies.  Either way its fingerprint must match the run's unless the user allows a
mismatch.  A checkpoint without a manifest, or with files it does not list, does not verify unless the
user allows it (``resume_allow_unverified``).  ``require_own_checkpoint`` holds a checkpoint the run's
saved state names (the best one) to the same rules, and to the run folder.  ``load_checkpoint``
restores the model weights, the engine's optimizer and scheduler state and this rank's RNG states, and
returns the saved ``training_state``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainbridge.checkpoint.engine_state import load_engine_state
from trainbridge.checkpoint.folders import CheckpointError, is_complete_checkpoint, list_checkpoints
from trainbridge.checkpoint.layout import COMPLETE_MARKER, TRAINING_STATE_FILE
from trainbridge.checkpoint.manifest import fingerprint_mismatches, read_manifest, verify_checkpoint
from trainbridge.checkpoint.rng import restore_rng
from trainbridge.checkpoint.weights import load_model_weights
from trainbridge.core.run_dir import CHECKPOINT_PREFIX

if TYPE_CHECKING:
    from trainbridge.parallel.engine import TrainingEngine

logger = logging.getLogger(__name__)


def latest_verified(output_dir: Path, checksums: bool = True, allow_unverified: bool = False) -> Path | None:
    """The newest complete checkpoint in ``output_dir`` whose files match its manifest; corrupt (and, unless
    ``allow_unverified``, unverifiable) ones are skipped with a warning naming them and what is wrong."""
    for path in reversed(list_checkpoints(output_dir)):
        problems = verify_checkpoint(path, checksums, allow_unverified)
        if not problems:
            return path
        logger.warning("skipping corrupt checkpoint %s: %s", path, "; ".join(problems))
    return None


def require_complete(path: Path, what: str = "") -> None:
    """Raise ``CheckpointError`` unless ``path`` is a complete checkpoint folder."""
    if not path.is_dir() or not is_complete_checkpoint(path):
        raise CheckpointError(
            f"{what}{str(path)!r} is not a complete checkpoint (a {CHECKPOINT_PREFIX}<step> folder with a "
            f"{COMPLETE_MARKER} marker)"
        )


def require_own_checkpoint(output_dir: Path, path: Path, checksums: bool, allow_unverified: bool) -> None:
    """Raise ``CheckpointError`` unless ``path`` is a complete checkpoint directly inside ``output_dir`` whose
    files verify (the best checkpoint a run's saved state names: it must not lead outside the run)."""
    if Path(path).resolve().parent != Path(output_dir).resolve():
        raise CheckpointError(f"{str(path)!r} is not a checkpoint of this run: it is not inside {output_dir}")
    require_complete(Path(path))
    problems = verify_checkpoint(Path(path), checksums, allow_unverified)
    if problems:
        raise CheckpointError(f"checkpoint {path} is corrupt: {'; '.join(problems)}")


def choose_resume(
    output_dir: Path,
    resume_from: str | Path,
    fingerprint: dict[str, Any],
    checksums: bool,
    allow_mismatch: bool,
    allow_unverified: bool = False,
) -> Path | None:
    """The checkpoint ``resume_from_checkpoint`` names (``auto``: the newest that verifies, or None)."""
    if str(resume_from) == "auto":
        path = latest_verified(output_dir, checksums, allow_unverified)
        if path is None:
            return None
    else:
        path = Path(resume_from)
        require_complete(path, "resume_from_checkpoint: ")
        problems = verify_checkpoint(path, checksums, allow_unverified)
        if problems:
            raise CheckpointError(f"resume_from_checkpoint: checkpoint {path} is corrupt: {'; '.join(problems)}")
    manifest = read_manifest(path) or {}
    mismatches = fingerprint_mismatches(manifest.get("fingerprint") or {}, fingerprint)
    if mismatches and not allow_mismatch:
        raise CheckpointError(
            f"resume_from_checkpoint: checkpoint {path} belongs to another run: {'; '.join(mismatches)}. "
            "Set resume_allow_mismatch=True to resume from it anyway"
        )
    if mismatches:
        logger.warning("resuming from %s despite: %s (resume_allow_mismatch=True)", path, "; ".join(mismatches))
    return path


def load_checkpoint(path: Path, engine: TrainingEngine) -> dict[str, Any]:
    """Load checkpoint ``path`` into ``engine`` (collective): model weights, optimizer and scheduler state,
    and this rank's RNG states.  Returns the ``training_state`` dict saved with it."""
    path = Path(path)
    require_complete(path)
    load_model_weights(path, engine)
    load_engine_state(engine, path)
    restore_rng(path, engine.env)
    return dict(json.loads((path / TRAINING_STATE_FILE).read_text()))
