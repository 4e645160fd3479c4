"""Reference-free pairs (ORPO, CPO) scored by one padding-free forward: what trl reads from padded logits.

``pack_labelled_pairs`` lays the chosen and the rejected sequence of every pair end to end in one row
(chosen first, as trl's concatenated batch), ``position_ids`` restarting at 0 for each.  ``score_pairs``
runs the model once on it and gives per sequence, as sums with their counts:

- the completion's label log-probs (trl's ``get_batch_logps``: labels past the first token, ``-100`` on
  the prompt);
- for ORPO's NLL (``whole_sequence=True``), the log-probs of every token after the first (trl's ORPO
  computes its chosen NLL over prompt and completion); for CPO, the completion's;
- the mean-over-vocabulary logit of the positions trl averages for ``logits/*``: every position but the
  last (ORPO) or every position (CPO).  trl averages over its padded tensor, pad positions included;
  here only real positions count, so the two agree when a micro-batch needs no padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from trainbridge.data.collate import CollatedBatch
from trainbridge.data.loss import forward_logits
from trainbridge.data.types import IGNORE_INDEX
from trainbridge.modeling.varlen_attention import sample_segments


@dataclass(frozen=True)
class LabelledPairs:
    """``pairs`` pairs packed into one padding-free row (``batch``), and what maps positions to sequences."""

    batch: CollatedBatch
    """``input_ids`` and ``position_ids``, ``[1, T]``; ``seq_lens`` the sequences' lengths."""
    pairs: int
    positions: torch.Tensor
    """Row positions of the scored tokens (each predicted by the logit one position before it)."""
    owner: torch.Tensor
    """The sequence of each scored token: ``i`` chosen of pair ``i``, ``pairs + i`` rejected of pair ``i``."""
    in_completion: torch.Tensor
    """Whether each scored token is a completion label (else a prompt token scored for ORPO's NLL)."""
    completion_tokens: torch.Tensor
    """Completion labels of each sequence ``[2 * pairs]``."""
    scored_tokens: torch.Tensor
    """Scored tokens of each sequence ``[2 * pairs]`` (the NLL's count)."""
    logit_owner: torch.Tensor
    """For every row position, the sequence whose ``logits/*`` it counts towards, or ``-1``."""
    logit_positions: torch.Tensor
    """Positions counted for ``logits/*`` of each sequence ``[2 * pairs]``."""


def pack_labelled_pairs(
    chosen_ids: Sequence[Sequence[int]],
    chosen_labels: Sequence[Sequence[int]],
    rejected_ids: Sequence[Sequence[int]],
    rejected_labels: Sequence[Sequence[int]],
    whole_sequence: bool,
) -> LabelledPairs:
    """Pack the pairs (see the module docstring); ``whole_sequence``: ORPO's scoring and ``logits/*``."""
    pairs = len(chosen_ids)
    if not pairs or not len(chosen_labels) == len(rejected_ids) == len(rejected_labels) == pairs:
        raise ValueError("pack_labelled_pairs: give ids and labels of chosen and rejected for at least one pair")
    sequences = [*zip(chosen_ids, chosen_labels, strict=True), *zip(rejected_ids, rejected_labels, strict=True)]
    input_ids: list[int] = []
    positions: list[int] = []
    owner: list[int] = []
    in_completion: list[bool] = []
    logit_owner: list[int] = []
    completion, scored, logit_positions = [], [], []
    for index, (ids, labels) in enumerate(sequences):
        if len(ids) != len(labels):
            raise ValueError(f"pack_labelled_pairs: sequence {index} has {len(ids)} ids and {len(labels)} labels")
        start = len(input_ids)
        input_ids.extend(ids)
        counted = 0
        for t in range(1, len(ids)):  # a sequence's first token is never predicted
            label = labels[t] != IGNORE_INDEX
            if label or (whole_sequence and index < pairs):
                positions.append(start + t)
                owner.append(index)
                in_completion.append(label)
                counted += 1
        completion.append(sum(1 for label in labels[1:] if label != IGNORE_INDEX))
        scored.append(counted)
        counted_logits = len(ids) - 1 if whole_sequence else len(ids)
        logit_owner.extend([index] * counted_logits + [-1] * (len(ids) - counted_logits))
        logit_positions.append(counted_logits)
    batch = CollatedBatch(
        input_ids=torch.tensor([input_ids], dtype=torch.long),
        position_ids=torch.tensor([[p for ids, _ in sequences for p in range(len(ids))]], dtype=torch.long),
    )
    batch.seq_lens = (tuple(len(ids) for ids, _ in sequences),)
    return LabelledPairs(
        batch=batch,
        pairs=pairs,
        positions=torch.tensor(positions, dtype=torch.long),
        owner=torch.tensor(owner, dtype=torch.long),
        in_completion=torch.tensor(in_completion, dtype=torch.bool),
        completion_tokens=torch.tensor(completion, dtype=torch.long),
        scored_tokens=torch.tensor(scored, dtype=torch.long),
        logit_owner=torch.tensor(logit_owner, dtype=torch.long),
        logit_positions=torch.tensor(logit_positions, dtype=torch.long),
    )


@dataclass(frozen=True)
class PairScores:
    """Per-sequence sums of one forward (``[2 * pairs]`` each, chosen first)."""

    completion_logps: torch.Tensor
    """Sum of the completion labels' log-probs; carries the gradient."""
    scored_logps: torch.Tensor
    """Sum of the log-probs of every scored token (the NLL's numerator, negated); carries the gradient."""
    completion_tokens: torch.Tensor
    scored_tokens: torch.Tensor
    logit_sums: torch.Tensor
    """Sum over the counted positions of the mean-over-vocabulary logit (no gradient)."""
    logit_positions: torch.Tensor
    pairs: int


def score_pairs(model: torch.nn.Module, packed: LabelledPairs) -> PairScores:
    """One forward of ``packed`` through ``model`` (see the module docstring)."""
    device = next(model.parameters()).device
    batch = CollatedBatch({key: value.to(device) for key, value in packed.batch.items()})
    batch.seq_lens = packed.batch.seq_lens
    with sample_segments(batch):
        logits = forward_logits(model, batch)[0]
    positions = packed.positions.to(device)
    targets = batch["input_ids"][0, positions]
    log_probs = torch.log_softmax(logits[positions - 1].float(), dim=-1)
    token_logps = log_probs.gather(1, targets.unsqueeze(1)).squeeze(1)
    owner = packed.owner.to(device)
    sequences = 2 * packed.pairs

    def per_sequence(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return torch.zeros(sequences, dtype=values.dtype, device=device).index_add(0, index, values)

    scored = per_sequence(token_logps, owner)
    completion = per_sequence(token_logps * packed.in_completion.to(device), owner)
    if positions.numel() == 0:  # nothing scored: a zero that still depends on the forward, so backward runs
        scored = scored + logits.sum() * 0.0
        completion = completion + logits.sum() * 0.0
    with torch.no_grad():
        logit_owner = packed.logit_owner.to(device)
        counted = (logit_owner >= 0).nonzero().squeeze(1)
        logit_sums = per_sequence(logits[counted].float().mean(-1), logit_owner[counted])
    return PairScores(
        completion_logps=completion,
        scored_logps=scored,
        completion_tokens=packed.completion_tokens.to(device),
        scored_tokens=packed.scored_tokens.to(device),
        logit_sums=logit_sums,
        logit_positions=packed.logit_positions.to(device),
        pairs=packed.pairs,
    )
