"""``build_engine``: the model wrapped for ``args.distributed_backend`` with its optimizer and schedule.

One process (``world_size == 1``) is always ``LocalEngine`` whatever the backend; otherwise DDP, FSDP2
or DeepSpeed (``ddp.py``, ``fsdp.py``, ``deepspeed.py``).  ``compile=True`` compiles each decoder layer
first, as torchtitan orders it (compile, then wrap).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from torch import nn

from trainbridge.parallel.backward_updates import FusedBackwardEngine, as_trainer_schedules, fuses_backward
from trainbridge.parallel.ddp import build_ddp
from trainbridge.parallel.deepspeed import build_deepspeed
from trainbridge.parallel.engine import LocalEngine, TrainingEngine
from trainbridge.parallel.fsdp import build_fsdp, decoder_layers
from trainbridge.parallel.optim import build_optimizer, build_scheduler, decay_parameter_names

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from trainbridge.core.config import TrainingArgs
    from trainbridge.core.config.plan import OptimizerFactory
    from trainbridge.core.distributed import DistributedEnv


def build_engine(
    model: PreTrainedModel,
    args: TrainingArgs,
    env: DistributedEnv,
    total_steps: int,
    weights_from_rank0: bool = False,
    optimizer_factory: OptimizerFactory | None = None,
) -> TrainingEngine:
    """Move ``model`` to ``env.device``, wrap it for ``args.distributed_backend``, and create AdamW (no decay
    on biases and norm weights) and the ``args.lr_scheduler`` schedule over ``total_steps`` steps.

    ``weights_from_rank0`` (FSDP2 only, every rank passes the same value): rank 0's ``model`` holds the
    weights, the other ranks' ``model`` is a meta-device skeleton of it (``modeling.load.build_skeleton``);
    after ``fully_shard`` rank 0 broadcasts every shard and buffer.  ``optimizer_factory``: the script's
    optimizer and schedule instead (``RunPlan.optimizer_factory``)."""
    decay_names = decay_parameter_names(model)
    backend = args.distributed_backend
    if args.compile:
        compile_decoder_layers(model, backend=args.compile_backend, mode=args.compile_mode)
    if env.world_size == 1:
        cast(nn.Module, model).to(env.device)
        factory = optimizer_factory
        # LOMO / AdaLomo and layer-wise optimizers update during backward, as under Trainer: one process only
        optimizer = as_trainer_schedules(
            build_optimizer(model, args, decay_names, total_steps=total_steps, factory=factory)
        )
        local = FusedBackwardEngine if fuses_backward(optimizer) else LocalEngine
        return local(model, model, optimizer, build_scheduler(optimizer, args, total_steps, factory), args, env)
    if backend == "ddp":
        return build_ddp(model, args, env, total_steps, decay_names, optimizer_factory)
    if backend == "fsdp":
        return build_fsdp(model, args, env, total_steps, decay_names, weights_from_rank0, optimizer_factory)
    if weights_from_rank0:
        raise ValueError(f"weights_from_rank0: only FSDP2 fills a skeleton from rank 0, not {backend}")
    return build_deepspeed(model, args, env, total_steps, decay_names, optimizer_factory)


def compile_decoder_layers(model: nn.Module, **compile_kwargs: Any) -> int:
    """``torch.compile`` each decoder layer in place (``nn.Module.compile``), before any wrapping (as
    torchtitan orders it: compile, then ``fully_shard``), or the whole model when it has no decoder layers
    (a classifier, a vision model: as Trainer compiles it); returns how many modules were compiled."""
    layers = decoder_layers(model) or [model]
    for layer in layers:
        layer.compile(**compile_kwargs)
    return len(layers)
