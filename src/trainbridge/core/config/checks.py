"""The checks that read several settings together: ``check_fields(args)`` (the fields, run when
``TrainingArgs`` validates) and ``check_consistent(args, plan)`` (the fields with the run's code, at the run
boundary: ``run_training``, ``build_run``, ``trainbridge.Trainer.train()``, before anything launches).

Each raises ``ValueError`` with a message that starts with the field to change and says how.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainbridge.core.config.loss import Loss, TokenLoss, declared_loss
from trainbridge.core.config.model import build_peft_config, peft_adapter_base
from trainbridge.core.config.plan import RunPlan, eval_set_names, predictions_of

if TYPE_CHECKING:
    from trainbridge.core.config.training import TrainingArgs


def check_consistent(args: TrainingArgs, plan: RunPlan) -> None:
    """The fields with the run's code (``plan``): the model, the data, the evaluation and the step that must
    agree with it."""
    check_model_source(args, plan)
    check_stream(args, plan, declared_loss(args, plan))  # one loss seam
    predictions_of(args, plan)  # one predictions seam
    if args.distributed_backend == "deepspeed" and plan.optimizer_factory is not None:
        raise ValueError(
            "optimizer_factory: DeepSpeed builds and steps its own optimizer (ZeRO partitions it), so the "
            "script's optimizer (optimizers= / optimizer_cls_and_kwargs= / create_optimizer) cannot be used; "
            "drop it and set optim='adamw_torch', or use distributed_backend='ddp'"
        )
    if (
        args.eval_strategy != "no"
        and args.val_data_path is None
        and args.validation_split == 0
        and not args.eval_data_paths
        and plan.evaluation is None
        and not (plan.script_data is not None and (plan.script_data.eval is not None or plan.script_data.named_eval))
    ):
        raise ValueError(
            f"eval_strategy: {args.eval_strategy!r} needs validation data: set val_data_path, eval_data_paths or "
            "validation_split > 0 (or give the run an evaluation of its own), or set eval_strategy='no'"
        )
    names = eval_set_names(args, plan)
    if names and args.tracks_best_metric and args.best_metric_eval_set(names) is None:
        raise ValueError(
            f"metric_for_best_model: {args.metric_for_best_model!r} is not a metric of a named validation set; "
            f"with eval_data_paths every metric is eval_<name>_<metric>, e.g. "
            f"'eval_{names[0]}_loss' (sets: {', '.join(names)})"
        )
    if plan.data_collator is not None and args.packing == "padding_free":
        raise ValueError(
            "packing: 'padding_free' cannot be used with a data_collator (it needs padded "
            "micro-batches); leave packing='auto' or set data_collator=None"
        )


def check_fields(args: TrainingArgs) -> None:
    """The fields together: evaluation, best model, saving, batching and model settings that must agree."""
    check_model(args)
    check_optimizer(args)
    if args.val_data_path is not None and args.validation_split > 0:
        raise ValueError("give val_data_path or validation_split, not both")
    if args.eval_data_paths and (args.val_data_path is not None or args.validation_split > 0):
        raise ValueError(
            "eval_data_paths: give named validation sets or val_data_path/validation_split, "
            "not both (name the single set too: eval_data_paths={'main': ..., ...})"
        )
    if args.eval_strategy == "steps" and args.eval_steps is None:
        raise ValueError("eval_steps: required when eval_strategy='steps'")
    if args.save_strategy == "best" and args.eval_strategy == "no":
        raise ValueError("save_strategy: 'best' needs an eval_strategy other than 'no'")
    if args.load_best_model_at_end:
        if args.eval_strategy == "no":
            raise ValueError("load_best_model_at_end: needs an eval_strategy other than 'no'")
        if args.save_strategy not in ("best", args.eval_strategy):
            raise ValueError(
                "load_best_model_at_end: save_strategy must match eval_strategy "
                f"({args.save_strategy!r} != {args.eval_strategy!r}), as in transformers"
            )
        if args.save_strategy == "steps" and args.eval_steps and args.save_steps:
            if args.save_steps % args.eval_steps:
                raise ValueError("save_steps: must be a multiple of eval_steps with load_best_model_at_end")
    if args.nonfinite_policy == "skip" and args.distributed_backend == "deepspeed":
        raise ValueError(
            "nonfinite_policy: 'skip' cannot be used with distributed_backend='deepspeed' (it "
            "applies its update inside its own step); use 'error' or 'warn'"
        )
    if args.max_batch_len < args.max_seq_len and args.packing != "padded":
        raise ValueError(
            f"max_batch_len: {args.max_batch_len} is smaller than max_seq_len {args.max_seq_len}; "
            "a longest sample would not fit in one micro-batch"
        )


def check_stream(args: TrainingArgs, plan: RunPlan, loss: Loss | None) -> None:
    """``data_path`` or ``train_stream``; a stream has no length, so it needs ``max_steps``; it has no rows to
    split or plan; neither it nor a ``train_loader`` makes token-budget batches (``loss``: the declared one)."""
    if plan.train_loader is not None and isinstance(loss, TokenLoss):
        raise ValueError("training_step: a train_loader's batches train on 'model_loss'; leave it 'auto'")
    if plan.train_stream is None:
        if args.data_path is None and plan.train_loader is None and plan.script_data is None:
            raise ValueError(
                "data_path: the training data is required (a file or folder), or give a train_stream or a train_loader"
            )
        return
    if args.max_steps is None:
        raise ValueError(
            "max_steps: a streaming train_stream has no length, so the number of steps cannot be derived "
            "from num_epochs; set max_steps to a positive number (as Trainer requires)"
        )
    if args.validation_split > 0:
        raise ValueError("validation_split: a train_stream cannot be split; give val_data_path instead")
    if isinstance(loss, TokenLoss):
        raise ValueError("training_step: a train_stream trains on 'model_loss' batches; leave it 'auto'")


OPTIMIZER_PACKAGES = {
    "adamw_torch_xla": "torch_xla",
    "adamw_torch_npu": "torch_npu",
    "adamw_anyprecision": "torchdistx",
    "adamw_torch_4bit": "torchao",
    "adamw_torch_8bit": "torchao",
    "adamw_8bit": "bitsandbytes",
    "adamw_bnb_8bit": "bitsandbytes",
    "ademamix": "bitsandbytes",
    "paged_": "bitsandbytes",
    "lion_": "bitsandbytes",
    "rmsprop_bnb": "bitsandbytes",
    "galore_": "galore_torch",
    "apollo_": "apollo_torch",
    "lomo": "lomo_optim",
    "adalomo": "lomo_optim",
    "grokadamw": "grokadamw",
    "stable_adamw": "optimi",
    "schedule_free_": "schedulefree",
}
"""The package an ``optim`` name needs (by name or prefix), as Trainer's ``get_optimizer_cls_and_kwargs``
imports it."""
INSTALL_NAMES = {
    "bitsandbytes": "'trainbridge[qlora]' (bitsandbytes)",
    "optimi": "torch-optimi",
    "lomo_optim": "lomo-optim",
}
"""What to ``pip install`` for a package whose import name is not its distribution's."""


