"""``TrainingEngine``: one interface over DDP, FSDP2 (``fully_shard``) and DeepSpeed ZeRO.

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
gradient is the global per-token mean whatever the split.  DDP synchronises gradients once per optimizer
step (``no_sync`` on non-last micro-batches).  FSDP2 reduce-scatters every micro-batch's gradients into
its sharded fp32 gradients by default (``fsdp_gradient_sync='every_micro_batch'``: no unsharded gradient
is ever kept; ``'last_micro_batch'`` accumulates unsharded and reduce-scatters once).  DeepSpeed marks the
boundary with ``set_gradient_accumulation_boundary`` (ZeRO-2/3 reduce-scatter every micro-batch: that is
how they partition gradients).

No host-device synchronisation in the step: ``clip_grad_norm`` returns the norm as a device tensor; the
loop reads it, with the loss, in the step's one reduction (``core.control.agree_control``).

With one process (``world_size == 1``) every backend runs the bare model (no wrapper, plain AdamW); the
arithmetic is the same and ``describe()`` says so.  With more ranks ``verify()`` asserts the configured
wrapper is really in place.

DeepSpeed is optional (``pip install trainbridge[deepspeed]``).  On CPU the builder sets
``DS_ACCELERATOR=cpu`` before importing it (DeepSpeed picks its accelerator once, at first import) and
DeepSpeed joins the gloo group ``DistributedEnv`` started.  Its ``bf16`` mode is DeepSpeed's own: bf16
parameters with fp32 master weights in the optimizer (as the Hugging Face Trainer configures it).
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from transformers import get_scheduler
from transformers.trainer_pt_utils import get_parameter_names

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from trainbridge.core.config import TrainingArgs
    from trainbridge.core.distributed import DistributedEnv

OPTIMIZER_FILE = "optimizer.pt"
SCHEDULER_FILE = "scheduler.pt"
SHARDED_STATE_DIR = "dcp"
"""The checkpoint's ``torch.distributed.checkpoint`` folder: each rank's shards of the model's own
(training-precision) weights under ``model``, and FSDP2's optimizer shards under ``optimizer``."""
LEGACY_FSDP_OPTIMIZER_DIR = "optimizer_dcp"
"""FSDP2 checkpoints written before the model went into ``dcp/``: the optimizer shards only (read, never
written)."""
DEEPSPEED_DIR = "deepspeed"
DEEPSPEED_TAG = "state"

# Same rule as transformers' Trainer.get_decay_parameter_names: no decay on biases and norm weights.
_NO_DECAY_NAME_PATTERNS = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]


def decay_parameter_names(model: nn.Module) -> set[str]:
    """Names of the parameters that get weight decay (everything but biases and norm weights, like HF)."""
    return set(get_parameter_names(model, [nn.LayerNorm], _NO_DECAY_NAME_PATTERNS))


def build_optimizer(
    model: nn.Module, args: TrainingArgs, decay_names: set[str], allow_fused: bool = True
) -> torch.optim.AdamW:
    """torch AdamW over ``model``'s trainable parameters: one group with ``weight_decay``, one without.

    Uses torch's fused AdamW kernel (several times faster than the per-parameter loop on CPU; Trainer's
    default too) when ``allow_fused`` and every parameter is a floating-point tensor on CPU or CUDA:
    plain parameters, or FSDP2's DTensor shards (DTensor dispatches ``_fused_adamw_`` shard-locally).
    """
    from torch.distributed.tensor import DTensor

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    fused = allow_fused and all(
        (type(p) is nn.Parameter or isinstance(p, DTensor))
        and p.is_floating_point() and p.device.type in ("cpu", "cuda")
        for _, p in named
    )
    groups = [
        {"params": [p for n, p in named if n in decay_names], "weight_decay": args.weight_decay},
        {"params": [p for n, p in named if n not in decay_names], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]],
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        fused=fused or None,
    )


