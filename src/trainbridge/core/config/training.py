"""``TrainingArgs``: every setting of one training run, validated once; loads from and dumps to YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ConfigDict, model_validator

from trainbridge.core.config.checks import check_consistent
from trainbridge.core.config.fields import (
    BatchFields,
    CallbackFields,
    CheckpointFields,
    DataFields,
    EvaluationFields,
    ModelFields,
    ParallelismFields,
    ReportingFields,
    ScheduleFields,
)
from trainbridge.core.config.imports import CallbackSpec
from trainbridge.core.config.model import peft_adapter_base
from trainbridge.core.events import Event, event_from_name
from trainbridge.core.instructlab_names import translate_instructlab_names
from trainbridge.core.run_dir import METRICS_FILE


class TrainingArgs(  # pydantic orders fields from the last base to the first: model fields come first
    CallbackFields,
    ReportingFields,
    CheckpointFields,
    EvaluationFields,
    ParallelismFields,
    ScheduleFields,
    BatchFields,
    DataFields,
    ModelFields,
):
    """Everything one training run needs.  Loads from and dumps to YAML.

    The fields, by group, are in ``core.config.fields``.  Event functions can be given flat, one keyword per
    event: ``TrainingArgs(..., on_save=fn, on_evaluate=[fn1, fn2])``; they are collected into
    ``event_functions``.
    """

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=True,
    )

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

    @model_validator(mode="after")
    def _consistent(self) -> TrainingArgs:
        check_consistent(self)
        return self

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
        for key in (
            "model_path",
            "tokenizer_path",
            "data_path",
            "val_data_path",
            "data_cache_dir",
            "ckpt_output_dir",
            "logging_dir",
            "metrics_file",
        ):
            if isinstance(data.get(key), str) and not Path(data[key]).is_absolute():
                data[key] = str(base / data[key])
        template = data.get("chat_template")
        if isinstance(template, str) and "{" not in template and (base / template).is_file():
            data["chat_template"] = str(base / template)  # a template file next to the YAML
        if isinstance(data.get("eval_data_paths"), dict):
            data["eval_data_paths"] = {
                name: str(base / p) if isinstance(p, str) and not Path(p).is_absolute() else p
                for name, p in data["eval_data_paths"].items()
            }
        if isinstance(data.get("resume_from_checkpoint"), str) and data["resume_from_checkpoint"] != "auto":
            if not Path(data["resume_from_checkpoint"]).is_absolute():
                data["resume_from_checkpoint"] = str(base / data["resume_from_checkpoint"])
        data.update(overrides)
        return cls.model_validate(data)

    def to_yaml(self, path: str | Path | None = None) -> str:
        """Dump to YAML.  Callbacks given as import specs are kept; live objects and functions cannot
        be written as YAML and are left out (they travel to the workers by ``trainbridge.launch.transport``)."""
        live = {
            "callbacks",
            "event_functions",
            "data_collator",
            "compute_metrics",
            "preprocess_logits_for_metrics",
            "compute_loss",
            "trainer_methods",
            "evaluation",
            "optimizer_factory",
            "checkpoint_model_files",
            "train_step",
            "train_stream",
            "train_loader",
        }
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
