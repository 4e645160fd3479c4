"""The summed token cross entropy of one micro-batch.

``token_loss_sum`` returns the *sum* of the per-token losses and the number of tokens summed, never a
mean: the loop normalises by the step's global loss-token count, known locally from the step plan
(``data.batching``)::

    loss = loss_sum / step.loss_tokens * world_size

DDP (and FSDP / DeepSpeed) average gradients over ranks, so the ``* world_size`` makes the reduced
gradient the gradient of ``sum over all tokens of the step / step.loss_tokens`` -- the same whatever
the split into ranks and micro-batches, and whatever the samples' lengths.

**Without full-vocabulary logits.**  ``install_loss_head`` makes the model's output layer compute the
loss itself, from the hidden states, during the training forward (``token_loss_sum`` hands it the
labels): ``chunked`` (``chunked_linear_cross_entropy``, torch, any device: at most ``chunk_tokens`` x
vocabulary fp32 logits exist at a time, in forward and in backward) or ``liger`` (Liger-Kernel's fused
linear cross entropy, CUDA, optional extra ``trainbridge[liger]``).  The loss is computed *inside* the
output layer's forward, so FSDP2 / ZeRO-3 have its weight gathered there and see the loss as the
layer's output (their backward hooks fire as for logits).  Every other forward (evaluation outside the
loop, ``generate``) gets ordinary logits.
"""

from __future__ import annotations

import ast
import inspect
import logging
import textwrap
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from trainbridge.data.types import IGNORE_INDEX

logger = logging.getLogger(__name__)

MODEL_INPUT_KEYS = ("input_ids", "attention_mask", "position_ids")
"""Batch entries passed to the model (``labels`` never is: the loss is computed here)."""

