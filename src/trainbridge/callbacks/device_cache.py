"""``EmptyDeviceCache``: Trainer's ``torch_empty_cache_steps``.

After the forward of every micro-batch of an optimizer step whose number (completed steps, from 0) is a
multiple of ``torch_empty_cache_steps``, the accelerator's cache allocator gives its unused blocks back
(accelerate's ``clear_device_cache``, which Trainer's ``training_step`` calls at the same point): a lower
peak of reserved memory for slower steps.
"""

from __future__ import annotations

from typing import Any

from trainbridge.core.callback import Callback
from trainbridge.core.context import TrainingContext


class EmptyDeviceCache(Callback):
    """Empties the device cache as Trainer's ``torch_empty_cache_steps`` (see the module doc)."""

    def on_after_forward(self, context: TrainingContext, **kwargs: Any) -> None:
        every = context.args.torch_empty_cache_steps
        if every is not None and context.global_step % every == 0:
            from accelerate.utils.memory import clear_device_cache

            clear_device_cache()
