"""Micro-batch tensors: padding-free (one packed row) or padded (right padding).

Both collators return CPU ``int64`` tensors; the loop moves them to the device.  The padding-free
layout follows ``transformers.DataCollatorWithFlattening``: samples are concatenated into one row,
``position_ids`` restart at 0 for every sample, and the first label of every sample is ``-100`` so no
token learns to predict across a sample boundary.  Transformers detects the packed sequences from the
restarting ``position_ids`` (``masking_utils.find_packed_sequence_indices`` for eager / sdpa / flex
attention, the varlen path for flash attention), provided no ``attention_mask`` and no KV cache are
passed -- ``data.loss.token_loss_sum`` calls the model that way.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from trainbridge.data.dataset import IGNORE_INDEX, Sample

DUMMY_TOKEN_ID = 0
"""Token id of the single token of a dummy (empty) padding-free micro-batch."""

PACKING_ATTENTION_IMPLEMENTATIONS = frozenset(
    {"eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3", "flash_attention_4"}
)
"""Attention implementations for which transformers honours packed ``position_ids``."""

_MASK_BUILDERS = frozenset(
    {"create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask"}
)


def collate_padding_free(samples: Sequence[Sample]) -> dict[str, torch.Tensor]:
    """Concatenate ``samples`` into one row: ``input_ids``, ``labels``, ``position_ids``, each ``[1, T]``.

    When every sample has the same length, they are stacked as ``[k, L]`` rows instead (no padding
    either way, the same loss): one row per sample keeps attention on the plain causal path, where a
    packed row would make eager/sdpa attention build a block-diagonal mask over all ``T`` tokens.
    An empty ``samples`` (a dummy micro-batch) gives one token ``DUMMY_TOKEN_ID`` with label ``-100``.
    """
    if len(samples) > 1 and len({s.length for s in samples}) == 1:
        return {
            "input_ids": torch.tensor([s.input_ids for s in samples], dtype=torch.long),
            "labels": torch.tensor([(IGNORE_INDEX, *s.labels[1:]) for s in samples], dtype=torch.long),
        }
    input_ids: list[int] = []
    labels: list[int] = []
    position_ids: list[int] = []
    for sample in samples:
        input_ids.extend(sample.input_ids)
        labels.append(IGNORE_INDEX)
        labels.extend(sample.labels[1:])
        position_ids.extend(range(sample.length))
    if not samples:
        input_ids, labels, position_ids = [DUMMY_TOKEN_ID], [IGNORE_INDEX], [0]
    return {
        "input_ids": torch.tensor([input_ids], dtype=torch.long),
        "labels": torch.tensor([labels], dtype=torch.long),
        "position_ids": torch.tensor([position_ids], dtype=torch.long),
    }


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
