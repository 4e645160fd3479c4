"""What touches a model's internals: padding-free support, packed-row sizes, per-sample varlen attention.

Nothing here registers anything with transformers on import; set-up calls ``enable_varlen_sdpa``.  The
names below are imported on first use (PEP 562): ``trainbridge.modeling.load`` (the tokenizer the
launcher's preflight reads data with) must not pay for transformers' modeling code.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainbridge.modeling.padding_free import (
        PACKED_ROW_TOKENS,
        VARLEN_SDPA,
        model_supports_padding_free,
        packed_row_tokens,
    )
    from trainbridge.modeling.varlen_attention import enable_varlen_sdpa, sample_segments

_EXPORTS = {
    "PACKED_ROW_TOKENS": "trainbridge.modeling.padding_free",
    "VARLEN_SDPA": "trainbridge.modeling.padding_free",
    "model_supports_padding_free": "trainbridge.modeling.padding_free",
    "packed_row_tokens": "trainbridge.modeling.padding_free",
    "enable_varlen_sdpa": "trainbridge.modeling.varlen_attention",
    "sample_segments": "trainbridge.modeling.varlen_attention",
}

__all__ = [
    "PACKED_ROW_TOKENS",
    "VARLEN_SDPA",
    "enable_varlen_sdpa",
    "model_supports_padding_free",
    "packed_row_tokens",
    "sample_segments",
]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'trainbridge.modeling' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
