"""``DDPEngine``: ``torch.nn.parallel.DistributedDataParallel``, replicated weights and averaged gradients.

Gradients are all-reduced once per optimizer step: ``no_sync`` on every micro-batch but the last.  The
optimizer is replicated, so its state is the same on every rank (``TrainingEngine.optimizer_state_dict``).
"""

from __future__ import annotations

import contextlib
import inspect
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainbridge.parallel.engine import TrainingEngine
from trainbridge.parallel.optim import build_optimizer, build_scheduler

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from trainbridge.core.config import TrainingArgs
    from trainbridge.core.config.plan import OptimizerFactory
    from trainbridge.core.distributed import DistributedEnv


class DDPEngine(TrainingEngine):
    """``torch.nn.parallel.DistributedDataParallel``: replicated weights, all-reduced (averaged) grads."""

    kind = "ddp"

    def micro_batch(self, is_last: bool) -> AbstractContextManager[None]:
        """``no_sync()`` on non-last micro-batches, so gradients are all-reduced once per step."""
        return contextlib.nullcontext() if is_last else self.module.no_sync()

    def describe(self) -> str:
        """E.g. ``ddp (DistributedDataParallel) world=2 device=cpu backend=gloo``."""
        return f"ddp (DistributedDataParallel) {self._where()} backend={self.env.backend}"

    def _verify_wrapper(self) -> None:
        if not isinstance(self.module, DistributedDataParallel):
            raise RuntimeError(f"rank {self.env.rank}: ddp configured but the model is {type(self.module).__name__}")


def _buffers_synced_at_construction_only() -> dict[str, Any]:
    """DDP broadcasts the buffers from rank 0 at construction; re-broadcasting them before every forward (its
    default) is one more collective per micro-batch for nothing here: a causal LM's buffers (rotary
    frequencies, masks) are constants, never updated by training.  ``forward_sync_buffers=False`` says that
    (torch 2.13, which CI pins); older torch only has ``broadcast_buffers=False``, deprecated since, which
    also skips the broadcast at construction."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def build_ddp(
    model: PreTrainedModel,
    args: TrainingArgs,
    env: DistributedEnv,
    total_steps: int,
    decay_names: set[str],
    factory: OptimizerFactory | None = None,
) -> DDPEngine:
    """``model`` on ``env.device`` in ``DistributedDataParallel``, with AdamW and the LR schedule."""
    cast(nn.Module, model).to(env.device)
    wrapped = DistributedDataParallel(
        model,
        device_ids=[env.device.index] if env.device.type == "cuda" else None,
        find_unused_parameters=False,
        gradient_as_bucket_view=True,
        **_buffers_synced_at_construction_only(),
    )
    optimizer = build_optimizer(model, args, decay_names, total_steps=total_steps, factory=factory)
    return DDPEngine(wrapped, model, optimizer, build_scheduler(optimizer, args, total_steps, factory), args, env)
