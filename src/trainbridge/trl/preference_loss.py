"""DPO's losses and metrics as pure functions of per-sequence log-probs (trl ``DPOTrainer``'s numbers).

``DPOLossSettings.from_config(DPOConfig)`` reads the fields of trl's config that shape the loss and
rejects the combinations trl rejects.  ``dpo_loss_terms`` gives, per ``loss_type``, the *sum* of the
term over the pairs it is given (or, for ``sft``, over the chosen completion tokens) and what that sum
is normalised by, so a step can divide by the step's global count: one micro-batch holding every pair
reproduces trl's ``loss`` exactly (``tests/unit/test_trl_preference_loss.py`` compares with trl's own
``_compute_loss`` on the same tensors).  ``dpo_metric_sums`` gives trl's logged metrics as sums and
counts, reduced across micro-batches and ranks before the one division.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

LOSS_TYPES = (
    "sigmoid",
    "hinge",
    "ipo",
    "exo_pair",
    "nca_pair",
    "robust",
    "bco_pair",
    "sppo_hard",
    "aot",
    "aot_unpaired",
    "apo_zero",
    "apo_down",
    "discopop",
    "sft",
    "sigmoid_norm",
)
"""Every ``DPOConfig.loss_type`` value of trl 1.16."""

BATCH_SORTED_LOSS_TYPES = frozenset({"aot", "aot_unpaired"})
"""Losses that sort the log-ratios across the pairs they are given: their value depends on which pairs
share a micro-batch (trl's is ``per_device_train_batch_size`` pairs)."""

F_DIVERGENCE_LOSS_TYPES = frozenset(
    {"sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft"}
)
"""Loss types that accept a non-default ``f_divergence_type`` (as in trl)."""

F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")

Normaliser = Literal["pairs", "chosen_tokens"]


@dataclass(frozen=True)
class SequenceLogps:
    """Per-pair completion log-probs of one model: ``chosen[i]``/``rejected[i]`` are the sums of the
    completion tokens' log-probs of pair ``i`` (``[B]`` each)."""

    chosen: torch.Tensor
    rejected: torch.Tensor


@dataclass(frozen=True)
class DPOLossSettings:
    """The fields of trl's ``DPOConfig`` that shape the loss."""

    loss_type: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] | None = None
    """One weight per loss type; None: 1.0 each."""
    beta: float = 0.1
    label_smoothing: float = 0.0
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    discopop_tau: float = 0.05
    use_weighting: bool = False
    ld_alpha: float | None = None

    def __post_init__(self) -> None:
        unknown = [t for t in self.loss_type if t not in LOSS_TYPES]
        if unknown:
            raise ValueError(f"loss_type: {unknown} not known; use one of {list(LOSS_TYPES)}")
        if self.loss_weights is not None and len(self.loss_weights) != len(self.loss_type):
            raise ValueError(
                f"loss_weights: {list(self.loss_weights)} has {len(self.loss_weights)} weights for "
                f"{len(self.loss_type)} loss types {list(self.loss_type)}; give one weight per type"
            )
        if self.f_divergence_type not in F_DIVERGENCES:
            raise ValueError(f"f_divergence_type: {self.f_divergence_type!r}; use one of {list(F_DIVERGENCES)}")
        if self.f_divergence_type != "reverse_kl" and not set(self.loss_type) <= F_DIVERGENCE_LOSS_TYPES:
            raise ValueError(
                f"f_divergence_type={self.f_divergence_type!r} works only with loss types "
                f"{sorted(F_DIVERGENCE_LOSS_TYPES)}, not {list(self.loss_type)}; use 'reverse_kl'"
            )
        if self.use_weighting and set(self.loss_type) & BATCH_SORTED_LOSS_TYPES:
            raise ValueError("use_weighting: not supported with the 'aot'/'aot_unpaired' loss types (as in trl)")
        if "robust" in self.loss_type and not 0.0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing: {self.label_smoothing} with loss_type 'robust' must be in [0, 0.5)")
        if "exo_pair" in self.loss_type and self.label_smoothing == 0.0:
            raise ValueError("label_smoothing: 'exo_pair' needs label_smoothing > 0 (the paper suggests 1e-3)")
        if self.ld_alpha is not None and not 0.0 <= self.ld_alpha <= 1.0:
            raise ValueError(f"ld_alpha: {self.ld_alpha} must be in [0, 1] (or None)")

    @property
    def weights(self) -> tuple[float, ...]:
        return self.loss_weights if self.loss_weights is not None else (1.0,) * len(self.loss_type)

    @classmethod
    def from_config(cls, config: Any) -> DPOLossSettings:
        """From trl's ``DPOConfig`` (or any object with its field names)."""
        loss_type = config.loss_type
        loss_type = (loss_type,) if isinstance(loss_type, str) else tuple(loss_type)
        weights = getattr(config, "loss_weights", None)
        return cls(
            loss_type=loss_type,
            loss_weights=tuple(float(w) for w in weights) if weights else None,
            beta=float(config.beta),
            label_smoothing=float(getattr(config, "label_smoothing", 0.0)),
            f_divergence_type=str(getattr(config, "f_divergence_type", "reverse_kl")),
            f_alpha_divergence_coef=float(getattr(config, "f_alpha_divergence_coef", 0.5)),
            discopop_tau=float(getattr(config, "discopop_tau", 0.05)),
            use_weighting=bool(getattr(config, "use_weighting", False)),
            ld_alpha=getattr(config, "ld_alpha", None),
        )


