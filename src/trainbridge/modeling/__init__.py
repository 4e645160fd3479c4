"""What touches a model's internals: padding-free support, packed-row sizes, per-sample varlen attention.

Nothing here registers anything with transformers on import; set-up calls ``enable_varlen_sdpa``.
"""

from trainbridge.modeling.padding_free import (
    PACKED_ROW_TOKENS,
    VARLEN_SDPA,
    model_supports_padding_free,
    packed_row_tokens,
)
from trainbridge.modeling.varlen_attention import enable_varlen_sdpa, sample_segments

__all__ = [
    "PACKED_ROW_TOKENS",
    "VARLEN_SDPA",
    "enable_varlen_sdpa",
    "model_supports_padding_free",
    "packed_row_tokens",
    "sample_segments",
]