FLASH_KWARG_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""Flash-attention varlen entries a collator may add (``data.collate.FLASH_ATTENTION_KWARGS``); passed on."""

LossImplementation = Literal["auto", "standard", "chunked", "liger"]

DEFAULT_CHUNK_TOKENS = 1024
"""Tokens per chunk of ``chunked_linear_cross_entropy`` (1024 x 128k vocabulary = 512 MiB fp32)."""


def token_loss_sum(
    model: torch.nn.Module, batch: Mapping[str, Any], num_tokens: int | None = None
) -> tuple[torch.Tensor, int]:
    """Forward ``batch`` and return ``(sum of token cross entropies, number of loss tokens)``.

    The model gets ``input_ids`` and ``position_ids`` (padding-free) or ``attention_mask`` (padded),
    with ``use_cache=False`` (a KV cache would stop transformers from detecting packed sequences), plus
    flash attention's ``cu_seq_lens_*``/``max_length_*`` when the batch has them.
    Logits at ``t`` are scored against ``labels`` at ``t + 1``, in float32, skipping ``-100``.  For a
    dummy micro-batch (no loss token) the sum is a zero that still depends on every parameter used by
    the forward, so ``backward`` runs and gradient hooks / collectives fire as on the other ranks.

    ``num_tokens``: the loss-token count when the caller knows it from CPU-side data (the loop takes it
    from the step plan); otherwise it is counted from ``labels`` (a host sync when they are on a GPU).
    """
    labels = batch["labels"]
    request = _LossRequest(labels)
    with _requested(request):
        logits = forward_logits(model, batch)
    if request.loss_sum is not None:  # the installed loss head computed it from the hidden states
        return request.loss_sum, _count_loss_tokens(labels) if num_tokens is None else num_tokens
    return logits_loss_sum(logits, labels, num_tokens)


def forward_logits(model: torch.nn.Module, batch: Mapping[str, Any]) -> torch.Tensor:
    """The model's logits for ``batch`` (only ``MODEL_INPUT_KEYS`` and ``FLASH_KWARG_KEYS`` are passed,
    ``use_cache=False``)."""
    inputs = {key: batch[key] for key in (*MODEL_INPUT_KEYS, *FLASH_KWARG_KEYS) if key in batch}
    return model(**inputs, use_cache=False).logits


def _count_loss_tokens(labels: torch.Tensor) -> int:
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


def logits_loss_sum(
    logits: torch.Tensor, labels: torch.Tensor, num_tokens: int | None = None
) -> tuple[torch.Tensor, int]:
    """``(sum of shifted token cross entropies, number of loss tokens)`` of ``logits`` against ``labels``
    (``num_tokens`` when the caller knows it from CPU-side data: no count on the device)."""
    if num_tokens is None:
        num_tokens = _count_loss_tokens(labels)
    if num_tokens == 0:
        return logits.sum() * 0.0, 0
    # Shift the labels, not the logits: no copy of the [B, T, V] logits.
    shifted_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
    loss_sum = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        shifted_labels.reshape(-1).to(logits.device),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return loss_sum, num_tokens


# ============================================================================ chunked linear cross entropy
class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``sum CE(hidden @ weight.T (+ bias), labels)`` over rows, chunk by chunk; backward recomputes each
    chunk's logits, so no more than one chunk of fp32 logits ever exists."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        labels: torch.Tensor,
        chunk_tokens: int,
    ) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        lse_chunks = []
        for start in range(0, hidden.shape[0], chunk_tokens):
            h, y = hidden[start : start + chunk_tokens], labels[start : start + chunk_tokens]
            logits = _chunk_logits(h, weight, bias)
            lse = torch.logsumexp(logits, dim=-1)
            valid = y != IGNORE_INDEX
            target = logits.gather(1, y.clamp(min=0).unsqueeze(1)).squeeze(1)
            total = total + torch.where(valid, lse - target, torch.zeros_like(lse)).sum()
            lse_chunks.append(lse)
        ctx.save_for_backward(hidden, weight, bias, labels, torch.cat(lse_chunks))
        ctx.chunk_tokens = chunk_tokens
        return total

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        chunk_tokens = ctx.chunk_tokens
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if ctx.needs_input_grad[1] else None
        )
        grad_bias = (
            torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
            if bias is not None and ctx.needs_input_grad[2]
            else None
        )
        for start in range(0, hidden.shape[0], chunk_tokens):
            h, y = hidden[start : start + chunk_tokens], labels[start : start + chunk_tokens]
            logits = _chunk_logits(h, weight, bias)
            # d(lse - logit_y)/d logits = softmax - onehot(y); zero on ignored rows; times the upstream grad
            grad_logits = torch.exp(logits - lse[start : start + chunk_tokens].unsqueeze(1))
            valid = y != IGNORE_INDEX
            grad_logits.scatter_add_(
                1, y.clamp(min=0).unsqueeze(1), torch.full_like(lse[start : start + chunk_tokens], -1.0).unsqueeze(1)
            )
            grad_logits = grad_logits * (valid.unsqueeze(1) * grad_output.float())
            if grad_hidden is not None:
                grad_hidden[start : start + chunk_tokens] = (grad_logits @ weight.float()).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += grad_logits.t() @ h.float()
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0)
        return (
            grad_hidden,
            grad_weight.to(weight.dtype) if grad_weight is not None else None,
            grad_bias.to(bias.dtype) if grad_bias is not None else None,
            None,
            None,
        )


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 logits of one chunk; the matmul in the hidden states' dtype (bf16 under mixed precision)."""
    return F.linear(hidden, weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype)).float()


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """Summed cross entropy of ``hidden @ weight.T (+ bias)`` (``hidden`` ``[N, H]``, ``weight``
    ``[V, H]``) against ``labels`` ``[N]`` (``-100`` skipped), in fp32, ``chunk_tokens`` rows at a time.

    Equal, to float32 rounding, to ``F.cross_entropy(F.linear(hidden, weight, bias).float(), labels,
    reduction="sum")``, and so are its gradients; peak extra memory is one ``[chunk_tokens, V]`` fp32
    block instead of ``[N, V]`` (the full logits, their fp32 copy and the softmax).
    """
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, bias, labels, chunk_tokens)