@dataclass(frozen=True)
class LossTerm:
    """One weighted term of the loss: ``weight * total / (the step's count of normaliser)``."""

    loss_type: str
    weight: float
    total: torch.Tensor
    normaliser: Normaliser


def _scores(logratios: torch.Tensor, settings: DPOLossSettings) -> torch.Tensor:
    """The f-divergence's ``f'`` of the policy/reference ratio (``reverse_kl``: the log-ratio itself)."""
    kind = settings.f_divergence_type
    if kind == "reverse_kl":
        return logratios
    if kind == "forward_kl":
        return 1 - torch.exp(-logratios)
    if kind == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    alpha = settings.f_alpha_divergence_coef
    if abs(alpha - 1.0) < 1e-6:
        return logratios
    clamp_max = {torch.float16: 11.0}.get(logratios.dtype, 80.0)
    t = torch.clamp(((alpha - 1.0) * logratios).float(), max=clamp_max)
    return (torch.exp(t) - 1.0).to(logratios.dtype) / (alpha - 1.0)


def _soft_dpo(delta: torch.Tensor, beta: float, smoothing: float) -> torch.Tensor:
    return -F.logsigmoid(beta * delta) * (1 - smoothing) - F.logsigmoid(-beta * delta) * smoothing


def dpo_loss_terms(
    policy: SequenceLogps,
    reference: SequenceLogps,
    settings: DPOLossSettings,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    weights: torch.Tensor | None = None,
) -> list[LossTerm]:
    """The weighted loss terms of the pairs given (see the module docstring).

    ``chosen_tokens``/``rejected_tokens``: completion lengths ``[B]`` (IPO and ``sigmoid_norm`` average
    per token; ``sft`` is the chosen completions' mean token NLL).  ``weights``: WPO's per-pair weights
    (``use_weighting``; ``pair_weights``), detached.
    """
    chosen_ratio = policy.chosen - reference.chosen
    rejected_ratio = policy.rejected - reference.rejected
    chosen_score, rejected_score = _scores(chosen_ratio, settings), _scores(rejected_ratio, settings)
    delta = chosen_score - rejected_score
    chosen_len = chosen_tokens.to(delta.dtype).clamp(min=1.0)
    rejected_len = rejected_tokens.to(delta.dtype).clamp(min=1.0)
    terms = []
    for loss_type, weight in zip(settings.loss_type, settings.weights, strict=True):
        if loss_type == "sft":  # trl: the chosen tokens' mean NLL, times the mean pair weight
            total = -policy.chosen.sum() * (1.0 if weights is None else weights.mean())
            terms.append(LossTerm(loss_type, weight, total, "chosen_tokens"))
            continue
        per_pair = _per_pair_loss(
            loss_type,
            settings,
            policy,
            reference,
            chosen_ratio,
            rejected_ratio,
            chosen_score,
            rejected_score,
            delta,
            chosen_len,
            rejected_len,
        )
        if weights is not None:
            per_pair = per_pair * weights
        terms.append(LossTerm(loss_type, weight, per_pair.sum(), "pairs"))
    return terms


