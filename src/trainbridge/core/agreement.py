"""Control requests and their agreement across ranks.

Callbacks *request* control (stop training, stop the epoch, save, evaluate, log) on their own rank.
The loop *acts* only on an ``AgreedControl``, produced by ``agree_control`` at fixed decision points:
one small collective in which every rank contributes its requests, so that any rank asks and every
rank acts, at the same step.  The agreement also records which rank and which callback asked.

At the step-end decision point the loop folds the step's loss sums into the same collective
(``summed``/``own``, named tuples), so agreeing on control costs no extra collective per step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Generic, NamedTuple, TypeVar

import torch

from trainbridge.core.distributed import DistributedEnv


class ControlFlag(str, Enum):
    """A control request a callback can make."""

    STOP_TRAINING = "stop_training"
    STOP_EPOCH = "stop_epoch"
    SAVE = "save"
    EVALUATE = "evaluate"
    LOG = "log"
    ABORT = "abort"
    """Internal: a callback failed under the ``fatal`` policy; every rank stops and the run fails."""


FLAGS: tuple[ControlFlag, ...] = tuple(ControlFlag)


@dataclass
class Requester:
    """Who asked for a flag: the rank and the name of the callback (or ``loop``/``schedule``)."""

    rank: int
    source: str


@dataclass
class ControlRequests:
    """This rank's pending requests, cleared after each agreement.

    Sources are numbered by the callback manager (registration order is the same on every rank), so
    the agreement can carry "callback #i asked" as a number and every rank can name it.
    """

    pending: dict[ControlFlag, int] = field(default_factory=dict)
    reasons: dict[ControlFlag, str] = field(default_factory=dict)

    def request(self, flag: ControlFlag, source_index: int = 0, reason: str = "") -> None:
        """Request ``flag`` from source number ``source_index`` (0 = the loop or an unnamed caller)."""
        if flag not in self.pending:
            self.pending[flag] = source_index
            if reason:
                self.reasons[flag] = reason

    def clear(self) -> None:
        """Forget every pending request (after an agreement consumed them)."""
        self.pending.clear()
        self.reasons.clear()

    def encode(self) -> list[float]:
        """One number per flag: 0 when not requested, else ``source_index + 1``."""
        return [float(self.pending[f] + 1) if f in self.pending else 0.0 for f in FLAGS]


@dataclass
class AgreedControl:
    """The flags every rank acts on after a decision point, with who asked for each."""

    flags: frozenset[ControlFlag] = frozenset()
    requesters: dict[ControlFlag, list[Requester]] = field(default_factory=dict)
    local_reasons: dict[ControlFlag, str] = field(default_factory=dict)
    """Reasons this rank gave for its own requests (reasons do not travel in the agreement)."""

    def __contains__(self, flag: object) -> bool:
        return flag in self.flags

    @property
    def stop_training(self) -> bool:
        """Every rank stops training after this decision point."""
        return ControlFlag.STOP_TRAINING in self.flags or ControlFlag.ABORT in self.flags

    def describe(self, flag: ControlFlag) -> str:
        """``'rank 1 (MyCallback)'``-style text naming who asked for ``flag``."""
        return ", ".join(f"rank {r.rank} ({r.source})" for r in self.requesters.get(flag, []))


Summed = TypeVar("Summed", bound=tuple[Any, ...])
Own = TypeVar("Own", bound=tuple[Any, ...])


class NoValues(NamedTuple):
    """No values ride in the agreement (a decision point that only agrees control)."""


NO_VALUES = NoValues()


@dataclass(frozen=True)
class Agreement(Generic[Summed, Own]):
    """What one agreement returns: the agreed control, the values summed over ranks and this rank's own
    values, each as the ``NamedTuple`` type the caller passed (fields of Python floats)."""

    control: AgreedControl
    summed: Summed
    own: Own


def agree_control(
    env: DistributedEnv,
    requests: ControlRequests,
    source_names: Sequence[str],
    summed: Summed = NO_VALUES,  # type: ignore[assignment]
    own: Own = NO_VALUES,  # type: ignore[assignment]
) -> Agreement[Summed, Own]:
    """Agree this rank's control requests with every other rank, in ONE collective.

    Each rank contributes a row ``[*summed, *own, *encoded flags]``; the collective (``env.gather_rows``,
    an all-gather done as one ``all_reduce(SUM)``) returns every rank's row.  A flag is agreed when
    *any* rank requested it (no flag lets one rank veto), the ``summed`` values are summed over ranks (the
    loop passes loss and token sums here at step end), and ``own`` values come back as this rank's (the
    loop passes its local loss and the gradient norm).  ``summed`` and ``own`` are ``NamedTuple``s; the
    result holds the same types with float fields.

    Values may be device tensors (0-dim): the row is assembled on the device and read back once, so the
    values the step left on the GPU cost no host synchronisation of their own.  The pending requests are
    cleared.
    """
    flags_row = torch.tensor(requests.encode(), dtype=torch.float64)
    values = [*summed, *own]
    if any(isinstance(v, torch.Tensor) for v in values):
        device = env.device
        if device.type == "cuda":  # pinned, so the copy is queued without waiting for the GPU
            flags_row = flags_row.pin_memory()
        row = torch.cat(
            [
                torch.stack(
                    [
                        torch.as_tensor(v, dtype=torch.float64).to(device, torch.float64, non_blocking=True).reshape(())
                        for v in values
                    ]
                ),
                flags_row.to(device, non_blocking=True),
            ]
        )
    else:
        row = torch.cat([torch.tensor([float(v) for v in values], dtype=torch.float64), flags_row])
    rows = env.gather_rows(row)  # the one device -> host read of the step
    n_summed, n_values = len(summed), len(values)
    sums = [math.fsum(r[i] for r in rows) for i in range(n_summed)]
    mine = rows[env.rank][n_summed:n_values]
    flags: set[ControlFlag] = set()
    requesters: dict[ControlFlag, list[Requester]] = {}
    for column, flag in enumerate(FLAGS):
        asked = [(rank, int(r[n_values + column]) - 1) for rank, r in enumerate(rows) if r[n_values + column] > 0]
        if asked:
            flags.add(flag)
            requesters[flag] = [
                Requester(rank, source_names[idx] if 0 <= idx < len(source_names) else f"source #{idx}")
                for rank, idx in asked
            ]
    reasons = dict(requests.reasons)
    requests.clear()
    summed_type: Any = type(summed)
    own_type: Any = type(own)
    return Agreement(AgreedControl(frozenset(flags), requesters, reasons), summed_type(*sums), own_type(*mine))
