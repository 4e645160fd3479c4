"""``FSDP2Engine``: torch FSDP2 (``fully_shard``), each rank holding its shards of weights, gradients
and optimizer state.

``fsdp_unit_groups`` picks the units sharded on their own (embeddings, each decoder layer, the final
norm with the output layer) before the root.  FSDP2 reduce-scatters every micro-batch's gradients into
its sharded fp32 gradients by default (``fsdp_gradient_sync='every_micro_batch'``: no unsharded gradient
is ever kept; ``'last_micro_batch'`` accumulates unsharded and reduce-scatters once).  With
``fsdp_load_on_rank0`` only rank 0 reads the weights; the other ranks build a meta-device skeleton and
receive their shards from it after ``fully_shard`` (``_rank0_full_state``, ``_fill_from_rank0``).
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn

from trainbridge.parallel.engine import TrainingEngine
from trainbridge.parallel.optim import build_optimizer, build_scheduler

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from trainbridge.core.config import TrainingArgs
    from trainbridge.core.config.plan import OptimizerFactory
    from trainbridge.core.distributed import DistributedEnv


class FSDP2Engine(TrainingEngine):
    """torch FSDP2: ``fully_shard`` on each decoder layer, then on the root; parameters are DTensor shards."""

    kind = "fsdp"
    sharded_model = True
    sharded_optimizer = True

    def __init__(
        self,
        *args: Any,
        sharded_modules: int,
        mixed_precision_policy: bool,
        weights_from_rank0: bool = False,
        **kwargs: Any,
    ) -> None:
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

    def _grad_scaler(self) -> Any:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(self.env.device.type)

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
        set_model_state_dict(
            self.module, cast(dict[str, Any], state), options=StateDictOptions(full_state_dict=True, strict=strict)
        )

    def sharded_model_state_dict(self) -> dict[str, Any]:
        """This rank's DTensor shards of the model (``get_model_state_dict``)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return cast(dict[str, Any], get_model_state_dict(self.module))

    def load_sharded_model_state_dict(self, state: dict[str, Any]) -> None:
        """Each rank's shards back into the sharded model (``set_model_state_dict``)."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.module, state)

    def describe(self) -> str:
        """E.g. ``fsdp2 (fully_shard) world=2 device=cpu, 3 sharded modules``."""
        precision = ", bf16 MixedPrecisionPolicy (fp32 reduce)" if self.mixed_precision_policy else ""
        precision += ", CPU offload" if self.args.fsdp_cpu_offload else ""
        sync = "reduce-scatter every micro-batch" if self.sync_every_micro_batch else "reduce-scatter per step"
        return (
            f"fsdp2 (fully_shard) {self._where()}, {self.sharded_modules} sharded modules, {sync}, "
            f"reshard_after_forward={self.args.fsdp_reshard_after_forward}{precision}"
            f"{', weights read on rank 0 and broadcast' if self.weights_from_rank0 else ''}"
        )

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


def packed_quantized_weights(model: nn.Module) -> list[nn.Parameter]:
    """bitsandbytes' packed 4-bit / 8-bit weights (a QLoRA base).  FSDP2 shards those stored in a float dtype
    (``bnb_4bit_quant_storage``, the FSDP-QLoRA recipe) like any frozen weight; bitsandbytes re-attaches each
    layer's quantisation state to the gathered weight in its forward.  Integer-stored ones (``uint8``, the
    default) cannot be sharded: they stay whole on every rank (``ignored_params``)."""
    return [p for p in model.parameters() if type(p).__name__ in ("Params4bit", "Int8Params")]


def decoder_layers(model: nn.Module, classes: list[str] | None = None) -> list[nn.Module]:
    """The decoder layers: modules whose class is named in ``classes``, by default in the model's
    ``_no_split_modules``."""
    names = set(cast(list[str], model._no_split_modules or []) if classes is None else classes)
    return [m for m in model.modules() if type(m).__name__ in names and m is not model]


def _model_method(model: nn.Module, name: str) -> Any:
    method = getattr(model, name, None)
    return method() if callable(method) else None


_FINAL_NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "ln_f")


def fsdp_unit_groups(model: nn.Module, classes: list[str] | None = None) -> list[tuple[str, list[nn.Module]]]:
    """The modules FSDP2 shards as their own units, in forward order, before the root:

    the input embeddings, each decoder layer (a module of ``classes``, by default of ``_no_split_modules``),
    and the final norm together with the output layer (they run back to back, so one all-gather serves
    both).  Tied input/output embeddings share a weight, which must stay in one unit: then both stay with
    the root.
    """
    layers = decoder_layers(model, classes)
    if classes:
        missing = sorted(set(classes) - {type(m).__name__ for m in model.modules()})
        if missing:
            raise ValueError(
                f"fsdp_wrap_classes={classes!r}: {missing} are not classes of {type(model).__name__}'s modules; "
                "name its layer classes (Trainer's fsdp_config transformer_layer_cls_to_wrap) or leave it unset"
            )
    embed = _model_method(model, "get_input_embeddings")
    head = _model_method(model, "get_output_embeddings")
    tied = embed is not None and head is not None and head.weight is embed.weight
    groups: list[tuple[str, list[nn.Module]]] = []
    if isinstance(embed, nn.Module) and not tied and any(True for _ in embed.parameters()):
        groups.append(("embeddings", [embed]))
    groups += [(f"decoder layer {i}", [layer]) for i, layer in enumerate(layers)]
    if isinstance(head, nn.Module) and not tied:
        base = getattr(model, getattr(model, "base_model_prefix", ""), None)
        norm = next(
            (getattr(base, n) for n in _FINAL_NORM_NAMES if isinstance(getattr(base, n, None), nn.Module)), None
        )
        groups.append(
            (
                "norm + output layer" if norm is not None else "output layer",
                [norm, head] if norm is not None else [head],
            )
        )
    return groups


def build_fsdp(
    model: PreTrainedModel,
    args: TrainingArgs,
    env: DistributedEnv,
    total_steps: int,
    decay_names: set[str],
    weights_from_rank0: bool = False,
    factory: OptimizerFactory | None = None,
) -> FSDP2Engine:
    """``fully_shard`` on each of ``fsdp_unit_groups``, then on the root, over a mesh of every rank, then
    AdamW on the DTensor shards.  ``weights_from_rank0``: rank 0's ``model`` holds the weights, the other
    ranks' a meta-device skeleton; rank 0 broadcasts every shard and buffer after sharding."""
    from torch.distributed.fsdp import fully_shard

    kwargs, use_mp_policy = _shard_kwargs(model, args, env)
    full_state = _rank0_full_state(model, env) if weights_from_rank0 else None
    groups = fsdp_unit_groups(model, args.fsdp_wrap_classes)
    for i, (_, modules) in enumerate(groups):
        # The last unit's backward follows its forward at once: keep its parameters gathered.
        reshard = args.fsdp_reshard_after_forward and i < len(groups) - 1
        fully_shard(modules if len(modules) > 1 else modules[0], reshard_after_forward=reshard, **kwargs)
    fully_shard(model, reshard_after_forward=args.fsdp_reshard_after_forward, **kwargs)
    if weights_from_rank0:
        _fill_from_rank0(model, full_state, env)
    # fully_shard replaced the parameters by DTensors: the optimizer must be built on the new ones.
    # ShardedGradScaler's found_inf (shape [1], all-reduced) does not fit the fused AdamW kernel's scaler arguments;
    # offloaded shards are stepped on the CPU
    fused = args.mixed_precision_for(env.device.type) != "fp16" and not args.fsdp_cpu_offload
    optimizer = build_optimizer(model, args, decay_names, allow_fused=fused, total_steps=total_steps, factory=factory)
    return FSDP2Engine(
        model,
        model,
        optimizer,
        build_scheduler(optimizer, args, total_steps, factory),
        args,
        env,
        sharded_modules=len(groups) + 1,
        mixed_precision_policy=use_mp_policy,
        weights_from_rank0=weights_from_rank0,
    )


