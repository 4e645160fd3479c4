"""KTO's loss and logged metrics (trl ``KTOTrainer``'s numbers) from per-row completion log-probs.

A KTO batch is unpaired rows: a prompt, a completion and a label (desirable or not).  ``KTOLoss.micro``
gives one rank's micro-batch loss as trl's ``_compute_loss`` does: the mean over the rows of
``desirable_weight * (1 - sigmoid(beta * (logratio - kl)))`` for desirable rows and
``undesirable_weight * (1 - sigmoid(beta * (kl - logratio)))`` for the others (``apo_zero_unpaired``:
no KL).  ``kl`` is the reference point, the mean over every rank's rows of the policy/reference log-ratio
of mismatched prompt/completion pairs, clamped at 0, which the caller reduces over ranks
(``kl_sum``).  The metrics are sums and counts reduced over ranks before trl's divisions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")


@dataclass(frozen=True)
class KTOLoss:
    """The fields of trl's ``KTOConfig`` that shape the loss."""

    loss_type: str = "kto"
    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.loss_type not in KTO_LOSS_TYPES:
            raise ValueError(f"loss_type: {self.loss_type!r} is not a KTO loss; use one of {list(KTO_LOSS_TYPES)}")

    @property
    def uses_kl(self) -> bool:
        """Whether the loss needs the KL reference point (trl's ``calculate_KL``)."""
        return self.loss_type == "kto"

    @classmethod
    def from_config(cls, config: Any) -> KTOLoss:
        return cls(
            loss_type=str(config.loss_type),
            beta=float(config.beta),
            desirable_weight=float(config.desirable_weight),
            undesirable_weight=float(config.undesirable_weight),
        )

    def micro(
        self, logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, kl: torch.Tensor | float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(loss, metric sums)`` of one rank's rows: ``logps``/``ref_logps`` are the completions' summed
        log-probs under the policy and the reference ``[B]``, ``desirable`` their labels ``[B]`` (bool), ``kl``
        the reference point (0 for ``apo_zero_unpaired``)."""
        logratios = logps - ref_logps
        beta = self.beta
        if self.loss_type == "kto":
            chosen_losses = 1 - F.sigmoid(beta * (logratios - kl))
            rejected_losses = 1 - F.sigmoid(beta * (kl - logratios))
        else:
            chosen_losses = 1 - F.sigmoid(beta * logratios)
            rejected_losses = F.sigmoid(beta * logratios)
        losses = torch.where(
            desirable, self.desirable_weight * chosen_losses, self.undesirable_weight * rejected_losses
        )
        rewards = beta * logratios.detach()
        chosen, rejected = desirable.to(rewards.dtype), (~desirable).to(rewards.dtype)
        sums = {
            "chosen": chosen.sum(),
            "rejected": rejected.sum(),
            "rewards/chosen": (rewards * chosen).sum(),
            "logps/chosen": (logps.detach() * chosen).sum(),
            "rewards/rejected": (rewards * rejected).sum(),
            "logps/rejected": (logps.detach() * rejected).sum(),
        }
        return losses.mean(), sums


def kl_sum(kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """This rank's part of the KL reference point: the mean log-ratio of its mismatched pairs (trl takes
    each rank's mean, then the mean over ranks, clamped at 0)."""
    return (kl_logps - ref_kl_logps).detach().mean()
