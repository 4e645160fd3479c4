"""The model's settings that are more than a value: ``from_pretrained`` keywords and PEFT configs/folders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator


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
        for key in ("load_in_4bit", "load_in_8bit"):
            if key in extra:
                raise ValueError(
                    f"model_kwargs.{key}: transformers takes it inside quantization_config; set "
                    f"model_kwargs={{'quantization_config': BitsAndBytesConfig({key}=True)}}"
                )
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
        return bool(extra.get("quantization_config"))


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
