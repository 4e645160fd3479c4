"""trl's per-token training metrics: ``entropy``, ``mean_token_accuracy`` and ``num_tokens``.

``token_metric_sums`` gives, for one micro-batch's logits and (unshifted) labels, the sums trl's fused LM
head yields over the scored tokens: the next-token distribution's entropy, the tokens whose label is
the top-1 prediction, and their count.  ``TokenMetrics`` keeps trl's logging rule: each micro-batch
contributes one ratio (its sums reduced over ranks, then divided), a log reports the mean of the ratios
since the last log, and ``num_tokens`` is the running count of every rank's input tokens.  An evaluation
reports the mean of its batches' ratios (``eval_logs``) and the training's ``num_tokens`` so far.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from trainbridge.data.types import IGNORE_INDEX

TOKEN_SUMS = ("entropy", "hits", "tokens")
"""The names of ``token_metric_sums``' values, in its order."""


def token_metric_sums(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``[entropy sum, top-1 hits, scored tokens]`` of ``logits`` ``[B, T, V]`` against ``labels`` ``[B, T]``
    (the logit at ``t`` scores the label at ``t + 1``; ``-100`` skipped), in float32, without gradient."""
    with torch.no_grad():
        targets = labels[:, 1:].to(logits.device)
        mask = targets != IGNORE_INDEX
        scored = logits[:, :-1][mask].float()
        log_probs = torch.log_softmax(scored, dim=-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1).sum()
        hits = (scored.argmax(-1) == targets[mask]).sum().float()
        return torch.stack([entropy, hits, mask.sum().float()])


@dataclass
class TokenMetrics:
    """trl's ``_metrics`` for ``entropy``/``mean_token_accuracy``/``num_tokens`` (see module doc)."""

    entropy: list[float] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    total_tokens: int = 0

    def add(self, sums: list[float], input_tokens: int | None = None) -> None:
        """One micro-batch: ``sums`` from ``token_metric_sums`` reduced over ranks; ``input_tokens``: every
        rank's input tokens of it (training only)."""
        entropy, hits, tokens = sums
        self.entropy.append(entropy / tokens if tokens > 0 else 0.0)
        self.accuracy.append(hits / tokens if tokens > 0 else 0.0)
        if input_tokens is not None:
            self.total_tokens += int(input_tokens)

    def log(self) -> dict[str, float]:
        """The values a log reports, and a fresh interval (``num_tokens`` keeps counting)."""
        logs: dict[str, float] = {}
        if self.entropy:
            logs["entropy"] = sum(self.entropy) / len(self.entropy)
            logs["mean_token_accuracy"] = sum(self.accuracy) / len(self.accuracy)
        logs["num_tokens"] = float(self.total_tokens)
        self.entropy.clear()
        self.accuracy.clear()
        return logs


def eval_logs(rows: list[dict[str, float]], total_tokens: int) -> dict[str, float]:
    """An evaluation's ``entropy``/``mean_token_accuracy`` (the mean over its batches of each batch's ratio,
    ``rows`` holding every batch's ``token_metric_sums`` reduced over ranks, by ``TOKEN_SUMS`` name) and
    ``num_tokens``, the training's input tokens so far, as trl's ``SFTTrainer`` logs them."""
    metrics = TokenMetrics(total_tokens=total_tokens)
    for row in rows:
        metrics.add([row[key] for key in TOKEN_SUMS])
    return metrics.log()
