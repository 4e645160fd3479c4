"""Third-party-style callbacks and the observers that check them, for the compat scenarios (issue 11).

Real third-party code runs unchanged where it is installed: trl's ``BEMACallback`` (imported in
``compat.scenarios``) and transformers' own callbacks and integrations.  The callbacks below reproduce
the *behaviour* of callbacks that public fine-tuning projects ship (written anew here, not copied: the
projects are named for what each one models), so the scenarios exercise what such callbacks do:

- ``LossWatchDog``: axolotl's loss watchdog (reads ``state.log_history`` after every step and stops
  training after ``patience`` logged losses above a threshold);
- ``SaveModelAtTrainEnd``: the "save the (PEFT) model when training ends" callbacks of QLoRA-style
  scripts and LLaMA-Factory (``kwargs["model"].save_pretrained(...)`` in ``on_train_end``);
- ``ReadsSFTConfig``: a callback written for trl that reads ``SFTConfig`` fields from ``args``.

Observers write JSON observations (``compat.scenarios.write_observation``) compared exactly between
Trainer and trainbridge.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import TrainerCallback


def _observe(args: Any, name: str, record: dict[str, Any]) -> None:
    from compat.scenarios import write_observation

    write_observation(args, name, record)


class LossWatchDog(TrainerCallback):
    """axolotl's loss watchdog: after every step, if the last log has a loss above ``threshold``, count a
    violation; ``patience`` violations in a row stop training."""

    def __init__(self, threshold: float, patience: int = 3) -> None:
        self.threshold = threshold
        self.patience = patience
        self.violations = 0

    def on_step_end(self, args, state, control, **kwargs):
        if state.log_history and "loss" in state.log_history[-1]:
            if state.log_history[-1]["loss"] > self.threshold:
                self.violations += 1
                if self.violations >= self.patience:
                    control.should_training_stop = True
            else:
                self.violations = 0
        return control


class SaveModelAtTrainEnd(TrainerCallback):
    """Saves ``kwargs["model"]`` to ``output_dir/final_model`` on rank 0 at train end (the model a user
    ships: with ``load_best_model_at_end`` it must be the best one)."""

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if state.is_world_process_zero:
            model.save_pretrained(str(Path(args.output_dir) / "final_model"))


class ReadsSFTConfig(TrainerCallback):
    """A callback written for trl: reads ``SFTConfig`` fields (absent from ``TrainingArguments``)."""

    def on_train_begin(self, args, state, control, **kwargs):
        _observe(
            args,
            "sft_config",
            {
                "class": type(args).__name__,
                "max_length": args.max_length,
                "dataset_text_field": args.dataset_text_field,
                "packing": args.packing,
            },
        )

    def on_step_end(self, args, state, control, **kwargs):
        _ = args.max_length, args.completion_only_loss  # read at every step, as trl's callbacks do


class WeightsAtTrainEnd(TrainerCallback):
    """Records which checkpoints hold exactly the weights the model has in ``on_train_end`` (with
    ``load_best_model_at_end``: the best checkpoint, not the last)."""

    def on_train_end(self, args, state, control, model=None, **kwargs):
        live = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
        matching = []
        for checkpoint in sorted(Path(args.output_dir).glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1])):
            weights = checkpoint / "model.safetensors"
            if weights.is_file():
                saved = load_file(str(weights))
                if all(name in live and torch.equal(live[name], tensor) for name, tensor in saved.items()):
                    matching.append(checkpoint.name)
        _observe(args, "weights_at_train_end", {"checkpoints_with_these_weights": matching})


class HookCounter(TrainerCallback):
    """Counts every hook it receives and writes the counts at train end (compared between runners: every
    working callback must receive every hook, whatever another callback does)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.counts: Counter[str] = Counter()

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("on_") and name != "on_train_end" and hasattr(TrainerCallback, name):
            counts = object.__getattribute__(self, "counts")
            return lambda *args, **kwargs: counts.update([name])
        return object.__getattribute__(self, name)

    def on_train_end(self, args, state, control, **kwargs):
        self.counts.update(["on_train_end"])
        _observe(args, f"hook_counts_{self.label}", dict(sorted(self.counts.items())))


class RaisesAtStepEnd(TrainerCallback):
    """A broken callback: raises at every ``on_step_end`` (trainbridge runs only; Trainer would crash)."""

    def on_step_end(self, args, state, control, **kwargs):
        raise RuntimeError("a broken third-party callback")
