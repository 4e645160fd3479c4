"""instructlab-training's public names, so ``from instructlab.training import X`` ports as
``from trainbridge.instructlab import X``.

``TrainingArgs`` takes instructlab's field names (translated with an ``InstructlabNameWarning``, or refused
naming ours: ``trainbridge.core.instructlab_names``) and ``run_training`` its argument order and
``torch_args``/``train_args`` keywords.
"""

from __future__ import annotations

from trainbridge.core.config import TorchrunArgs, TrainingArgs
from trainbridge.core.instructlab_names import DeepSpeedOptions, InstructlabNameWarning, LoraOptions
from trainbridge.launch.launcher import run_training

__all__ = ["DeepSpeedOptions", "InstructlabNameWarning", "LoraOptions", "TorchrunArgs", "TrainingArgs", "run_training"]
