"""The training batches of an instance whose class overrides how Trainer builds them: its own
``get_train_dataloader()`` (with a ``_get_train_sampler`` override, Trainer's ``get_train_dataloader`` over it).

``SubclassLoader`` is the ``RunPlan.train_loader`` of such a run: it calls the live instance's
``get_train_dataloader()`` -- the script's ``train_dataset`` and ``data_collator``, the DataLoader prepared
by the instance's own accelerator, which deals this rank its share as under Trainer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from trainbridge.trainer.subclass import instance_batches

if TYPE_CHECKING:
    from trainbridge.trainer.facade import LoopTrainer

LOADER_METHODS = ("get_train_dataloader", "_get_train_sampler")
"""The Trainer methods whose overrides build the training batches."""


class SubclassLoader:
    """``RunPlan.train_loader``: the instance's ``get_train_dataloader()`` (see the module doc)."""

    def __init__(self, trainer: LoopTrainer) -> None:
        self.instance = trainer

    def __call__(self, dataset: object, collate: object, model: object) -> Iterable[Any]:
        return self.instance.get_train_dataloader()


def subclass_loader(trainer: LoopTrainer) -> SubclassLoader | None:
    """The ``train_loader`` of ``trainer``'s jobs when its class overrides ``get_train_dataloader`` or
    ``_get_train_sampler``, else None (Trainer's sample batches)."""
    return SubclassLoader(trainer) if instance_batches(trainer) else None