def _shard_kwargs(model: nn.Module, args: TrainingArgs, env: DistributedEnv) -> tuple[dict[str, Any], bool]:
    """``fully_shard``'s keyword arguments for ``model`` (mesh, ignored packed weights, bf16 policy, CPU
    offload) and whether they hold a mixed-precision policy."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    # An explicit mesh: fully_shard's default is a CUDA mesh whenever CUDA exists, even for device='cpu'.
    # The model stays where it was loaded; fully_shard moves each unit to the mesh device as it shards it,
    # so no rank ever holds the whole model on the GPU.
    mesh = init_device_mesh(env.device.type, (env.world_size,))
    packed = packed_quantized_weights(model)
    # A parameter cast would corrupt 4-bit weights packed in a float storage: a quantised model autocasts.
    precision = args.mixed_precision_for(env.device.type)
    use_mp_policy = precision in ("bf16", "fp16") and env.device.type == "cuda" and not packed
    kwargs: dict[str, Any] = {"mesh": mesh}
    if args.fsdp_cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=env.device.type == "cuda")
    if any(not p.is_floating_point() for p in packed):  # uint8-packed (no bnb_4bit_quant_storage): kept whole
        kwargs["ignored_params"] = {p for p in packed if not p.is_floating_point()}
    if use_mp_policy:
        # bf16 / fp16 compute, fp32 gradient reduce-scatter (and fp32 sharded gradients for the optimizer)
        dtype = torch.bfloat16 if precision == "bf16" else torch.float16
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    return kwargs, use_mp_policy


def shard_frozen(
    model: nn.Module, args: TrainingArgs, env: DistributedEnv, weights_from_rank0: bool = False
) -> nn.Module:
    """A model that only runs forwards (DPO's reference) sharded as ``build_fsdp`` shards the policy: the
    same unit groups, then the root, each rank keeping its DTensor shards, gathered for each forward
    (collective: every rank shards it, and runs every forward).  ``weights_from_rank0``: the other ranks
    hold a meta-device skeleton, filled from rank 0's weights after sharding, as the policy is."""
    from torch.distributed.fsdp import fully_shard

    kwargs, _ = _shard_kwargs(model, args, env)
    full_state = _rank0_full_state(model, env) if weights_from_rank0 else None
    for _, modules in fsdp_unit_groups(model, args.fsdp_wrap_classes):
        fully_shard(modules if len(modules) > 1 else modules[0], reshard_after_forward=True, **kwargs)
    fully_shard(model, reshard_after_forward=True, **kwargs)
    if weights_from_rank0:
        _fill_from_rank0(model, full_state, env)
    return model.eval().requires_grad_(False)


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
        raise RuntimeError(
            f"rank {env.rank}: the model built from the config differs from rank 0's loaded model "
            f"(first differences: {differing}); set fsdp_load_on_rank0=False"
        )
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
    set_model_state_dict(
        model,
        cast(dict[str, Any], full_state or {}),
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=True),
    )
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)  # collective: one per buffer (a handful: rotary frequencies)
