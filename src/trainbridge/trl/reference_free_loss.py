"""ORPO's and CPO's (SimPO's, AlphaPO's) losses and logged metrics from one micro-batch's ``PairScores``.

Neither uses a reference model: both are a pair loss over the policy's completion log-probs plus an NLL
on the chosen sequences.  ``ORPOLoss.from_config(ORPOConfig)`` / ``CPOLoss.from_config(CPOConfig)`` read
the fields of trl's config that shape them.  ``micro`` gives, for one rank's micro-batch, trl's loss of
that micro-batch (``get_batch_loss_metrics``: pair means and the token-mean NLL of the micro-batch) and
its metrics: ``pair_sums`` (summed over the pairs; trl means them over every rank's pairs) and
``rank_means`` (a value per rank; trl means them over the ranks).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from trainbridge.trl.pair_scores import PairScores

CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")
"""``CPOConfig.loss_type`` values (``alphapo`` is ``alpha != 0`` with any of them)."""

PAIR_KEYS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/rejected",
    "logps/chosen",
)
"""trl's per-pair metrics, each a mean over every rank's pairs of a micro-batch."""


class MicroLoss(NamedTuple):
    """One micro-batch: its loss (trl's ``get_batch_loss_metrics``) and its metrics' sums."""

    loss: torch.Tensor
    pair_sums: dict[str, torch.Tensor]
    rank_means: dict[str, torch.Tensor]


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, stable on both sides of ``-log 2``."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _mean_logps(scores: PairScores) -> torch.Tensor:
    return scores.completion_logps / scores.completion_tokens.to(scores.completion_logps.dtype)


def _chosen_nll(scores: PairScores) -> torch.Tensor:
    pairs = scores.pairs
    tokens = scores.scored_tokens[:pairs].sum().clamp(min=1).to(scores.scored_logps.dtype)
    return -scores.scored_logps[:pairs].sum() / tokens


def _pair_sums(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor, logps: torch.Tensor, pairs: int) -> Any:
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    return {
        "rewards/chosen": chosen_rewards.sum(),
        "rewards/rejected": rejected_rewards.sum(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().sum(),
        "rewards/margins": (chosen_rewards - rejected_rewards).sum(),
        "logps/rejected": logps[pairs:].detach().sum(),
        "logps/chosen": logps[:pairs].detach().sum(),
    }


def _logit_means(scores: PairScores) -> dict[str, torch.Tensor]:
    pairs = scores.pairs
    sums, counts = scores.logit_sums, scores.logit_positions.to(scores.logit_sums.dtype)
    return {
        "logits/rejected": sums[pairs:].sum() / counts[pairs:].sum().clamp(min=1),
        "logits/chosen": sums[:pairs].sum() / counts[:pairs].sum().clamp(min=1),
    }


@dataclass(frozen=True)
class ORPOLoss:
    """trl's ORPO: ``nll(chosen) - beta * mean(logsigmoid(log odds(chosen) - log odds(rejected)))`` over the
    completions' mean token log-probs; the NLL covers prompt and completion of the chosen sequences."""

    beta: float = 0.1
    whole_sequence = True
    rank_keys = ("logits/rejected", "logits/chosen", "nll_loss", "log_odds_ratio", "log_odds_chosen")

    @classmethod
    def from_config(cls, config: Any) -> ORPOLoss:
        return cls(beta=float(config.beta))

    def micro(self, scores: PairScores) -> MicroLoss:
        pairs = scores.pairs
        logps = _mean_logps(scores).float()
        chosen, rejected = logps[:pairs], logps[pairs:]
        log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected))
        ratio = F.logsigmoid(log_odds)
        nll = _chosen_nll(scores)
        loss = nll - (self.beta * ratio).mean()
        rank_means = {
            **_logit_means(scores),
            "nll_loss": nll.detach(),
            "log_odds_ratio": ratio.detach().mean(),
            "log_odds_chosen": log_odds.detach().mean(),
        }
        return MicroLoss(loss, _pair_sums(self.beta * chosen, self.beta * rejected, logps, pairs), rank_means)


@dataclass(frozen=True)
class CPOLoss:
    """trl's CPO: a DPO-like loss on the policy's own log-probs (no reference) plus ``cpo_alpha`` times the
    chosen completions' NLL; ``simpo`` is its length-normalised variant with margin ``simpo_gamma``;
    ``alpha != 0`` shapes the rewards as AlphaPO, ``(1 - p^-alpha) / alpha``."""

    loss_type: str = "sigmoid"
    beta: float = 0.1
    label_smoothing: float = 0.0
    cpo_alpha: float = 1.0
    simpo_gamma: float = 0.5
    alpha: float = 0.0
    whole_sequence = False
    rank_keys = ("logits/rejected", "logits/chosen", "nll_loss")

    def __post_init__(self) -> None:
        if self.loss_type not in CPO_LOSS_TYPES:
            raise ValueError(
                f"loss_type: {self.loss_type!r} is not a CPO loss; use one of {list(CPO_LOSS_TYPES)} "
                "(AlphaPO: any of them with alpha != 0; kto_pair: use KTOTrainer)"
            )

    @classmethod
    def from_config(cls, config: Any) -> CPOLoss:
        return cls(
            loss_type=str(config.loss_type),
            beta=float(config.beta),
            label_smoothing=float(config.label_smoothing),
            cpo_alpha=float(config.cpo_alpha),
            simpo_gamma=float(config.simpo_gamma),
            alpha=float(config.alpha),
        )

    def micro(self, scores: PairScores) -> MicroLoss:
        pairs = scores.pairs
        averaged = self.loss_type in ("ipo", "simpo")
        logps = _mean_logps(scores) if averaged else scores.completion_logps
        chosen, rejected = logps[:pairs], logps[pairs:]
        if self.alpha != 0.0:
            chosen_reward = (1 - torch.exp(chosen).pow(-self.alpha)) / self.alpha
            rejected_reward = (1 - torch.exp(rejected).pow(-self.alpha)) / self.alpha
        else:
            chosen_reward, rejected_reward = chosen, rejected
        logits = chosen_reward - rejected_reward
        beta, smoothing = self.beta, self.label_smoothing
        if self.loss_type == "simpo":
            logits = logits - self.simpo_gamma / beta
        if self.loss_type in ("sigmoid", "simpo"):
            losses = -F.logsigmoid(beta * logits) * (1 - smoothing) - F.logsigmoid(-beta * logits) * smoothing
        elif self.loss_type == "hinge":
            losses = torch.relu(1 - beta * logits)
        else:  # ipo
            losses = (logits - 1 / (2 * beta)) ** 2
        nll = _chosen_nll(scores) if self.cpo_alpha != 0 else torch.zeros((), device=logps.device)
        loss = losses.mean() + self.cpo_alpha * nll
        rank_means = {**_logit_means(scores), "nll_loss": nll.detach()}
        return MicroLoss(loss, _pair_sums(beta * chosen_reward, beta * rejected_reward, logps, pairs), rank_means)
