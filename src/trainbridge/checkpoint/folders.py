"""Checkpoint folders in a run folder: their names, which are complete, and how they appear and go.

A checkpoint is written into ``.tmp-checkpoint-{step}`` (its ``.owner`` file names the run, host and
pid writing it), made private (``make_private``: nobody else may read optimizer state, weights or RNG
states), then renamed to ``checkpoint-{step}``: it appears whole or not at all.  Re-saving a
step renames the old folder aside (``.old-checkpoint-{step}``), renames the new one in, then deletes
the old one.  Deleting renames the folder to ``.deleting-checkpoint-{step}`` first, so it leaves the
listing at once.  ``clean_leftovers`` tidies what an interrupted save or deletion left: a temporary
folder is removed only by the run that made it, or once its maker is gone, never while another live
run may still be writing it.  Only rank 0 calls these.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
from pathlib import Path

from trainbridge.checkpoint.layout import COMPLETE_MARKER, DELETING_PREFIX, OLD_PREFIX, OWNER_FILE, TMP_PREFIX
from trainbridge.checkpoint.runlock import process_is_alive
from trainbridge.core.private_files import make_private as make_private
from trainbridge.core.private_files import modes
from trainbridge.core.run_dir import CHECKPOINT_PREFIX

logger = logging.getLogger(__name__)

_CHECKPOINT_NAME = re.compile(rf"^{CHECKPOINT_PREFIX}(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or is not a complete checkpoint."""


def checkpoint_step(path: Path) -> int:
    """The global step in a ``checkpoint-{step}`` folder name."""
    match = _CHECKPOINT_NAME.match(path.name)
    if match is None:
        raise CheckpointError(f"{str(path)!r} is not named {CHECKPOINT_PREFIX}<step>")
    return int(match.group(1))


def is_complete_checkpoint(path: Path) -> bool:
    """True for a ``checkpoint-{step}`` folder carrying the ``COMPLETE`` marker."""
    return _CHECKPOINT_NAME.match(path.name) is not None and (path / COMPLETE_MARKER).is_file()


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints in ``output_dir``, oldest (lowest step) first."""
    if not output_dir.is_dir():
        return []
    found = [p for p in output_dir.iterdir() if p.is_dir() and is_complete_checkpoint(p)]
    return sorted(found, key=checkpoint_step)


def temporary_folder(final: Path) -> Path:
    """Where checkpoint ``final`` is written before it is renamed into place."""
    return final.with_name(f"{TMP_PREFIX}{checkpoint_step(final)}")


def make_owned_folder(tmp: Path, run_id: str, share_with_group: bool = False) -> None:
    """Create the temporary folder ``tmp`` (private, or readable by the group with ``share_with_group``,
    whatever the umask) with an ``.owner`` file naming this run; refuse a folder another live run is
    writing."""
    try:
        tmp.mkdir(mode=modes(share_with_group)[0])
        tmp.chmod(modes(share_with_group)[0])
    except FileExistsError:
        raise CheckpointError(
            f"{tmp} is being written by another live run ({read_owner(tmp)}) into the same ckpt_output_dir; "
            "two runs must not share a run folder"
        ) from None
    owner_record = {"run_id": run_id, "host": socket.gethostname(), "pid": os.getpid()}
    (tmp / OWNER_FILE).write_text(json.dumps(owner_record))


def read_owner(tmp: Path) -> str:
    """Who writes the temporary folder ``tmp``, in words."""
    try:
        owner = json.loads((tmp / OWNER_FILE).read_text())
        return f"run {owner.get('run_id') or '?'}, pid {owner.get('pid')} on {owner.get('host')}"
    except (OSError, ValueError):
        return "owner unknown"


def owned_by_us_or_dead(tmp: Path, run_id: str) -> bool:
    """A temporary folder belongs to the run that made it: ours (``run_id``, or this process), or one whose
    writer is gone."""
    try:
        owner = json.loads((tmp / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return True  # no owner file: an already-finished folder
    if run_id and owner.get("run_id") == run_id:
        return True
    if owner.get("host") == socket.gethostname() and owner.get("pid") == os.getpid():
        return True
    return not process_is_alive(str(owner.get("host")), int(owner.get("pid", 0)))


def clean_leftovers(output_dir: Path, run_id: str) -> None:
    """Before a save: restore a checkpoint renamed aside by an interrupted re-save, and delete temporary
    folders of interrupted saves and deletions (of this run, or of a run that is gone)."""
    for path in output_dir.iterdir():
        if path.name.startswith(OLD_PREFIX):
            final = path.with_name(CHECKPOINT_PREFIX + path.name[len(OLD_PREFIX) :])
            if final.exists():
                shutil.rmtree(path)
            else:
                logger.warning("restoring %s, left aside by an interrupted re-save", final)
                path.rename(final)
        elif path.name.startswith(TMP_PREFIX) and not owned_by_us_or_dead(path, run_id):
            logger.warning("leaving %s alone: another live run is writing it (%s)", path, read_owner(path))
        elif path.name.startswith((TMP_PREFIX, DELETING_PREFIX)):
            logger.warning("removing %s, left by an interrupted checkpoint save or deletion", path)
            shutil.rmtree(path)


def rename_into_place(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``; an existing ``final`` is renamed aside first and deleted after."""
    if not final.exists():
        tmp.rename(final)
        return
    aside = final.with_name(f"{OLD_PREFIX}{checkpoint_step(final)}")
    if aside.exists():
        shutil.rmtree(aside)
    final.rename(aside)
    tmp.rename(final)
    shutil.rmtree(aside)


def delete_checkpoint(path: Path) -> None:
    """Delete checkpoint ``path``: renamed first (atomic: it leaves the listing at once), then removed."""
    doomed = path.with_name(f"{DELETING_PREFIX}{checkpoint_step(path)}")
    path.rename(doomed)
    shutil.rmtree(doomed)


def surplus(checkpoints: list[Path], limit: int, protected: set[Path] | frozenset[Path]) -> list[Path]:
    """The checkpoints (oldest first) beyond ``limit``: as in transformers, protected ones (the best) are
    never chosen and the newest one is always kept for resuming, so with a limit of 1 and an older best
    checkpoint two remain."""
    protected_resolved = {Path(p).resolve() for p in protected}
    keep = [p for p in checkpoints if p.resolve() in protected_resolved]
    for path in reversed(checkpoints):
        if path in keep:
            continue
        if path == checkpoints[-1] or len(keep) < limit:
            keep.append(path)
    return [p for p in checkpoints if p not in keep]
