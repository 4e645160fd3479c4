"""``auto_find_batch_size``: Trainer's own search (accelerate's ``find_executable_batch_size``), agreed by the ranks.

Under Trainer each process searches on its own: on several ranks an out-of-memory error on one leaves the others
waiting in the next collective (DDP's gradient all-reduce) until ``ddp_timeout``.  Here, on several ranks with DDP,
an error in a training forward (where activations run out of memory) is agreed there: after each training forward
of the model every rank adds its flag to one small all-reduce (``AgreedForwards``), the failed rank from its error;
every rank raises, and Trainer's search goes on with the same smaller size everywhere.  This costs one collective
per micro-batch, only under ``auto_find_batch_size`` on several ranks.

An out-of-memory error the ranks cannot agree on (after the forward: a loss computed outside the model, as the
token path's cross entropy, a backward or an optimizer step; or inside FSDP2's or DeepSpeed's forward, which gather
weights) ends the run with an error that names it, rather than a search on one rank while the others wait: the
launcher then stops every rank.

On resume the search starts from the checkpoint's ``TrainerState.train_batch_size``, as Trainer's ``train()``.
Each size trains with ``with_batch_size``'s arguments: the same accumulation, so fewer items per step, as Trainer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch

from trainbridge.core.config import TrainingArgs
from trainbridge.core.distributed import DistributedEnv

logger = logging.getLogger(__name__)

T = TypeVar("T")


class PeerOutOfMemory(RuntimeError):
    """Another rank's training forward ran out of memory: the message is one accelerate's search retries on."""

    def __init__(self, batch_size: int) -> None:
        super().__init__(
            "another rank ran out of memory. (auto_find_batch_size: every rank leaves its training forward with "
            f"{batch_size} items per micro-batch and retries with fewer)"
        )


class UnagreedOutOfMemory(RuntimeError):
    """This rank ran out of memory where the ranks cannot agree to retry (not one accelerate's search retries)."""

    def __init__(self, rank: int, batch_size: int) -> None:
        super().__init__(  # the cause is chained, not quoted: its text would make accelerate's search retry
            f"auto_find_batch_size: rank {rank} ran out of memory outside a training forward with {batch_size} items "
            "per micro-batch (the cause above); on several ranks only an error in a DDP forward is retried by every "
            "rank together. Lower per_device_train_batch_size"
        )


class AgreedForwards:
    """One small all-reduce after each training forward of ``model``: whether a rank's forward failed."""

    def __init__(self, env: DistributedEnv, model: torch.nn.Module, batch_size: int) -> None:
        self.env, self.batch_size = env, batch_size
        self.inside = False
        """True from a training forward's start until its agreement (a failure in between is a forward's)."""
        self._handles = [
            model.register_forward_pre_hook(self._begin, prepend=True),  # before the script's own hooks
            model.register_forward_hook(self._end),
        ]

    def _begin(self, module: torch.nn.Module, args: Any) -> None:
        self.inside = module.training and torch.is_grad_enabled()

    def _end(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if self.inside and self.agree(failed=False):
            raise PeerOutOfMemory(self.batch_size)

    def agree(self, failed: bool) -> bool:
        """Collective: True when any rank's forward failed (this one's: ``failed``)."""
        self.inside = False
        flag = torch.tensor([1.0 if failed else 0.0], device=self.env.device)
        return bool(self.env.all_reduce_max(flag).item() > 0)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def find_batch_size(
    attempt: Callable[[int, Callable[[Any], Any]], T], start: int, env: DistributedEnv, search: bool
) -> T:
    """``attempt(batch_size, agreeing)`` through Trainer's ``find_executable_batch_size`` from ``start``.
    ``attempt`` runs its built engine inside ``agreeing(engine)``: with ``search`` on several ranks, the engine's
    training forwards are agreed (``agreed``)."""
    from transformers.trainer_utils import find_executable_batch_size

    if search and env.is_distributed:
        run: Callable[[int], T] = agreed(attempt, env)
    else:
        run = lambda batch_size: attempt(batch_size, _not_agreeing)  # noqa: E731
    return find_executable_batch_size(run, start, search)()  # type: ignore[no-any-return]


@contextmanager
def _not_agreeing(engine: Any) -> Iterator[None]:
    yield


def agreed(attempt: Callable[[int, Callable[[Any], Any]], T], env: DistributedEnv) -> Callable[[int], T]:
    """``attempt`` left by every rank together when one runs out of memory in a training forward."""
    from accelerate.utils.memory import should_reduce_batch_size

    def run(batch_size: int) -> T:
        forwards: list[AgreedForwards] = []

        @contextmanager
        def agreeing(engine: Any) -> Iterator[None]:
            if engine.kind == "ddp":
                forwards.append(AgreedForwards(env, engine.unwrapped, batch_size))
            try:
                yield
            finally:
                for agreement in forwards:
                    agreement.remove()

        try:
            return attempt(batch_size, agreeing)
        except PeerOutOfMemory:
            raise
        except Exception as exc:
            if not should_reduce_batch_size(exc):
                raise
            if forwards and forwards[0].inside:
                forwards[0].agree(failed=True)  # every other rank waits in this agreement, after its forward
                raise
            raise UnagreedOutOfMemory(env.rank, batch_size) from exc

    return run


def resumed_batch_size(resume_from: str | Path | None, output_dir: Path) -> int | None:
    """The ``train_batch_size`` in the ``trainer_state.json`` of the checkpoint ``resume_from`` names (``auto``: the
    newest complete one in ``output_dir``), where Trainer's ``train()`` starts its search on resume; None without."""
    from transformers import TrainerState
    from transformers.trainer import TRAINER_STATE_NAME

    from trainbridge.checkpoint.folders import list_checkpoints

    if resume_from is None:
        return None
    found = list_checkpoints(output_dir) if resume_from == "auto" else [Path(resume_from)]
    if not found or not (found[-1] / TRAINER_STATE_NAME).is_file():
        return None
    return TrainerState.load_from_json(str(found[-1] / TRAINER_STATE_NAME)).train_batch_size


def with_batch_size(args: TrainingArgs, batch_size: int, world_size: int) -> TrainingArgs:
    """``args`` with ``batch_size`` items per micro-batch (``auto_find_batch_size``'s search): the same
    accumulation, so fewer items per step, as under Trainer; the token path's ``max_batch_len`` follows."""
    if batch_size == args.per_device_batch_size:
        return args
    per_device = args.per_device_batch_size or 1
    accumulation = max(1, args.effective_batch_size // (per_device * world_size))
    logger.info("auto_find_batch_size: training with %d items per micro-batch", batch_size)
    return args.model_copy(
        update={
            "per_device_batch_size": batch_size,
            "effective_batch_size": batch_size * accumulation * world_size,
            "max_batch_len": max(batch_size * args.max_seq_len, args.max_seq_len),
        }
    )
