"""Optimizers that update the parameters during ``backward``, run as Trainer runs them (one process only: each
update uses this rank's gradient before it is reduced, so several are refused before launch,
``core.config.checks.check_world``).

* LOMO and AdaLomo (``optim="lomo"`` / ``"adalomo"``, package ``lomo-optim``) update inside their fused backward.
  Trainer's ``training_step`` passes the schedule's learning rate to accelerate's ``backward``, which calls
  ``optimizer.fused_backward(loss, lr)`` instead of ``loss.backward()``; their ``step`` does nothing (accelerate
  skips it) and no gradient is left for the clip (Trainer logs a norm of 0).  ``FusedBackwardEngine`` does the same.
* Layer-wise optimizers (``*_layerwise``) step each parameter in its gradient hook; the ``LayerWiseDummyOptimizer``
  Trainer holds does nothing.  Trainer builds its schedule after accelerate wrapped that dummy, so
  ``transformers.get_scheduler`` schedules the dummy's one group like any optimizer's (the logged learning rate)
  and the layers' optimizers keep ``learning_rate``.  ``ScheduledDummy`` is that wrapper.
"""

from __future__ import annotations

from typing import Any

import torch

from trainbridge.parallel.engine import LocalEngine


def fuses_backward(optimizer: object) -> bool:
    """Whether ``optimizer`` is LOMO's or AdaLomo's (False when ``lomo-optim`` is not installed)."""
    try:
        from lomo_optim import AdaLomo, Lomo
    except ImportError:
        return False
    return isinstance(optimizer, Lomo | AdaLomo)


class FusedBackwardEngine(LocalEngine):
    """One process, an optimizer that updates in its fused backward (LOMO, AdaLomo)."""

    def backward(self, loss: torch.Tensor) -> None:
        """``optimizer.fused_backward(loss, lr)`` with the learning rate of this step, as accelerate's
        ``lomo_backward``: the parameters are updated as their gradients are computed."""
        self.optimizer.fused_backward(loss, self.current_lr())

    def optimizer_step(self) -> None:
        """Nothing: the update ran in ``backward`` (accelerate skips the step of these optimizers)."""

    def describe(self) -> str:
        """``LocalEngine``'s line, and which optimizer updates in its backward."""
        return f"{super().describe()}; {type(self.optimizer).__name__} updates in its fused backward"


class ScheduledDummy(torch.optim.Optimizer):
    """A layer-wise optimizer's ``LayerWiseDummyOptimizer`` as Trainer's schedule sees it (accelerate's
    ``AcceleratedOptimizer`` around it): every call goes to the dummy, whose one group the schedule sets."""

    def __init__(self, dummy: torch.optim.Optimizer) -> None:  # no Optimizer.__init__: a view, as accelerate's
        self.optimizer = dummy

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """The dummy's (nothing: each layer stepped in its gradient hook)."""
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The dummy's (nothing: each layer's optimizer zeroed its gradient after its step)."""
        self.optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)


def as_trainer_schedules(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``optimizer`` as Trainer's schedule gets it: a layer-wise optimizer's dummy in ``ScheduledDummy``."""
    from transformers.trainer_pt_utils import LayerWiseDummyOptimizer

    return ScheduledDummy(optimizer) if isinstance(optimizer, LayerWiseDummyOptimizer) else optimizer
