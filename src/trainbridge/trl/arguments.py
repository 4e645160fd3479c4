"""What trl's trainers do with their arguments before anything else: the config and the tokenizer."""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def model_source(model: Any) -> str:
    """The model's path: ``model`` itself when given as a path, else its config's ``_name_or_path``."""
    if isinstance(model, str | Path):
        return str(model)
    return str(getattr(getattr(model, "config", None), "_name_or_path", ""))


def trl_config(args: Any, config_cls: type, model: Any, suffix: str) -> Any:
    """``args`` as trl's ``config_cls`` (``SFTConfig``, ``DPOConfig``...): as given, trl's default
    (``<model name>-<suffix>`` as output_dir) when None, or a ``TrainingArguments`` converted field by field."""
    if args is None:
        return config_cls(f"{Path(model_source(model)).name or 'model'}-{suffix}")
    if isinstance(args, config_cls):
        return args
    names = {field.name for field in dataclasses.fields(config_cls)}
    return config_cls(**{k: v for k, v in args.to_dict().items() if k in names})


def trl_tokenizer(processing_class: Any, model: Any) -> tuple[Any, Any]:
    """``(processing_class, tokenizer)``: loaded from the model's folder when not given; padding with the EOS
    token when the tokenizer has no pad token, as trl does."""
    from transformers import AutoTokenizer

    if processing_class is None:
        processing_class = AutoTokenizer.from_pretrained(model_source(model))
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return processing_class, tokenizer


@contextmanager
def fields_read(config: Any, names: Iterable[str] | None = None) -> Iterator[None]:
    """Without the porting's warning that a field of trl's ``config`` (not a ``TrainingArguments`` field) "has no
    effect" for ``names`` (None: every such field): trl's own code or trainbridge's step reads them."""
    from trainbridge.hf.porting import HFPortingWarning

    cls = re.escape(type(config).__name__)
    fields = r"\w+" if names is None else "|".join(re.escape(name) for name in names)
    with warnings.catch_warnings():
        message = rf"{cls}\.({fields})=.* is ignored: {cls} is not TrainingArguments"
        warnings.filterwarnings("ignore", message=message, category=HFPortingWarning)
        yield
