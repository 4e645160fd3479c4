"""``trainbridge.Trainer``: port a ``transformers.Trainer`` script by changing its import.

``facade`` holds ``Trainer`` and ``LoopTrainer``; ``jobs`` runs ``train()``'s loop in place on every rank;
``subclass``, ``save_overrides`` and ``optimizers`` are the loop's calls into the instance.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainbridge.trainer.facade import Trainer, UnsupportedTrainerFeatureError

__all__ = ["Trainer", "UnsupportedTrainerFeatureError"]


def __getattr__(name: str) -> Any:
    # Imported on first use: ``python script.py`` asking for several processes is re-executed under torchrun
    # here (``launch_script``), before the facade (and torch's distributed set-up) is imported.
    if name in __all__:
        from trainbridge.launch.script_launch import launch_script

        launch_script()
        from trainbridge.trainer import facade

        return getattr(facade, name)
    raise AttributeError(f"module 'trainbridge.trainer' has no attribute {name!r}")