def check_optimizer(args: TrainingArgs) -> None:
    """``optim``: its package installed; DeepSpeed keeps its own AdamW; a metric-driven schedule needs an
    evaluation; fp16's loss scaler skips overflowed steps, so the run must go on past them."""
    if args.mixed_precision == "fp16" and args.nonfinite_policy != "warn":
        raise ValueError(
            f"nonfinite_policy: {args.nonfinite_policy!r} with mixed_precision='fp16': fp16's gradient scaler skips "
            "the steps whose scaled gradients overflow (their norm is infinite) and lowers its scale; set "
            "nonfinite_policy='warn', as Trainer goes on"
        )
    check_optimizer_engine(args)
    import importlib.util

    package = next((p for key, p in OPTIMIZER_PACKAGES.items() if args.optim.startswith(key)), None)
    if package is not None and importlib.util.find_spec(package) is None:
        extra = INSTALL_NAMES.get(package, package.replace("_", "-"))
        raise ValueError(f"optim={args.optim!r}: needs the {package} package; pip install {extra}")
    if args.lr_scheduler in ("reduce_lr_on_plateau", "greedy") and args.eval_strategy == "no":
        raise ValueError(
            f"lr_scheduler={args.lr_scheduler!r}: it steps on the evaluation metric (metric_for_best_model), "
            "so it needs an evaluation; set eval_strategy='steps' or 'epoch', as Trainer requires"
        )
    names_optimizer = bool(args.deepspeed_config and "optimizer" in args.deepspeed_config)  # the JSON's: DeepSpeed's
    deepspeed = args.distributed_backend == "deepspeed" and not names_optimizer
    if deepspeed and args.optim not in ("adamw_torch", "adamw_torch_fused"):
        raise ValueError(
            f"optim={args.optim!r}: DeepSpeed steps its own AdamW (FusedAdam on CUDA); use "
            "optim='adamw_torch' with distributed_backend='deepspeed', or ddp/fsdp for this optimizer"
        )


