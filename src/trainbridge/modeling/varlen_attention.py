"""Per-sample causal attention for padding-free rows: sdpa without a block-diagonal mask.

A padding-free row concatenates samples with ``position_ids`` restarting at 0 for each (``collate``).
Under transformers' ``sdpa`` attention such a row is masked apart with a block-diagonal ``[T, T]``
mask, so attention costs ``T^2`` for the row and sdpa runs its masked kernel.  Flash attention's varlen
kernel avoids that on CUDA; nothing does on CPU.  ``VARLEN_SDPA`` is an attention implementation,
registered with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``, that runs one
causal ``scaled_dot_product_attention`` per sample of the row instead: attention costs the sum of the
samples' squared lengths, no mask is built, and the result is the same as the masked row's.  On a CUDA
GPU in half precision (bf16 training) the whole row goes instead through torch's own variable-length
flash kernel (``torch.nn.attention.varlen.varlen_attn``) in one call, cut at ``cu_seq`` built from the
same CPU-side boundaries; the per-sample sdpa calls are the fallback (CPU, fp32, attention dropout, a GPU
the kernel does not support).

``enable_varlen_sdpa`` switches a model from ``sdpa`` to it only when that is exact: the model keeps
packed samples apart (``modeling.padding_free.model_supports_padding_free``), has no sliding-window or chunked
attention that could act within ``max_seq_len``, and a start-up probe gives the same logits for a
packed row under both implementations.  Padded batches (an ``attention_mask``) and decoding with a KV
cache still go through transformers' own sdpa path, so a callback that calls ``generate`` is
unaffected.  The implementation name is not written to checkpoints (``config.json`` does not keep the
attention implementation), so saved models load anywhere.
"""

from __future__ import annotations

import functools
import itertools
import logging
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, cast

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from trainbridge.modeling.load import unwrap_peft
from trainbridge.modeling.padding_free import VARLEN_SDPA, model_supports_padding_free

logger = logging.getLogger(__name__)

_PROBE_SEGMENTS = (7, 5, 9)
"""Sample lengths of the packed row ``enable_varlen_sdpa`` checks the model with."""


class _SegmentCache:
    """Sample boundaries of the last ``position_ids`` seen: every layer of one forward gets the same
    tensor, so the boundaries (one host sync on CUDA) are computed once per forward."""

    def __init__(self) -> None:
        self._ref: weakref.ref[torch.Tensor] | None = None
        self._version = -1
        self._bounds: list[list[int]] = []

    def bounds(self, position_ids: torch.Tensor) -> list[list[int]]:
        """Per row of ``position_ids``, the start of every sample and the row's end."""
        if self._ref is not None and self._ref() is position_ids and self._version == position_ids._version:
            return self._bounds
        starts = (position_ids == 0).nonzero().tolist()
        bounds: list[list[int]] = [[] for _ in range(position_ids.shape[0])]
        for row, column in starts:
            bounds[row].append(column)
        for row in bounds:
            if not row or row[0] != 0:
                row.insert(0, 0)  # a row that does not start a sample still starts a segment
            row.append(position_ids.shape[1])
        self._ref, self._version, self._bounds = weakref.ref(position_ids), position_ids._version, bounds
        return bounds


_segments = _SegmentCache()

_known_bounds: list[list[int]] | None = None
"""Boundaries of the forward running inside ``sample_segments`` (from the batch's Python metadata)."""


@contextmanager
def sample_segments(batch: Mapping[str, Any]) -> Iterator[None]:
    """Tell the per-sample attention where the samples of ``batch`` start, for the forward run inside.

    The boundaries come from CPU-side metadata: the collator's ``seq_lens`` (``data.collate.CollatedBatch``)
    for packed rows, or "every row is one sample" for a batch with neither ``position_ids`` nor an
    ``attention_mask`` (stacked equal-length rows).  Without it the attention reads them from the
    device ``position_ids`` (``nonzero().tolist()``: one host-device synchronisation per forward).
    A padded batch (``attention_mask``) sets nothing: it takes transformers' masked path.
    """
    global _known_bounds
    seq_lens = getattr(batch, "seq_lens", None)
    input_ids = batch.get("input_ids")
    bounds: list[list[int]] | None = None
    if seq_lens is not None:
        bounds = [[0, *itertools.accumulate(row)] for row in seq_lens]
    elif "position_ids" not in batch and "attention_mask" not in batch and isinstance(input_ids, torch.Tensor):
        bounds = [[0, input_ids.shape[1]]] * input_ids.shape[0]
    previous, _known_bounds = _known_bounds, bounds
    try:
        yield
    finally:
        _known_bounds = previous


