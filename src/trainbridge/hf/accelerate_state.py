"""accelerate's process-wide state while Hugging Face callbacks run, as ``Trainer`` leaves it.

``Trainer.__init__`` creates an ``Accelerator``, so during training accelerate's shared singletons
(``PartialState``, ``AcceleratorState``) describe the run, and callbacks written for Trainer rely on
that: trl's ``SyncRefModelCallback`` reads ``AcceleratorState().deepspeed_plugin``,
``accelerate.logging.get_logger`` loggers refuse to log before a ``PartialState`` exists, and scripts
and callbacks ask ``PartialState().is_main_process`` or ``AcceleratorState().mixed_precision``.  Without
it such a callback raises ("Please make sure to properly initialize your accelerator via
`accelerator = Accelerator()`...").

trainbridge owns the process group, the device and the engine, so it does not run accelerate's
initialisation (which may start a process group, rewrite ``RANK``/``WORLD_SIZE``/``MASTER_PORT`` and set
thread counts).  ``share_accelerate_state`` fills the two shared states with this run's facts instead,
the same fields an ``Accelerator`` leaves there: rank, local rank, world size, device, backend and
distributed type (``hf.arguments.process_state_for``, which ``TrainingArguments.distributed_state``
holds too), the mixed precision, and no plugins -- except under DeepSpeed, where a ``DeepSpeedPlugin``
of the run's own DeepSpeed config is there (not selected: transformers' ZeRO-3 loading switch is left
alone).  FSDP2 reports the ``MULTI_GPU``/``MULTI_CPU`` type: trainbridge shards with torch, not through
accelerate's FSDP plugin.

It does so only where no ``AcceleratorState`` exists yet in this process (a script's own
``Accelerator`` stays as it is; a ``PartialState`` its ``TrainingArguments`` made is kept and built on),
and ``SharedAccelerateState.release`` empties what it filled once the run is over, so in-process runs
(tests, notebooks) leave nothing behind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DeepSpeedPlugin, TorchDynamoPlugin

from trainbridge.core.config import TrainingArgs
from trainbridge.core.distributed import DistributedEnv
from trainbridge.hf.arguments import process_state_for
from trainbridge.parallel.deepspeed import deepspeed_config


@dataclass
class SharedAccelerateState:
    """What ``share_accelerate_state`` put into accelerate's shared states (to release it afterwards)."""

    partial: dict[str, Any] | None
    """``PartialState``'s shared state as filled here; None when it existed before (left alone)."""
    accelerator: dict[str, Any]

    def release(self) -> None:
        """Empty what was filled, if it still holds what was shared (nobody re-initialised it since)."""
        if AcceleratorState._shared_state != self.accelerator:
            return
        AcceleratorState._shared_state.clear()
        if self.partial is not None and PartialState._shared_state == self.partial:
            PartialState._shared_state.clear()


def share_accelerate_state(env: DistributedEnv, args: TrainingArgs) -> SharedAccelerateState | None:
    """Make ``PartialState()`` and ``AcceleratorState()`` describe this run (module docstring).

    A ``PartialState`` that already exists (a script's ``TrainingArguments`` makes one) is kept and the
    ``AcceleratorState`` is built on it, as an ``Accelerator`` would; None when an ``AcceleratorState``
    exists already (then nothing is changed)."""
    if AcceleratorState._shared_state:
        return None
    filled_partial = not PartialState._shared_state
    if filled_partial:
        PartialState._shared_state.update(process_state_for(env, args).__dict__)
    deepspeed = args.distributed_backend == "deepspeed" and env.world_size > 1
    AcceleratorState._shared_state.update(
        {
            **PartialState._shared_state,
            # under DeepSpeed accelerate reads the precision from the plugin's config ("no" here, as it sets it)
            "_mixed_precision": "no" if deepspeed else args.mixed_precision_for(env.device.type),
            "deepspeed_plugins": DeepSpeedPlugin(hf_ds_config=deepspeed_config(args, env)) if deepspeed else None,
            "dynamo_plugin": TorchDynamoPlugin(),
            "torch_tp_plugin": None,
            "parallelism_config": None,
            "device_mesh": None,
        }
    )
    return SharedAccelerateState(
        dict(PartialState._shared_state) if filled_partial else None, dict(AcceleratorState._shared_state)
    )
