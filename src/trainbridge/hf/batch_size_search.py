"""``auto_find_batch_size``: Trainer's own search (accelerate's ``find_executable_batch_size``), agreed by the ranks.

Under Trainer each process searches on its own: on several ranks an out-of-memory error on one leaves the others
waiting in the next collective (DDP's gradient all-reduce) until ``ddp_timeout``.  Here, on several ranks with DDP,
an error between a training forward's start and its backward (the activations, the loss) is agreed there: before
each backward every rank adds its flag to one small all-reduce (``AgreedForwards``), the failed rank from its
error; every rank leaves the attempt (the others from the first step of their backward, before any gradient is
reduced), and Trainer's search goes on with the same smaller size everywhere.  This costs one collective per
micro-batch, only under ``auto_find_batch_size`` on several ranks.

An out-of-memory error the ranks cannot agree on (in a backward or an optimizer step, or inside FSDP2's or
DeepSpeed's forward, which gather weights) ends the run with an error that names it, rather than a search on one
rank while the others wait: the launcher then stops every rank.

On resume the search starts from ``TrainerState.train_batch_size`` of the checkpoint the loop resumes from, as
Trainer's ``train()``: the first attempt reads it once its run is built, and starts again from it if it differs.
Each size trains with ``with_batch_size``'s arguments: the same accumulation, so fewer items per step, as Trainer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from trainbridge.core.callback import Callback
from trainbridge.core.config import TrainingArgs
from trainbridge.core.distributed import DistributedEnv

if TYPE_CHECKING:
    from trainbridge.loop.build import RunComponents

logger = logging.getLogger(__name__)

T = TypeVar("T")

NOT_AGREED = (
    "auto_find_batch_size on several ranks with %s: only DDP's training micro-batches are agreed by the ranks, so "
    "an out-of-memory error ends the run with an error naming it instead of a search on one rank"
)


class PeerOutOfMemory(RuntimeError):
    """Another rank ran out of memory in a training micro-batch: the message is one accelerate's search retries on."""

    def __init__(self, batch_size: int) -> None:
        super().__init__(
            "another rank ran out of memory. (auto_find_batch_size: every rank leaves the micro-batch with "
            f"{batch_size} items and retries with fewer)"
        )


class UnagreedOutOfMemory(RuntimeError):
    """This rank ran out of memory where the ranks cannot agree to retry (not one accelerate's search retries)."""

    def __init__(self, rank: int, batch_size: int) -> None:
        super().__init__(  # the cause is chained, not quoted: its text would make accelerate's search retry
            f"auto_find_batch_size: rank {rank} ran out of memory after a training forward and its loss, with "
            f"{batch_size} items per micro-batch (the cause above); on several ranks only an error up to the backward "
            "of a DDP model is retried by every rank together. Lower per_device_train_batch_size"
        )


class AgreedForwards(Callback):
    """One small all-reduce before each backward of a training forward of ``model``: whether a rank failed since
    that forward began; the others then leave from their backward's first step (a hook on the loss)."""

    def __init__(self, env: DistributedEnv, model: torch.nn.Module, batch_size: int) -> None:
        self.env, self.batch_size = env, batch_size
        self.inside = False
        """True from a training forward's start until the agreement before its backward."""
        self._handle = model.register_forward_pre_hook(self._begin, prepend=True)  # before the script's own hooks

    def _begin(self, module: torch.nn.Module, args: Any) -> None:
        self.inside = self.inside or (module.training and torch.is_grad_enabled())

    def on_before_backward(self, context: Any, loss: Any = None, **kwargs: Any) -> None:
        if not self.inside or not self.agree(failed=False):
            return
        batch_size = self.batch_size

        def leave(grad: torch.Tensor) -> None:  # raised from backward(), which a callback's error is not
            raise PeerOutOfMemory(batch_size)

        loss.register_hook(leave)

    def agree(self, failed: bool) -> bool:
        """Collective: True when any rank failed since its training forward began (this one: ``failed``)."""
        self.inside = False
        flag = torch.tensor([1.0 if failed else 0.0], device=self.env.device)
        return bool(self.env.all_reduce_max(flag).item() > 0)

    def remove(self) -> None:
        self._handle.remove()


