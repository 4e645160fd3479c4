"""Micro-batch tensors: padding-free (packed rows) or padded (right padding).

Both collators return CPU ``int64`` tensors; the loop moves them to the device.  The padding-free
layout follows ``transformers.DataCollatorWithFlattening``: samples are concatenated into one row,
``position_ids`` restart at 0 for every sample, and the first label of every sample is ``-100`` so no
token learns to predict across a sample boundary.  Transformers detects the packed sequences from the
restarting ``position_ids`` (``masking_utils.find_packed_sequence_indices`` for eager / sdpa / flex
attention, the varlen path for flash attention), provided no ``attention_mask`` and no KV cache are
passed -- ``data.loss.token_loss_sum`` calls the model that way.

Eager and sdpa attention have no varlen kernel: they mask the packed samples apart with a
block-diagonal mask over the whole row, so a row of ``T`` tokens costs ``T^2`` in attention.  The loop
switches sdpa models to ``VARLEN_SDPA`` (``data.varlen_attention``: one causal sdpa per sample) where
that is exact; for the rest (eager, and sdpa models it does not apply to) it passes ``row_tokens=PACKED_ROW_TOKENS`` (``packed_row_tokens``) and a larger micro-batch is
spread over several balanced packed rows (``benchmarks/packed_rows.py`` measures the difference).
"""

from __future__ import annotations

import ast
import functools
import heapq
import inspect
import math
import sys
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from trainbridge.data.dataset import IGNORE_INDEX, Sample

DUMMY_TOKEN_ID = 0
"""Token id of the single token of a dummy (empty) padding-free micro-batch."""

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

_MASK_BUILDERS = frozenset(
    {"create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask"}
)


def collate_padding_free(samples: Sequence[Sample], row_tokens: int | None = None) -> dict[str, torch.Tensor]:
    """Concatenate ``samples`` into one row: ``input_ids``, ``labels``, ``position_ids``, each ``[1, T]``.

    When every sample has the same length, they are stacked as ``[k, L]`` rows instead (no padding
    either way, the same loss): one row per sample keeps attention on the plain causal path, where a
    packed row would make eager/sdpa attention build a block-diagonal mask over all ``T`` tokens.
    With ``row_tokens`` and ``T > row_tokens``, the samples go, longest first, to the lightest of
    ``ceil(T / row_tokens)`` packed rows (at most one per sample), each right-padded to the longest:
    a row's padding is one more packed sequence (``DUMMY_TOKEN_ID``, ``position_ids`` restarting at 0,
    labels ``-100``), so no sample attends to it and the loss is the same as in one row.
    An empty ``samples`` (a dummy micro-batch) gives one token ``DUMMY_TOKEN_ID`` with label ``-100``.
    """
    if len(samples) > 1 and len({s.length for s in samples}) == 1:
        return {
            "input_ids": torch.tensor([s.input_ids for s in samples], dtype=torch.long),
            "labels": torch.tensor([(IGNORE_INDEX, *s.labels[1:]) for s in samples], dtype=torch.long),
        }
    if not samples:
        return {
            "input_ids": torch.tensor([[DUMMY_TOKEN_ID]], dtype=torch.long),
            "labels": torch.tensor([[IGNORE_INDEX]], dtype=torch.long),
            "position_ids": torch.tensor([[0]], dtype=torch.long),
        }
    total = sum(sample.length for sample in samples)
    num_rows = 1 if row_tokens is None else min(len(samples), math.ceil(total / row_tokens))
    rows = [_packed_row(row) for row in _balanced_rows(samples, num_rows)]
    width = max(len(input_ids) for input_ids, _, _ in rows)
    for input_ids, labels, position_ids in rows:
        padding = width - len(input_ids)
        input_ids.extend([DUMMY_TOKEN_ID] * padding)
        labels.extend([IGNORE_INDEX] * padding)
        position_ids.extend(range(padding))
    return {
        "input_ids": torch.tensor([input_ids for input_ids, _, _ in rows], dtype=torch.long),
        "labels": torch.tensor([labels for _, labels, _ in rows], dtype=torch.long),
        "position_ids": torch.tensor([position_ids for _, _, position_ids in rows], dtype=torch.long),
    }


def packed_row_tokens(model: torch.nn.Module) -> int | None:
    """The ``row_tokens`` cap ``collate_padding_free`` should use for ``model``: ``PACKED_ROW_TOKENS``
    when its attention implementation attends over whole packed rows (eager, sdpa), else ``None``
    (varlen flash attention and flex attention's block mask cost nothing extra for a long row)."""
    config = model.config if isinstance(model, PreTrainedModel) else None
    if config is not None and config._attn_implementation in QUADRATIC_PACKING_ATTENTION_IMPLEMENTATIONS:
        return PACKED_ROW_TOKENS
    return None


def _balanced_rows(samples: Sequence[Sample], num_rows: int) -> list[list[Sample]]:
    """Longest first, each sample to the row with the fewest tokens so far (ties: the lower row)."""
    if num_rows == 1:
        return [list(samples)]
    rows: list[list[Sample]] = [[] for _ in range(num_rows)]
    heap = [(0, row) for row in range(num_rows)]
    for sample in sorted(samples, key=lambda s: -s.length):
        load, row = heapq.heappop(heap)
        rows[row].append(sample)
        heapq.heappush(heap, (load + sample.length, row))
    return rows


def _packed_row(samples: Sequence[Sample]) -> tuple[list[int], list[int], list[int]]:
    """``input_ids``, ``labels`` (``-100`` on each sample's first token) and restarting ``position_ids``."""
    input_ids: list[int] = []
    labels: list[int] = []
    position_ids: list[int] = []
    for sample in samples:
        input_ids.extend(sample.input_ids)
        labels.append(IGNORE_INDEX)
        labels.extend(sample.labels[1:])
        position_ids.extend(range(sample.length))
    return input_ids, labels, position_ids


def collate_padded(samples: Sequence[Sample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad ``samples`` to the longest: ``input_ids``, ``attention_mask``, ``labels`` (``-100`` on padding).

    An empty ``samples`` (a dummy micro-batch) gives one attended ``pad_token_id`` with label ``-100``.
    """
    if not samples:
        return {
            "input_ids": torch.tensor([[pad_token_id]], dtype=torch.long),
            "attention_mask": torch.ones(1, 1, dtype=torch.long),
            "labels": torch.tensor([[IGNORE_INDEX]], dtype=torch.long),
        }
    width = max(sample.length for sample in samples)
    input_ids = torch.full((len(samples), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), width), dtype=torch.long)
    labels = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)
    for row, sample in enumerate(samples):
        input_ids[row, : sample.length] = torch.tensor(sample.input_ids, dtype=torch.long)
        labels[row, : sample.length] = torch.tensor(sample.labels, dtype=torch.long)
        attention_mask[row, : sample.length] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def model_supports_padding_free(model: torch.nn.Module) -> bool:
    """Whether ``model`` (an unwrapped Hugging Face causal LM) keeps packed samples independent.

    True when the model is decoder-only, its ``forward`` takes ``position_ids``, its attention
    implementation is one for which transformers detects packing from ``position_ids``, every causal
    mask its modeling code builds is given the ``position_ids`` (so packed sequences are masked apart;
    e.g. OPT and Bloom do not pass them) and it uses no ALiBi (whose positions come from the attention
    mask).  Checked statically on the model's modeling source; a model whose source cannot be read
    counts as unsupported.
    """
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
    calls = [
        node for node in ast.walk(tree) if isinstance(node, ast.Call) and _called_name(node.func) in builders
    ]
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
