"""The typed configuration: ``TrainingArgs`` and ``TorchrunArgs``.

Validated once, in the parent process, and passed as objects everywhere else.  Every field has a
docstring (``use_attribute_docstrings``), so ``TrainingArgs.model_fields[name].description`` documents
it, and an invalid value raises a ``pydantic.ValidationError`` naming the field.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)

from trainbridge.core import config_errors
from trainbridge.core.events import Event, event_from_name
from trainbridge.core.instructlab_names import translate_instructlab_names
from trainbridge.core.run_dir import METRICS_FILE

DataColumn = Literal["input_ids", "labels", "attention_mask", "messages", "tools", "prompt", "completion", "text"]
"""The column names data rows are read from (``TrainingArgs.data_columns`` maps other names onto them)."""


class CallbackSpec(BaseModel):
    """A callback named by import path, as written in a YAML config.

    ``{"class": "package.module:ClassName", "kwargs": {...}}`` builds ``ClassName(**kwargs)`` in each
    worker.  The path is imported when the config is validated, so a typo fails before launch.
    """

    model_config = ConfigDict(extra="forbid", populate_by_name=True, use_attribute_docstrings=True)

    class_path: str = Field(alias="class")
    """``package.module:ClassName`` (or ``package.module.ClassName``) of the callback class."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments passed to the class constructor."""

    @field_validator("class_path")
    @classmethod
    def _importable(cls, value: str) -> str:
        resolve_import_path(value)
        return value

    @model_validator(mode="after")
    def _kwargs_fit(self) -> CallbackSpec:
        try:
            config_errors.check_constructor_kwargs(resolve_import_path(self.class_path), self.kwargs)
        except ValueError as exc:
            raise ValueError(f"kwargs: {exc}") from None
        return self

    def build(self) -> Any:
        """Import the class and instantiate it with ``kwargs``."""
        return resolve_import_path(self.class_path)(**self.kwargs)


class ModelKwargs(BaseModel):
    """Keyword arguments for ``from_pretrained`` (``TrainingArgs.model_kwargs``).

    The named fields are checked; any other ``from_pretrained`` keyword (``revision``,
    ``quantization_config``, ...) is passed through unchanged.
    """

    model_config = ConfigDict(extra="allow", use_attribute_docstrings=True)

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of the loaded model (``auto``: as saved).  The default, fp32, keeps optimizer
    arithmetic exact; use ``mixed_precision='bf16'`` for bf16 compute."""
    attn_implementation: str | None = None
    """Attention kernel (``eager``, ``sdpa``, ``flash_attention_2``, ...); None: transformers' default."""
    trust_remote_code: bool = False
    """Run model code shipped inside the model folder.  Off by default: turn on only for a model you trust."""

    @model_validator(mode="after")
    def _no_device_placement(self) -> ModelKwargs:
        extra = self.model_extra or {}
        for key in ("device_map", "torch_dtype"):
            if key in extra:
                fix = "the engine places the model on its rank's device" if key == "device_map" else "use dtype"
                raise ValueError(f"model_kwargs.{key}: not supported here ({fix})")
        return self

    def from_pretrained_kwargs(self) -> dict[str, Any]:
        """The keywords for ``from_pretrained``: set fields and every extra keyword (dtype as given)."""
        kwargs: dict[str, Any] = {"dtype": self.dtype, "trust_remote_code": self.trust_remote_code}
        if self.attn_implementation is not None:
            kwargs["attn_implementation"] = self.attn_implementation
        kwargs.update(self.model_extra or {})
        return kwargs

    def quantized(self) -> bool:
        """Whether the keywords ask for a quantized (bitsandbytes) base model."""
        extra = self.model_extra or {}
        return bool(extra.get("quantization_config") or extra.get("load_in_4bit") or extra.get("load_in_8bit"))


ADAPTER_CONFIG_FILE = "adapter_config.json"
"""A PEFT adapter folder's config file (the one place this name is written down)."""


