"""A Trainer subclass's ``get_train_dataloader`` / ``_get_train_sampler`` run in the workers.

``subclass_loader(trainer)`` is the ``RunPlan.train_loader`` of a facade job whose class overrides one of
them: a picklable ``SubclassLoader`` holding the script's Trainer class (by value when the script defines
it, as callbacks travel) and the attributes the script set on its instance.  In each worker it builds an
instance of that class without running its ``__init__`` -- those attributes, ``args``, ``model``,
``train_dataset`` (the training items as the dataset's ``__getitem__`` returned them, same indices; a stream
as it is), ``data_collator`` (the script's), ``processing_class``, ``state``, ``_train_batch_size`` and an
``accelerator`` whose ``prepare`` shards a ``DataLoader`` across ranks as accelerate does under Trainer --
and calls its ``get_train_dataloader()``.

Trainer's own ``get_train_dataloader`` (what ``super()`` runs, and what runs with only ``_get_train_sampler``
overridden) is ``default_train_dataloader``: a ``DataLoader`` of ``per_device_train_batch_size`` items with the
sampler ``self._get_train_sampler(dataset)`` gives (none for a stream), the collator with the unused columns
removed, ``dataloader_drop_last`` and ``dataloader_num_workers``, prepared by ``self.accelerator``.
``default_train_sampler`` is Trainer's ``_get_train_sampler`` itself.  ``shard_loader`` is accelerate's
sharding without its process state: the batches of a map-style loader dealt round robin to the ranks by
``BatchSamplerShard`` (even batches; a ``RandomSampler`` made a ``SeedableRandomSampler`` seeded by
``data_seed``/``seed``), an iterable dataset split by ``IterableDatasetShard``.
"""

from __future__ import annotations

from typing import Any

import torch

from trainbridge.trainer.subclass import overrides, script_attributes
from trainbridge.trainer.worker_methods import WorkerAccelerator

LOADER_METHODS = ("get_train_dataloader", "_get_train_sampler")
"""The Trainer methods whose overrides build the training batches in the workers."""

ITEM_COLLATE_KEY = "_item_collate"
"""The worker-side instance's attribute holding the collator with unused columns removed."""


class LoaderAccelerator(WorkerAccelerator):
    """``trainer.accelerator`` of a worker-side instance building the ``DataLoader``: ``prepare`` shards it."""

    def __init__(self, model: Any, data_seed: int | None) -> None:
        super().__init__(model)
        self.data_seed = data_seed

    def prepare(self, *objects: Any) -> Any:
        """Each ``DataLoader`` sharded across ranks (``shard_loader``); anything else as it is."""
        prepared = [
            shard_loader(o, self.num_processes, self.process_index, self.data_seed)
            if isinstance(o, torch.utils.data.DataLoader)
            else o
            for o in objects
        ]
        return prepared[0] if len(prepared) == 1 else tuple(prepared)


def shard_loader(loader: Any, world_size: int, rank: int, data_seed: int | None) -> Any:
    """``loader`` as rank ``rank``'s share of ``world_size``, as ``accelerate.prepare_data_loader`` makes it."""
    from accelerate.data_loader import BatchSamplerShard, IterableDatasetShard, SeedableRandomSampler
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler

    common = {
        "collate_fn": loader.collate_fn,
        "num_workers": loader.num_workers,
        "pin_memory": loader.pin_memory,
        "worker_init_fn": loader.worker_init_fn,
    }
    if isinstance(loader.dataset, torch.utils.data.IterableDataset):
        shard = IterableDatasetShard(
            loader.dataset,
            batch_size=loader.batch_size,
            drop_last=loader.drop_last,
            num_processes=world_size,
            process_index=rank,
        )
        return DataLoader(shard, batch_size=loader.batch_size, drop_last=loader.drop_last, **common)
    batch_sampler = loader.batch_sampler
    sampler = getattr(batch_sampler, "sampler", None)
    if type(sampler) is RandomSampler:
        seedable = SeedableRandomSampler(
            data_source=sampler.data_source,
            replacement=sampler.replacement,
            num_samples=sampler._num_samples,
            generator=sampler.generator,
            data_seed=data_seed,
        )
        batch_sampler = BatchSampler(seedable, batch_sampler.batch_size, batch_sampler.drop_last)
    sharded = BatchSamplerShard(batch_sampler, num_processes=world_size, process_index=rank, even_batches=True)
    return DataLoader(loader.dataset, batch_sampler=sharded, **common)


