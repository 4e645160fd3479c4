"""``TrainingArgs``' fields, in groups of related settings; ``TrainingArgs`` inherits every group.

Each field has a docstring (``use_attribute_docstrings``: ``TrainingArgs.model_fields[name].description``)
and the validators that read it alone.  A new field goes next to its related fields here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError, field_validator

from trainbridge.core import config_errors
from trainbridge.core.config.imports import CallbackSpec
from trainbridge.core.config.model import ADAPTER_CONFIG_FILE, ModelKwargs, build_peft_config, peft_adapter_base
from trainbridge.core.config.names import DataColumn, OptimizerName, SchedulerName

_GROUP = ConfigDict(use_attribute_docstrings=True)
_NON_REENTRANT: dict[str, JsonValue] = {"use_reentrant": False}


class ModelFields(BaseModel):
    """The model: what to load or build, its keywords, a PEFT adapter, gradient checkpointing."""

    model_config = _GROUP

    model_path: Path | None = None
    """Local Hugging Face model directory (``config.json`` + weights), loaded with ``from_pretrained``; or a
    PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``), whose base model (its
    ``base_model_name_or_path``, a local folder) is loaded and the adapter applied, trainable, to continue
    training it.  Required unless ``model_init`` is given."""
    model_kwargs: ModelKwargs = Field(default_factory=lambda: ModelKwargs())
    """Keyword arguments for ``AutoModelForCausalLM.from_pretrained`` (``dtype``, ``attn_implementation``,
    ``trust_remote_code``, and any other ``from_pretrained`` keyword)."""
    peft_config: dict[str, JsonValue] | None = None
    """A ``peft.PeftConfig`` (e.g. ``peft.LoraConfig(r=8, target_modules=[...])``), or its dict form in
    YAML (``peft_type`` defaults to ``LORA``, ``task_type`` to ``CAUSAL_LM``).  The adapter is applied in
    every worker before DDP/FSDP2/DeepSpeed wrapping and before the optimizer is built: only adapter
    parameters train and hold optimizer state, and checkpoints hold the adapter in PEFT's layout.
    Needs ``pip install 'trainbridge[peft]'``."""
    merge_adapter_at_end: bool = False
    """With a PEFT model: when training ends, merge the final adapter (the best one under
    ``load_best_model_at_end``) into the base weights (``merge_and_unload``) and write the merged model in
    Hugging Face layout to ``ckpt_output_dir/merged`` (loadable with ``AutoModelForCausalLM``)."""
    requires_grad: dict[str, bool] | None = None
    """Every parameter of the model by name (``named_parameters()`` once loaded, with its PEFT adapter) and
    whether it trains.  The loaded model must have exactly these parameters (another set is an error naming
    the difference), and each one's ``requires_grad`` is set from here.  ``trainbridge.Trainer`` records it
    from the script's model, so layers a script froze stay frozen in the workers.  None: as loaded."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (``model.gradient_checkpointing_enable``), applied before
    wrapping (also under FSDP2); trades compute for activation memory."""
    gradient_checkpointing_kwargs: dict[str, JsonValue] = Field(default_factory=lambda: _NON_REENTRANT.copy())
    """Passed to ``gradient_checkpointing_enable``; non-reentrant checkpointing by default.  With
    ``use_reentrant=True`` and a frozen base (PEFT) the inputs are made to require grads, as Trainer does."""

    @field_validator("model_path")
    @classmethod
    def _model_dir_exists(cls, value: Path | None) -> Path | None:
        if value is None:
            return None
        if not value.is_dir():
            raise ValueError(f"model directory {str(value)!r} does not exist")
        if peft_adapter_base(value) is None and not (value / "config.json").is_file():
            raise ValueError(
                f"{str(value)!r} has no config.json (not a Hugging Face model directory) and no "
                f"{ADAPTER_CONFIG_FILE} (not a PEFT adapter folder)"
            )
        return value

    @field_validator("peft_config", mode="before")
    @classmethod
    def _peft_config_as_data(cls, value: Any) -> Any:
        if value is None:
            return None
        data = build_peft_config(value).to_dict()  # checked by peft, kept as data (rebuilt where it is applied)
        return {k: sorted(v) if isinstance(v, set) else getattr(v, "value", v) for k, v in data.items()}


class DataFields(BaseModel):
    """The data: tokenizer, files, columns, chat formatting, the cache, and the output folder."""

    model_config = _GROUP

    tokenizer_path: Path | None = None
    """Tokenizer directory; defaults to ``model_path``."""
    data_path: Path | None = None
    """Training data (required unless ``train_stream`` is given): a JSONL, JSON, parquet or Arrow file, or a
    ``Dataset.save_to_disk`` folder (read with ``datasets``, tokenised once into a memory-mapped cache).
    Rows hold pre-tokenized ``input_ids`` (optional ``labels`` with -100 masking, ``attention_mask``), chat
    ``messages`` (loss on the assistant turns), ``prompt``/``completion`` (loss on the completion) or
    ``text``."""
    val_data_path: Path | None = None
    """Validation data in the same formats; exclusive with ``validation_split``."""
    eval_data_paths: dict[str, Path] = Field(default_factory=dict)
    """Several named validation sets ``{name: path}`` (same formats), as ``transformers.Trainer`` with a dict
    ``eval_dataset``: each evaluation evaluates every set in turn, each with its own ``on_log``/``on_evaluate``
    and metrics prefixed ``eval_<name>_``; ``metric_for_best_model`` names one set's metric (``eval_<name>_loss``
    or ``<name>_loss``).  Exclusive with ``val_data_path`` and ``validation_split``."""
    data_columns: dict[DataColumn, str] = Field(default_factory=dict)
    """Read differently named columns: ``{ours: theirs}``, e.g. ``{messages: conversations}``; ours is one
    of input_ids, labels, attention_mask, messages, tools, prompt, completion, text."""
    chat_train_on: Literal["all", "last"] = "all"
    """Chat ``messages``: train on every assistant turn (``all``) or on the last one only (``last``)."""
    chat_system_prompt: str | None = None
    """Chat ``messages``: a system message added to conversations that have none."""
    chat_template: str | None = None
    """Chat ``messages``: a Jinja chat template (the string, or a path to a file) used instead of the
    tokenizer's; needed when the tokenizer has none."""
    data_num_proc: int | None = Field(default=None, gt=0)
    """Processes that tokenise the data on a cache miss (``datasets.map(num_proc=...)``); default
    ``min(8, cpu count)``, fewer for small files."""
    data_cache_dir: Path | None = None
    """Where tokenised data is cached (one folder per data file, tokenizer, template and options); default
    ``$TRAINBRIDGE_DATA_CACHE`` or ``~/.cache/trainbridge/data``.  Must be shared by the ranks of a node."""
    validation_split: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Fraction of ``data_path`` held out (deterministically, by ``seed``) for validation."""
    ckpt_output_dir: Path
    """Where checkpoints ``checkpoint-{global_step}/`` go, and the run's own files unless ``run_files_dir``."""
    run_files_dir: Path | None = None
    """Where the run's own files go (``metrics.jsonl``, ``result.json``, ``control/``, ``logs/``); None:
    ``ckpt_output_dir``.  A ported ``TrainingArguments`` (``trainbridge.Trainer``) sets
    ``output_dir/trainbridge``, leaving ``output_dir`` to what Trainer writes there."""
    share_run_dir_with_group: bool = False
    """Share the run folder with its group: a new ``ckpt_output_dir`` is created 0750 instead of 0700 (and
    checkpoints 0750 / files 0640 instead of 0700 / 0600), and a
    folder (or a parent) its group can write to is accepted: the group's members are trusted.  By default the
    run folder is private, and one that anyone but you (or root) could change is refused before launch (a
    folder writable by your own private group, as umask 002 makes them, is yours alone: accepted)."""

    @field_validator("data_path", "val_data_path")
    @classmethod
    def _data_file_exists(cls, value: Path | None) -> Path | None:
        if value is not None and not value.exists():
            raise ValueError(f"data file {str(value)!r} does not exist")
        return value

    @field_validator("eval_data_paths")
    @classmethod
    def _named_eval_files_exist(cls, value: dict[str, Path]) -> dict[str, Path]:
        for name, path in value.items():
            if not name:
                raise ValueError("a validation set needs a non-empty name (its metrics are eval_<name>_...)")
            if not path.exists():
                raise ValueError(f"validation set {name!r}: data file {str(path)!r} does not exist")
        return value