def peft_adapter_base(path: Path) -> Path | None:
    """For a PEFT adapter folder, the local folder of its base model; None when ``path`` is no adapter folder.

    ``base_model_name_or_path`` in ``adapter_config.json`` is taken as given, or relative to the adapter
    folder.  ``ValueError`` (naming ``model_path``) when the base model is not a local model folder.
    """
    config_file = path / ADAPTER_CONFIG_FILE
    if not config_file.is_file():
        return None
    try:
        base = json.loads(config_file.read_text()).get("base_model_name_or_path")
    except (OSError, ValueError) as exc:
        raise ValueError(f"model_path: {str(config_file)!r} is not readable JSON: {exc}") from exc
    if not base:
        raise ValueError(
            f"model_path: adapter folder {str(path)!r} names no base model (base_model_name_or_path is empty in "
            f"{ADAPTER_CONFIG_FILE}); set it to the base model's folder"
        )
    for candidate in (Path(base), path / base):
        if (candidate / "config.json").is_file():
            return candidate
    raise ValueError(
        f"model_path: the base model of adapter folder {str(path)!r} is missing: base_model_name_or_path="
        f"{base!r} (from {ADAPTER_CONFIG_FILE}) is not a local model folder with a config.json; nothing is "
        "downloaded, so put the base model there or edit base_model_name_or_path to point at it"
    )


def build_peft_config(value: Any) -> Any:
    """A ``peft.PeftConfig`` from itself or its dict form (``peft_type`` defaults to ``LORA``)."""
    try:
        import peft
    except ImportError:
        raise ValueError(
            "peft_config: the peft package is not installed; pip install 'trainbridge[peft]' (or pip install peft)"
        ) from None
    if isinstance(value, peft.PeftConfig):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"peft_config: expected a peft.PeftConfig or a dict, got {type(value).__name__} {value!r}")
    data = dict(value)
    data.setdefault("peft_type", "LORA")
    data.setdefault("task_type", "CAUSAL_LM")
    try:
        return peft.get_peft_config(data)
    except Exception as exc:
        raise ValueError(f"peft_config: {data!r} is not a valid peft config: {type(exc).__name__}: {exc}") from None


