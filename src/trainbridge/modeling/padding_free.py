"""What a model must offer for padding-free batches, and how long a packed row may be for it.

``model_supports_padding_free`` decides (statically, from the model's modeling source) whether packed
samples stay independent under the model's attention; ``packed_row_tokens`` gives the row-length cap
``data.collate.collate_padding_free`` should use for a model whose attention is quadratic in the row.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys

import torch
from transformers import PreTrainedModel

from trainbridge.modeling.load import unwrap_peft

VARLEN_SDPA = "trainbridge_varlen_sdpa"
"""trainbridge's per-sample sdpa attention for packed rows (registered by ``data.varlen_attention``)."""

PACKING_ATTENTION_IMPLEMENTATIONS = frozenset(
    {"eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4", VARLEN_SDPA}
)
"""Attention implementations for which transformers honours packed ``position_ids``."""

QUADRATIC_PACKING_ATTENTION_IMPLEMENTATIONS = frozenset({"eager", "sdpa"})
"""Attention implementations that attend over a whole packed row (block-diagonal mask): cost ``T^2``."""

PACKED_ROW_TOKENS = 512
"""Row-length cap for ``QUADRATIC_PACKING_ATTENTION_IMPLEMENTATIONS``: above it, a padding-free
micro-batch is split into balanced packed rows (on CPU, 8 x 491 tokens cost a third of one 3,900-token
row and 4 samples (~320 tokens) stay one row; ``benchmarks/packed_rows.py``)."""

_MASK_BUILDERS = frozenset({"create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask"})


def packed_row_tokens(model: torch.nn.Module) -> int | None:
    """The ``row_tokens`` cap ``collate_padding_free`` should use for ``model``: ``PACKED_ROW_TOKENS``
    when its attention implementation attends over whole packed rows (eager, sdpa), else ``None``
    (varlen flash attention and flex attention's block mask cost nothing extra for a long row)."""
    model = unwrap_peft(model)
    config = model.config if isinstance(model, PreTrainedModel) else None
    if config is not None and config._attn_implementation in QUADRATIC_PACKING_ATTENTION_IMPLEMENTATIONS:
        return PACKED_ROW_TOKENS
    return None


def model_supports_padding_free(model: torch.nn.Module) -> bool:
    """Whether ``model`` (an unwrapped Hugging Face causal LM) keeps packed samples independent.

    True when the model is decoder-only, its ``forward`` takes ``position_ids``, its attention
    implementation is one for which transformers detects packing from ``position_ids``, every causal
    mask its modeling code builds is given the ``position_ids`` (so packed sequences are masked apart;
    e.g. OPT and Bloom do not pass them) and it uses no ALiBi (whose positions come from the attention
    mask).  Checked statically on the model's modeling source; a model whose source cannot be read
    counts as unsupported.  A PEFT model is judged by the transformers model inside it.
    """
    model = unwrap_peft(model)
    if not isinstance(model, PreTrainedModel):
        return False
    config = model.config
    if config.is_encoder_decoder:
        return False
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return False
    if config._attn_implementation not in PACKING_ATTENTION_IMPLEMENTATIONS:
        return False
    module = sys.modules.get(type(model).__module__)
    if module is None:
        return False
    # Falcon has ALiBi only with ``config.alibi``; Bloom and MPT always.
    if hasattr(module, "build_alibi_tensor") and config.to_dict().get("alibi", True):
        return False
    return _masks_get_position_ids(module.__name__)


@functools.cache
def _masks_get_position_ids(module_name: str) -> bool:
    """Whether the module builds causal masks, passing ``position_ids`` to every mask-builder call.

    A builder is one of ``_MASK_BUILDERS`` or a local name bound to one (Mistral's ``mask_function =
    create_causal_mask if ... else create_sliding_window_causal_mask``).  A call passes the ids with
    ``position_ids=...`` or with ``**kwargs`` where ``kwargs`` is a dict literal holding a
    ``"position_ids"`` key, or a ``.copy()`` of one (Qwen2's and Gemma3's ``mask_kwargs``).
    """
    try:
        tree = ast.parse(inspect.getsource(sys.modules[module_name]))
    except (OSError, TypeError, SyntaxError, KeyError):
        return False
    assignments = [
        (target.id, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    ]
    builders = set(_MASK_BUILDERS)
    kwargs_with_position_ids: set[str] = set()
    changed = True
    while changed:  # fixpoint: aliases of aliases, copies of copies
        changed = False
        for name, value in assignments:
            if name not in builders and _is_builder_alias(value, builders):
                builders.add(name)
                changed = True
            if name not in kwargs_with_position_ids and _holds_position_ids(value, kwargs_with_position_ids):
                kwargs_with_position_ids.add(name)
                changed = True
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and _called_name(node.func) in builders]
    return bool(calls) and all(
        any(
            keyword.arg == "position_ids"
            or (
                keyword.arg is None
                and isinstance(keyword.value, ast.Name)
                and keyword.value.id in kwargs_with_position_ids
            )
            for keyword in call.keywords
        )
        for call in calls
    )


def _is_builder_alias(value: ast.expr, builders: set[str]) -> bool:
    """``value`` is a builder name, or a conditional choosing between builder names."""
    if isinstance(value, ast.IfExp):
        return _is_builder_alias(value.body, builders) and _is_builder_alias(value.orelse, builders)
    return _called_name(value) in builders


def _holds_position_ids(value: ast.expr, known: set[str]) -> bool:
    """``value`` is a dict literal with a ``"position_ids"`` key, or ``x.copy()`` / ``dict(x)`` of one."""
    if isinstance(value, ast.Dict):
        return any(isinstance(key, ast.Constant) and key.value == "position_ids" for key in value.keys)
    if isinstance(value, ast.Call):
        func = value.func
        if isinstance(func, ast.Attribute) and func.attr == "copy" and isinstance(func.value, ast.Name):
            return func.value.id in known
        if isinstance(func, ast.Name) and func.id == "dict" and len(value.args) == 1:
            arg = value.args[0]
            return isinstance(arg, ast.Name) and arg.id in known
    return False


def _called_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None
