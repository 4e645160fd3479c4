"""``TrainingArgs``: every setting of one training run, validated once; loads from and dumps to YAML."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ConfigDict, model_validator

from trainbridge.core.config.checks import check_fields
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
from trainbridge.core.config.model import peft_adapter_base
from trainbridge.core.config.plan import CODE_KEYWORDS
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
    """Everything one training run needs, as data.  Loads from and dumps to YAML.

    The fields, by group, are in ``core.config.fields``.  The run's code (callback objects, ``on_<event>=fn``,
    ``model_init``, ``compute_metrics``...) is its ``RunPlan`` (``core.config.plan``), given beside these
    arguments: ``run_training(args, torchrun_args, callbacks=[...], on_save=fn)``.
    """

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=True,
    )

    @model_validator(mode="before")
    @classmethod
    def _data_only(cls, data: Any) -> Any:
        """instructlab's names translated; a code keyword (``model_init``, ``compute_metrics``, ``on_<event>``...)
        is refused with the fix: it belongs to ``run_training``."""
        if not isinstance(data, dict):
            return data
        data = translate_instructlab_names(dict(data))
        if data.pop("token_metrics", False):  # the loss seam's now (RunPlan.loss); an older config's False: a no-op
            raise ValueError(
                "token_metrics: trl's SFT metrics are part of the run's loss, not a setting; pass "
                "run_training(args, torchrun_args, loss=trainbridge.core.config.loss.TokenLoss(metrics=True))"
            )
        for key in data:
            if isinstance(key, str) and (key in CODE_KEYWORDS or key.startswith("on_")):
                raise ValueError(
                    f"{key}: code, not a setting: TrainingArgs holds data only; pass it to "
                    f"run_training(args, torchrun_args, {key}=...) (trainbridge.Trainer takes it from the script)"
                )
        return data

    @model_validator(mode="after")
    def _fields_agree(self) -> TrainingArgs:
        check_fields(self)
        return self

    # ----------------------------------------------------------------- derived values
    @property
    def best_metric_name(self) -> str:
        """``metric_for_best_model`` with transformers' default (``eval_loss``) and ``eval_`` prefix."""
        name = self.metric_for_best_model or "loss"
        return name if name.startswith("eval_") else f"eval_{name}"

    def best_metric_eval_set(self, eval_set_names: Iterable[str]) -> str | None:
        """With named validation sets (``eval_set_names(args, plan)``): the set whose evaluation reports
        ``best_metric_name`` (the longest name that prefixes it as ``eval_<name>_``), else None."""
        owners = [n for n in eval_set_names if self.best_metric_name.startswith(f"eval_{n}_")]
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

    def mixed_precision_for(self, device_type: str) -> Literal["no", "bf16", "fp16"]:
        """``mixed_precision`` with ``auto`` resolved for a run on ``device_type`` (``cuda``/``cpu``)."""
        if self.mixed_precision != "auto":
            return self.mixed_precision
        if device_type != "cuda":
            return "no"
        import torch

        return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"

    @property
    def data_order_seed(self) -> int:
        """The seed of the training data order: ``data_seed``, else ``seed`` (as Trainer's sampler)."""
        return self.data_seed if self.data_seed is not None else self.seed

    @property
    def resolved_run_files_dir(self) -> Path:
        """Where the run's own files go: ``run_files_dir``, else ``ckpt_output_dir``."""
        return self.run_files_dir or self.ckpt_output_dir

    @property
    def resolved_metrics_file(self) -> Path:
        """Where rank 0 writes the JSONL metrics."""
        return self.metrics_file or self.resolved_run_files_dir / METRICS_FILE

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
        """Load a YAML file (relative data/model paths resolve against the file's folder; ``read_yaml``)."""
        return cls.model_validate({**read_yaml(path), **overrides})

    def to_yaml(self, path: str | Path | None = None) -> str:
        """Dump to YAML (data only: the callbacks' import specs are kept; a run's code is its ``RunPlan``)."""
        data = self.model_dump(mode="json", exclude={"callbacks"}, exclude_none=True)
        for key, value in data.items():  # absolute, so the file loads the same from any folder
            if isinstance(getattr(self, key), Path):
                data[key] = str(Path(value).resolve())
        if self.eval_data_paths:
            data["eval_data_paths"] = {name: str(p.resolve()) for name, p in self.eval_data_paths.items()}
        specs = [c.model_dump(by_alias=True) for c in self.callbacks]
        if specs:
            data["callbacks"] = specs
        text = yaml.safe_dump(data, sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping of a YAML config, its relative data/model paths resolved against the file's folder (a
    ``model_init:`` import path stays in it: code, which ``run_training`` takes, not ``TrainingArgs``)."""
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
    return data