def resolve_import_path(path: str) -> Any:
    """Resolve ``pkg.mod:Name`` or ``pkg.mod.Name`` to the object; ``ValueError`` says what failed."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{path!r} is not an import path of the form 'package.module:Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r}: {exc} (a module of your own must be on "
                         "sys.path: `trainbridge train` adds the config's folder and the working directory)"
                         ) from exc
    obj: Any = module
    owner = f"module {module_name!r}"
    for part in attr.split("."):
        try:
            obj, owner = getattr(obj, part), repr(part)
        except AttributeError:
            raise ValueError(config_errors.missing_attribute_message(obj, owner, part)) from None
    return obj


class TrainingArgs(BaseModel):
    """Everything one training run needs.  Loads from and dumps to YAML.

    Event functions can be given flat, one keyword per event: ``TrainingArgs(..., on_save=fn,
    on_evaluate=[fn1, fn2])``; they are collected into ``event_functions``.
    """

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=True,
    )

    # ----------------------------------------------------------------- model and data
    model_path: Path | None = None
    """Local Hugging Face model directory (``config.json`` + weights), loaded with ``from_pretrained``; or a
    PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``), whose base model (its
    ``base_model_name_or_path``, a local folder) is loaded and the adapter applied, trainable, to continue
    training it.  Required unless ``model_init`` is given."""
    model_init: Callable[..., Any] | None = None
    """A picklable function returning the model to train (as ``transformers.Trainer``'s ``model_init``;
    called with no argument, or with ``None`` for a one-argument ``model_init(trial)``), or its import path
    ``package.module:function`` in YAML.  Called in every worker instead of loading ``model_path``; it may
    return a ``peft.PeftModel``.  Needs ``tokenizer_path`` when ``model_path`` is not given."""
    model_kwargs: ModelKwargs = Field(default_factory=lambda: ModelKwargs())
    """Keyword arguments for ``AutoModelForCausalLM.from_pretrained`` (``dtype``, ``attn_implementation``,
    ``trust_remote_code``, and any other ``from_pretrained`` keyword)."""
    peft_config: Any = None
    """A ``peft.PeftConfig`` (e.g. ``peft.LoraConfig(r=8, target_modules=[...])``), or its dict form in
    YAML (``peft_type`` defaults to ``LORA``, ``task_type`` to ``CAUSAL_LM``).  The adapter is applied in
    every worker before DDP/FSDP2/DeepSpeed wrapping and before the optimizer is built: only adapter
    parameters train and hold optimizer state, and checkpoints hold the adapter in PEFT's layout.
    Needs ``pip install 'trainbridge[peft]'``."""
    merge_adapter_at_end: bool = False
    """With a PEFT model: when training ends, merge the final adapter (the best one under
    ``load_best_model_at_end``) into the base weights (``merge_and_unload``) and write the merged model in
    Hugging Face layout to ``ckpt_output_dir/merged`` (loadable with ``AutoModelForCausalLM``)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (``model.gradient_checkpointing_enable``), applied before
    wrapping (also under FSDP2); trades compute for activation memory."""
    gradient_checkpointing_kwargs: dict[str, Any] = Field(default_factory=lambda: {"use_reentrant": False})
    """Passed to ``gradient_checkpointing_enable``; non-reentrant checkpointing by default.  With
    ``use_reentrant=True`` and a frozen base (PEFT) the inputs are made to require grads, as Trainer does."""
    tokenizer_path: Path | None = None
    """Tokenizer directory; defaults to ``model_path``."""
    data_path: Path
    """Training data: a JSONL, JSON, parquet or Arrow file, or a ``Dataset.save_to_disk`` folder (read with
    ``datasets``, tokenised once into a memory-mapped cache).  Rows hold pre-tokenized ``input_ids``
    (optional ``labels`` with -100 masking, ``attention_mask``), chat ``messages`` (loss on the assistant
    turns), ``prompt``/``completion`` (loss on the completion) or ``text``."""
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
    """Where checkpoints ``checkpoint-{global_step}/``, ``metrics.jsonl`` and ``result.json`` go."""
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
    data_collator: Callable[..., Any] | None = None
    """A collate function called as written on each micro-batch (e.g. a ``transformers`` data collator):
    it gets a list of feature dicts (``input_ids``, ``attention_mask``, and ``labels`` when the data has
    its own) and returns the batch dict (``input_ids``, ``attention_mask``, ``labels``; missing labels
    become ``input_ids`` with padding at -100).  Setting it selects padded micro-batches (``packing``
    must not be ``padding_free``).  None: trainbridge's own collation."""
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

    # ----------------------------------------------------------------- schedule
    num_epochs: int = Field(default=1, gt=0)
    """Passes over the training data."""
    max_steps: int | None = Field(default=None, gt=0)
    """Optional cap on optimizer steps; training ends at this step even mid-epoch."""
    learning_rate: float = Field(default=2e-5, gt=0)
    """Peak learning rate."""
    lr_scheduler: Literal["constant", "constant_with_warmup", "linear", "cosine", "cosine_with_min_lr"] = (
        "constant_with_warmup"
    )
    """Learning-rate schedule (``transformers.get_scheduler`` names)."""
    lr_scheduler_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra arguments of the schedule (transformers' ``scheduler_specific_kwargs``), e.g.
    ``{"min_lr_rate": 0.1}`` for ``cosine_with_min_lr`` or ``{"num_cycles": 0.5}`` for ``cosine``."""
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
    seed: int = 42
    """Seed for model init side effects, data order and validation split."""

    # ----------------------------------------------------------------- parallelism
    distributed_backend: Literal["ddp", "fsdp", "deepspeed"] = "ddp"
    """``ddp`` (torch DDP), ``fsdp`` (torch FSDP2 ``fully_shard``), or ``deepspeed`` (ZeRO, optional extra)."""
    deepspeed_zero_stage: Literal[1, 2, 3] = 2
    """ZeRO stage when ``distributed_backend='deepspeed'``."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """``auto`` uses CUDA (NCCL) when available, else CPU (gloo)."""
    mixed_precision: Literal["auto", "no", "bf16"] = "auto"
    """``bf16`` autocasts forward/backward (parameters and optimizer stay fp32; under FSDP2 a
    ``MixedPrecisionPolicy`` with bf16 compute and fp32 gradient reduction); with
    ``distributed_backend='deepspeed'`` it enables DeepSpeed's bf16 mode instead (bf16 weights, fp32
    master weights in the optimizer).  ``auto`` (default): ``bf16`` on a CUDA device that supports it,
    ``no`` elsewhere (CPU runs stay fp32)."""
    fsdp_gradient_sync: Literal["every_micro_batch", "last_micro_batch"] = "every_micro_batch"
    """FSDP2 with gradient accumulation: ``every_micro_batch`` reduce-scatters each micro-batch's
    gradients into the sharded fp32 gradients (memory: one shard of gradients, as torchtitan does);
    ``last_micro_batch`` accumulates unsharded gradients and reduce-scatters once per optimizer step
    (fewer collectives, but a full unsharded gradient per rank).  The result is the same."""
    fsdp_reshard_after_forward: bool = True
    """FSDP2: free each unit's gathered parameters after its forward (gathered again for backward; less
    memory, one more all-gather per unit).  ``False`` keeps them until backward (ZeRO-2-like).  The
    ``norm`` + output-layer unit never reshards after forward: its backward comes right after."""
    fsdp_load_on_rank0: bool = True
    """FSDP2 with several ranks: only rank 0 reads the checkpoint; the other ranks build the model on the
    meta device (no memory, no disk read) and receive their shards from rank 0 after ``fully_shard``
    (``set_model_state_dict(..., broadcast_from_rank0=True)``, buffers broadcast too).  Models from
    ``model_init``, PEFT models (``peft_config`` or an adapter folder) and models loaded with extra
    ``model_kwargs`` (quantization, config overrides, ``revision``, ...) are loaded on every rank as
    before.  ``False``: every rank reads the full checkpoint."""
    compile: bool = False
    """``torch.compile`` each decoder layer (opt-in; after the first steps' compilation, faster on GPU)."""
    collective_timeout_s: float = Field(default=600.0, gt=0)
    """Timeout of any collective; a rank that never arrives fails the job instead of hanging it."""

    # ----------------------------------------------------------------- logging / eval / save
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
    compute_metrics: Callable[..., Any] | None = None
    """``fn(EvalPrediction) -> dict`` as in ``transformers.Trainer``: predictions and labels of the whole
    validation set (every rank's share gathered in dataset order, padding removed), results prefixed
    ``eval_`` and merged into the evaluation metrics (logs, ``metric_for_best_model``...)."""
    preprocess_logits_for_metrics: Callable[..., Any] | None = None
    """``fn(logits, labels) -> predictions`` applied to each validation batch on its rank before the
    predictions are kept (e.g. ``logits.argmax(-1)``), as in ``transformers.Trainer``."""
    include_for_metrics: list[Literal["inputs", "loss"]] = Field(default_factory=list)
    """Also give ``compute_metrics`` the ``inputs`` and/or per-sample ``loss``
    (``EvalPrediction.inputs``/``.losses``)."""
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
    report_to: list[str] = Field(default_factory=list)
    """Hugging Face reporting integrations, e.g. ``["tensorboard", "mlflow", "wandb"]``."""
    include_num_input_tokens_seen: Literal["no", "all", "non_padding"] = "no"
    """What ``TrainerState.num_input_tokens_seen`` counts for Hugging Face callbacks (and whether their logs
    carry it), as transformers' option of that name: ``no`` (not counted), ``all`` (every input position,
    padding included) or ``non_padding`` (real tokens); ``True``/``False`` mean ``all``/``no``.  The native
    counters (``TrainingContext.tokens_seen``, ``input_tokens_seen``) always count."""
    hf_args: Any = Field(default=None, exclude=True)
    """The ``transformers.TrainingArguments`` (or subclass instance: trl's ``SFTConfig``, ``DPOConfig``...)
    these settings were ported from; ``training_args_from_hf`` sets it.  Hugging Face callbacks then see an
    instance of its class with all its fields, only the fields this run owns replaced
    (``trainbridge.hf.arguments``).  Not written to YAML."""
    run_name: str | None = None
    """Run name shown by reporting integrations."""
    logging_dir: Path | None = None
    """TensorBoard log directory (default ``ckpt_output_dir/runs``)."""
    disable_tqdm: bool = False
    """Disable the rank-0 progress bar (a plain printer logs instead)."""
    metrics_file: Path | None = None
    """JSONL metrics file written by rank 0 (default ``ckpt_output_dir/metrics.jsonl``)."""

    # ----------------------------------------------------------------- callbacks
    callbacks: list[Any] = Field(default_factory=list)
    """Callback objects: ``trainbridge.Callback`` instances, ``transformers.TrainerCallback`` instances or
    classes, or ``CallbackSpec``/``{"class": ..., "kwargs": ...}`` import specs."""
    event_functions: dict[Event, list[Callable[..., Any]]] = Field(default_factory=dict)
    """Plain functions per event (filled from the flat ``on_<event>=fn`` keywords)."""
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

    @model_validator(mode="before")
    @classmethod
    def _collect_flat_event_functions(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = translate_instructlab_names(data)  # instructlab's names: translated, or an error naming ours
        functions: dict[Event, list[Any]] = {}
        for key, value in (data.pop("event_functions", None) or {}).items():
            functions.setdefault(event_from_name(str(getattr(key, "value", key))), []).extend(
                value if isinstance(value, list | tuple) else [value]
            )
        for key in [k for k in data if isinstance(k, str) and k.startswith("on_")]:
            value = data.pop(key)
            try:
                event = event_from_name(key)
            except ValueError as exc:
                raise ValueError(f"{key}: {exc}") from None
            functions.setdefault(event, []).extend(value if isinstance(value, list | tuple) else [value])
        for event, fns in functions.items():
            for fn in fns:
                if not callable(fn):
                    raise ValueError(f"{event.value}: expected a callable, got {type(fn).__name__} {fn!r}")
        data["event_functions"] = functions
        return data

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
                problems += [f"callbacks[{i}].{line}" for line in config_errors.describe_validation_error(
                    exc, CallbackSpec)]
                continue
            if item is None or isinstance(item, int | float | bool):
                problems.append(f"callbacks[{i}]: {item!r} is not a callback object, class or spec")
            out.append(item)
        if problems:
            raise ValueError("\n".join(problems))
        return out

    @field_validator("include_num_input_tokens_seen", mode="before")
    @classmethod
    def _token_counting(cls, value: Any) -> Any:
        if isinstance(value, bool):  # as TrainingArguments: True -> "all", False -> "no"
            return "all" if value else "no"
        return value

    @field_validator("hf_args")
    @classmethod
    def _hf_training_arguments(cls, value: Any) -> Any:
        if value is None:
            return None
        from transformers import TrainingArguments

        if not isinstance(value, TrainingArguments):
            raise ValueError(f"expected a transformers.TrainingArguments (or subclass) instance, got "
                             f"{type(value).__name__}; pass the object your script built, or leave it unset")
        return value

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

    @field_validator("model_init", mode="before")
    @classmethod
    def _model_init_callable(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = resolve_import_path(value)
        if value is not None and not callable(value):
            raise ValueError(f"expected a function returning the model, got {type(value).__name__} {value!r}")
        return value

    @field_validator("peft_config", mode="before")
    @classmethod
    def _peft_config(cls, value: Any) -> Any:
        return None if value is None else build_peft_config(value)

    @field_serializer("peft_config")
    def _peft_config_as_dict(self, value: Any) -> Any:
        if value is None:
            return None
        data = value.to_dict()
        return {k: sorted(v) if isinstance(v, set) else getattr(v, "value", v) for k, v in data.items()}

    @field_serializer("model_init")
    def _model_init_as_path(self, value: Any) -> Any:
        if value is None:
            return None
        module, name = getattr(value, "__module__", None), getattr(value, "__qualname__", "")
        return f"{module}:{name}" if module and module != "__main__" and "<" not in name else None

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

    @model_validator(mode="after")
    def _consistent(self) -> TrainingArgs:
        self._check_model_fields()
        if self.val_data_path is not None and self.validation_split > 0:
            raise ValueError("give val_data_path or validation_split, not both")
        if self.eval_data_paths and (self.val_data_path is not None or self.validation_split > 0):
            raise ValueError("eval_data_paths: give named validation sets or val_data_path/validation_split, "
                             "not both (name the single set too: eval_data_paths={'main': ..., ...})")
        if self.eval_strategy == "steps" and self.eval_steps is None:
            raise ValueError("eval_steps: required when eval_strategy='steps'")
        if (self.eval_strategy != "no" and self.val_data_path is None and self.validation_split == 0
                and not self.eval_data_paths):
            raise ValueError("eval_strategy: evaluation needs val_data_path, eval_data_paths or validation_split > 0")
        if self.eval_data_paths and self.tracks_best_metric and self.best_metric_eval_set is None:
            raise ValueError(
                f"metric_for_best_model: {self.metric_for_best_model!r} is not a metric of a named validation set; "
                f"with eval_data_paths every metric is eval_<name>_<metric>, e.g. "
                f"'eval_{next(iter(self.eval_data_paths))}_loss' (sets: {', '.join(self.eval_data_paths)})"
            )
        if self.save_strategy == "best" and self.eval_strategy == "no":
            raise ValueError("save_strategy: 'best' needs an eval_strategy other than 'no'")
        if self.load_best_model_at_end:
            if self.eval_strategy == "no":
                raise ValueError("load_best_model_at_end: needs an eval_strategy other than 'no'")
            if self.save_strategy not in ("best", self.eval_strategy):
                raise ValueError(
                    "load_best_model_at_end: save_strategy must match eval_strategy "
                    f"({self.save_strategy!r} != {self.eval_strategy!r}), as in transformers"
                )
            if self.save_strategy == "steps" and self.eval_steps and self.save_steps:
                if self.save_steps % self.eval_steps:
                    raise ValueError("save_steps: must be a multiple of eval_steps with load_best_model_at_end")
        if self.data_collator is not None and self.packing == "padding_free":
            raise ValueError("packing: 'padding_free' cannot be used with a data_collator (it needs padded "
                             "micro-batches); leave packing='auto' or set data_collator=None")
        if self.max_batch_len < self.max_seq_len and self.packing != "padded":
            raise ValueError(
                f"max_batch_len: {self.max_batch_len} is smaller than max_seq_len {self.max_seq_len}; "
                "a longest sample would not fit in one micro-batch"
            )
        return self

    def _check_model_fields(self) -> None:
        """The model fields together: what to load, PEFT options that cannot combine, quantization."""
        if self.model_path is None and self.model_init is None:
            raise ValueError("model_path: required (a model or PEFT adapter folder) unless model_init is given")
        if self.model_path is None and self.tokenizer_path is None:
            raise ValueError("tokenizer_path: required when the model comes from model_init without model_path")
        adapter_base = peft_adapter_base(self.model_path) if self.model_path is not None else None
        config = self.peft_config
        if config is not None:
            if adapter_base is not None and self.model_init is None:
                raise ValueError(
                    f"peft_config: model_path {str(self.model_path)!r} is already a PEFT adapter folder, which is "
                    "trained as it is; give peft_config with a base model, or drop peft_config to continue the adapter"
                )
            task = getattr(config, "task_type", None)
            if task is not None and str(getattr(task, "value", task)) != "CAUSAL_LM":
                raise ValueError(
                    f"peft_config: task_type={task!r}; this loop trains causal LMs (use CAUSAL_LM or None)"
                )
            if getattr(config, "inference_mode", False):
                raise ValueError("peft_config: inference_mode=True freezes the adapter, so nothing would train; "
                                 "set inference_mode=False")
            if getattr(config, "is_prompt_learning", False):
                raise ValueError(
                    f"peft_config: {type(config).__name__} is a prompt-learning method, not supported here: its "
                    "virtual tokens shift the logits against the labels the loss is computed from, and its weights "
                    "live outside the model's state dict; use an adapter method (LoRA, DoRA, IA3, ...)"
                )
        is_peft = config is not None or adapter_base is not None
        if self.merge_adapter_at_end and not is_peft and self.model_init is None:
            raise ValueError(
                "merge_adapter_at_end: needs a PEFT model (peft_config or an adapter folder as model_path)"
            )
        if self.gradient_checkpointing_kwargs != {"use_reentrant": False} and not self.gradient_checkpointing:
            raise ValueError("gradient_checkpointing_kwargs: given but gradient_checkpointing is False; set it True")
        if self.model_kwargs.quantized():
            import torch

            if self.device == "cpu" or not torch.cuda.is_available():
                raise ValueError(
                    "model_kwargs.quantization_config: a quantized (bitsandbytes, QLoRA) base model needs CUDA, and "
                    f"this run is on CPU (device={self.device!r}, CUDA available: {torch.cuda.is_available()}); "
                    "drop the quantization keywords or run on a GPU"
                )
            if self.distributed_backend == "fsdp" or (
                self.distributed_backend == "deepspeed" and self.deepspeed_zero_stage == 3
            ):
                raise ValueError(
                    "model_kwargs.quantization_config: a bitsandbytes-quantized base cannot be sharded by "
                    f"{self.distributed_backend}{'' if self.distributed_backend == 'fsdp' else ' ZeRO-3'} here; "
                    "use ddp or deepspeed ZeRO-1/2"
                )

    # ----------------------------------------------------------------- derived values
    @property
    def best_metric_name(self) -> str:
        """``metric_for_best_model`` with transformers' default (``eval_loss``) and ``eval_`` prefix."""
        name = self.metric_for_best_model or "loss"
        return name if name.startswith("eval_") else f"eval_{name}"

    @property
    def best_metric_eval_set(self) -> str | None:
        """With ``eval_data_paths``: the set whose evaluation reports ``best_metric_name`` (the longest name
        that prefixes it as ``eval_<name>_``), else None."""
        owners = [n for n in self.eval_data_paths if self.best_metric_name.startswith(f"eval_{n}_")]
        return max(owners, key=len) if owners else None

    @property
    def best_metric_greater_is_better(self) -> bool:
        """``greater_is_better`` with transformers' default (False for losses, True otherwise)."""
        if self.greater_is_better is not None:
            return self.greater_is_better
        return not self.best_metric_name.endswith("loss")

    @property
    def tracks_best_metric(self) -> bool:
        """Whether the best checkpoint is tracked (as transformers does it)."""
        return self.metric_for_best_model is not None or self.load_best_model_at_end or self.save_strategy == "best"

    def mixed_precision_for(self, device_type: str) -> Literal["no", "bf16"]:
        """``mixed_precision`` with ``auto`` resolved for a run on ``device_type`` (``cuda``/``cpu``)."""
        if self.mixed_precision != "auto":
            return self.mixed_precision
        if device_type != "cuda":
            return "no"
        import torch

        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"

    @property
    def resolved_metrics_file(self) -> Path:
        """Where rank 0 writes the JSONL metrics."""
        return self.metrics_file or self.ckpt_output_dir / METRICS_FILE

    @property
    def resolved_logging_dir(self) -> Path:
        """Where TensorBoard writes."""
        return self.logging_dir or self.ckpt_output_dir / "runs"

    @property
    def resolved_tokenizer_path(self) -> Path:
        """Where the tokenizer is loaded from: ``tokenizer_path``, else ``model_path`` (for an adapter folder
        without tokenizer files, its base model's folder)."""
        if self.tokenizer_path is not None:
            return self.tokenizer_path
        assert self.model_path is not None  # validated: model_path or tokenizer_path is set
        base = peft_adapter_base(self.model_path)
        if base is not None and not (self.model_path / "tokenizer_config.json").is_file():
            return base
        return self.model_path

    # ----------------------------------------------------------------- YAML
    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> TrainingArgs:
        """Load a YAML file (relative data/model paths resolve against the file's folder)."""
        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a mapping of TrainingArgs fields at the top level")
        base = path.parent
        for key in ("model_path", "tokenizer_path", "data_path", "val_data_path", "data_cache_dir", "ckpt_output_dir",
                    "logging_dir", "metrics_file"):
            if isinstance(data.get(key), str) and not Path(data[key]).is_absolute():
                data[key] = str(base / data[key])
        template = data.get("chat_template")
        if isinstance(template, str) and "{" not in template and (base / template).is_file():
            data["chat_template"] = str(base / template)  # a template file next to the YAML
        if isinstance(data.get("eval_data_paths"), dict):
            data["eval_data_paths"] = {name: str(base / p) if isinstance(p, str) and not Path(p).is_absolute() else p
                                       for name, p in data["eval_data_paths"].items()}
        if isinstance(data.get("resume_from_checkpoint"), str) and data["resume_from_checkpoint"] != "auto":
            if not Path(data["resume_from_checkpoint"]).is_absolute():
                data["resume_from_checkpoint"] = str(base / data["resume_from_checkpoint"])
        data.update(overrides)
        return cls.model_validate(data)

    def to_yaml(self, path: str | Path | None = None) -> str:
        """Dump to YAML.  Callbacks given as import specs are kept; live objects and functions cannot
        be written as YAML and are left out (they travel to the workers by ``trainbridge.launch.transport``)."""
        live = {"callbacks", "event_functions", "data_collator", "compute_metrics", "preprocess_logits_for_metrics"}
        data = self.model_dump(mode="json", exclude=live, exclude_none=True)
        for key, value in data.items():  # absolute, so the file loads the same from any folder
            if isinstance(getattr(self, key), Path):
                data[key] = str(Path(value).resolve())
        if self.eval_data_paths:
            data["eval_data_paths"] = {name: str(p.resolve()) for name, p in self.eval_data_paths.items()}
        specs = [c.model_dump(by_alias=True) for c in self.callbacks if isinstance(c, CallbackSpec)]
        if specs:
            data["callbacks"] = specs
        text = yaml.safe_dump(data, sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text


class TorchrunArgs(BaseModel):
    """How ``torchrun`` launches the workers; multi-node works the way torchrun does."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    nnodes: int | str = 1
    """Number of nodes, or ``MIN:MAX`` for elastic runs."""
    nproc_per_node: int = Field(default=1, gt=0)
    """Worker processes per node (one per GPU on CUDA)."""
    node_rank: int = Field(default=0, ge=0)
    """This node's rank (static rendezvous)."""
    rdzv_id: str | None = None
    """Rendezvous job id (c10d rendezvous); an integer (instructlab's ``rdzv_id=123``) is taken as its text."""
    rdzv_endpoint: str | None = None
    """``host:port`` of the rendezvous (c10d); when set, master_addr/master_port are not used."""
    rdzv_backend: str = "c10d"
    """Rendezvous backend when ``rdzv_endpoint`` is set."""
    master_addr: str = "127.0.0.1"
    """Address of rank 0's node (static rendezvous)."""
    master_port: int | None = Field(default=None, gt=0, lt=65536)
    """Port on ``master_addr``; None picks a free port (single node only)."""
    max_restarts: int = Field(default=0, ge=0)
    """Restarts of the whole job after a worker fails, before the run fails.  The launcher restarts it
    itself (a fresh torchrun, rendezvous and port: torchrun's in-place restart is unreliable with gloo),
    resuming from the newest complete checkpoint in ``ckpt_output_dir``; ``RunResult.restarts`` counts them."""

    @field_validator("rdzv_id", mode="before")
    @classmethod
    def _rdzv_id_text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("nnodes")
    @classmethod
    def _nnodes(cls, value: int | str) -> int | str:
        text = str(value)
        parts = text.split(":")
        if len(parts) > 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"nnodes: {value!r} is not N or MIN:MAX with positive integers")
        return int(text) if len(parts) == 1 else text
