"""``trainbridge.Trainer``: port a ``transformers.Trainer`` script by changing its import.

- ``facade``: the ``Trainer`` class (Trainer's constructor and methods; ``train()`` is the loop) and ``LoopTrainer``,
  what any Trainer class (``seq2seq``, trl's in ``trainbridge.trl``) puts in front of it.
- ``jobs``: ``train()``'s job, the loop in place on every rank; ``job_args``: its ``TrainingArgs`` and run plan.
- ``subclass``, ``save_overrides``, ``optimizers``: the loop's calls into the instance (its
  step, evaluation, log, data loader, saves, optimizer).
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

        launch_script()  # python script.py: runs as torchrun would, from here (trainbridge.launch.script_launch)
        from trainbridge.trainer import facade

        return getattr(facade, name)
    raise AttributeError(f"module 'trainbridge.trainer' has no attribute {name!r}")
