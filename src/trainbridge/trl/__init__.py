"""trl's trainers on trainbridge's loop.

- ``trl_loop``: ``TrlLoop``, what a trl class gets in front of it to be trained by the loop.
- ``sft_trainer``: ``SFTTrainer`` (trl's class; the loop's token step stands in for its ``compute_loss``).
- ``dpo_trainer``: ``DPOTrainer`` (trl's class; the packed DPO step stands in for its ``compute_loss``).
- ``dpo_step``: DPO on the step seam (``PreferenceStep``, ``PairBatches``).
- ``preference_loss``: DPO's loss types and metrics as functions of per-sequence log-probs.
- ``sequence_logps``: chosen and rejected sequences scored by one padding-free forward.
- ``preference_data``: trl's DPO data preparation, run by trl; the reference model's log-probs.
- ``reference_free_trainer``: ``ORPOTrainer`` and ``CPOTrainer`` (trl's classes; the packed step stands in for
  their ``compute_loss``); ``reference_free_step``: ORPO/CPO on the step seam; ``reference_free_loss``: their
  losses and metrics; ``pair_scores``: labelled pairs scored by one padding-free forward.
- ``kto_trainer``: ``KTOTrainer`` (trl's class; the KTO step stands in for its ``compute_loss``); ``kto_step``: KTO
  on the step seam (unpaired rows, the KL reference point); ``kto_loss``: its loss and metrics.
- ``online_rl``: ``GRPOTrainer`` and ``RLOOTrainer`` (trl's classes, trained by the loop);
  ``generation_buffer``: the generation batch pending at a checkpoint, saved and restored.
- ``reward_model``: ``RewardTrainer`` (trl's class, trained by the loop).
"""

from typing import Any

__all__ = [
    "CPOTrainer",
    "DPOTrainer",
    "GRPOTrainer",
    "KTOTrainer",
    "ORPOTrainer",
    "RLOOTrainer",
    "RewardTrainer",
    "SFTTrainer",
]


def __getattr__(name: str) -> Any:
    # Imported on first use: trl and the facade are heavy imports.
    if name in __all__:
        from trainbridge.launch.script_launch import launch_script

        launch_script()  # python script.py: runs as torchrun would, from here (trainbridge.launch.script_launch)
    if name == "SFTTrainer":
        from trainbridge.trl.sft_trainer import SFTTrainer

        return SFTTrainer
    if name == "DPOTrainer":
        from trainbridge.trl.dpo_trainer import DPOTrainer

        return DPOTrainer
    if name == "KTOTrainer":
        from trainbridge.trl.kto_trainer import KTOTrainer

        return KTOTrainer
    if name in ("ORPOTrainer", "CPOTrainer"):
        from trainbridge.trl import reference_free_trainer

        return getattr(reference_free_trainer, name)
    if name in ("GRPOTrainer", "RLOOTrainer"):
        from trainbridge.trl import online_rl

        return getattr(online_rl, name)
    if name == "RewardTrainer":
        from trainbridge.trl.reward_model import RewardTrainer

        return RewardTrainer
    raise AttributeError(f"module 'trainbridge.trl' has no attribute {name!r}")
