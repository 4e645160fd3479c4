"""Per-sequence completion log-probs of preference pairs from one padding-free forward.

``pack_pairs`` lays the chosen and the rejected sequence of every pair (``prompt + completion``,
truncated to ``max_length`` as trl's ``DataCollatorForPreference`` does) end to end in one row, with
``position_ids`` restarting at 0 for each (``data.collate``'s padding-free layout): chosen rows first,
then rejected rows, as trl's batch is.  ``sequence_stats`` runs the model once on that row and sums,
per sequence, what trl's fused LM head gives per completion token: the label's log-prob, and for the
metrics the mean logit, the entropy and whether the label was the top-1 token.  The result equals
separate padded forwards (``tests/unit/test_trl_sequence_logps.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainbridge.data.collate import CollatedBatch
from trainbridge.data.loss import forward_logits
from trainbridge.data.types import IGNORE_INDEX
from trainbridge.modeling.varlen_attention import sample_segments
from trainbridge.trl.preference_loss import SequenceLogps


@dataclass(frozen=True)
class PackedPairs:
    """``pairs`` preference pairs as one padding-free row (``batch``) and what maps tokens to sequences."""

    batch: CollatedBatch
    """``input_ids``, ``position_ids``, ``labels`` (completion tokens; ``-100`` elsewhere), ``[1, T]``."""
    pairs: int
    sequence_of_label: torch.Tensor
    """For each label (``labels != -100``, in row order), its sequence: ``i`` chosen of pair ``i``,
    ``pairs + i`` rejected of pair ``i``."""
    beyond_shared: torch.Tensor
    """For each label, whether it lies past the shorter completion of its pair (LD-DPO's verbose tail)."""
    completion_tokens: torch.Tensor
    """Scored completion tokens of each sequence ``[2 * pairs]`` (chosen first)."""
    label_positions: torch.Tensor
    """Column of each label in the row (from the CPU-side lists: no ``nonzero`` on the device, which waits
    for the queued kernels on a GPU)."""


def truncate(ids: list[int], mask: list[int], max_length: int | None, mode: str) -> tuple[list[int], list[int]]:
    """trl's per-sequence truncation: ``keep_start`` keeps the first ``max_length`` tokens, ``keep_end``
    the last."""
    if max_length is None:
        return ids, mask
    if mode == "keep_start":
        return ids[:max_length], mask[:max_length]
    if mode == "keep_end":
        return ids[-max_length:], mask[-max_length:]
    raise ValueError(f"truncation_mode: {mode!r}; use 'keep_start' or 'keep_end'")


def pack_pairs(
    prompts: Sequence[Sequence[int]],
    chosen: Sequence[Sequence[int]],
    rejected: Sequence[Sequence[int]],
    max_length: int | None = None,
    truncation_mode: str = "keep_start",
) -> PackedPairs:
    """Pack the pairs ``(prompts[i] + chosen[i], prompts[i] + rejected[i])`` into one row (see module doc)."""
    if not len(prompts) == len(chosen) == len(rejected) or not prompts:
        raise ValueError(
            f"pack_pairs: {len(prompts)} prompts, {len(chosen)} chosen, {len(rejected)} rejected; "
            "give one of each per pair, at least one pair"
        )
    sequences = []
    for completions in (chosen, rejected):
        for prompt, completion in zip(prompts, completions, strict=True):
            ids = [*prompt, *completion]
            mask = [0] * len(prompt) + [1] * len(completion)
            sequences.append(truncate(ids, mask, max_length, truncation_mode))
    pairs = len(prompts)
    input_ids: list[int] = []
    labels: list[int] = []
    position_ids: list[int] = []
    owner: list[int] = []
    rank: list[int] = []
    columns: list[int] = []
    counts = []
    for index, (ids, mask) in enumerate(sequences):
        scored = [False, *(bool(m) for m in mask[1:])]  # a sequence's first token is never predicted
        start = len(input_ids)
        input_ids.extend(ids)
        position_ids.extend(range(len(ids)))
        labels.extend(token if keep else IGNORE_INDEX for token, keep in zip(ids, scored, strict=True))
        count = 0
        for column, keep in enumerate(scored, start):
            if keep:
                count += 1
                owner.append(index)
                rank.append(count)
                columns.append(column)
        counts.append(count)
    shared = [min(counts[i % pairs], counts[i % pairs + pairs]) for i in range(2 * pairs)]
    batch = CollatedBatch(
        input_ids=torch.tensor([input_ids], dtype=torch.long),
        labels=torch.tensor([labels], dtype=torch.long),
        position_ids=torch.tensor([position_ids], dtype=torch.long),
    )
    batch.seq_lens = (tuple(len(ids) for ids, _ in sequences),)
    return PackedPairs(
        batch=batch,
        pairs=pairs,
        sequence_of_label=torch.tensor(owner, dtype=torch.long),
        beyond_shared=torch.tensor([r > shared[o] for o, r in zip(owner, rank, strict=True)], dtype=torch.bool),
        completion_tokens=torch.tensor(counts, dtype=torch.long),
        label_positions=torch.tensor(columns, dtype=torch.long),
    )


@dataclass(frozen=True)
class SequenceStats:
    """Per-sequence sums over completion tokens (``[2 * pairs]``, chosen first)."""

    logps: torch.Tensor
    """Label log-probs (LD-DPO-weighted with ``ld_alpha``); carries the gradient."""
    tokens: torch.Tensor
    mean_logits: torch.Tensor
    """Sums of the mean-over-vocabulary logit at each completion token (trl's ``logits/*``)."""
    entropy: torch.Tensor
    top1: torch.Tensor
    """Completion tokens whose label is the model's most likely token (``mean_token_accuracy``)."""
    aligned_logps: torch.Tensor
    """Sums of ``log p(label) - log sum_v p_v^2`` (WPO's weights); no gradient."""

    def pair_logps(self) -> SequenceLogps:
        chosen, rejected = self.logps.chunk(2)
        return SequenceLogps(chosen=chosen, rejected=rejected)


def sequence_stats(model: torch.nn.Module, packed: PackedPairs, ld_alpha: float | None = None) -> SequenceStats:
    """One forward of ``packed`` through ``model``; per-sequence sums (see module doc)."""
    batch = packed.batch
    device = next(model.parameters()).device
    on_device = CollatedBatch({key: value.to(device, non_blocking=True) for key, value in batch.items()})
    on_device.seq_lens = batch.seq_lens
    with sample_segments(on_device):
        logits = forward_logits(model, on_device)
    labels = on_device["labels"][0]
    positions = packed.label_positions.to(device, non_blocking=True)
    scored = logits[0, positions - 1].float()  # the logit at t predicts the token at t + 1
    log_probs = torch.log_softmax(scored, dim=-1)
    targets = labels[positions]
    token_logps = log_probs.gather(1, targets.unsqueeze(1)).squeeze(1)
    owner = packed.sequence_of_label.to(device, non_blocking=True)
    if ld_alpha is not None:
        token_logps = token_logps * torch.where(packed.beyond_shared.to(device, non_blocking=True), ld_alpha, 1.0)
    sequences = 2 * packed.pairs

    def per_sequence(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(sequences, dtype=values.dtype, device=device).index_add(0, owner, values)

    with torch.no_grad():
        probs = log_probs.exp()
        entropy = -(probs * log_probs).sum(-1)
        top1 = (scored.argmax(-1) == targets).float()
        aligned = log_probs.gather(1, targets.unsqueeze(1)).squeeze(1) - torch.logsumexp(2 * log_probs, dim=-1)
    sequence_logps = per_sequence(token_logps)
    if positions.numel() == 0:  # nothing scored: a zero that still depends on the forward, so backward runs
        sequence_logps = sequence_logps + logits.sum() * 0.0
    return SequenceStats(
        logps=sequence_logps,
        tokens=packed.completion_tokens.to(device, non_blocking=True),
        mean_logits=per_sequence(scored.detach().mean(-1)),
        entropy=per_sequence(entropy),
        top1=per_sequence(top1),
        aligned_logps=per_sequence(aligned),
    )
