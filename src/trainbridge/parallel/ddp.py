"""``DDPEngine``: ``torch.nn.parallel.DistributedDataParallel``, replicated weights and averaged gradients.

Gradients are all-reduced once per optimizer step: ``no_sync`` on every micro-batch but the last.  The
optimizer is replicated, so its state is the same on every rank (``TrainingEngine.optimizer_state_dict``).
On CPU the clip reads the norm (no device to wait for) and skips scaling the gradients by a coefficient of
exactly 1 (``clip_grad_norm``): the same gradients, one pass over them fewer per step.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from transformers import PreTrainedModel

from trainbridge.parallel.engine import TrainingEngine
from trainbridge.parallel.optim import build_optimizer, build_scheduler

if TYPE_CHECKING:
    from trainbridge.core.config import TrainingArgs
    from trainbridge.core.config.plan import OptimizerFactory
    from trainbridge.core.distributed import DistributedEnv


class DDPEngine(TrainingEngine):
    """``torch.nn.parallel.DistributedDataParallel``: replicated weights, all-reduced (averaged) grads."""

    kind = "ddp"

    def micro_batch(self, is_last: bool) -> AbstractContextManager[None]:
        """``no_sync()`` on non-last micro-batches, so gradients are all-reduced once per step."""
        return contextlib.nullcontext() if is_last else self.module.no_sync()

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor | None:
        """The base engine's clip; on CPU without a grad scaler, the gradients are scaled only when torch's
        clip coefficient (``max_norm / (norm + 1e-6)``, clamped to 1) is below 1: multiplying by 1.0 changes
        no value, and reading a CPU norm waits for nothing.  A non-finite norm clips as torch does."""
        if max_norm is None or self.grad_scaler is not None or self.env.device.type != "cpu":
            return super().clip_grad_norm(max_norm)
        return clip_cpu_grads([p for p in self.module.parameters() if p.grad is not None], max_norm)

    def describe(self) -> str:
        """E.g. ``ddp (DistributedDataParallel) world=2 device=cpu backend=gloo``."""
        return f"ddp (DistributedDataParallel) {self._where()} backend={self.env.backend}"

    def _verify_wrapper(self) -> None:
        if not isinstance(self.module, DistributedDataParallel):
            raise RuntimeError(f"rank {self.env.rank}: ddp configured but the model is {type(self.module).__name__}")


def clip_cpu_grads(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_(params, max_norm)`` for CPU gradients, the same values: the pre-clip
    total norm (detached), the gradients scaled only when the clip coefficient is below 1."""
    norm = torch.nn.utils.get_total_norm([cast(torch.Tensor, p.grad) for p in params])
    if not bool(max_norm / (norm + 1e-6) >= 1.0):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm.detach()


_TRAINED_BUFFERS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
_UNUSED_HINT = (
    "some parameters took no part in the loss; set ddp_find_unused_parameters=True (TrainingArgs or "
    "TrainingArguments), as Trainer does by default"
)


class _DDP(DistributedDataParallel):
    """``DistributedDataParallel`` whose unused-parameter error names the field that fixes it."""

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        try:
            return super().forward(*inputs, **kwargs)
        except RuntimeError as exc:
            if "find_unused_parameters" in str(exc) and not self.find_unused_parameters:
                raise RuntimeError(f"{_UNUSED_HINT}. DDP said: {exc}") from exc
            raise


def find_unused_parameters(model: nn.Module, args: TrainingArgs) -> bool:
    """``args.ddp_find_unused_parameters``, or Trainer's rule when None: True unless gradient checkpointing
    is on (the model's, or ``args.gradient_checkpointing``)."""
    if args.ddp_find_unused_parameters is not None:
        return args.ddp_find_unused_parameters
    if isinstance(model, PreTrainedModel):
        with warnings.catch_warnings():  # transformers 5 renames it is_activation_checkpointing
            warnings.simplefilter("ignore", FutureWarning)
            return not (model.is_gradient_checkpointing or args.gradient_checkpointing)
    return True


def buffer_sync(model: nn.Module, args: TrainingArgs) -> dict[str, Any]:
    """DDP's buffer options.  ``args.ddp_broadcast_buffers`` given: torch's ``broadcast_buffers``.  None:
    rank 0's buffers are broadcast before each forward only when training updates some (batch-norm running
    statistics, where torch's default matters); a causal LM's buffers (rotary frequencies, masks) are
    constants, so re-broadcasting them every micro-batch is one collective for nothing.
    ``forward_sync_buffers=False`` says that (torch 2.13, which CI pins); older torch only has
    ``broadcast_buffers=False``, which also skips the broadcast at construction."""
    if args.ddp_broadcast_buffers is not None:
        return {"broadcast_buffers": args.ddp_broadcast_buffers}
    if any(isinstance(m, _TRAINED_BUFFERS) and m.track_running_stats for m in model.modules()):
        return {}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def ddp_options(model: nn.Module, args: TrainingArgs) -> dict[str, Any]:
    """The ``DistributedDataParallel`` keyword arguments of ``args``' ``ddp_*`` fields (Trainer's)."""
    options: dict[str, Any] = {"find_unused_parameters": find_unused_parameters(model, args)}
    if args.ddp_bucket_cap_mb is not None:
        options["bucket_cap_mb"] = args.ddp_bucket_cap_mb
    if args.ddp_static_graph is not None:
        options["static_graph"] = args.ddp_static_graph
    return {**options, **buffer_sync(model, args)}


def build_ddp(
    model: PreTrainedModel,
    args: TrainingArgs,
    env: DistributedEnv,
    total_steps: int,
    decay_names: set[str],
    factory: OptimizerFactory | None = None,
) -> DDPEngine:
    """``model`` on ``env.device`` in ``DistributedDataParallel`` (``ddp_options``), with the optimizer and
    the LR schedule."""
    cast(nn.Module, model).to(env.device)
    wrapped = _DDP(
        model,
        device_ids=[env.device.index] if env.device.type == "cuda" else None,
        gradient_as_bucket_view=True,
        **ddp_options(model, args),
    )
    optimizer = build_optimizer(model, args, decay_names, total_steps=total_steps, factory=factory)
    return DDPEngine(wrapped, model, optimizer, build_scheduler(optimizer, args, total_steps, factory), args, env)