def _per_pair_loss(
    loss_type: str,
    s: DPOLossSettings,
    policy: SequenceLogps,
    reference: SequenceLogps,
    chosen_ratio: torch.Tensor,
    rejected_ratio: torch.Tensor,
    chosen_score: torch.Tensor,
    rejected_score: torch.Tensor,
    delta: torch.Tensor,
    chosen_len: torch.Tensor,
    rejected_len: torch.Tensor,
) -> torch.Tensor:
    beta, eps = s.beta, s.label_smoothing
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * delta)
    if loss_type == "hinge":
        return torch.relu(1 - beta * delta)
    if loss_type == "ipo":  # per-token log-ratios (trl's normalisation, confirmed with the IPO authors)
        return (chosen_score / chosen_len - rejected_score / rejected_len - 1 / (2 * beta)) ** 2
    if loss_type == "sigmoid_norm":
        return -F.logsigmoid(beta * (chosen_score / chosen_len - rejected_score / rejected_len))
    if loss_type == "exo_pair":
        epsilon = torch.tensor(eps, device=delta.device)
        return torch.sigmoid(beta * delta) * (F.logsigmoid(beta * delta) - torch.log1p(-epsilon)) + torch.sigmoid(
            -beta * delta
        ) * (F.logsigmoid(-beta * delta) - torch.log(epsilon))
    if loss_type == "nca_pair":
        chosen_reward, rejected_reward = beta * chosen_ratio, beta * rejected_ratio
        return -F.logsigmoid(chosen_reward) - 0.5 * F.logsigmoid(-chosen_reward) - 0.5 * F.logsigmoid(-rejected_reward)
    if loss_type == "robust":
        return (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
    if loss_type == "bco_pair":
        return -F.logsigmoid(beta * chosen_ratio) - F.logsigmoid(-beta * rejected_ratio)
    if loss_type == "sppo_hard":
        return (chosen_ratio - 0.5 / beta) ** 2 + (rejected_ratio + 0.5 / beta) ** 2
    if loss_type == "aot":
        logratios = torch.sort(policy.chosen - policy.rejected, dim=0).values
        ref_logratios = torch.sort(reference.chosen - reference.rejected, dim=0).values
        return _soft_dpo(logratios - ref_logratios, beta, eps)
    if loss_type == "aot_unpaired":
        return _soft_dpo(torch.sort(chosen_ratio, dim=0).values - torch.sort(rejected_ratio, dim=0).values, beta, eps)
    if loss_type == "apo_zero":
        return 1 - torch.sigmoid(beta * chosen_ratio) + torch.sigmoid(beta * rejected_ratio)
    if loss_type == "apo_down":
        return torch.sigmoid(beta * chosen_ratio) + 1 - torch.sigmoid(beta * (chosen_ratio - rejected_ratio))
    if loss_type == "discopop":
        logits = beta * delta
        modulation = torch.sigmoid(logits / s.discopop_tau)
        return -F.logsigmoid(logits) * (1 - modulation) + torch.exp(-logits) * modulation
    raise ValueError(f"loss_type: {loss_type!r} not known; use one of {list(LOSS_TYPES)}")


def combine_terms(terms: Sequence[LossTerm], counts: Mapping[Normaliser, float]) -> torch.Tensor:
    """``sum(weight * total / counts[normaliser])``: the loss once the step's counts are known."""
    loss = torch.zeros((), device=terms[0].total.device, dtype=terms[0].total.dtype)
    for term in terms:
        loss = loss + term.weight * term.total / max(counts[term.normaliser], 1.0)
    return loss


METRIC_KEYS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
"""trl's per-pair metrics (each a mean over pairs); ``logits/*``, ``entropy`` and
``mean_token_accuracy`` are per-token means (``token_metric_sums``)."""


def dpo_metric_sums(policy: SequenceLogps, reference: SequenceLogps, beta: float) -> dict[str, torch.Tensor]:
    """Per-pair metrics of trl's DPOTrainer as sums over the pairs given (divide by the pair count)."""
    chosen_rewards = beta * (policy.chosen - reference.chosen).detach()
    rejected_rewards = beta * (policy.rejected - reference.rejected).detach()
    return {
        "rewards/chosen": chosen_rewards.sum(),
        "rewards/rejected": rejected_rewards.sum(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().sum(),
        "rewards/margins": (chosen_rewards - rejected_rewards).sum(),
        "logps/chosen": policy.chosen.detach().sum(),
        "logps/rejected": policy.rejected.detach().sum(),
    }


def pair_weights(chosen_mean_aligned: torch.Tensor, rejected_mean_aligned: torch.Tensor) -> torch.Tensor:
    """WPO's weight of each pair (``use_weighting``): ``exp(mean aligned log-prob)`` of chosen times
    rejected, where a token's aligned log-prob is ``log p(y) - log sum_v p_v^2``."""
    return (torch.exp(chosen_mean_aligned) * torch.exp(rejected_mean_aligned)).detach()