# ============================================================================ the loss head
@dataclass
class _LossRequest:
    """Labels of the forward ``token_loss_sum`` is running, and the loss sum the head computed."""

    labels: torch.Tensor
    loss_sum: torch.Tensor | None = None


_request: _LossRequest | None = None


@contextmanager
def _requested(request: _LossRequest) -> Iterator[None]:
    global _request
    previous, _request = _request, request
    try:
        yield
    finally:
        _request = previous


def resolve_loss_implementation(requested: LossImplementation, device: torch.device) -> str:
    """``auto``: ``liger`` on CUDA when Liger-Kernel is installed, else ``chunked`` on CUDA, ``standard`` on
    CPU (no memory pressure there, and full logits measured as fast).  Explicit choices are checked."""
    if requested == "auto":
        if device.type != "cuda":
            return "standard"
        return "liger" if _liger_loss_class() is not None else "chunked"
    if requested == "liger":
        if device.type != "cuda":
            raise ValueError(f"loss_implementation: 'liger' needs CUDA (device is {device.type}); use 'chunked'")
        if _liger_loss_class() is None:
            raise ValueError("loss_implementation: 'liger' needs Liger-Kernel: pip install 'trainbridge[liger]'")
    return requested


def _liger_loss_class() -> Any:
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    return LigerFusedLinearCrossEntropyLoss


def install_loss_head(model: torch.nn.Module, implementation: str, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> bool:
    """Make ``model``'s output layer compute the training loss from hidden states (see the module
    docstring); returns whether it did.  ``standard`` does nothing.  A model whose ``forward`` does more
    to the logits than the output layer (soft-capping, scaling), or whose output layer is not an
    ``nn.Linear``, keeps the standard loss (with a warning).  Call before wrapping the model."""
    if implementation == "standard":
        return False
    get_base = getattr(model, "get_base_model", None)  # a PEFT model: its base model's forward and head
    if callable(get_base):
        model = get_base()
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, torch.nn.Linear) or not _logits_come_straight_from(type(model), head, model):
        logger.warning(
            "loss_implementation=%r: %s post-processes its logits or has no linear output layer; "
            "using the standard loss",
            implementation,
            type(model).__name__,
        )
        return False
    if implementation == "liger":
        liger = _liger_loss_class()(ignore_index=IGNORE_INDEX, reduction="sum")

        def loss_fn(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
            return liger(w, h, y, b)
    else:

        def loss_fn(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
            return chunked_linear_cross_entropy(h, w, y, b, chunk_tokens)

    original = head.forward

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        request = _request
        if request is None or request.loss_sum is not None or hidden_states.shape[:2] != request.labels.shape:
            return original(hidden_states)
        labels = F.pad(request.labels, (0, 1), value=IGNORE_INDEX)[:, 1:].to(hidden_states.device)
        loss_sum = loss_fn(
            hidden_states.reshape(-1, hidden_states.shape[-1]), head.weight, labels.reshape(-1), head.bias
        )
        request.loss_sum = loss_sum.float()
        # The loss is this layer's output (FSDP2's backward hooks attach to it); the model returns it
        # as its "logits", which token_loss_sum ignores.
        return request.loss_sum.reshape(1, 1, 1)

    head.forward = forward  # type: ignore[method-assign,assignment]
    return True


def _logits_come_straight_from(model_class: type, head: torch.nn.Module, model: torch.nn.Module) -> bool:
    """The class's ``forward`` assigns ``logits`` exactly once, from a call of the output layer."""
    head_names = {name for name, module in model.named_children() if module is head}
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(model_class.forward)))  # type: ignore[attr-defined]
    except (OSError, TypeError, SyntaxError):
        return False
    values = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "logits" for t in targets):
                values.append(node.value)
    if len(values) != 1 or isinstance(values[0], type(None)):
        return False
    call = values[0]
    return (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and isinstance(call.func.value, ast.Name)
        and call.func.value.id == "self"
        and call.func.attr in head_names
    )