def build_scheduler(optimizer: torch.optim.Optimizer, args: TrainingArgs, total_steps: int) -> Any:
    """``transformers.get_scheduler(args.lr_scheduler)`` with ``warmup_steps`` over ``total_steps``."""
    return get_scheduler(
        args.lr_scheduler,
        optimizer=optimizer,
        num_warmup_steps=args.warmup_steps or math.ceil(args.warmup_ratio * total_steps),
        num_training_steps=total_steps,
        scheduler_specific_kwargs=args.lr_scheduler_kwargs or None,
    )


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

    def __init__(self, module: Any, unwrapped: PreTrainedModel, optimizer: Any, lr_scheduler: Any,
                 args: TrainingArgs, env: DistributedEnv) -> None:
        # Any: a DDP module, an FSDPModule, a DeepSpeed engine or the bare model, each with its own API.
        self.module: Any = module
        self.unwrapped = unwrapped
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.args = args
        self.env = env
        self.precision = args.mixed_precision_for(env.device.type)
        """``args.mixed_precision`` resolved for this device (``auto`` -> ``bf16`` on CUDA, ``no`` on CPU)."""

    # ------------------------------------------------------------------ the step
    @abstractmethod
    def micro_batch(self, is_last: bool) -> AbstractContextManager[None]:
        """Context for one micro-batch's forward and backward; gradients sync only when ``is_last``."""

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate the (already normalised) loss; gradients accumulate until the optimizer step."""
        loss.backward()

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor | None:
        """Total L2 gradient norm before clipping, a 0-dim tensor on the device (same on every rank; no
        host synchronisation); clips to ``max_norm`` unless None.  ``None`` when the backend clips inside
        its own step (DeepSpeed): then ``reported_grad_norm`` gives it after ``optimizer_step``."""
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
        """Apply the accumulated gradients."""
        self.optimizer.step()

    def scheduler_step(self) -> None:
        """Advance the learning-rate schedule by one optimizer step."""
        self.lr_scheduler.step()

    def zero_grad(self) -> None:
        """Drop the gradients (``set_to_none``) before the next step's first micro-batch."""
        self.optimizer.zero_grad(set_to_none=True)

    def current_lr(self) -> float:
        """The learning rate the next optimizer step uses (the scheduler's last value)."""
        return float(self.lr_scheduler.get_last_lr()[0])

    def autocast(self) -> AbstractContextManager[Any]:
        """bf16 autocast for forward/loss when ``mixed_precision`` resolves to bf16 and the wrapper does not already
        run in bf16; a null context otherwise."""
        if self.precision == "bf16" and not self._wrapper_handles_precision():
            return torch.autocast(device_type=self.env.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _wrapper_handles_precision(self) -> bool:
        return False

    # ------------------------------------------------------------------ state
    def full_model_state_dict(self, names: set[str] | None = None) -> dict[str, torch.Tensor] | None:
        """Full, unsharded model weights as CPU tensors on rank 0, None on the other ranks; only the
        parameters in ``names`` when given (a PEFT adapter's weights without the frozen base).

        Collective for sharded backends (FSDP2, ZeRO-3): every rank must call it.
        """
        if not self.env.is_world_process_zero:
            return None
        return {k: v.detach().to("cpu", copy=True) for k, v in self.unwrapped.state_dict().items()
                if names is None or k in names}

    def load_model_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Load a full state dict (every rank holds it) into the live, possibly sharded, model.  ``strict``:
        every weight of the model; otherwise a subset (e.g. a PEFT adapter's weights), each of which must
        exist in the model."""
        _load_into(self.unwrapped, state, strict)

    def save_training_state(self, directory: Path, model_state: bool = False,
                            background: bool = False) -> Future[Any] | None:
        """Write optimizer and scheduler state into ``directory`` (collective: every rank calls it); with
        ``model_state`` also the model's own weights, in their training dtype, into ``dcp/``
        (``SHARDED_STATE_DIR``; DCP de-duplicates replicated tensors, so rank 0 writes them once).

        Replicated optimizers (DDP, one process) are written once by rank 0 as ``optimizer.pt``.
        ``background`` (``checkpoint_async``): the optimizer state goes into ``dcp/`` too, and ``dcp/`` is
        written by ``dcp.async_save`` (staged to CPU memory first, so training may go on); the returned
        future completes when this rank's part is on disk.  None when nothing is left to write.
        """
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        state: dict[str, Any] = {"model": self._model_state()} if model_state else {}
        if background:
            state["optimizer"] = get_optimizer_state_dict(self.unwrapped, self.optimizer)
        elif self.env.is_world_process_zero:
            torch.save(self.optimizer.state_dict(), directory / OPTIMIZER_FILE)
        self._save_scheduler(directory)
        return self._write_dcp(state, directory / SHARDED_STATE_DIR, background) if state else None

    def has_model_state(self, directory: Path) -> bool:
        """Whether checkpoint ``directory`` holds the model's own weights in its sharded state ``dcp/``."""
        return _dcp_has(directory / SHARDED_STATE_DIR, "model")

    def load_model_state(self, directory: Path) -> bool:
        """Load the model's own weights from checkpoint ``directory``'s ``dcp/`` when it holds them
        (collective; each rank reads its own shards) and return True; False (nothing loaded) otherwise:
        then the HF-layout weights are the model's."""
        if not self.has_model_state(directory):
            return False
        state = {"model": self._model_state()}
        self._read_dcp(state, directory / SHARDED_STATE_DIR)  # only the model's entries
        self._set_model_state(state["model"])
        return True

    def load_training_state(self, directory: Path) -> None:
        """Restore the optimizer and scheduler state ``save_training_state`` wrote (every rank calls it):
        ``optimizer.pt``, or the optimizer's entries in ``dcp/`` (a background save)."""
        if _dcp_has(directory / SHARDED_STATE_DIR, "optimizer"):
            self._read_dcp_optimizer(directory / SHARDED_STATE_DIR, self.unwrapped)
        else:
            path = _require_file(directory / OPTIMIZER_FILE)
            self.optimizer.load_state_dict(torch.load(path, map_location=self.env.device, weights_only=True))
        self._load_scheduler(directory)

    def _model_state(self) -> dict[str, Any]:
        """The model's own state for DCP: live tensors in their training dtype (FSDP2: this rank's shards)."""
        return cast(dict[str, Any], self.unwrapped.state_dict())

    def _set_model_state(self, state: dict[str, Any]) -> None:
        _load_into(self.unwrapped, state, strict=True)

    def _write_dcp(self, state: dict[str, Any], path: Path, background: bool) -> Future[Any] | None:
        """``dcp.save`` of ``state`` into ``path`` (collective), or with ``background`` ``dcp.async_save``
        over the checkpoint process group (``DistributedEnv.checkpoint_group``): returns its future."""
        import torch.distributed.checkpoint as dcp

        if background:
            # collective (staging and planning start here); the write goes on in DCP's writer thread
            return cast(Future[Any], dcp.async_save(state, checkpoint_id=path, no_dist=not self.env.is_distributed,
                                                    process_group=self.env.checkpoint_group()))
        with _single_process_quiet():
            dcp.save(state, checkpoint_id=path, no_dist=not self.env.is_distributed)  # collective
        return None

    def _read_dcp(self, state: dict[str, Any], path: Path) -> None:
        """``dcp.load`` of ``state``'s entries from the DCP folder ``path``, in place (collective: each rank
        reads the entries, or shards, it holds)."""
        import torch.distributed.checkpoint as dcp

        with _single_process_quiet():
            dcp.load(state, checkpoint_id=path, no_dist=not self.env.is_distributed)

    def _read_dcp_optimizer(self, path: Path, module: nn.Module) -> None:
        """The optimizer's entries of the DCP folder ``path`` into ``self.optimizer``, whose parameters are
        ``module``'s (the bare model, or FSDP2's sharded module; collective)."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        state = {"optimizer": get_optimizer_state_dict(module, self.optimizer)}
        self._read_dcp(state, path)
        set_optimizer_state_dict(module, self.optimizer, state["optimizer"])

    def _save_scheduler(self, directory: Path) -> None:
        if self.env.is_world_process_zero:
            torch.save(self.lr_scheduler.state_dict(), directory / SCHEDULER_FILE)

    def _load_scheduler(self, directory: Path) -> None:
        path = _require_file(directory / SCHEDULER_FILE)
        self.lr_scheduler.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))

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


def _load_into(module: nn.Module, state: dict[str, torch.Tensor], strict: bool) -> None:
    result = module.load_state_dict(state, strict=strict)
    if result.unexpected_keys:
        raise KeyError(f"weights not in the model: {sorted(result.unexpected_keys)}")


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every save and load without a process group; one process is what we mean then."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _dcp_has(path: Path, entry: str) -> bool:
    """Whether the DCP folder ``path`` exists and holds entries under ``entry`` (``model``, ``optimizer``)."""
    if not (path / ".metadata").is_file():
        return False
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    return any(key.startswith(f"{entry}.") for key in metadata.state_dict_metadata)


def _require_file(path: Path) -> Path:
    if not path.exists():
        raise FileNotFoundError(f"training state file {str(path)!r} is missing (not written by this backend?)")
    return path


# ====================================================================== one process / DDP
class LocalEngine(TrainingEngine):
    """One process: the bare model and plain AdamW (every backend with ``world_size == 1``)."""

    kind = "local"

    def micro_batch(self, is_last: bool) -> AbstractContextManager[None]:
        """Nothing to synchronise on one process."""
        return contextlib.nullcontext()

    def describe(self) -> str:
        """E.g. ``single process (ddp requested, world=1: no wrapper) device=cpu``."""
        return (f"single process ({self.args.distributed_backend} requested, world=1: no wrapper) "
                f"device={self.env.device.type}")

    def _verify_wrapper(self) -> None:
        if self.env.world_size != 1:
            raise RuntimeError(f"rank {self.env.rank}: unwrapped model used with world_size={self.env.world_size}")
        if self.module is not self.unwrapped:
            raise RuntimeError("single-process engine: module is not the bare model")


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


# ====================================================================== FSDP2
class FSDP2Engine(TrainingEngine):
    """torch FSDP2: ``fully_shard`` on each decoder layer, then on the root; parameters are DTensor shards."""

    kind = "fsdp"
    sharded_model = True

    def __init__(self, *args: Any, sharded_modules: int, mixed_precision_policy: bool,
                 weights_from_rank0: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sharded_modules = sharded_modules
        self.mixed_precision_policy = mixed_precision_policy
        self.weights_from_rank0 = weights_from_rank0
        """The weights were read on rank 0 only and broadcast into the shards (``fsdp_load_on_rank0``)."""
        self.sync_every_micro_batch = self.args.fsdp_gradient_sync == "every_micro_batch"

    def micro_batch(self, is_last: bool) -> AbstractContextManager[None]:
        """Reduce-scatter this micro-batch's gradients into the sharded gradients (default), or, with
        ``fsdp_gradient_sync='last_micro_batch'``, only after the step's last backward."""
        self.module.set_requires_gradient_sync(is_last or self.sync_every_micro_batch)
        self.module.set_is_last_backward(is_last)
        return contextlib.nullcontext()

    def _full_norm(self, norm: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import DTensor

        # collective (DTensor redistribution of a partial norm): stays on the device, no host sync
        return (norm.full_tensor() if isinstance(norm, DTensor) else norm).detach()

    def _wrapper_handles_precision(self) -> bool:
        return self.mixed_precision_policy

    def full_model_state_dict(self, names: set[str] | None = None) -> dict[str, torch.Tensor] | None:
        """Collective: all-gathers the shards (only those of ``names`` when given, parameter by parameter in
        the same order on every rank); the full CPU state lands on rank 0."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
        from torch.distributed.tensor import DTensor

        if names is not None:
            out: dict[str, torch.Tensor] = {}
            for name, param in self.unwrapped.named_parameters(remove_duplicate=False):
                if name in names:
                    full = param.full_tensor() if isinstance(param, DTensor) else param  # collective per parameter
                    if self.env.is_world_process_zero:
                        out[name] = full.detach().to("cpu", copy=True)
            return out if self.env.is_world_process_zero else None
        state = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return cast(dict[str, torch.Tensor], state) if self.env.is_world_process_zero else None

    def load_model_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Each rank keeps its shard of the full ``state`` (collective); ``strict=False`` loads a subset."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        expected = set(self.unwrapped.state_dict().keys())
        if set(state) - expected:
            raise KeyError(f"weights not in the model: {sorted(set(state) - expected)}")
        set_model_state_dict(self.module, cast(dict[str, Any], state),
                             options=StateDictOptions(full_state_dict=True, strict=strict))

    def save_training_state(self, directory: Path, model_state: bool = False,
                            background: bool = False) -> Future[Any] | None:
        """Sharded optimizer state, and with ``model_state`` the model's sharded weights (training dtype),
        in one ``torch.distributed.checkpoint`` folder ``dcp/``: each rank writes its own shards."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        state: dict[str, Any] = {"optimizer": get_optimizer_state_dict(self.module, self.optimizer)}
        if model_state:
            state["model"] = self._model_state()
        self._save_scheduler(directory)
        return self._write_dcp(state, directory / SHARDED_STATE_DIR, background)

    def load_training_state(self, directory: Path) -> None:
        """Each rank reads its own optimizer shards back (the model's: ``load_model_state``); a checkpoint
        from before ``dcp/`` (``optimizer_dcp/``, the optimizer only) is read too."""
        path = directory / SHARDED_STATE_DIR
        if not path.exists():
            path = _require_file(directory / LEGACY_FSDP_OPTIMIZER_DIR)
        self._read_dcp_optimizer(path, self.module)  # each rank reads the shards it owns
        self._load_scheduler(directory)

    def _model_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return cast(dict[str, Any], get_model_state_dict(self.module))  # this rank's DTensor shards

    def _set_model_state(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.module, state)

    def describe(self) -> str:
        """E.g. ``fsdp2 (fully_shard) world=2 device=cpu, 3 sharded modules``."""
        precision = ", bf16 MixedPrecisionPolicy (fp32 reduce)" if self.mixed_precision_policy else ""
        sync = "reduce-scatter every micro-batch" if self.sync_every_micro_batch else "reduce-scatter per step"
        return (f"fsdp2 (fully_shard) {self._where()}, {self.sharded_modules} sharded modules, {sync}, "
                f"reshard_after_forward={self.args.fsdp_reshard_after_forward}{precision}"
                f"{', weights read on rank 0 and broadcast' if self.weights_from_rank0 else ''}")

    def _verify_wrapper(self) -> None:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        if not isinstance(self.module, FSDPModule):
            raise RuntimeError(f"rank {self.env.rank}: fsdp configured but the root is not an FSDPModule")
        whole = {id(p) for p in packed_quantized_weights(self.unwrapped) if not p.is_floating_point()}
        for name, param in self.unwrapped.named_parameters():
            if id(param) in whole:
                continue  # a uint8-packed quantised weight: replicated by design (ignored_params)
            if not isinstance(param, DTensor):
                raise RuntimeError(f"rank {self.env.rank}: fsdp configured but parameter {name} is not a DTensor shard")
            if param.device_mesh.size() != self.env.world_size:
                raise RuntimeError(
                    f"rank {self.env.rank}: parameter {name} is sharded over {param.device_mesh.size()} ranks, "
                    f"expected {self.env.world_size}"
                )


# ====================================================================== DeepSpeed
class DeepSpeedEngine(TrainingEngine):
    """DeepSpeed ZeRO (stage 1/2/3) around our torch AdamW; the engine owns the step and the clipping."""

    kind = "deepspeed"

    def __init__(self, *args: Any, zero_stage: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.zero_stage = zero_stage

    def micro_batch(self, is_last: bool) -> AbstractContextManager[None]:
        """Mark the gradient-accumulation boundary: reduction and step happen after the last micro-batch."""
        self.module.set_gradient_accumulation_boundary(is_last)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        """``engine.backward(loss, scale_wrt_gas=False)``: the loop's loss is already normalised."""
        self.module.backward(loss, scale_wrt_gas=False)

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor | None:
        """None: DeepSpeed measures the norm and clips inside its step (``gradient_clipping``, set from
        ``args.max_grad_norm`` at build time; a different ``max_norm`` here is an error); read the norm
        from ``reported_grad_norm`` after ``optimizer_step`` (as transformers' Trainer does), not
        recomputed."""
        configured = self.args.max_grad_norm
        if max_norm != configured:
            raise ValueError(
                f"deepspeed clips inside its step with gradient_clipping={configured} (args.max_grad_norm); "
                f"clip_grad_norm was called with max_norm={max_norm}"
            )
        return None

    def reported_grad_norm(self) -> torch.Tensor | float | None:
        """``engine.get_global_grad_norm()``: the pre-clip norm DeepSpeed computed in its last step."""
        norm = self.module.get_global_grad_norm()
        return norm.detach() if isinstance(norm, torch.Tensor) else norm

    def optimizer_step(self) -> None:
        """``engine.step()`` at the boundary: clip, optimizer step, and DeepSpeed's own ``zero_grad``."""
        self.module.step()

    def zero_grad(self) -> None:
        """Nothing to do: DeepSpeed's ``step()`` already cleared the gradients."""

    def _wrapper_handles_precision(self) -> bool:
        return True

    def full_model_state_dict(self, names: set[str] | None = None) -> dict[str, torch.Tensor] | None:
        """ZeRO-3: gathered layer by layer (collective; only the parameters of ``names`` when given);
        ZeRO-1/2: the replicated module weights on rank 0."""
        if self.zero_stage == 3 and names is not None:
            import deepspeed

            out: dict[str, torch.Tensor] = {}
            for name, param in self.unwrapped.named_parameters(remove_duplicate=False):
                if name in names:
                    with deepspeed.zero.GatheredParameters([param]):  # collective per parameter
                        if self.env.is_world_process_zero:
                            out[name] = param.detach().to("cpu", copy=True)
            return out if self.env.is_world_process_zero else None
        if self.zero_stage == 3:
            state = self.module._zero3_consolidated_16bit_state_dict()
            return {k: v.detach().to("cpu", copy=True) for k, v in state.items()} if state is not None else None
        return super().full_model_state_dict(names)

    def load_model_state_dict(self, state: dict[str, torch.Tensor], strict: bool = True) -> None:
        """Copy ``state`` into the module (ZeRO-3: per layer, gathered and re-partitioned; a subset of the
        weights when not ``strict``), then refresh the optimizer's fp32 master partitions from it."""
        if self.zero_stage == 3:
            import deepspeed

            expected = set(self.unwrapped.state_dict().keys())
            missing, unexpected = expected - set(state), set(state) - expected
            if (missing and strict) or unexpected:
                raise KeyError(f"state dict mismatch: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
            for prefix, submodule in self.unwrapped.named_modules():
                params = {name: param for name, param in submodule.named_parameters(recurse=False)
                          if (f"{prefix}.{name}" if prefix else name) in state}
                if not params:
                    continue
                with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=0), torch.no_grad():
                    if self.env.is_world_process_zero:
                        for name, param in params.items():
                            param.copy_(state[f"{prefix}.{name}" if prefix else name])
        else:
            _load_into(self.unwrapped, state, strict)
        self.module.optimizer.refresh_fp32_params()

    def save_training_state(self, directory: Path, model_state: bool = False,
                            background: bool = False) -> Future[Any] | None:
        """``engine.save_checkpoint`` (each rank writes its ZeRO partition, the fp32 master weights
        included, so ``model_state`` asks nothing more) plus ``scheduler.pt``; always synchronous."""
        self.module.save_checkpoint(str(directory / DEEPSPEED_DIR), tag=DEEPSPEED_TAG, save_latest=False)
        self._save_scheduler(directory)
        return None

    def has_model_state(self, directory: Path) -> bool:
        """False: resume loads the HF-layout weights first, then DeepSpeed's folder overwrites the module
        and its fp32 master partitions (``load_training_state``), so resume is exact whatever the export."""
        return False

    def load_training_state(self, directory: Path) -> None:
        """``engine.load_checkpoint`` of the ZeRO partitions (module + optimizer) plus the scheduler."""
        path = _require_file(directory / DEEPSPEED_DIR / DEEPSPEED_TAG)
        loaded, _ = self.module.load_checkpoint(
            str(path.parent), tag=DEEPSPEED_TAG, load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if loaded is None:
            raise RuntimeError(f"rank {self.env.rank}: DeepSpeed could not load its state from {path}")
        self._load_scheduler(directory)

    def describe(self) -> str:
        """E.g. ``deepspeed ZeRO-2 world=2 device=cpu``."""
        precision = ", bf16" if self.precision == "bf16" else ""
        optimizer = type(getattr(self.module.optimizer, "optimizer", self.module.optimizer)).__name__
        return f"deepspeed ZeRO-{self.zero_stage} {self._where()}{precision}, {optimizer}"

    def _verify_wrapper(self) -> None:
        from deepspeed import DeepSpeedEngine as DSEngine

        if not isinstance(self.module, DSEngine):
            raise RuntimeError(
                f"rank {self.env.rank}: deepspeed configured but the model is {type(self.module).__name__}"
            )
        stage = self.module.zero_optimization_stage()
        if stage != self.zero_stage:
            raise RuntimeError(f"rank {self.env.rank}: DeepSpeed runs ZeRO stage {stage}, configured {self.zero_stage}")
        if self.module.dp_world_size != self.env.world_size:
            raise RuntimeError(
                f"rank {self.env.rank}: DeepSpeed data-parallel size {self.module.dp_world_size} != "
                f"world_size {self.env.world_size}"
            )


# ====================================================================== builder
def build_engine(model: PreTrainedModel, args: TrainingArgs, env: DistributedEnv, total_steps: int,
                 weights_from_rank0: bool = False) -> TrainingEngine:
    """Move ``model`` to ``env.device``, wrap it for ``args.distributed_backend``, and create AdamW (no decay
    on biases and norm weights) and the ``args.lr_scheduler`` schedule over ``total_steps`` steps.

    ``weights_from_rank0`` (FSDP2 only, every rank passes the same value): rank 0's ``model`` holds the
    weights, the other ranks' ``model`` is a meta-device skeleton of it (``modeling.load.build_skeleton``);
    after ``fully_shard`` rank 0 broadcasts every shard and buffer (``_fill_from_rank0``)."""
    decay_names = decay_parameter_names(model)
    backend = args.distributed_backend
    if args.compile:
        compile_decoder_layers(model)
    if env.world_size == 1:
        cast(nn.Module, model).to(env.device)
        optimizer = build_optimizer(model, args, decay_names)
        return LocalEngine(model, model, optimizer, build_scheduler(optimizer, args, total_steps), args, env)
    if backend == "ddp":
        return _build_ddp(model, args, env, total_steps, decay_names)
    if backend == "fsdp":
        return _build_fsdp(model, args, env, total_steps, decay_names, weights_from_rank0)
    if weights_from_rank0:
        raise ValueError(f"weights_from_rank0: only FSDP2 fills a skeleton from rank 0, not {backend}")
    return _build_deepspeed(model, args, env, total_steps, decay_names)


def _build_ddp(model: PreTrainedModel, args: TrainingArgs, env: DistributedEnv, total_steps: int,
               decay_names: set[str]) -> DDPEngine:
    cast(nn.Module, model).to(env.device)
    wrapped = DistributedDataParallel(
        model,
        device_ids=[env.device.index] if env.device.type == "cuda" else None,
        find_unused_parameters=False,
        gradient_as_bucket_view=True,
        # DDP broadcasts the buffers from rank 0 at construction; re-broadcasting them before every
        # forward (the default) is one more collective per micro-batch for nothing here: a causal LM's
        # buffers (rotary frequencies, masks) are constants, never updated by training.
        broadcast_buffers=False,
    )
    optimizer = build_optimizer(model, args, decay_names)
    return DDPEngine(wrapped, model, optimizer, build_scheduler(optimizer, args, total_steps), args, env)


def _sharding_units(model: nn.Module) -> list[nn.Module]:
    """The decoder layers: modules whose class is named in the model's ``_no_split_modules``."""
    names = set(cast(list[str], model._no_split_modules or []))
    return [m for m in model.modules() if type(m).__name__ in names and m is not model]


def compile_decoder_layers(model: nn.Module, **compile_kwargs: Any) -> int:
    """``torch.compile`` each decoder layer in place (``nn.Module.compile``), before any wrapping (as
    torchtitan orders it: compile, then ``fully_shard``); returns how many were compiled."""
    layers = _sharding_units(model)
    for layer in layers:
        layer.compile(**compile_kwargs)
    return len(layers)


def _model_method(model: nn.Module, name: str) -> Any:
    method = getattr(model, name, None)
    return method() if callable(method) else None


_FINAL_NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "ln_f")


def fsdp_unit_groups(model: nn.Module) -> list[tuple[str, list[nn.Module]]]:
    """The modules FSDP2 shards as their own units, in forward order, before the root:

    the input embeddings, each decoder layer, and the final norm together with the output layer (they
    run back to back, so one all-gather serves both).  Tied input/output embeddings share a weight,
    which must stay in one unit: then both stay with the root.
    """
    decoder_layers = _sharding_units(model)
    embed = _model_method(model, "get_input_embeddings")
    head = _model_method(model, "get_output_embeddings")
    tied = embed is not None and head is not None and head.weight is embed.weight
    groups: list[tuple[str, list[nn.Module]]] = []
    if isinstance(embed, nn.Module) and not tied and any(True for _ in embed.parameters()):
        groups.append(("embeddings", [embed]))
    groups += [(f"decoder layer {i}", [layer]) for i, layer in enumerate(decoder_layers)]
    if isinstance(head, nn.Module) and not tied:
        base = getattr(model, getattr(model, "base_model_prefix", ""), None)
        norm = next((getattr(base, n) for n in _FINAL_NORM_NAMES if isinstance(getattr(base, n, None), nn.Module)),
                    None)
        groups.append(("norm + output layer" if norm is not None else "output layer",
                       [norm, head] if norm is not None else [head]))
    return groups


def _build_fsdp(model: PreTrainedModel, args: TrainingArgs, env: DistributedEnv, total_steps: int,
                decay_names: set[str], weights_from_rank0: bool = False) -> FSDP2Engine:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # An explicit mesh: fully_shard's default is a CUDA mesh whenever CUDA exists, even for device='cpu'.
    # The model stays where it was loaded; fully_shard moves each unit to the mesh device as it shards it,
    # so no rank ever holds the whole model on the GPU.
    mesh = init_device_mesh(env.device.type, (env.world_size,))
    packed = packed_quantized_weights(model)
    # A parameter cast would corrupt 4-bit weights packed in a float storage: a quantised model autocasts.
    use_mp_policy = (args.mixed_precision_for(env.device.type) == "bf16" and env.device.type == "cuda"
                     and not packed)
    kwargs: dict[str, Any] = {"mesh": mesh}
    if any(not p.is_floating_point() for p in packed):  # uint8-packed (no bnb_4bit_quant_storage): kept whole
        kwargs["ignored_params"] = {p for p in packed if not p.is_floating_point()}
    if use_mp_policy:
        # bf16 compute, fp32 gradient reduce-scatter (and fp32 sharded gradients for the optimizer)
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    full_state = _rank0_full_state(model, env) if weights_from_rank0 else None
    groups = fsdp_unit_groups(model)
    for i, (_, modules) in enumerate(groups):
        # The last unit's backward follows its forward at once: keep its parameters gathered.
        reshard = args.fsdp_reshard_after_forward and i < len(groups) - 1
        fully_shard(modules if len(modules) > 1 else modules[0], reshard_after_forward=reshard, **kwargs)
    fully_shard(model, reshard_after_forward=args.fsdp_reshard_after_forward, **kwargs)
    if weights_from_rank0:
        _fill_from_rank0(model, full_state, env)
    # fully_shard replaced the parameters by DTensors: the optimizer must be built on the new ones.
    optimizer = build_optimizer(model, args, decay_names)
    return FSDP2Engine(model, model, optimizer, build_scheduler(optimizer, args, total_steps), args, env,
                       sharded_modules=len(groups) + 1, mixed_precision_policy=use_mp_policy,
                       weights_from_rank0=weights_from_rank0)


def packed_quantized_weights(model: nn.Module) -> list[nn.Parameter]:
    """bitsandbytes' packed 4-bit / 8-bit weights (a QLoRA base).  FSDP2 shards those stored in a float dtype
    (``bnb_4bit_quant_storage``, the FSDP-QLoRA recipe) like any frozen weight; bitsandbytes re-attaches each
    layer's quantisation state to the gathered weight in its forward.  Integer-stored ones (``uint8``, the
    default) cannot be sharded: they stay whole on every rank (``ignored_params``)."""
    return [p for p in model.parameters() if type(p).__name__ in ("Params4bit", "Int8Params")]


def _tensor_layout(model: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """Name, shape and dtype of every parameter and buffer (duplicates of tied weights included)."""
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    return [(name, tuple(t.shape), str(t.dtype)) for name, t in tensors]


def _rank0_full_state(model: nn.Module, env: DistributedEnv) -> dict[str, torch.Tensor] | None:
    """Before ``fully_shard``: rank 0's full state dict (references, no copy), None elsewhere, after
    checking that every rank's model (a skeleton off rank 0) has rank 0's tensors (collective)."""
    layout = _tensor_layout(model)
    expected = env.broadcast_object(layout)  # collective: rank 0's names, shapes and dtypes
    if layout != expected:
        differing = sorted(set(layout) ^ set(expected))[:5]
        raise RuntimeError(f"rank {env.rank}: the model built from the config differs from rank 0's loaded model "
                           f"(first differences: {differing}); set fsdp_load_on_rank0=False")
    if not env.is_world_process_zero:
        if not all(t.is_meta for t in model.parameters()):
            raise RuntimeError(f"rank {env.rank}: weights_from_rank0 expects a meta-device skeleton off rank 0")
        return None
    return model.state_dict()


def _fill_from_rank0(model: nn.Module, full_state: dict[str, torch.Tensor] | None, env: DistributedEnv) -> None:
    """After ``fully_shard``: allocate the skeleton ranks' shards and buffers on the device, then
    broadcast rank 0's weights into every rank's shards (``set_model_state_dict`` with
    ``broadcast_from_rank0``, one tensor at a time: no rank holds more than one full tensor it does not
    own) and every buffer, persistent or not (rotary ``inv_freq`` is not in the state dict).  Tied
    weights are one parameter and stay one."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if not env.is_world_process_zero:
        model.to_empty(device=env.device)
    set_model_state_dict(model, cast(dict[str, Any], full_state or {}),
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True))
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)  # collective: one per buffer (a handful: rotary frequencies)


DEEPSPEED_BUCKET_ELEMENTS = 200_000_000
"""Elements per ZeRO reduce / all-gather bucket (DeepSpeed's default is 5e8; 2e8 is what large-model
recipes use to bound the bucket memory, 2 x 400 MB in bf16)."""


def deepspeed_config(args: TrainingArgs, env: DistributedEnv) -> dict[str, Any]:
    """The explicit DeepSpeed config: one sample per micro-batch, the boundary set by the engine per step
    (so ``gradient_accumulation_steps`` is 1), clipping from ``max_grad_norm``, bf16 if configured;
    ZeRO with contiguous gradients and bounded buckets, and on CUDA communication overlapped with the
    backward (``overlap_comm``)."""
    zero: dict[str, Any] = {
        "stage": args.deepspeed_zero_stage,
        "contiguous_gradients": True,
        "reduce_bucket_size": DEEPSPEED_BUCKET_ELEMENTS,
        "allgather_bucket_size": DEEPSPEED_BUCKET_ELEMENTS,
        "overlap_comm": env.device.type == "cuda",
    }
    if args.deepspeed_zero_stage == 3:
        zero["stage3_prefetch_bucket_size"] = DEEPSPEED_BUCKET_ELEMENTS
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": env.world_size,
        "gradient_clipping": args.max_grad_norm or 0.0,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**62,
        "wall_clock_breakdown": False,
    }
    if args.mixed_precision_for(env.device.type) == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _import_deepspeed(env: DistributedEnv) -> Any:
    if env.device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError as exc:
        raise ImportError(
            "distributed_backend='deepspeed' needs DeepSpeed: pip install 'trainbridge[deepspeed]' "
            f"(import failed: {exc})"
        ) from exc
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator().device_name()
    if accelerator != env.device.type:
        raise RuntimeError(
            f"rank {env.rank}: DeepSpeed's accelerator is {accelerator!r} but the run uses {env.device.type!r}; "
            f"set DS_ACCELERATOR={env.device.type} before deepspeed is first imported"
        )
    return deepspeed


def _build_deepspeed(model: PreTrainedModel, args: TrainingArgs, env: DistributedEnv, total_steps: int,
                     decay_names: set[str]) -> DeepSpeedEngine:
    deepspeed = _import_deepspeed(env)
    # Joins the process group DistributedEnv already started (gloo on CPU, NCCL on CUDA).
    deepspeed.init_distributed(dist_backend=env.backend, auto_mpi_discovery=False)
    cast(nn.Module, model).to(env.device)
    optimizer = (_deepspeed_fused_adam(deepspeed, model, args, decay_names) if env.device.type == "cuda"
                 else build_optimizer(model, args, decay_names, allow_fused=False))
    # The scheduler drives the torch optimizer's param_groups, which the ZeRO optimizer steps with.
    scheduler = build_scheduler(optimizer, args, total_steps)
    ds_engine, ds_optimizer, _, _ = deepspeed.initialize(
        model=model, optimizer=optimizer, config=deepspeed_config(args, env), dist_init_required=False
    )
    return DeepSpeedEngine(ds_engine, model, ds_optimizer, scheduler, args, env, zero_stage=args.deepspeed_zero_stage)


def _deepspeed_fused_adam(deepspeed: Any, model: nn.Module, args: TrainingArgs, decay_names: set[str]) -> Any:
    """``deepspeed.ops.adam.FusedAdam`` in AdamW mode, with the same two parameter groups as
    ``build_optimizer`` (its CUDA multi-tensor kernel; what DeepSpeed's own configs pick on GPUs)."""
    from deepspeed.ops.adam import FusedAdam

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay_names], "weight_decay": args.weight_decay},
        {"params": [p for n, p in named if n not in decay_names], "weight_decay": 0.0},
    ]
    return FusedAdam([g for g in groups if g["params"]], lr=args.learning_rate,
                     betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon, adam_w_mode=True)