def _bounds_for(position_ids: torch.Tensor, rows: int, length: int) -> list[list[int]]:
    """The known boundaries when they fit this call (``rows`` rows of ``length``), else read them from
    ``position_ids``."""
    known = _known_bounds
    if known is not None and len(known) == rows and all(row[-1] == length for row in known):
        return known
    return _segments.bounds(position_ids)


def varlen_sdpa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers attention function: ``query`` ``[B, H, T, D]``, ``key``/``value`` ``[B, H_kv, T, D]``.

    With no mask, equal query and key lengths and ``position_ids`` in ``kwargs`` (a training forward),
    each sample of each row (a run of ``position_ids`` starting at 0) attends causally to itself only;
    otherwise (an attention mask, a KV cache) this is transformers' ``sdpa_attention_forward``.
    Returns ``([B, T, H, D], None)`` as every transformers attention function does.
    """
    position_ids = kwargs.get("position_ids")
    if (
        attention_mask is not None
        or position_ids is None
        or query.shape[2] != key.shape[2]
        or position_ids.shape[0] not in (1, query.shape[0])
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    # Boundaries known from the batch (``sample_segments``), else of the tensor every layer receives
    # (the cache hits from the second layer on); one shared row of position_ids (the model's default
    # arange for stacked rows) applies to every row.
    bounds = _bounds_for(position_ids, query.shape[0], query.shape[2])
    if len(bounds) != query.shape[0]:
        bounds = bounds * query.shape[0]
    dropout_p = dropout if module.training else 0.0
    gqa = key.shape[1] != query.shape[1]
    if _kernel_applies(query, dropout_p):
        return _torch_varlen_forward(query, key, value, bounds, scaling, gqa), None
    return _per_sample_forward(query, key, value, bounds, dropout_p, scaling, gqa), None


def _per_sample_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: list[list[int]],
    dropout_p: float,
    scaling: float | None,
    gqa: bool,
) -> torch.Tensor:
    """One causal sdpa call per sample (the fallback where torch's varlen kernel does not run: CPU, fp32,
    dropout); returns ``[B, T, H, D]``."""
    if all(len(row) == 2 for row in bounds):  # one sample per row: plain causal attention, one call
        output = F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout_p, is_causal=True, scale=scaling, enable_gqa=gqa
        )
        return output.transpose(1, 2).contiguous()
    # torch.split, not slicing: the backward of a split is one concatenation, while every slice's
    # backward writes a zero tensor of the whole row (quadratic in the number of samples).
    rows = []
    for row_q, row_k, row_v, row_bounds in zip(query.split(1), key.split(1), value.split(1), bounds, strict=True):
        lengths = [end - start for start, end in itertools.pairwise(row_bounds)]
        if dropout_p == 0.0 and len(set(lengths)) == 1:  # samples of one length (fixed-length data): one call
            rows.append(_equal_lengths_forward(row_q, row_k, row_v, len(lengths), scaling, gqa))
            continue
        pieces = [
            F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scaling, enable_gqa=gqa)
            for q, k, v in zip(
                row_q.split(lengths, dim=2), row_k.split(lengths, dim=2), row_v.split(lengths, dim=2), strict=True
            )
        ]
        rows.append(torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0])
    output = torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]
    return output.transpose(1, 2).contiguous()


def _equal_lengths_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, samples: int, scaling: float | None, gqa: bool
) -> torch.Tensor:
    """One packed row ``[1, H, T, D]`` of ``samples`` samples of one length: the samples as a batch in one causal
    sdpa call (views, no copy in), the same values as one call per sample; returns ``[1, H, T, D]``."""

    def as_batch(row: torch.Tensor) -> torch.Tensor:  # [1, H, T, D] -> [samples, H, T / samples, D]
        return row[0].unflatten(1, (samples, row.shape[2] // samples)).transpose(0, 1)

    output = F.scaled_dot_product_attention(
        as_batch(query), as_batch(key), as_batch(value), is_causal=True, scale=scaling, enable_gqa=gqa
    )
    return output.transpose(0, 1).flatten(1, 2).unsqueeze(0)


_KERNEL_DTYPES = (torch.float16, torch.bfloat16)
_KERNEL_MAX_HEAD_DIM = 256
_kernel_works: bool | None = None
"""Whether torch's varlen kernel ran in this process: None before its first call; False once that first
call raised (a GPU or build the kernel does not support), and the per-sample path serves every later call."""


@functools.lru_cache(maxsize=1)
def torch_varlen_kernel() -> Callable[..., torch.Tensor] | None:
    """torch's own variable-length attention (``torch.nn.attention.varlen.varlen_attn``: the flash
    kernel shipped inside torch, CUDA only), or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return cast(Callable[..., torch.Tensor], varlen_attn)


