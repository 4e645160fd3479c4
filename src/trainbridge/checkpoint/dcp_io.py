"""``torch.distributed.checkpoint`` folders (``dcp/``): written as DCP writes them, read without trusting
their author.

DCP's own reader unpickles ``.metadata`` with a plain ``pickle.load``, and its default load planner reads
every non-tensor entry with ``torch.load(weights_only=False)``: a checkpoint someone else wrote could run
code at resume.  Here ``.metadata`` is read by ``MetadataUnpickler``, which builds only what DCP's metadata
holds (its metadata dataclasses and enums, ``torch.Size``, dtypes and layouts, paths, builtin containers)
and refuses anything else before it is called; non-tensor entries are read with ``weights_only=True``.
Tensors are DCP's raw bytes (read with ``weights_only=True`` by DCP itself).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import io
import pickle
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from trainbridge.checkpoint.folders import CheckpointError
from trainbridge.checkpoint.layout import DCP_METADATA_FILE

if TYPE_CHECKING:
    from torch.distributed.checkpoint.planner import ReadItem

    from trainbridge.core.distributed import DistributedEnv

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
    *(("builtins", name) for name in ("set", "frozenset", "slice", "complex", "bytearray", "range")),
}
"""What DCP's ``.metadata`` pickles besides its own metadata types and torch's dtypes."""


class MetadataUnpickler(pickle.Unpickler):
    """An unpickler that builds only DCP metadata: its metadata dataclasses and enums, ``_StorageInfo``,
    ``torch.Size``, dtypes, layouts, paths and builtin containers.  Any other global (a function to call,
    a class to build) is refused before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS or _is_metadata_type(module, name) or _is_dtype(module, name):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which DCP metadata never holds")


def _is_metadata_type(module: str, name: str) -> bool:
    if module != _METADATA_MODULE or name.startswith("__"):
        return False
    import torch.distributed.checkpoint.metadata as metadata_module

    value = getattr(metadata_module, name, None)
    return isinstance(value, type) and (dataclasses.is_dataclass(value) or issubclass(value, enum.Enum))


def _is_dtype(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class VerifiedReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` uses ``MetadataUnpickler``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = Path(str(self.path)) / (DCP_METADATA_FILE if rank is None else f"__{rank}{DCP_METADATA_FILE}")
        with open(path, "rb") as handle:
            try:
                metadata = MetadataUnpickler(handle).load()
            except Exception as exc:
                raise CheckpointError(f"{path} is refused: {exc}") from exc
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} is refused: it holds a {type(metadata).__name__}, not DCP metadata")
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor entries with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            checked = torch.load(value, weights_only=True)
        except Exception as exc:
            raise CheckpointError(
                f"the entry {read_item.dest_index.fqn!r} of a DCP checkpoint is refused: {exc}"
            ) from exc
        trusted = io.BytesIO()  # our own serialisation of what passed the check, for DCP's own loader
        torch.save(checked, trusted)
        trusted.seek(0)
        super().load_bytes(read_item, trusted)


def write_dcp(state: dict[str, Any], path: Path, env: DistributedEnv, background: bool) -> Future[Any] | None:
    """``dcp.save`` of ``state`` into ``path``, or with ``background`` ``dcp.async_save`` over the checkpoint
    process group (``DistributedEnv.checkpoint_group``): returns its future."""
    import torch.distributed.checkpoint as dcp

    if background:
        # collective (staging and planning start here); the write goes on in DCP's writer thread
        return cast(
            Future[Any],
            dcp.async_save(
                state, checkpoint_id=path, no_dist=not env.is_distributed, process_group=env.checkpoint_group()
            ),
        )
    with _single_process_quiet():
        dcp.save(state, checkpoint_id=path, no_dist=not env.is_distributed)
    return None


def read_dcp(state: dict[str, Any], path: Path, env: DistributedEnv) -> None:
    """``dcp.load`` of ``state``'s entries from the DCP folder ``path``, in place (each rank reads the
    entries, or shards, it holds), through ``VerifiedReader`` and ``WeightsOnlyLoadPlanner``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _single_process_quiet():
            dcp.load(
                state,
                storage_reader=VerifiedReader(path),
                planner=WeightsOnlyLoadPlanner(),
                no_dist=not env.is_distributed,
            )
    except CheckpointException as exc:  # DCP gathers each rank's failure: ours names what was refused
        refused = [failure[0] for failure in exc.failures.values() if isinstance(failure[0], CheckpointError)]
        if refused:
            raise refused[0] from exc
        raise


def dcp_has(path: Path, entry: str) -> bool:
    """Whether the DCP folder ``path`` exists and holds entries under ``entry`` (``model``, ``optimizer``)."""
    if not (path / DCP_METADATA_FILE).is_file():
        return False
    metadata = VerifiedReader(path).read_metadata()
    return any(key.startswith(f"{entry}.") for key in metadata.state_dict_metadata)


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every save and load without a process group; one process is what we mean then."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield
