"""``TrainingEngine``: one interface over DDP, FSDP2 (``fully_shard``) and DeepSpeed ZeRO, and the
single-process engine.

The loop never touches a wrapper directly.  For each optimizer step every rank runs the same number of
micro-batches and calls, in this order::

    for i, batch in enumerate(micro_batches):
        with engine.micro_batch(is_last=i == n - 1), engine.autocast():
            loss = compute_loss(engine.module, batch)      # already normalised, see below
        engine.backward(loss)
    grad_norm = engine.clip_grad_norm(args.max_grad_norm)  # pre-clip total norm, same on all ranks
    engine.optimizer_step(); engine.scheduler_step(); engine.zero_grad()

The loss handed to ``backward`` is ``sum_token_CE / global_loss_tokens * world_size``; every backend here
*averages* gradients over ranks (DDP and FSDP2 natively, DeepSpeed with ``scale_wrt_gas=False``), so the
gradient is the global per-token mean whatever the split.  No host-device synchronisation in the step:
``clip_grad_norm`` returns the norm as a device tensor; the loop reads it, with the loss, in the step's one
reduction (``core.agreement.agree_control``).

Engines give and take state dicts (model, optimizer, scheduler); ``checkpoint/`` writes and reads them.
With one process (``world_size == 1``) every backend runs the bare model (``LocalEngine``: no wrapper,
plain AdamW); the arithmetic is the same and ``describe()`` says so.  With more ranks ``verify()`` asserts
the configured wrapper is really in place.  The backends: ``ddp.py``, ``fsdp.py``, ``deepspeed.py``;
``build.py`` picks one.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from trainbridge.parallel.optim import is_metric_schedule

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from trainbridge.core.config import TrainingArgs
    from trainbridge.core.distributed import DistributedEnv


class TrainingEngine(ABC):
    """One distributed training setup: the wrapped model, its optimizer and LR scheduler.

    Attributes:
        module: call this for the forward pass (the DDP / FSDP2 module, the DeepSpeed engine, or the bare
            model on one process).
        unwrapped: the underlying ``PreTrainedModel`` (``save_pretrained``, config, generation config).
        optimizer: the optimizer the step uses (for DeepSpeed its ZeRO optimizer; ``param_groups`` holds
            the live learning rates).
        lr_scheduler: the LR scheduler, stepped by ``scheduler_step``.
        kind: ``"local"`` (one process), ``"ddp"``, ``"fsdp"`` or ``"deepspeed"``.
    """

    kind = "base"
    sharded_model = False
    """Each rank holds only its shards of the weights (FSDP2): checkpoints then always keep the model's
    shards in ``dcp/`` and resume reads them there, never the full HF-layout weights on every rank."""
    sharded_optimizer = False
    """Each rank holds only its shards of the optimizer state (FSDP2): it is only ever saved in
    ``torch.distributed.checkpoint`` form (``sharded_optimizer_state_dict``)."""
    native_checkpoint = False
    """The backend writes its model and optimizer state in its own format (DeepSpeed's ZeRO partitions,
    fp32 master weights included): ``save_native_state`` / ``load_native_state`` instead of state dicts."""

    def __init__(
        self,
        module: Any,
        unwrapped: PreTrainedModel,
        optimizer: Any,
        lr_scheduler: Any,
        args: TrainingArgs,
        env: DistributedEnv,
    ) -> None:
        # Any: a DDP module, an FSDPModule, a DeepSpeed engine or the bare model, each with its own API.
        self.module: Any = module
        self.unwrapped = unwrapped
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.args = args
        self.env = env
        self.metric_schedule = is_metric_schedule(lr_scheduler)
        """The schedule steps on the evaluation metric (``reduce_lr_on_plateau``, ``greedy``), after each
        evaluation (``callbacks.metric_schedule``), not in ``scheduler_step``."""
        self.precision = args.mixed_precision_for(env.device.type)
        """``args.mixed_precision`` resolved for this device (``auto`` -> ``bf16`` on CUDA, ``no`` on CPU)."""
        self.grad_scaler: Any = self._grad_scaler() if self.precision == "fp16" else None
        """fp16's loss scaler (``torch.amp.GradScaler``; FSDP2's sharded one; None where the backend scales
        itself: DeepSpeed)."""
        self._step_skipped = False

    # ------------------------------------------------------------------ the step
    @abstractmethod
    def micro_batch(self, is_last: bool) -> AbstractContextManager[None]:
        """Context for one micro-batch's forward and backward; gradients sync only when ``is_last``."""

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate the (already normalised) loss, scaled under fp16; gradients accumulate until the
        optimizer step."""
        (loss if self.grad_scaler is None else self.grad_scaler.scale(loss)).backward()

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor | None:
        """Total L2 gradient norm before clipping, a 0-dim tensor on the device (same on every rank; no
        host synchronisation); clips to ``max_norm`` unless None.  ``None`` when the backend clips inside
        its own step (DeepSpeed): then ``reported_grad_norm`` gives it after ``optimizer_step``.  Under
        fp16 the gradients are unscaled first (infinite norm: an overflow, the scaler skips the step)."""
        if self.grad_scaler is not None:
            self.grad_scaler.unscale_(self.optimizer)
        params = [p for p in self.module.parameters() if p.grad is not None]
        if max_norm is None:
            norm = torch.nn.utils.get_total_norm([cast(torch.Tensor, p.grad) for p in params])
        else:
            norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return self._full_norm(norm)

    def _full_norm(self, norm: torch.Tensor) -> torch.Tensor:
        return norm.detach()

    def reported_grad_norm(self) -> torch.Tensor | float | None:
        """The pre-clip norm the backend measured in ``optimizer_step`` (only where ``clip_grad_norm`` is
        None: DeepSpeed)."""
        return None

    def optimizer_step(self) -> None:
        """Apply the accumulated gradients (fp16: through the scaler, which skips an overflowed step and
        updates its scale)."""
        if self.grad_scaler is None:
            self.optimizer.step()
            return
        scale = self.grad_scaler.get_scale()  # fp16 only: a host read, as accelerate's skip check
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()
        self._step_skipped = self.grad_scaler.get_scale() < scale

    def scheduler_step(self) -> None:
        """Advance the learning-rate schedule by one optimizer step (a metric-driven one waits for the
        evaluation; under fp16 a step the scaler skipped does not advance it: both as under Trainer)."""
        if not self.metric_schedule and not self._step_skipped:
            self.lr_scheduler.step()

    def zero_grad(self) -> None:
        """Drop the gradients (``set_to_none``) before the next step's first micro-batch."""
        self.optimizer.zero_grad(set_to_none=True)

    def current_lr(self) -> float:
        """The learning rate the next optimizer step uses (the scheduler's last value; the optimizer's
        for a metric-driven schedule, as Trainer reads it)."""
        if self.metric_schedule:
            return float(self.optimizer.param_groups[0]["lr"])
        return float(self.lr_scheduler.get_last_lr()[0])

    def autocast(self) -> AbstractContextManager[Any]:
        """bf16 / fp16 autocast for forward/loss when ``mixed_precision`` resolves to it and the wrapper does
        not already run in it; a null context otherwise."""
        if self.precision in ("bf16", "fp16") and not self._wrapper_handles_precision():
            dtype = torch.bfloat16 if self.precision == "bf16" else torch.float16
            return torch.autocast(device_type=self.env.device.type, dtype=dtype)
        return contextlib.nullcontext()

    def _wrapper_handles_precision(self) -> bool:
        return False

    def _grad_scaler(self) -> Any:
        return torch.amp.GradScaler(self.env.device.type)

    def grad_scaler_state_dict(self) -> dict[str, Any] | None:
        """The fp16 loss scaler's state (the same on every rank), None without one."""
        return None if self.grad_scaler is None else cast(dict[str, Any], self.grad_scaler.state_dict())

    def load_grad_scaler_state_dict(self, state: dict[str, Any]) -> None:
        """Load what ``grad_scaler_state_dict`` gave."""
        if self.grad_scaler is not None:
            self.grad_scaler.load_state_dict(state)

    # ------------------------------------------------------------------ state
    def full_model_state_dict(self, names: set[str] | None = None) -> dict[str, torch.Tensor] | None:
        """Full, unsharded model weights as CPU tensors on rank 0, None on the other ranks; only the
        parameters in ``names`` when given (a PEFT adapter's weights without the frozen base).

        Collective for sharded backends (FSDP2, ZeRO-3): every rank must call it.
        """
        if not self.env.is_world_process_zero:
            return None
        return {
            k: v.detach().to("cpu", copy=True)
            for k, v in self.unwrapped.state_dict().items()
            if names is None or k in names
        }

    def load_model_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load a full state dict (every rank holds it) into the live, possibly sharded, model.  ``strict``:
        every weight of the model; otherwise a subset (e.g. a PEFT adapter's weights), each of which must
        exist in the model."""
        load_into(self.unwrapped, state, strict)

    def sharded_model_state_dict(self) -> dict[str, Any]:
        """The model's own state in ``torch.distributed.checkpoint`` form: the live tensors in their training
        dtype, keyed by name (FSDP2: this rank's DTensor shards).  ``checkpoint/`` loads into it in place
        and hands it back to ``load_sharded_model_state_dict``."""
        return cast(dict[str, Any], self.unwrapped.state_dict())

    def load_sharded_model_state_dict(self, state: dict[str, Any]) -> None:
        """Load what ``sharded_model_state_dict`` gave, filled from a checkpoint, into the live model."""
        load_into(self.unwrapped, state, strict=True)

    def optimizer_state_dict(self) -> dict[str, Any]:
        """The whole optimizer state (``Optimizer.state_dict()``) of a replicated optimizer (one process,
        DDP): the same on every rank, so one rank's copy is the checkpoint's."""
        return cast(dict[str, Any], self.optimizer.state_dict())

    def load_optimizer_state_dict(self, state: dict[str, Any]) -> None:
        """Load what ``optimizer_state_dict`` gave into the optimizer."""
        self.optimizer.load_state_dict(state)

    def sharded_optimizer_state_dict(self) -> dict[str, Any]:
        """The optimizer state in ``torch.distributed.checkpoint`` form (``get_optimizer_state_dict``: keyed
        by parameter name; FSDP2: this rank's shards).  ``checkpoint/`` loads into it in place and hands it
        back to ``load_sharded_optimizer_state_dict``."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return cast(dict[str, Any], get_optimizer_state_dict(self.unwrapped, self.optimizer))

    def load_sharded_optimizer_state_dict(self, state: dict[str, Any]) -> None:
        """Load what ``sharded_optimizer_state_dict`` gave, filled from a checkpoint, into the optimizer."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.unwrapped, self.optimizer, state)

    def scheduler_state_dict(self) -> dict[str, Any]:
        """The LR scheduler's state (the same on every rank)."""
        return cast(dict[str, Any], self.lr_scheduler.state_dict())

    def load_scheduler_state_dict(self, state: dict[str, Any]) -> None:
        """Load what ``scheduler_state_dict`` gave into the LR scheduler."""
        self.lr_scheduler.load_state_dict(state)

    def save_native_state(self, folder: Path) -> None:
        """Backends with their own checkpoint format (``native_checkpoint``) write their model and optimizer
        state into ``folder`` themselves (collective)."""
        raise NotImplementedError(f"{type(self).__name__} has no checkpoint format of its own")

    def load_native_state(self, folder: Path) -> None:
        """Read back what ``save_native_state`` wrote into ``folder`` (collective)."""
        raise NotImplementedError(f"{type(self).__name__} has no checkpoint format of its own")

    # ------------------------------------------------------------------ introspection
    @abstractmethod
    def describe(self) -> str:
        """One line: backend, world size, device and what was wrapped."""

    def verify(self) -> None:
        """Raise ``RuntimeError`` unless the run really is what was configured (no silent fallback)."""
        if self.env.world_size > 1:
            if not (dist.is_available() and dist.is_initialized()):
                raise RuntimeError(
                    f"rank {self.env.rank}: world_size={self.env.world_size} but no process group is initialised"
                )
            if dist.get_world_size() != self.env.world_size:
                raise RuntimeError(
                    f"rank {self.env.rank}: process group has {dist.get_world_size()} ranks, "
                    f"expected world_size={self.env.world_size}"
                )
        self._verify_wrapper()

    @abstractmethod
    def _verify_wrapper(self) -> None: ...

    def _where(self) -> str:
        return f"world={self.env.world_size} device={self.env.device.type}"


class LocalEngine(TrainingEngine):
    """One process: the bare model and plain AdamW (every backend with ``world_size == 1``)."""

    kind = "local"

    def micro_batch(self, is_last: bool) -> AbstractContextManager[None]:
        """Nothing to synchronise on one process."""
        return contextlib.nullcontext()

    def describe(self) -> str:
        """E.g. ``single process (ddp requested, world=1: no wrapper) device=cpu``."""
        return (
            f"single process ({self.args.distributed_backend} requested, world=1: no wrapper) "
            f"device={self.env.device.type}"
        )

    def _verify_wrapper(self) -> None:
        if self.env.world_size != 1:
            raise RuntimeError(f"rank {self.env.rank}: unwrapped model used with world_size={self.env.world_size}")
        if self.module is not self.unwrapped:
            raise RuntimeError("single-process engine: module is not the bare model")


def load_into(module: nn.Module, state: dict[str, torch.Tensor], strict: bool) -> None:
    """``module.load_state_dict(state, strict)``, refusing names the module does not have even when not
    ``strict``."""
    result = module.load_state_dict(state, strict=strict)
    if result.unexpected_keys:
        raise KeyError(f"weights not in the model: {sorted(result.unexpected_keys)}")