@functools.lru_cache(maxsize=8)
def _flash_capable(device_index: int) -> bool:
    """The flash kernel needs compute capability 8.0 or newer (A100, H100, ...); no device sync."""
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


def _kernel_applies(query: torch.Tensor, dropout_p: float) -> bool:
    """Whether this call runs torch's varlen kernel: CUDA, half precision (as under bf16 training), no
    attention dropout (the kernel has none), a head size the kernel takes, and the kernel present."""
    return (
        _kernel_works is not False
        and query.is_cuda
        and query.dtype in _KERNEL_DTYPES
        and dropout_p == 0.0
        and query.shape[-1] <= _KERNEL_MAX_HEAD_DIM
        and torch_varlen_kernel() is not None
        and _flash_capable(query.device.index or 0)
    )


class _CumulativeLengths:
    """``cu_seq`` of the last boundaries seen, on the device: built once per forward (every layer gets the
    same boundaries object), from Python integers, copied host-to-device without waiting."""

    def __init__(self) -> None:
        self._key: tuple[object, int, torch.device] | None = None
        self._value: tuple[torch.Tensor, int] = (torch.zeros(1, dtype=torch.int32), 0)

    def get(self, bounds: list[list[int]], length: int, device: torch.device) -> tuple[torch.Tensor, int]:
        """``(cu_seq, longest sample)`` of rows of ``length`` tokens flattened one after another."""
        if self._key is not None and self._key[0] is bounds and self._key[1:] == (length, device):
            return self._value
        starts = [row_index * length + start for row_index, row in enumerate(bounds) for start in row[:-1]]
        longest = max(end - start for row in bounds for start, end in itertools.pairwise(row))
        host = torch.tensor([*starts, len(bounds) * length], dtype=torch.int32, pin_memory=device.type == "cuda")
        self._key, self._value = (bounds, length, device), (host.to(device, non_blocking=True), longest)
        return self._value


_cumulative = _CumulativeLengths()


