"""``trainbridge.Trainer``: port a ``transformers.Trainer`` script by changing its import.

- ``facade``: the ``Trainer`` class (constructor, ``train``/``evaluate``/``predict``, saving, callbacks).
- ``jobs``: train and evaluate, in place under the script's launcher or in torchrun workers it launches.
- ``run_folder``: the job's inputs written into ``output_dir/.trainbridge/``, as a typed ``RunLayout``.
- ``job_args``: the job's ``TrainingArgs``; ``results``: what it returns, as Trainer's state and metrics.
- ``script_data``: datasets, collators and the model, made ready for the workers.
- ``runner``: the jobs on each rank (in place, or as the torchrun workers' module).
- ``script_events``: Trainer's events outside training, on the script's callbacks.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainbridge.trainer.facade import Trainer, UnsupportedTrainerFeatureError

__all__ = ["Trainer", "UnsupportedTrainerFeatureError"]


def __getattr__(name: str) -> Any:
    # Imported on first use, so ``python -m trainbridge.trainer.runner`` (the workers) does not load the
    # facade first.
    if name in __all__:
        from trainbridge.launch.script_launch import launch_script

        launch_script()  # python script.py: runs as torchrun would, from here (trainbridge.launch.script_launch)
        from trainbridge.trainer import facade

        return getattr(facade, name)
    raise AttributeError(f"module 'trainbridge.trainer' has no attribute {name!r}")