class BatchFields(BaseModel):
    """Batches and the loss: sequence and batch lengths, packing, the collator, the loss kernel."""

    model_config = _GROUP

    max_seq_len: int = Field(default=512, gt=0)
    """Longest sample in tokens; longer ones are handled by ``overlong_policy``."""
    overlong_policy: Literal["drop", "truncate", "error"] = "drop"
    """What to do with a sample longer than ``max_seq_len``: drop it (counted), truncate it, or fail."""
    max_batch_len: int = Field(default=4096, gt=0)
    """Token budget of one micro-batch on one rank (padded length x rows when padding)."""
    effective_batch_size: int = Field(default=8, gt=0)
    """Samples per optimizer step, all ranks together; reached by gradient accumulation."""
    packing: Literal["auto", "padding_free", "padded"] = "auto"
    """Micro-batch layout: ``padding_free`` concatenates samples with ``position_ids`` (models that
    support it, e.g. Llama with flash/sdpa-compatible packing); ``padded`` pads to the longest row;
    ``auto`` picks padding-free when the model supports it."""
    training_step: Literal["auto", "token_cross_entropy", "model_loss"] = "auto"
    """What a step trains on (``trainbridge.step``): ``token_cross_entropy``, padding-free token-budget
    batches and the summed token cross entropy (causal LMs only); ``model_loss``, Trainer's sample batches
    (``per_device_batch_size`` items formed by ``data_collator``, else ``DataCollatorWithPadding`` /
    ``default_data_collator`` as Trainer picks) and the loss the model's forward returns (any model with a
    task head: classification, masked LM, encoder-decoder, images).  ``auto``: ``token_cross_entropy`` for
    causal LMs, ``model_loss`` for every other model.  Under ``model_loss`` the data files are read as the
    dataset's items, unchanged (a ``text`` column without ``input_ids`` is tokenised, up to ``max_seq_len``).
    It names the run's loss seam (``RunPlan.loss``, ``core.config.loss``: ``TokenLoss`` / ``ForwardLoss``), which the
    run's code may give instead (``run_training(..., loss=...)``; a different one is refused)."""
    per_device_batch_size: int | None = Field(default=None, gt=0)
    """``model_loss``: items per micro-batch on one rank (Trainer's ``per_device_train_batch_size``); the
    micro-batches per step are ``effective_batch_size / (per_device_batch_size x world size)``.  None: one
    micro-batch per step, ``effective_batch_size / world size`` items."""
    train_sampling_strategy: Literal["random", "sequential", "group_by_length", "batch_rebalance"] = "random"
    """``model_loss``: the order of an epoch's items, Trainer's sampler's (``data.sample_order``): ``random``
    (seeded by ``data_seed``/``seed`` and the epoch), ``sequential``, ``group_by_length`` (transformers'
    length-grouped mega-batches) or ``batch_rebalance`` (transformers' ``BatchRebalanceSampler``: micro-batches
    of varying size, cost-balanced across ranks).  ``token_cross_entropy`` takes each step's samples in a
    random order, or in order under ``sequential``, and packs them by length itself (longest first, balanced
    across ranks, no padding to save): ``group_by_length`` and ``batch_rebalance`` add nothing there."""
    length_column_name: str = "length"
    """``group_by_length`` / ``batch_rebalance``: the dataset column holding each item's length, read when the
    dataset keeps it for the model (else the items' first model input is measured), as Trainer reads it."""
    per_device_eval_batch_size: int | None = Field(default=None, gt=0)
    """Validation items per batch on one rank (Trainer's ``per_device_eval_batch_size``): ``model_loss``
    (None: ``per_device_batch_size``); ``token_cross_entropy``: batches of that many samples in order, batch
    ``i`` on rank ``i % world size``, as Trainer's validation batches (trl's per-batch evaluation metrics
    follow them), and ``eval_loss`` is Trainer's: each batch's token mean, weighted by its samples; None:
    filled up to ``max_batch_len`` tokens, ``eval_loss`` the token mean of the whole set."""
    dataloader_num_workers: int = Field(default=0, ge=0)
    """``model_loss``: worker processes that fetch and collate the micro-batches ahead of the step (a
    ``torch.utils.data.DataLoader``'s, as Trainer's ``dataloader_num_workers``): for items decoded or transformed
    on access (images, audio).  0: in the training process."""
    dataloader_prefetch_factor: int | None = Field(default=None, gt=0)
    """Micro-batches each worker prepares ahead (``DataLoader``'s ``prefetch_factor``; None: torch's 2)."""
    dataloader_persistent_workers: bool = False
    """Keep the workers from one epoch to the next (``DataLoader``'s ``persistent_workers``)."""
    dataloader_multiprocessing_context: Literal["fork", "spawn", "forkserver"] | None = None
    """How the workers start (``DataLoader``'s ``multiprocessing_context``; None: the platform's default)."""
    dataloader_in_order: bool = True
    """With workers, yield the micro-batches in the plan's order; ``False``: as soon as a worker has one ready
    (``DataLoader``'s ``in_order``, as Trainer's ``dataloader_in_order``; the epoch holds the same batches)."""
    remove_unused_columns: bool = True
    """``model_loss``: drop the keys of each item that the model's forward does not take before the collator
    sees it, as Trainer does (``label``, ``label_ids`` and ``label_names`` are kept).  A ``trainbridge.Trainer``
    whose datasets would hand the model more than the token step gives trains on sample batches."""
    label_names: list[str] | None = None
    """``model_loss``: the batch keys that hold the labels (Trainer's ``label_names``); None: ``labels``, or
    ``start_positions``/``end_positions`` for question answering."""
    loss_implementation: Literal["auto", "standard", "chunked", "liger"] = "auto"
    """How the token cross entropy is computed (``data.loss``): ``standard`` from the model's full
    logits; ``chunked`` from the hidden states, ``loss_chunk_tokens`` at a time, never holding the
    full-vocabulary fp32 logits (same value and gradients); ``liger``: Liger-Kernel's fused linear cross
    entropy (CUDA, ``pip install 'trainbridge[liger]'``).  ``auto``: ``liger`` on CUDA when installed,
    else ``chunked`` on CUDA, ``standard`` on CPU.  Models that post-process logits keep ``standard``."""
    loss_chunk_tokens: int = Field(default=1024, gt=0)
    """Tokens per chunk of ``loss_implementation='chunked'`` (fp32 logits held: this x vocabulary)."""
    varlen_sdpa: bool = True
    """Padding-free batches of an ``sdpa`` model run one causal sdpa per sample
    (``data.varlen_attention``) instead of masking the whole packed row: the same results, attention
    cost of the samples' squared lengths instead of the row's.  Applied only where it is exact (checked
    at start-up by a probe); ``False`` keeps transformers' sdpa."""


