"""``TorchrunArgs``: how ``torchrun`` launches the workers, and the one default process count."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from trainbridge.core.nproc import default_nproc_per_node


class TorchrunArgs(BaseModel):
    """How ``torchrun`` launches the workers; multi-node works the way torchrun does."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    nnodes: int | str = 1
    """Number of nodes, or ``MIN:MAX`` for elastic runs."""
    nproc_per_node: int = Field(default_factory=default_nproc_per_node, gt=0)
    """Worker processes per node.  Default: ``default_nproc_per_node`` (``$TRAINBRIDGE_NPROC_PER_NODE``, else
    one per visible GPU, else 1; a run with ``device='cpu'`` counts no GPU, see ``for_device``)."""
    node_rank: int = Field(default=0, ge=0)
    """This node's rank (static rendezvous)."""
    rdzv_id: str | None = None
    """Rendezvous job id (c10d rendezvous); an integer (instructlab's ``rdzv_id=123``) is taken as its text."""
    rdzv_endpoint: str | None = None
    """``host:port`` of the rendezvous (c10d); when set, master_addr/master_port are not used."""
    rdzv_backend: str = "c10d"
    """Rendezvous backend when ``rdzv_endpoint`` is set."""
    master_addr: str = "127.0.0.1"
    """Address of rank 0's node (static rendezvous)."""
    master_port: int | None = Field(default=None, gt=0, lt=65536)
    """Port on ``master_addr``; None picks a free port (single node only)."""
    max_restarts: int = Field(default=0, ge=0)
    """Restarts of the whole job after a worker fails, before the run fails.  The launcher restarts it
    itself (a fresh torchrun, rendezvous and port: torchrun's in-place restart is unreliable with gloo),
    resuming from the newest complete checkpoint in ``ckpt_output_dir``; ``RunResult.restarts`` counts them."""

    @field_validator("rdzv_id", mode="before")
    @classmethod
    def _rdzv_id_text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("nnodes")
    @classmethod
    def _nnodes(cls, value: int | str) -> int | str:
        text = str(value)
        parts = text.split(":")
        if len(parts) > 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"nnodes: {value!r} is not N or MIN:MAX with positive integers")
        return int(text) if len(parts) == 1 else text

    def max_world_size(self) -> int:
        """The ranks these arguments start (elastic ``MIN:MAX`` nodes: the most)."""
        return self.nproc_per_node * int(str(self.nnodes).split(":")[-1])

    def for_device(self, device: str) -> TorchrunArgs:
        """These arguments for a run on ``device``: a default ``nproc_per_node`` (not given) is counted
        again for it, so a CPU run on a machine with GPUs starts one process, not one per GPU."""
        if "nproc_per_node" in self.model_fields_set:
            return self
        return self.model_copy(update={"nproc_per_node": default_nproc_per_node(device)})
