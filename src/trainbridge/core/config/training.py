"""``TrainingArgs``: every setting of one training run, validated once; loads from and dumps to YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ConfigDict, ModelWrapValidatorHandler, PrivateAttr, model_validator

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
from trainbridge.core.config.imports import CallbackSpec, resolve_import_path
from trainbridge.core.config.model import peft_adapter_base
from trainbridge.core.config.plan import PLAN_KEYWORDS, RunPlan
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

    _plan: RunPlan = PrivateAttr(default_factory=RunPlan)

    @model_validator(mode="wrap")
    @classmethod
    def _data_and_plan(cls, data: Any, handler: ModelWrapValidatorHandler[TrainingArgs]) -> TrainingArgs:
        """The fields are data; the code keywords (``RunPlan``'s: ``model_init``, ``compute_metrics``, callback
        objects, ``on_<event>=fn``...) are split off into the arguments' plan, then everything is checked."""
        plan: RunPlan | None = None
        if isinstance(data, dict):
            data, plan = _split_plan(translate_instructlab_names(dict(data)))
        args = handler(data)
        if plan is not None:
            plan.callbacks = _ordered_callbacks(plan.callbacks, args.callbacks)
            args._plan = plan
        check_consistent(args, args._plan)
        return args

    @property
    def plan(self) -> RunPlan:
        """The code given with these arguments (``core.config.plan``); never a field, never in YAML."""
        return self._plan

    def with_plan(self, plan: RunPlan) -> TrainingArgs:
        """A copy of these arguments running ``plan`` (checked against the fields)."""
        check_consistent(self, plan)
        copy = self.model_copy()
        copy._plan = plan
        return copy

    # ----------------------------------------------------------------- derived values
    @property
    def best_metric_name(self) -> str:
        """``metric_for_best_model`` with transformers' default (``eval_loss``) and ``eval_`` prefix."""
        name = self.metric_for_best_model or "loss"
        return name if name.startswith("eval_") else f"eval_{name}"

    @property
    def eval_set_names(self) -> list[str]:
        """The names of the named validation sets: ``eval_data_paths``'s, or in place the script's
        (``RunPlan.script_data.named_eval``)."""
        script = self.plan.script_data
        return list(script.named_eval) if script is not None else list(self.eval_data_paths)

    @property
    def best_metric_eval_set(self) -> str | None:
        """With named validation sets: the set whose evaluation reports ``best_metric_name`` (the longest name
        that prefixes it as ``eval_<name>_``), else None."""
        owners = [n for n in self.eval_set_names if self.best_metric_name.startswith(f"eval_{n}_")]
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
        data = self.model_dump(mode="json", exclude={"callbacks"}, exclude_none=True)
        for key, value in data.items():  # absolute, so the file loads the same from any folder
            if isinstance(getattr(self, key), Path):
                data[key] = str(Path(value).resolve())
        if self.eval_data_paths:
            data["eval_data_paths"] = {name: str(p.resolve()) for name, p in self.eval_data_paths.items()}
        model_init = _import_path(self.plan.model_init)
        if model_init is not None:
            data["model_init"] = model_init
        specs = [c.model_dump(by_alias=True) for c in self.callbacks]
        if specs:
            data["callbacks"] = specs
        text = yaml.safe_dump(data, sort_keys=False)
        if path is not None:
            Path(path).write_text(text)
        return text


def _split_plan(data: dict[str, Any]) -> tuple[dict[str, Any], RunPlan]:
    """``data`` without its code keywords, and the ``RunPlan`` they make."""
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
    code = {key: data.pop(key) for key in PLAN_KEYWORDS if key in data}
    code["event_functions"] = functions
    model_init = code.get("model_init")
    if isinstance(model_init, str):
        code["model_init"] = model_init = resolve_import_path(model_init)
    if model_init is not None and not callable(model_init):
        raise ValueError(f"model_init: expected a function returning the model, got {type(model_init).__name__}")
    hf_args = code.get("hf_args")
    if hf_args is not None:
        from transformers import TrainingArguments

        if not isinstance(hf_args, TrainingArguments):
            raise ValueError(
                f"hf_args: expected a transformers.TrainingArguments (or subclass) instance, got "
                f"{type(hf_args).__name__}; pass the object your script built, or leave it unset"
            )
    given = data.get("callbacks")
    items = [] if given is None else list(given) if isinstance(given, list | tuple) else [given]
    data["callbacks"] = items  # the field checks every item and keeps the specs (data)
    return data, RunPlan(callbacks=items, **code)


def _ordered_callbacks(given: list[Any], specs: list[CallbackSpec]) -> list[Any]:
    """Every callback in the order given: objects as they are, specs as validated."""
    validated = iter(specs)
    return [next(validated) if isinstance(c, dict | str | CallbackSpec) else c for c in given]


def _import_path(function: Any) -> str | None:
    """``package.module:name`` of an importable function, else None (a lambda, a ``__main__`` function)."""
    if function is None:
        return None
    module, name = getattr(function, "__module__", None), getattr(function, "__qualname__", "")
    return f"{module}:{name}" if module and module != "__main__" and "<" not in name else None
