"""The typed configuration: ``TrainingArgs`` and ``TorchrunArgs``.

Validated once, in the parent process, and passed as objects everywhere else.  Every field has a
docstring (``use_attribute_docstrings``), so ``TrainingArgs.model_fields[name].description`` documents
it, and an invalid value raises a ``pydantic.ValidationError`` naming the field.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trainbridge.core.events import Event, event_from_name


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

    def build(self) -> Any:
        """Import the class and instantiate it with ``kwargs``."""
        return resolve_import_path(self.class_path)(**self.kwargs)


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
        raise ValueError(f"cannot import module {module_name!r} for {path!r}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"module {module_name!r} has no attribute {attr!r} (from {path!r})") from None
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
    model_path: Path
    """Local Hugging Face model directory (``config.json`` + weights), loaded with ``from_pretrained``."""
    tokenizer_path: Path | None = None
    """Tokenizer directory; defaults to ``model_path``."""
    data_path: Path
    """Training data, JSONL: pre-tokenized (``input_ids``, optional ``labels`` with -100 masking) or ``text``."""
    val_data_path: Path | None = None
    """Validation data in the same format; exclusive with ``validation_split``."""
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
    lr_scheduler: Literal["constant", "constant_with_warmup", "linear", "cosine"] = "constant_with_warmup"
    """Learning-rate schedule (``transformers.get_scheduler`` names)."""
    warmup_steps: int = Field(default=0, ge=0)
    """Linear warm-up steps."""
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
    mixed_precision: Literal["no", "bf16"] = "no"
    """``bf16`` autocasts forward/backward (parameters and optimizer stay fp32); with
    ``distributed_backend='deepspeed'`` it enables DeepSpeed's bf16 mode instead (bf16 weights, fp32
    master weights in the optimizer)."""
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
    resume_allow_mismatch: bool = False
    """Resume even from a checkpoint whose fingerprint (model architecture/config, base model folder,
    training data) differs from this run's; by default such a checkpoint is refused, naming the difference."""
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
        data = dict(data)
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
        out = []
        for i, item in enumerate(value):
            if isinstance(item, dict):
                try:
                    item = CallbackSpec.model_validate(item)
                except Exception as exc:
                    raise ValueError(f"callbacks[{i}]: {exc}") from None
            elif isinstance(item, str):
                item = CallbackSpec.model_validate({"class": item})
            elif item is None or isinstance(item, int | float | bool):
                raise ValueError(f"callbacks[{i}]: {item!r} is not a callback object, class or spec")
            out.append(item)
        return out

    @field_validator("model_path")
    @classmethod
    def _model_dir_exists(cls, value: Path) -> Path:
        if not value.is_dir():
            raise ValueError(f"model directory {str(value)!r} does not exist")
        if not (value / "config.json").is_file():
            raise ValueError(f"{str(value)!r} has no config.json: not a Hugging Face model directory")
        return value

    @field_validator("data_path", "val_data_path")
    @classmethod
    def _data_file_exists(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_file():
            raise ValueError(f"data file {str(value)!r} does not exist")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> TrainingArgs:
        if self.val_data_path is not None and self.validation_split > 0:
            raise ValueError("give val_data_path or validation_split, not both")
        if self.eval_strategy == "steps" and self.eval_steps is None:
            raise ValueError("eval_steps: required when eval_strategy='steps'")
        if self.eval_strategy != "no" and self.val_data_path is None and self.validation_split == 0:
            raise ValueError("eval_strategy: evaluation needs val_data_path or validation_split > 0")
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
        if self.max_batch_len < self.max_seq_len and self.packing != "padded":
            raise ValueError(
                f"max_batch_len: {self.max_batch_len} is smaller than max_seq_len {self.max_seq_len}; "
                "a longest sample would not fit in one micro-batch"
            )
        return self

    # ----------------------------------------------------------------- derived values
    @property
    def best_metric_name(self) -> str:
        """``metric_for_best_model`` with transformers' default (``eval_loss``) and ``eval_`` prefix."""
        name = self.metric_for_best_model or "loss"
        return name if name.startswith("eval_") else f"eval_{name}"

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

    @property
    def resolved_metrics_file(self) -> Path:
        """Where rank 0 writes the JSONL metrics."""
        return self.metrics_file or self.ckpt_output_dir / "metrics.jsonl"

    @property
    def resolved_logging_dir(self) -> Path:
        """Where TensorBoard writes."""
        return self.logging_dir or self.ckpt_output_dir / "runs"

    @property
    def resolved_tokenizer_path(self) -> Path:
        """Where the tokenizer is loaded from."""
        return self.tokenizer_path or self.model_path

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
        for key in ("model_path", "tokenizer_path", "data_path", "val_data_path", "ckpt_output_dir",
                    "logging_dir", "metrics_file"):
            if isinstance(data.get(key), str) and not Path(data[key]).is_absolute():
                data[key] = str(base / data[key])
        if isinstance(data.get("resume_from_checkpoint"), str) and data["resume_from_checkpoint"] != "auto":
            if not Path(data["resume_from_checkpoint"]).is_absolute():
                data["resume_from_checkpoint"] = str(base / data["resume_from_checkpoint"])
        data.update(overrides)
        return cls.model_validate(data)

    def to_yaml(self, path: str | Path | None = None) -> str:
        """Dump to YAML.  Callbacks given as import specs are kept; live objects and functions cannot
        be written as YAML and are left out (they travel to the workers by ``trainbridge.launch.transport``)."""
        data = self.model_dump(mode="json", exclude={"callbacks", "event_functions"}, exclude_none=True)
        for key, value in data.items():  # absolute, so the file loads the same from any folder
            if isinstance(getattr(self, key), Path):
                data[key] = str(Path(value).resolve())
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
    """Rendezvous job id (c10d rendezvous)."""
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

    @field_validator("nnodes")
    @classmethod
    def _nnodes(cls, value: int | str) -> int | str:
        text = str(value)
        parts = text.split(":")
        if len(parts) > 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"nnodes: {value!r} is not N or MIN:MAX with positive integers")
        return int(text) if len(parts) == 1 else text