Searching = Callable[["RunComponents"], list[Callback]]
"""What an attempt calls once its run is built: the callbacks the search adds to its loop."""


def find_batch_size(attempt: Callable[[int, Searching], T], args: TrainingArgs, env: DistributedEnv, search: bool) -> T:
    """``attempt(batch_size, searching)`` through Trainer's ``find_executable_batch_size`` from ``args``' size.
    ``attempt`` adds ``searching(components)`` to its loop's callbacks once its run is built: with ``search`` on
    several ranks, the engine's training micro-batches are agreed (``agreed``); on resume, the first attempt reads
    the batch size of the checkpoint its run resumes from (``resumed``)."""
    from transformers.trainer_utils import find_executable_batch_size

    run = resumed(attempt, args) if search and args.resume_from_checkpoint is not None else attempt
    tried = agreed(run, env) if search and env.is_distributed else lambda batch_size: run(batch_size, lambda c: [])
    try:
        return find_executable_batch_size(tried, args.per_device_batch_size or 1, search)()  # type: ignore[no-any-return]
    except ResumedBatchSize as checkpoint:  # the search starts again from the checkpoint's size, as Trainer's train()
        return find_executable_batch_size(tried, checkpoint.batch_size, search)()  # type: ignore[no-any-return]


class ResumedBatchSize(Exception):
    """The checkpoint the run resumes from was trained with ``batch_size`` items per micro-batch (not an
    out-of-memory error: Trainer's search lets it through, and ``find_batch_size`` starts again from it)."""

    def __init__(self, batch_size: int) -> None:
        super().__init__(f"the resumed checkpoint trained with {batch_size} items per micro-batch")
        self.batch_size = batch_size


def resumed(attempt: Callable[[int, Searching], T], args: TrainingArgs) -> Callable[[int, Searching], T]:
    """``attempt`` whose first run, once built, reads ``train_batch_size`` from the ``trainer_state.json`` of the
    checkpoint its loop resumes from (``CheckpointManager.resume_path``: one decision, the loop's), as Trainer's
    ``train()`` starts its search there; a different size raises ``ResumedBatchSize``."""
    from transformers import TrainerState
    from transformers.trainer import TRAINER_STATE_NAME

    pending = [True]

    def run(batch_size: int, searching: Searching) -> T:
        def read_then_search(components: RunComponents) -> list[Callback]:
            if pending:
                pending.clear()
                found = components.checkpoints.resume_path(args.resume_from_checkpoint, args.resume_allow_mismatch)
                if found is not None and (found / TRAINER_STATE_NAME).is_file():
                    size = TrainerState.load_from_json(str(found / TRAINER_STATE_NAME)).train_batch_size
                    if size is not None and size != batch_size:
                        raise ResumedBatchSize(size)
            return searching(components)

        return attempt(batch_size, read_then_search)

    return run


def agreed(attempt: Callable[[int, Searching], T], env: DistributedEnv) -> Callable[[int], T]:
    """``attempt`` left by every rank together when one runs out of memory in a training micro-batch's forward
    or loss."""
    from accelerate.utils.memory import should_reduce_batch_size

    def run(batch_size: int) -> T:
        agreements: list[AgreedForwards] = []

        def agreeing(components: RunComponents) -> list[Callback]:
            engine = components.engine
            if engine.kind == "ddp":
                agreements.append(AgreedForwards(env, engine.unwrapped, batch_size))
            elif env.is_world_process_zero:
                logger.warning(NOT_AGREED, engine.kind)
            return list(agreements)

        try:
            return attempt(batch_size, agreeing)
        except Exception as exc:
            if not should_reduce_batch_size(exc):
                raise
            if not isinstance(exc, PeerOutOfMemory):
                if not agreements or not agreements[0].inside:
                    raise UnagreedOutOfMemory(env.rank, batch_size) from exc
                agreements[0].agree(failed=True)  # every other rank waits in this agreement, before its backward
            raise
        finally:
            for agreement in agreements:
                agreement.remove()

    return run


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