def _torch_varlen_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: list[list[int]],
    scaling: float | None,
    gqa: bool,
) -> torch.Tensor:
    """Every sample of every row in one call of torch's varlen kernel: the rows are flattened into one
    ``[B*T, H, D]`` sequence cut at ``cu_seq``; returns ``[B, T, H, D]``.  If the kernel's first call in
    this process raises (other than out of memory), this process keeps the per-sample path, with a warning."""
    global _kernel_works
    batch, heads, length, head_dim = query.shape
    cu_seq, longest = _cumulative.get(bounds, length, query.device)

    def flat(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.transpose(1, 2).reshape(batch * length, tensor.shape[1], head_dim)

    kernel = cast(Callable[..., torch.Tensor], torch_varlen_kernel())
    try:
        output = kernel(
            flat(query),
            flat(key),
            flat(value),
            cu_seq,
            cu_seq,
            longest,
            longest,
            scale=scaling,
            window_size=(-1, 0),
            enable_gqa=gqa,
        )
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as exc:
        if _kernel_works:
            raise
        _kernel_works = False
        logger.warning("torch's varlen attention kernel does not run here (%s); using per-sample sdpa", exc)
        return _per_sample_forward(query, key, value, bounds, 0.0, scaling, gqa)
    _kernel_works = True
    return output.view(batch, length, heads, head_dim)


def varlen_sdpa_mask(**kwargs: Any) -> torch.Tensor | None:
    """Transformers mask function (called with keywords only): no mask for unpadded input (the
    attention function separates the samples itself), transformers' sdpa mask when there is padding."""
    if kwargs.get("attention_mask") is None:
        return None
    return sdpa_mask(**kwargs)


def register_varlen_sdpa() -> None:
    """Register ``VARLEN_SDPA`` with transformers' attention and mask interfaces (idempotent).

    Called from set-up (``enable_varlen_sdpa``), never as a side effect of importing this module."""
    AttentionInterface.register(VARLEN_SDPA, varlen_sdpa_attention_forward)
    AttentionMaskInterface.register(VARLEN_SDPA, varlen_sdpa_mask)


def enable_varlen_sdpa(model: torch.nn.Module, max_seq_len: int, probe: bool = True) -> bool:
    """Switch ``model`` from ``sdpa`` to ``VARLEN_SDPA`` when that gives the same results; say whether.

    Left as it is (``False``): any attention implementation other than sdpa, a model that does not
    keep packed samples apart, sliding-window or chunked attention that could act within
    ``max_seq_len``, or a probe (one packed row of three samples, evaluation mode, no gradient) whose
    logits differ between the two implementations.  ``probe=False`` skips the probe (a meta-device
    skeleton has no weights to run it with; its caller then takes the probed choice of rank 0).
    """
    model = unwrap_peft(model)
    if not isinstance(model, PreTrainedModel) or model.config._attn_implementation != "sdpa":
        return False
    if not model_supports_padding_free(model) or has_local_attention(model.config, max_seq_len):
        return False
    register_varlen_sdpa()
    if probe and not _probe_matches(model):
        logger.warning("varlen sdpa: %s gives different logits than sdpa; keeping sdpa", type(model).__name__)
        return False
    model.set_attn_implementation(VARLEN_SDPA)
    return True


def enable_for_own_rows(model: torch.nn.Module, args: Any, max_length: int | None) -> bool:
    """``enable_varlen_sdpa`` for a training step that packs its own padding-free rows (trl's DPO, KTO and
    reference-free steps: the loop's batch set-up, which enables it for token batches, does not run for
    them); say whether it switched.  ``max_length``: the step's longest sequence (None: unbounded).  Not
    with ``args.varlen_sdpa`` off, nor on a meta-device skeleton (no weights to probe: it keeps sdpa,
    which gives the same results more slowly)."""
    if not getattr(args, "varlen_sdpa", True) or any(p.is_meta for p in model.parameters()):
        return False
    return enable_varlen_sdpa(model, max_length if max_length is not None else 2**31 - 1)


def has_local_attention(config: Any, max_seq_len: int) -> bool:
    """Whether some layer attends within a window or chunk shorter than ``max_seq_len``."""
    layer_types = getattr(config, "layer_types", None) or ()
    if any(kind != "full_attention" for kind in layer_types):
        return True
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk is not None and chunk < max_seq_len:
        return True
    window = getattr(config, "sliding_window", None)
    return bool(window is not None and window < max_seq_len and getattr(config, "use_sliding_window", True))


def _probe_matches(model: PreTrainedModel) -> bool:
    """Logits of one packed row under sdpa and under ``VARLEN_SDPA`` agree (float32 tolerance)."""
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, vocab, (1, sum(_PROBE_SEGMENTS)), generator=generator)
    position_ids = torch.cat([torch.arange(length) for length in _PROBE_SEGMENTS]).unsqueeze(0)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            reference = model(input_ids=input_ids.to(device), position_ids=position_ids.to(device), use_cache=False)
            model.set_attn_implementation(VARLEN_SDPA)
            candidate = model(input_ids=input_ids.to(device), position_ids=position_ids.to(device), use_cache=False)
        return bool(torch.allclose(reference.logits.float(), candidate.logits.float(), rtol=1e-4, atol=1e-4))
    except Exception:
        logger.warning("varlen sdpa probe failed for %s; keeping sdpa", type(model).__name__, exc_info=True)
        return False
    finally:
        model.set_attn_implementation("sdpa")
        model.train(was_training)