class SubclassLoader:
    """``RunPlan.train_loader`` for a Trainer subclass (see the module doc)."""

    def __init__(self, trainer_cls: type, args: Any, processing_class: Any, attributes: dict[str, Any]) -> None:
        self.trainer_cls = trainer_cls
        self.args = args
        self.processing_class = processing_class
        self.attributes = attributes
        """The attributes the script set on its Trainer (``subclass.script_attributes``), as the other
        worker-side overrides see them."""

    def __call__(self, dataset: Any, collate: Any, model: Any) -> Any:
        from transformers import TrainerState

        instance: Any = object.__new__(self.trainer_cls)
        accelerator = LoaderAccelerator(model, _data_seed(self.args))
        instance.__dict__.update(self.attributes)
        instance.__dict__.update(
            args=self.args,
            model=accelerator.unwrap_model(model),
            train_dataset=dataset,
            eval_dataset=None,
            data_collator=getattr(collate, "collator", collate),
            processing_class=self.processing_class,
            state=TrainerState(),
            callbacks=[],
            model_init=None,
            _train_batch_size=_per_device(self.args),
            _worker_accelerator=accelerator,
            _env=None,
            **{ITEM_COLLATE_KEY: collate},
        )
        return instance.get_train_dataloader()


def _per_device(args: Any) -> int:
    """``per_device_train_batch_size`` (a ``TrainingArgs``: ``per_device_batch_size``, else 1)."""
    return int(getattr(args, "per_device_train_batch_size", None) or getattr(args, "per_device_batch_size", None) or 1)


def _data_seed(args: Any) -> int | None:
    """Trainer's sampler seed: ``data_seed``, else ``seed``."""
    seed = getattr(args, "data_seed", None)
    return seed if seed is not None else getattr(args, "seed", None)


def subclass_loader(trainer: Any) -> SubclassLoader | None:
    """The ``train_loader`` of ``trainer``'s jobs when its class overrides ``get_train_dataloader`` or
    ``_get_train_sampler``, else None (Trainer's sample batches)."""
    if not overrides(type(trainer), LOADER_METHODS):
        return None
    return SubclassLoader(type(trainer), trainer.args, trainer.processing_class, script_attributes(trainer))


def in_worker(trainer: Any) -> bool:
    """Whether ``trainer`` is a worker-side instance built by ``SubclassLoader``."""
    return ITEM_COLLATE_KEY in vars(trainer)


def default_train_dataloader(trainer: Any) -> Any:
    """Trainer's ``get_train_dataloader`` on a worker-side instance (see the module doc)."""
    from torch.utils.data import DataLoader

    dataset, args = trainer.train_dataset, trainer.args
    params: dict[str, Any] = {
        "batch_size": trainer._train_batch_size,
        "collate_fn": vars(trainer)[ITEM_COLLATE_KEY],
        "num_workers": int(getattr(args, "dataloader_num_workers", 0) or 0),
    }
    if not isinstance(dataset, torch.utils.data.IterableDataset):
        params["sampler"] = trainer._get_train_sampler(dataset)
        params["drop_last"] = bool(getattr(args, "dataloader_drop_last", False))
    return trainer.accelerator.prepare(DataLoader(dataset, **params))


def default_train_sampler(trainer: Any, train_dataset: Any = None) -> Any:
    """Trainer's ``_get_train_sampler`` (transformers' own code) on a worker-side instance."""
    from transformers import Trainer as HFTrainer

    return HFTrainer._get_train_sampler(trainer, train_dataset)
