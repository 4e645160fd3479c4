"""The non-finite guard: a NaN or inf loss or gradient norm, noticed in the step's existing agreement.

The step's summed loss and the global gradient norm already ride in the step's one collective
(``core.agreement.agree_control``), so every rank sees the same values and takes the same decision, with no
collective of its own.  ``nonfinite_policy`` (``TrainingArgs``) says what happens:

- ``error`` (default): the run stops with ``NonFiniteLossError`` naming the step; nothing is saved for
  that step and no checkpoint is rotated out, so the last finite checkpoint survives.
- ``skip``: the optimizer step is not applied when the gradient norm is not finite (read before the
  update: one host-device synchronisation per step under this policy), and the step's loss is left out
  of the logged averages; a warning names the step.
- ``warn``: a warning names the step; training goes on as if nothing happened.
"""

from __future__ import annotations

import logging
import math
from typing import Literal

import torch

logger = logging.getLogger(__name__)

NonFinitePolicy = Literal["error", "skip", "warn"]

NOT_MEASURED = -1.0
"""The gradient norm of a step whose engine reported none (a norm is never negative)."""


class NonFiniteLossError(RuntimeError):
    """A step's loss or gradient norm was NaN or infinite under ``nonfinite_policy="error"``."""


class NonFiniteGuard:
    """Applies ``nonfinite_policy`` to each step's agreed loss sum and gradient norm."""

    def __init__(self, policy: NonFinitePolicy) -> None:
        self.policy = policy
        self.last: tuple[float, float] = (0.0, NOT_MEASURED)
        """The last step's agreed loss sum and gradient norm."""

    @property
    def stops(self) -> bool:
        """A non-finite step ends the run (``error``)."""
        return self.policy == "error"

    @property
    def counts_nonfinite(self) -> bool:
        """A non-finite step's loss still enters the logged averages (``warn``)."""
        return self.policy == "warn"

    def allows_update(self, grad_norm: torch.Tensor | float | None) -> bool:
        """Whether the optimizer step may be applied: always, except under ``skip`` with a non-finite norm
        (read here: a host synchronisation, under ``skip`` only)."""
        if self.policy != "skip" or grad_norm is None:
            return True
        return bool(torch.isfinite(torch.as_tensor(grad_norm)))

    def check(self, step: int, loss_sum: float, grad_norm: float) -> bool:
        """Whether step ``step``'s agreed loss sum (every rank's) and gradient norm are finite; a non-finite
        step is logged as a warning under ``skip`` and ``warn`` (``error``: the loop calls ``raise_error``)."""
        self.last = (float(loss_sum), float(grad_norm))
        finite = math.isfinite(self.last[0]) and math.isfinite(self.last[1])
        if not finite and not self.stops:
            logger.warning(
                "step %d: %s; %s (nonfinite_policy=%r)",
                step,
                self._values(),
                "the update was not applied"
                if self.policy == "skip" and not math.isfinite(self.last[1])
                else "training goes on",
                self.policy,
            )
        return finite

    def raise_error(self, step: int) -> None:
        """Stop the run: ``NonFiniteLossError`` naming the step."""
        raise NonFiniteLossError(
            f"step {step}: {self._values()}; the run stopped without saving this step, so the last checkpoint "
            "holds the last finite weights. Lower the learning rate, check the data and the model's precision, "
            "or set nonfinite_policy='skip' (or 'warn') to go on"
        )

    def _values(self) -> str:
        loss, norm = self.last
        parts = [
            f"loss sum {loss}" if not math.isfinite(loss) else "",
            f"gradient norm {norm}" if not math.isfinite(norm) else "",
        ]
        return "non-finite " + " and ".join(p for p in parts if p)
