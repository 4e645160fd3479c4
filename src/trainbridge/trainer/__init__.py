"""``trainbridge.Trainer``: port a ``transformers.Trainer`` script by changing its import.

- ``facade``: the ``Trainer`` class (constructor, ``train``/``evaluate``/``predict``, saving, callbacks).
- ``inputs``: datasets, collators and the model, made ready for the workers.
- ``runner``: the jobs the facade runs on each rank (in place, or in its own torchrun workers).
- ``launch_env``: in place vs self-launch, and the self-launch process count.
"""

from typing import Any

__all__ = ["Trainer", "UnsupportedTrainerFeatureError"]


def __getattr__(name: str) -> Any:
    # Imported on first use, so ``python -m trainbridge.trainer.runner`` (the workers) does not load the
    # facade first.
    if name in __all__:
        from trainbridge.trainer import facade

        return getattr(facade, name)
    raise AttributeError(f"module 'trainbridge.trainer' has no attribute {name!r}")