def is_layerwise(optim: str) -> bool:
    """Whether ``optim`` is one of Trainer's layer-wise optimizers (``*_layerwise``): each parameter is stepped
    by its own optimizer in a hook when its gradient is accumulated, during ``backward``."""
    return optim.endswith("layerwise")


def check_optimizer_engine(args: TrainingArgs) -> None:
    """``optim`` with the engine: the combinations that cannot work, refused before launch as Trainer refuses
    them (layer-wise optimizers and gradient accumulation) or as they would fail inside the workers."""
    optim, backend = args.optim, args.distributed_backend
    if backend == "deepspeed" and args.deepspeed_config and "optimizer" in args.deepspeed_config:
        return  # the JSON's optimizer, built and stepped by DeepSpeed: ``optim`` is not used
    if is_layerwise(optim) and backend != "ddp":
        raise ValueError(
            f"optim={optim!r}: a layer-wise optimizer steps each whole parameter in a hook during backward, which "
            f"distributed_backend={backend!r} shards or owns; use distributed_backend='ddp' on one process, or "
            f"optim={optim.removesuffix('_layerwise')!r}"
        )
    if optim.startswith(("galore_", "apollo_")) and backend == "fsdp":
        raise ValueError(
            f"optim={optim!r}: GaLore / APOLLO project each target module's whole gradient matrix "
            "(optim_target_modules), which FSDP2 shards across ranks; use distributed_backend='ddp', or "
            "optim='adamw_torch' with fsdp"
        )
    if updates_in_backward(optim) and args.mixed_precision == "fp16":
        raise ValueError(
            f"optim={optim!r}: it updates on each gradient during backward, before fp16's gradient scaler could "
            "unscale it or skip an overflowed step; use mixed_precision='bf16' or 'no', or optim="
            f"{optim.removesuffix('_layerwise') if is_layerwise(optim) else 'adafactor'!r}"
        )
    if optim == "galore_adafactor_layerwise":
        raise ValueError(
            f"optim={optim!r}: transformers builds each layer's GaLoreAdafactor with a learning rate and "
            "relative_step=True, which galore_torch refuses (transformers.Trainer fails the same way); use "
            "optim='galore_adafactor' or 'galore_adamw_layerwise'"
        )
    if optim in CUDA_ONLY and not _cuda_run(args):
        why, instead = CUDA_ONLY[optim]
        raise ValueError(f"optim={optim!r}: {why}, so it needs a CUDA device; use optim={instead!r} on CPU")


CUDA_ONLY = {
    "galore_adamw_8bit": ("galore_torch's 8-bit GaLore synchronises CUDA in every step", "galore_adamw"),
    "galore_adamw_8bit_layerwise": (
        "galore_torch's 8-bit GaLore synchronises CUDA in every step",
        "galore_adamw_layerwise",
    ),
    "adalomo": ("lomo_optim's AdaLomo allocates its state with .cuda()", "lomo"),
}
"""The ``optim`` values whose package runs only on CUDA (Trainer fails on CPU too): why, and what to use instead."""


def _cuda_run(args: TrainingArgs) -> bool:
    """Whether the run trains on CUDA (``device``, ``auto`` resolved as the workers resolve it)."""
    if args.device != "auto":
        return args.device == "cuda"
    import torch

    return torch.cuda.is_available()


def updates_in_backward(optim: str) -> bool:
    """Whether ``optim`` updates the parameters during ``backward``: a layer-wise optimizer (in each parameter's
    gradient hook) or LOMO / AdaLomo (in their fused backward, ``parallel.backward_updates``)."""
    return is_layerwise(optim) or optim in ("lomo", "adalomo")