class ScheduleFields(BaseModel):
    """How long and how fast: epochs or steps, learning rate and schedule, optimizer, seed."""

    model_config = _GROUP

    num_epochs: int = Field(default=1, gt=0)
    """Passes over the training data."""
    max_steps: int | None = Field(default=None, gt=0)
    """Optional cap on optimizer steps; training ends at this step even mid-epoch."""
    learning_rate: float = Field(default=2e-5, gt=0)
    """Peak learning rate."""
    lr_scheduler: SchedulerName = "constant_with_warmup"
    """Learning-rate schedule (``transformers.get_scheduler`` names; Trainer's ``lr_scheduler_type``)."""
    lr_scheduler_kwargs: dict[str, JsonValue] = Field(default_factory=dict)
    """Extra arguments of the schedule (transformers' ``scheduler_specific_kwargs``), e.g.
    ``{"min_lr_rate": 0.1}`` for ``cosine_with_min_lr`` or ``{"num_cycles": 0.5}`` for ``cosine``."""
    optim: OptimizerName = "adamw_torch"
    """The optimizer, by Trainer's ``optim`` names (``transformers.training_args.OptimizerNames``), built by
    Trainer's own ``get_optimizer_cls_and_kwargs``: ``adamw_torch`` (torch AdamW, fused kernel where every
    parameter allows it), ``sgd``, ``adagrad``, ``rmsprop``, ``adafactor``...; those of another package need
    it installed (bitsandbytes: ``pip install 'trainbridge[qlora]'``; ``schedulefree``, ``galore-torch``...).
    DeepSpeed keeps its own AdamW (``adamw_torch`` only).  Refused before launch, as they cannot work:
    layer-wise ``*_layerwise`` on more than one process, with FSDP2 or DeepSpeed, with fp16, or over more than
    one micro-batch per step; GaLore / APOLLO with FSDP2; LOMO / AdaLomo on more than one process or with fp16
    (they update in their fused backward, ``parallel.backward_updates``); ``galore_adafactor_layerwise``, which
    Trainer cannot build either; 8-bit GaLore and AdaLomo without CUDA (``core.config.checks``)."""
    optim_args: dict[str, JsonValue] = Field(default_factory=dict)
    """Trainer's ``optim_args`` as a dict, read as Trainer reads them for ``optim``, e.g.
    ``{"momentum": 0.9, "nesterov": True}`` for ``sgd``, ``{"alpha": 0.9}`` for ``rmsprop``."""
    optim_target_modules: list[str] | str | None = None
    """The modules GaLore / APOLLO optimizers project (Trainer's ``optim_target_modules``): names, a regex,
    or ``"all-linear"``."""
    warmup_steps: int = Field(default=0, ge=0)
    """Linear warm-up steps."""
    warmup_ratio: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Warm-up as a fraction of the run's optimizer steps (rounded up), used when ``warmup_steps`` is 0:
    Trainer's ``warmup_steps < 1``, resolved once the run's step count is known."""
    weight_decay: float = Field(default=0.0, ge=0.0)
    """AdamW weight decay."""
    adam_beta1: float = Field(default=0.9, gt=0.0, lt=1.0)
    """AdamW beta1."""
    adam_beta2: float = Field(default=0.95, gt=0.0, lt=1.0)
    """AdamW beta2."""
    adam_epsilon: float = Field(default=1e-8, gt=0.0)
    """AdamW epsilon."""
    max_grad_norm: float | None = Field(default=1.0, gt=0.0)
    """Gradient clipping norm; None disables clipping (the norm is still measured)."""
    nonfinite_policy: Literal["error", "skip", "warn"] = "error"
    """A step whose loss or gradient norm is NaN or infinite (seen in the step's agreement, no extra
    collective): ``error`` stops the run naming the step, saving nothing for it and rotating nothing out, so
    the last finite checkpoint survives; ``skip`` does not apply that step's update (reads the norm before
    the optimizer step: one host-device synchronisation per step; not with ``deepspeed``, which steps
    inside its engine) and leaves its loss out of the logged averages; ``warn`` only logs a warning."""
    seed: int = 42
    """Seed for model init side effects, data order and validation split."""
    data_seed: int | None = None
    """Seed of the training data order alone (Trainer's ``data_seed``); None: ``seed``."""
    full_determinism: bool = False
    """Deterministic algorithms everywhere (``transformers.enable_full_determinism(seed)``: deterministic torch
    and cuDNN kernels, cuBLAS workspace), as Trainer's ``full_determinism``; slower."""


class ParallelismFields(BaseModel):
    """Where and how it runs: the engine (DDP, FSDP2, DeepSpeed), device, precision, compile."""

    model_config = _GROUP

    distributed_backend: Literal["ddp", "fsdp", "deepspeed"] = "ddp"
    """``ddp`` (torch DDP), ``fsdp`` (torch FSDP2 ``fully_shard``), or ``deepspeed`` (ZeRO, optional extra)."""
    deepspeed_zero_stage: Literal[1, 2, 3] = 2
    """ZeRO stage when ``distributed_backend='deepspeed'``."""
    deepspeed_config: dict[str, JsonValue] | None = None
    """With ``distributed_backend='deepspeed'``: a DeepSpeed config (Trainer's ``deepspeed=`` JSON, ``"auto"``
    values filled by Trainer's integration).  Its ``zero_optimization`` (offload, buckets...) and precision are
    used, and its ``optimizer`` / ``scheduler`` when it names them (DeepSpeed builds and steps them); the batch
    keys are the loop's; ``"auto"`` left (model size, step count) is filled as Trainer fills it
    (``parallel.deepspeed``).  None: trainbridge's own config with ``deepspeed_zero_stage``."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto`` uses CUDA (NCCL) when available, else CPU (gloo)."""
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    """``bf16`` autocasts forward/backward (parameters and optimizer stay fp32; under FSDP2 a
    ``MixedPrecisionPolicy`` with bf16 compute and fp32 gradient reduction); with
    ``distributed_backend='deepspeed'`` it enables DeepSpeed's bf16 mode instead (bf16 weights, fp32
    master weights in the optimizer).  ``fp16`` (Trainer's ``fp16=True``): float16 autocast with a
    ``torch.amp.GradScaler`` (FSDP2: an fp16 ``MixedPrecisionPolicy`` on CUDA and a ``ShardedGradScaler``;
    DeepSpeed: its own fp16 mode), the scaler's state checkpointed (``scaler.pt``); a step whose scaled
    gradients overflow is skipped, schedule included, as under Trainer (needs ``nonfinite_policy='warn'``).
    ``auto`` (default): ``bf16`` on a CUDA device that supports it, ``no`` elsewhere (CPU runs stay fp32)."""
    fsdp_gradient_sync: Literal["every_micro_batch", "last_micro_batch"] = "every_micro_batch"
    """FSDP2 with gradient accumulation: ``every_micro_batch`` reduce-scatters each micro-batch's
    gradients into the sharded fp32 gradients (memory: one shard of gradients, as torchtitan does);
    ``last_micro_batch`` accumulates unsharded gradients and reduce-scatters once per optimizer step
    (fewer collectives, but a full unsharded gradient per rank).  The result is the same."""
    fsdp_reshard_after_forward: bool = True
    """FSDP2: free each unit's gathered parameters after its forward (gathered again for backward; less
    memory, one more all-gather per unit).  ``False`` keeps them until backward (ZeRO-2-like).  The
    ``norm`` + output-layer unit never reshards after forward: its backward comes right after."""
    fsdp_wrap_classes: list[str] | None = None
    """FSDP2: the class names sharded as units of their own (Trainer's ``fsdp_config``
    ``transformer_layer_cls_to_wrap``); ``[]``: none but the embeddings and output layer (``auto_wrap_policy:
    NO_WRAP``).  None (default): the model's ``_no_split_modules``, its decoder layers."""
    fsdp_cpu_offload: bool = False
    """FSDP2: parameters, gradients and optimizer state live on the CPU between uses, copied to the device for
    each unit's forward and backward; the optimizer steps on the CPU (``CPUOffloadPolicy``; Trainer's
    ``fsdp='full_shard offload'`` / ``fsdp_config`` ``cpu_offload``).  Less device memory, slower steps."""
    fsdp_load_on_rank0: bool = True
    """FSDP2 with several ranks: only rank 0 reads the checkpoint; the other ranks build the model on the
    meta device (no memory, no disk read) and receive their shards from rank 0 after ``fully_shard``
    (``set_model_state_dict(..., broadcast_from_rank0=True)``, buffers broadcast too).  Models from
    ``model_init``, PEFT models (``peft_config`` or an adapter folder) and models loaded with extra
    ``model_kwargs`` (quantization, config overrides, ``revision``, ...) are loaded on every rank as
    before.  ``False``: every rank reads the full checkpoint."""
    compile: bool = False
    """``torch.compile`` each decoder layer, or the whole model when it has none (opt-in; after the first
    steps' compilation, faster on GPU).  Trainer's ``torch_compile``."""
    compile_backend: str = "inductor"
    """``torch.compile``'s backend (Trainer's ``torch_compile_backend``)."""
    compile_mode: str | None = None
    """``torch.compile``'s mode, e.g. ``"reduce-overhead"`` (Trainer's ``torch_compile_mode``)."""
    debug_underflow_overflow: bool = False
    """Watch every module's activations with transformers' ``DebugUnderflowOverflow`` and stop at the first
    inf/nan, printing the frames before it (Trainer's ``debug="underflow_overflow"``)."""
    torch_empty_cache_steps: int | None = Field(default=None, gt=0)
    """Empty the accelerator's memory cache (``torch.cuda.empty_cache()``...) after the forward of every
    micro-batch of each optimizer step whose number is a multiple of this, as Trainer's
    ``torch_empty_cache_steps``: lower peak memory, slower steps.  None: never."""
    average_tokens_across_devices: bool = True
    """``model_loss``: a model that takes ``num_items_in_batch`` gets the step's loss items of every rank
    and the loss is their mean (Trainer's default); False: each rank's own items, and the step's loss is the
    mean over ranks of each rank's mean, as Trainer's ``average_tokens_across_devices=False``."""
    collective_timeout_s: float = Field(default=600.0, gt=0)
    """Timeout of any collective; a rank that never arrives fails the job instead of hanging it."""
    ddp_find_unused_parameters: bool | None = False
    """DDP: search each step's autograd graph for parameters the loss did not use (one more small all-reduce
    per step), needed when some parameters take no part in a batch's loss (permutation LM, MoE, several
    heads).  ``None``: Trainer's rule, True unless gradient checkpointing is on (what a ported
    ``TrainingArguments`` leaves unset gets).  ``False`` (default) keeps the step lean for models whose
    every parameter trains each step."""
    ddp_bucket_cap_mb: int | None = Field(default=None, gt=0)
    """DDP gradient bucket size in MiB (Trainer's ``ddp_bucket_cap_mb``); None: torch's default (25)."""
    ddp_broadcast_buffers: bool | None = None
    """DDP: broadcast rank 0's buffers before every forward (torch's ``broadcast_buffers``).  None: only
    when the model has buffers training updates (batch-norm running statistics), as torch's default
    then gives; a causal LM's constant buffers (rotary frequencies) are broadcast once, at wrapping."""
    ddp_static_graph: bool | None = None
    """DDP ``static_graph`` (Trainer's ``ddp_static_graph``): the set of used parameters never changes."""


class EvaluationFields(BaseModel):
    """When to log and evaluate, and what ``compute_metrics`` sees."""

    model_config = _GROUP

    logging_strategy: Literal["no", "steps", "epoch"] = "steps"
    """When to log: every ``logging_steps``, at each epoch end, or never."""
    logging_steps: int = Field(default=10, gt=0)
    """Log every this many optimizer steps (``logging_strategy='steps'``)."""
    logging_first_step: bool = False
    """Also log after the first optimizer step."""
    eval_strategy: Literal["no", "steps", "epoch"] = "no"
    """When to compute validation loss; ``steps`` needs ``eval_steps``."""
    eval_steps: int | None = Field(default=None, gt=0)
    """Evaluate every this many optimizer steps (``eval_strategy='steps'``)."""
    eval_delay: float = Field(default=0.0, ge=0.0)
    """Steps (or epochs, with ``eval_strategy='epoch'``) to wait before the first evaluation."""
    eval_on_start: bool = False
    """Evaluate once before the first step (a sanity check of the validation path)."""
    include_for_metrics: list[Literal["inputs", "loss"]] = Field(default_factory=list)
    """Also give ``compute_metrics`` the ``inputs`` and/or per-sample ``loss``
    (``EvalPrediction.inputs``/``.losses``)."""
    predict_with_generate: bool = False
    """``model_loss``: the validation predictions are the token ids ``model.generate`` returns for each batch
    (its inputs without the labels), padded to the generation config's ``max_length`` with the pad token,
    labels padded the same way, as ``Seq2SeqTrainer.prediction_step`` gives them; the loss is still the
    forward's.  ``Seq2SeqTrainer`` sets it from ``Seq2SeqTrainingArguments.predict_with_generate``."""
    generation_kwargs: dict[str, JsonValue] = Field(default_factory=dict)
    """``predict_with_generate``: keyword arguments of ``model.generate`` (``max_length``, ``num_beams``:
    ``Seq2SeqTrainingArguments.generation_max_length`` / ``generation_num_beams``); the model's generation
    config gives the rest."""


class CheckpointFields(BaseModel):
    """Saving and resuming: when, how many, best-model tracking, interruption, outside control."""

    model_config = _GROUP

    save_strategy: Literal["no", "steps", "epoch", "best"] = "steps"
    """When to checkpoint: every ``save_steps``/``save_samples``, each epoch end, on a new best metric, or never."""
    save_steps: int | None = Field(default=None, gt=0)
    """Checkpoint every this many optimizer steps (``save_strategy='steps'``)."""
    save_samples: int | None = Field(default=None, gt=0)
    """Checkpoint each time this many more samples have been seen (instructlab style)."""
    checkpoint_at_epoch: bool = False
    """Also checkpoint at every epoch end, whatever ``save_strategy``."""
    save_final_checkpoint: bool = True
    """Checkpoint when training ends (also after an agreed early stop) unless that step was just saved."""
    save_total_limit: int | None = Field(default=None, gt=0)
    """Keep at most this many checkpoints (oldest removed first; the best one is kept)."""
    metric_for_best_model: str | None = None
    """Metric that defines the best checkpoint (``eval_loss`` by default when best tracking is on)."""
    greater_is_better: bool | None = None
    """Whether a larger ``metric_for_best_model`` is better (default: False for losses)."""
    load_best_model_at_end: bool = False
    """Load the best checkpoint's weights into the model when training ends."""
    resume_from_checkpoint: Literal["auto"] | Path | None = None
    """``auto`` resumes from the newest complete checkpoint in ``ckpt_output_dir`` that verifies against its
    manifest (a corrupt one is skipped with a warning naming it); a path resumes from it (it must verify)."""
    checkpoint_checksums: bool = True
    """Record every checkpoint file's SHA-256 in its ``manifest.json`` and check them at resume (hashing reads
    every byte, about 1 GB/s); ``False`` records and checks file sizes only (very large checkpoints)."""
    checkpoint_weights_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """dtype of the Hugging Face-layout model weights (``model.safetensors``) written into checkpoints and the
    merged export.  ``auto``: the dtype the model folder's ``config.json`` records (what the original
    checkpoint was: a Llama trained in fp32 from a bf16 checkpoint exports bf16, half the disk), else the
    parameters' dtype.  Resume stays exact whatever this is: when the export is of another dtype than the
    parameters, the parameters themselves are kept in the checkpoint's sharded state (``dcp/``) and resume
    reads them from there.  A PEFT adapter is written in its training dtype."""
    checkpoint_async: bool = False
    """Write intermediate checkpoints' sharded state (``dcp/``: the optimizer state -- under DDP / one
    process it then goes there instead of ``optimizer.pt`` -- and the model's shards or full-precision
    weights) in the background with ``torch.distributed.checkpoint.async_save`` while training goes on;
    the rest (HF-layout weights, tokenizer, loop state) is written at once.  The checkpoint is published
    (``COMPLETE``, renamed into place, rotation) and ``on_save`` fires at the first step end at which every
    rank's background write has finished, so ``on_save`` comes later than under Trainer.  The final
    checkpoint and saves at a stop or interrupt stay synchronous.  DeepSpeed writes its own folder
    synchronously."""
    resume_allow_mismatch: bool = False
    """Resume even from a checkpoint whose fingerprint (model architecture/config, base model folder,
    training data) differs from this run's; by default such a checkpoint is refused, naming the difference."""
    resume_allow_unverified: bool = False
    """Resume from (or load the best model of) a checkpoint that has no ``manifest.json``, or holds files its
    manifest does not list (or symbolic links): nothing then vouches that its files are the ones trainbridge
    wrote.  By default such a checkpoint is refused, naming what is wrong; allow it only for checkpoints you
    trust (DCP metadata and non-tensor entries are read without running code either way)."""
    ignore_data_skip: bool = False
    """On resume, start the resumed epoch's data from its beginning instead of skipping the batches the
    checkpoint's steps consumed, as Trainer's ``ignore_data_skip``: the step count, schedule and RNG are
    restored; the epoch trains on its first batches until the run's last step."""
    save_only_model: bool = False
    """Checkpoints hold the model (and ``trainer_state.json``, the loop's counters) but no optimizer, scheduler,
    scaler or RNG state, as Trainer's ``save_only_model``; resuming from one starts a fresh optimizer and
    scheduler at the saved step (warned), as Trainer does."""
    save_on_interrupt: bool = False
    """On SIGTERM (what schedulers send before killing a job), write a checkpoint at the next step
    boundary, agreed across ranks, then stop; ``resume_from_checkpoint='auto'`` then loses at most one step.
    A second SIGTERM, or ``save_on_interrupt_timeout_s`` without reaching a step boundary, stops at once."""
    save_on_interrupt_timeout_s: float = Field(default=25.0, gt=0)
    """How long ``save_on_interrupt`` may take to reach the next step boundary after SIGTERM before the worker
    gives up and stops without saving (torchrun kills workers 30 s after its own SIGTERM)."""
    external_control: bool = True
    """Obey ``trainbridge control RUN_DIR save|stop|evaluate|log`` from another shell: rank 0 checks the run
    folder's ``control/`` requests at every step end and they are agreed like any callback request."""


class ReportingFields(BaseModel):
    """Reports: integrations, token counting, the ``TrainingArguments`` callbacks see, metric files."""

    model_config = _GROUP

    report_to: list[str] = Field(default_factory=list)
    """Hugging Face reporting integrations, e.g. ``["tensorboard", "mlflow", "wandb"]``."""
    include_num_input_tokens_seen: Literal["no", "all", "non_padding"] = "no"
    """What ``TrainerState.num_input_tokens_seen`` counts for Hugging Face callbacks (and whether their logs
    carry it), as transformers' option of that name: ``no`` (not counted), ``all`` (every input position,
    padding included) or ``non_padding`` (real tokens); ``True``/``False`` mean ``all``/``no``.  The native
    counters (``TrainingContext.tokens_seen``, ``input_tokens_seen``) always count."""
    run_name: str | None = None
    """Run name shown by reporting integrations."""
    logging_dir: Path | None = None
    """TensorBoard log directory (default ``ckpt_output_dir/runs``)."""
    disable_tqdm: bool = False
    """Disable the rank-0 progress bar (a plain printer logs instead)."""
    metrics_file: Path | None = None
    """JSONL metrics file written by rank 0 (default ``ckpt_output_dir/metrics.jsonl``)."""

    @field_validator("include_num_input_tokens_seen", mode="before")
    @classmethod
    def _token_counting(cls, value: Any) -> Any:
        if isinstance(value, bool):  # as TrainingArguments: True -> "all", False -> "no"
            return "all" if value else "no"
        return value


class CallbackFields(BaseModel):
    """Callbacks and event functions, and how their errors and queues are handled."""

    model_config = _GROUP

    callbacks: list[CallbackSpec] = Field(default_factory=list)
    """Callbacks given as import specs (``CallbackSpec``/``{"class": ..., "kwargs": ...}``/``"pkg.mod:Class"``),
    built in every worker.  Callback objects and classes are code: ``run_training(..., callbacks=[...])``."""
    callback_error_policy: Literal["isolate", "fatal"] = "isolate"
    """``isolate``: a callback error after train begin is logged, counted and reported; ``fatal``: any
    callback error stops every rank cleanly and fails the run."""
    callback_max_consecutive_errors: int = Field(default=3, gt=0)
    """Under ``isolate``, a callback failing this many times in a row is switched off."""
    restore_callback_states: bool = True
    """Restore callback state (e.g. EarlyStopping patience) from the checkpoint on resume."""
    nonblocking_queue_size: int = Field(default=256, gt=0)
    """Bound of the queue feeding non-blocking observer callbacks."""
    nonblocking_drain_timeout_s: float = Field(default=30.0, ge=0)
    """How long train end waits for non-blocking observers to drain their queue."""

    @field_validator("callbacks", mode="before")
    @classmethod
    def _callback_specs(cls, value: Any) -> Any:
        if value is None:
            return []
        if not isinstance(value, list | tuple):
            value = [value]
        out, problems = [], []
        for i, item in enumerate(value):
            try:
                if isinstance(item, dict | str):
                    item = CallbackSpec.model_validate(item if isinstance(item, dict) else {"class": item})
            except ValidationError as exc:  # every bad callback, one line each, without pydantic's noise
                problems += [
                    f"callbacks[{i}].{line}" for line in config_errors.describe_validation_error(exc, CallbackSpec)
                ]
                continue
            if item is None or isinstance(item, int | float | bool):
                problems.append(f"callbacks[{i}]: {item!r} is not a callback object, class or spec")
            elif not isinstance(item, CallbackSpec):
                problems.append(
                    f"callbacks[{i}]: {item!r} is code, not a setting: pass it to "
                    "run_training(args, torchrun_args, callbacks=[...]); TrainingArgs.callbacks takes import "
                    "specs ('package.module:Class' or {'class': ..., 'kwargs': ...})"
                )
            out.append(item)
        if problems:
            raise ValueError("\n".join(problems))
        return out