def check_world(args: TrainingArgs, world_size: int) -> None:
    """``optim`` with the number of processes: a layer-wise optimizer steps each parameter in its gradient
    hook during backward, before DDP has reduced the gradient over ranks and before a later micro-batch adds
    to it, so Trainer refuses it under DDP and with gradient accumulation; LOMO / AdaLomo update inside their
    fused backward, also before the reduction (on one process they update per micro-batch, as under
    Trainer).  Run at every run boundary that
    knows the world (``run_training``, ``Trainer.train()``, ``build_run``)."""
    optim = args.optim
    if optim in ("lomo", "adalomo") and world_size > 1:
        raise ValueError(
            f"optim={optim!r}: LOMO updates each parameter inside its fused backward, before its gradient is "
            f"reduced across ranks, so it cannot run on {world_size} processes; run one process "
            "(nproc_per_node=1), or use optim='adafactor' for a low-memory optimizer on several"
        )
    if not is_layerwise(optim):
        return
    if world_size > 1:
        raise ValueError(
            f"optim={optim!r}: layer-wise optimizers cannot run on {world_size} processes (they step each "
            "parameter before its gradient is reduced across ranks; Trainer refuses them under DDP too); "
            f"run one process (nproc_per_node=1), or use optim={optim.removesuffix('_layerwise')!r}"
        )
    per_rank, samples = args.per_device_batch_size, args.effective_batch_size
    fits = samples <= per_rank if per_rank else samples * args.max_seq_len <= args.max_batch_len
    if not fits:
        what = (
            f"effective_batch_size={samples} > per_device_batch_size={per_rank}"
            if per_rank
            else f"effective_batch_size={samples} x max_seq_len={args.max_seq_len} > max_batch_len={args.max_batch_len}"
        )
        raise ValueError(
            f"optim={optim!r}: a layer-wise optimizer steps during each backward, so it cannot accumulate "
            f"gradients over micro-batches ({what}), as Trainer refuses gradient_accumulation_steps > 1 with "
            "it; use one micro-batch per optimizer step (raise max_batch_len / per_device_batch_size or lower "
            "effective_batch_size)"
        )


def check_model_source(args: TrainingArgs, plan: RunPlan) -> None:
    """The model's source: ``model_path`` or the plan's ``model_init``, and what needs a loaded model."""
    if args.model_path is None and plan.model_init is None:
        raise ValueError(
            "model_path: None; required (a model or PEFT adapter folder) unless run_training(..., model_init=fn) "
            "builds the model"
        )
    if args.model_path is None and args.tokenizer_path is None and plan.script_data is None:
        raise ValueError("tokenizer_path: required when the model comes from model_init without model_path")
    if plan.model_init is not None:
        return
    adapter_base = peft_adapter_base(args.model_path) if args.model_path is not None else None
    if args.peft_config is not None and adapter_base is not None:
        raise ValueError(
            f"peft_config: model_path {str(args.model_path)!r} is already a PEFT adapter folder, which is "
            "trained as it is; give peft_config with a base model, or drop peft_config to continue the adapter"
        )
    is_peft = args.peft_config is not None or adapter_base is not None
    if args.merge_adapter_at_end and not is_peft:
        raise ValueError("merge_adapter_at_end: needs a PEFT model (peft_config or an adapter folder as model_path)")
    if args.model_kwargs.quantized() and not is_peft:
        raise ValueError(
            "model_kwargs.quantization_config: a quantized base model trains through an adapter "
            "(QLoRA); set peft_config (e.g. a peft.LoraConfig) or drop the quantization keywords"
        )


def check_model(args: TrainingArgs) -> None:
    """The model fields together: PEFT options that cannot combine, quantization."""
    config = args.peft_config
    if config is not None:
        task = config.get("task_type")
        if task is not None and str(getattr(task, "value", task)) != "CAUSAL_LM":
            raise ValueError(f"peft_config: task_type={task!r}; this loop trains causal LMs (use CAUSAL_LM or None)")
        if config.get("inference_mode"):
            raise ValueError(
                "peft_config: inference_mode=True freezes the adapter, so nothing would train; set inference_mode=False"
            )
        peft_object = build_peft_config(config)
        if peft_object.is_prompt_learning:
            raise ValueError(
                f"peft_config: {type(peft_object).__name__} is a prompt-learning method, not supported here: its "
                "virtual tokens shift the logits against the labels the loss is computed from, and its weights "
                "live outside the model's state dict; use an adapter method (LoRA, DoRA, IA3, ...)"
            )
    if args.gradient_checkpointing_kwargs != {"use_reentrant": False} and not args.gradient_checkpointing:
        raise ValueError("gradient_checkpointing_kwargs: given but gradient_checkpointing is False; set it True")
    if args.model_kwargs.quantized():
        import importlib.util

        if importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError(
                "model_kwargs.quantization_config: a quantized base model needs bitsandbytes; "
                "pip install 'trainbridge[qlora]'"
            )
        if args.distributed_backend == "deepspeed" and args.deepspeed_zero_stage == 3:
            raise ValueError(
                "model_kwargs.quantization_config: a bitsandbytes-quantized base cannot be "
                "partitioned by DeepSpeed ZeRO-3 here; use ddp, fsdp (with bnb_4bit_quant_storage) "
                "or ZeRO-1/2"
            )
