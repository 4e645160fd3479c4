"""The compat scenarios: ``TrainingArguments`` settings plus Hugging Face callbacks, run identically
by ``transformers.Trainer`` and by trainbridge (``compat.runners``).

A scenario names its settings as ``TrainingArguments`` keyword arguments; the runners add the fixed
ones (``output_dir``, ``use_cpu``, batch sizes derived from ``samples_per_step``...).  The callbacks
below are defined at module level so both runners build them the same way (the Trainer worker imports
this module; trainbridge ships instances to its workers by reference to it).

Every optimizer step takes ``samples_per_step`` samples on 1 rank and on 2 ranks alike (the per-device
batch shrinks with the world size), so a scenario's step numbers mean the same at both sizes.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from transformers import EarlyStoppingCallback, TrainerCallback
from transformers.trainer_callback import ExportableState

from compat.assets import EVAL_SAMPLES, SAMPLE_TOKENS, TRAIN_SAMPLES
from compat.third_party import (
    HookCounter,
    LossWatchDog,
    RaisesAtStepEnd,
    ReadsSFTConfig,
    SaveModelAtTrainEnd,
    WeightsAtTrainEnd,
)

OBSERVATIONS_DIR = "observations"
"""Under a run's ``output_dir``: JSON files scenario callbacks write; compared exactly between runners."""


def write_observation(args: Any, name: str, record: Mapping[str, Any]) -> None:
    """Append ``record`` to ``output_dir/observations/{name}-rank{r}.json`` (a JSON list)."""
    path = Path(args.output_dir) / OBSERVATIONS_DIR / f"{name}-rank{args.process_index}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    records = json.loads(path.read_text()) if path.is_file() else []
    records.append(dict(record))
    path.write_text(json.dumps(records, indent=1, sort_keys=True))


# ============================================================================ scenario callbacks
class ScriptedEvalLoss(TrainerCallback):
    """Overwrites ``metrics["eval_loss"]`` with the next value of a script at every evaluation (the last
    value repeats), so best-model tracking and early stopping decide at known steps.  Put it before
    ``EarlyStoppingCallback``."""

    def __init__(self, values: Sequence[float]) -> None:
        self.values = list(values)
        self.evaluations = 0

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        metrics["eval_loss"] = self.values[min(self.evaluations, len(self.values) - 1)]
        self.evaluations += 1


class ControlScript(TrainerCallback):
    """At ``on_step_end`` of the listed steps, *returns a modified copy* of ``control`` with the listed
    flags switched on (the handler must carry the returned object on)."""

    def __init__(self, actions: Mapping[int, Sequence[str]]) -> None:
        self.actions = {int(step): tuple(flags) for step, flags in actions.items()}

    def on_step_end(self, args, state, control, **kwargs):
        flags = self.actions.get(state.global_step)
        if not flags:
            return None
        changed = copy.copy(control)
        for flag in flags:
            setattr(changed, flag, True)
        return changed


class StepTally(TrainerCallback, ExportableState):
    """A stateful callback: counts optimizer steps and evaluations; its state goes into
    ``trainer_state.json`` and is restored on resume.  Observes its (restored) state at train begin."""

    def __init__(self, label: str = "tally", steps_seen: int = 0, evaluations: int = 0) -> None:
        self.label = label
        self.steps_seen = steps_seen
        self.evaluations = evaluations

    def on_train_begin(self, args, state, control, **kwargs):
        write_observation(
            args,
            "step_tally",
            {
                "at_train_begin_global_step": state.global_step,
                "label": self.label,
                "steps_seen": self.steps_seen,
                "evaluations": self.evaluations,
            },
        )

    def on_step_end(self, args, state, control, **kwargs):
        self.steps_seen += 1

    def on_evaluate(self, args, state, control, **kwargs):
        self.evaluations += 1

    def state(self) -> dict[str, Any]:
        return {
            "args": {"label": self.label},
            "attributes": {"steps_seen": self.steps_seen, "evaluations": self.evaluations},
        }


class StopOnLastRank(TrainerCallback):
    """Sets ``control.should_training_stop`` at ``step`` on the last rank only (rank 0 on one rank)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if args.process_index == args.world_size - 1 and state.global_step == self.step:
            control.should_training_stop = True


# ============================================================================ scenarios
@dataclass(frozen=True)
class Scenario:
    """One configuration run both ways.

    ``arguments``: ``TrainingArguments`` keyword arguments of the scenario.  ``callbacks``: builds the
    scenario's HF callbacks (fresh instances per run; the recorder is appended by the runner).
    ``resume_from``: a second phase resumes from ``checkpoint-{resume_from}`` of the first, in the same
    output directory.  ``fast``: world sizes run by the CI part of the suite.  ``trainer_fails``: world
    sizes where Trainer is *expected* to crash or hang (bounded by ``timeout_s``).
    """

    name: str
    covers: str
    arguments: Mapping[str, Any] = field(default_factory=dict)
    callbacks: Callable[[], list[TrainerCallback]] = list
    samples_per_step: int = 8
    gradient_accumulation_steps: int = 1
    world_sizes: tuple[int, ...] = (1, 2)
    resume_from: int | None = None
    fast: tuple[int, ...] = (1,)
    trainer_fails: tuple[int, ...] = ()
    timeout_s: float = 240.0
    config_class: str = "transformers:TrainingArguments"
    """The ``TrainingArguments`` class both runners build the settings with (``module:Class``; a subclass
    such as ``trl:SFTConfig``)."""
    trainbridge_extra: Callable[[], list[TrainerCallback]] = list
    """Callbacks inserted after the scenario's first callback in trainbridge runs only (a broken callback:
    Trainer would crash, so its run without it is the reference every other callback must match)."""
    expected_callback_errors: tuple[str, ...] = ()
    """Callback classes trainbridge must report in ``RunResult.callback_errors`` (anything else is a
    difference)."""
    task: Literal["causal-lm", "classification", "dpo", "grpo"] = "causal-lm"
    """``causal-lm``: the tiny Llama on the fixed-width problems; trainbridge runs ``run_training``.
    ``classification``: the tiny BERT classifier of ``compat.assets`` on its own loss, with
    ``DataCollatorWithPadding`` and ``compute_metrics``; trainbridge runs the same worker with
    ``trainbridge.Trainer`` (the facade) in place of ``transformers.Trainer``.  ``dpo``: the tiny Llama on
    preference pairs with trl's ``DPOTrainer`` (its reference a frozen copy), and ``trainbridge.DPOTrainer``
    in its place.  ``grpo``: the tiny Llama generating completions of addition prompts with trl's
    ``GRPOTrainer`` and two reward functions, and ``trainbridge.GRPOTrainer`` in its place."""

    def arguments_class(self) -> type:
        """The class named by ``config_class``."""
        module, _, name = self.config_class.partition(":")
        return getattr(importlib.import_module(module), name)

    def per_device_batch(self, world_size: int) -> int:
        """``per_device_train_batch_size`` (and eval batch) at ``world_size``."""
        rows, remainder = divmod(self.samples_per_step, self.gradient_accumulation_steps * world_size)
        if remainder or rows == 0:
            raise ValueError(
                f"scenario {self.name}: {self.samples_per_step} samples per step do not split into "
                f"{self.gradient_accumulation_steps} accumulation steps x {world_size} ranks"
            )
        if TRAIN_SAMPLES % self.samples_per_step or EVAL_SAMPLES % (rows * world_size):
            raise ValueError(f"scenario {self.name}: data sizes must be multiples of the batch sizes")
        return rows

    def training_arguments(self, output_dir: str | Path, world_size: int) -> dict[str, Any]:
        """The full ``TrainingArguments`` keyword arguments at ``world_size``."""
        rows = self.per_device_batch(world_size)
        values: dict[str, Any] = {
            "disable_tqdm": True,
            "seed": 7,
            **self.arguments,
            "output_dir": str(output_dir),
            "use_cpu": True,
            "per_device_train_batch_size": rows,
            "per_device_eval_batch_size": rows,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "dataloader_drop_last": False,
        }
        return values

    def max_batch_len(self, world_size: int) -> int:
        """trainbridge's token budget giving micro-batches of exactly ``per_device_batch`` samples."""
        return self.per_device_batch(world_size) * SAMPLE_TOKENS


def _early_stopping() -> list[TrainerCallback]:
    # evaluations at steps 2, 4, 6, 8: best at step 4 (0.5), no improvement at 6 and 8 -> stop at 8
    return [ScriptedEvalLoss([0.9, 0.5, 0.7, 0.6, 0.4]), EarlyStoppingCallback(early_stopping_patience=2)]


def _accuracy_early_stopping() -> list[TrainerCallback]:
    # threshold 1.0: no evaluation after the first can improve on it, so with evaluations every 2 steps and
    # patience 2 the stop is at step 6 whatever the accuracies are
    return [EarlyStoppingCallback(early_stopping_patience=2, early_stopping_threshold=1.0)]


def _third_party_best() -> list[TrainerCallback]:
    from trl import BEMACallback  # trl's own callback, unchanged (runs without a trainer object)

    # evaluations at steps 2, 4, 6, 8: best at step 4 (0.5), so the best model is not the last one
    return [
        ScriptedEvalLoss([0.9, 0.5, 0.7, 0.8]),
        BEMACallback(update_freq=2),
        ReadsSFTConfig(),
        LossWatchDog(threshold=1e9),
        WeightsAtTrainEnd(),
        SaveModelAtTrainEnd(),
    ]


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "defaults",
        "TrainingArguments defaults (3 epochs, log/save every 500 steps -> final save, ProgressCallback)",
        {"disable_tqdm": False},
    ),
    Scenario(
        "step_schedules",
        "logging/eval/save every 2/3/5 steps, logging_first_step, eval_delay=4, eval_on_start, max_steps "
        "ending mid-epoch (10 of 4 per epoch), gradient accumulation 2 (substeps)",
        {
            "logging_steps": 2,
            "logging_first_step": True,
            "eval_strategy": "steps",
            "eval_steps": 3,
            "eval_delay": 4,
            "eval_on_start": True,
            "save_strategy": "steps",
            "save_steps": 5,
            "max_steps": 10,
        },
        gradient_accumulation_steps=2,
        fast=(1, 2),
    ),
    Scenario(
        "epoch_strategies",
        "logging/eval/save at every epoch end, 3 epochs, eval_delay=2 epochs",
        {
            "logging_strategy": "epoch",
            "eval_strategy": "epoch",
            "eval_delay": 2,
            "save_strategy": "epoch",
            "num_train_epochs": 3,
        },
    ),
    Scenario(
        "early_stopping",
        "EarlyStoppingCallback(patience=2) on a scripted eval_loss (stops at step 8), "
        "load_best_model_at_end, save_total_limit=2",
        {
            "eval_strategy": "steps",
            "eval_steps": 2,
            "save_strategy": "steps",
            "save_steps": 2,
            "logging_steps": 2,
            "metric_for_best_model": "eval_loss",
            "load_best_model_at_end": True,
            "save_total_limit": 2,
            "max_steps": 12,
        },
        callbacks=_early_stopping,
    ),
    Scenario(
        "save_best",
        'save_strategy="best" on a scripted eval_loss (new bests at steps 2, 4, 8, 12), save_total_limit=2',
        {
            "eval_strategy": "steps",
            "eval_steps": 2,
            "save_strategy": "best",
            "metric_for_best_model": "eval_loss",
            "logging_steps": 4,
            "save_total_limit": 2,
            "max_steps": 12,
        },
        callbacks=lambda: [ScriptedEvalLoss([0.9, 0.8, 0.85, 0.7, 0.75, 0.6])],
    ),
    Scenario(
        "control_returns",
        "a callback returning a modified copy of control: save at 2, evaluate at 3, log at 5, "
        "epoch stop at 6, training stop at 9",
        {"save_strategy": "no", "logging_steps": 500, "max_steps": 12},
        callbacks=lambda: [
            ControlScript(
                {
                    2: ["should_save"],
                    3: ["should_evaluate"],
                    5: ["should_log"],
                    6: ["should_epoch_stop"],
                    9: ["should_training_stop"],
                }
            )
        ],
    ),
    Scenario(
        "stateful_resume",
        "an ExportableState callback: its state in trainer_state.json, then a resume from checkpoint-3 "
        "(restore_callback_states_from_checkpoint=True)",
        {
            "save_strategy": "steps",
            "save_steps": 3,
            "eval_strategy": "steps",
            "eval_steps": 2,
            "logging_steps": 2,
            "max_steps": 6,
            "restore_callback_states_from_checkpoint": True,
        },
        callbacks=lambda: [StepTally("tally")],
        resume_from=3,
        fast=(),
    ),
    Scenario(
        "integrations",
        "ProgressCallback plus report_to tensorboard, mlflow (file store) and wandb (offline): "
        "TensorBoard tags, MLflow metric keys and params, W&B history keys",
        {
            "disable_tqdm": False,
            "report_to": ["tensorboard", "mlflow", "wandb"],
            "logging_steps": 2,
            "eval_strategy": "steps",
            "eval_steps": 4,
            "max_steps": 8,
            "run_name": "compat",
        },
        fast=(),
        timeout_s=300.0,
    ),
    Scenario(
        "third_party_best",
        "trl SFTConfig settings (subclass fields read by a callback), load_best_model_at_end with the best "
        "checkpoint (step 4) not the last (step 8): trl's BEMACallback, an axolotl-style loss watchdog, a "
        "save-the-model-at-train-end callback and an observer of the weights in on_train_end; "
        "include_num_input_tokens_seen='non_padding'",
        {
            "eval_strategy": "steps",
            "eval_steps": 2,
            "save_strategy": "steps",
            "save_steps": 2,
            "logging_steps": 2,
            "metric_for_best_model": "eval_loss",
            "load_best_model_at_end": True,
            "max_steps": 8,
            "bf16": False,
            "gradient_checkpointing": False,
            "learning_rate": 1e-3,
            "max_length": 64,
            "dataset_text_field": "prompt",
            "include_num_input_tokens_seen": "non_padding",
        },
        callbacks=_third_party_best,
        config_class="trl:SFTConfig",
        fast=(),
    ),
    Scenario(
        "isolated_failure",
        "one callback raising at every on_step_end among working ones (trainbridge only; Trainer, which would "
        "crash, runs without it): the others receive every hook, the broken one is reported and switched off",
        {
            "logging_steps": 2,
            "eval_strategy": "steps",
            "eval_steps": 3,
            "save_strategy": "steps",
            "save_steps": 4,
            "max_steps": 8,
        },
        callbacks=lambda: [HookCounter("before"), StepTally("tally"), HookCounter("after")],
        trainbridge_extra=lambda: [RaisesAtStepEnd()],
        expected_callback_errors=("RaisesAtStepEnd",),
    ),
    Scenario(
        "classification",
        "a non-causal model on its own loss: BertForSequenceClassification, DataCollatorWithPadding, "
        "compute_metrics accuracy, EarlyStoppingCallback on eval_accuracy (stop at step 6 of 12), "
        "save_total_limit=2, load_best_model_at_end; trainbridge side: trainbridge.Trainer",
        {
            "learning_rate": 5e-3,
            "num_train_epochs": 3,
            "logging_steps": 2,
            "eval_strategy": "steps",
            "eval_steps": 2,
            "save_strategy": "steps",
            "save_steps": 2,
            "save_total_limit": 2,
            "metric_for_best_model": "eval_accuracy",
            "load_best_model_at_end": True,
        },
        callbacks=_accuracy_early_stopping,
        task="classification",
    ),
    Scenario(
        "dpo",
        "trl's DPOTrainer (sigmoid loss, the reference a frozen copy of the policy) with HF callbacks "
        "(an ExportableState tally, a hook counter), evaluation of preference pairs every 2 steps, "
        "checkpoints every 4; trainbridge side: trainbridge.DPOTrainer",
        {
            "learning_rate": 1e-3,
            "logging_steps": 2,
            "eval_strategy": "steps",
            "eval_steps": 2,
            "save_strategy": "steps",
            "save_steps": 4,
            "max_steps": 8,
            "max_length": 32,
            "beta": 0.1,
            "bf16": False,
            "gradient_checkpointing": False,
        },
        callbacks=lambda: [StepTally("tally"), HookCounter("dpo")],
        config_class="trl:DPOConfig",
        task="dpo",
    ),
    Scenario(
        "grpo",
        "trl's GRPOTrainer (two reward functions as callables, 4 completions per prompt sampled with generate, "
        "one generation batch per optimizer step, no reference model) with HF callbacks (an ExportableState "
        "tally, a hook counter, a callback asking through control for a save at step 3 and a log at step 5), "
        "checkpoints every 4 steps; trainbridge side: trainbridge.GRPOTrainer",
        {
            "learning_rate": 1e-3,
            "logging_steps": 2,
            "save_strategy": "steps",
            "save_steps": 4,
            "max_steps": 6,
            "num_generations": 4,
            "max_completion_length": 6,
            "beta": 0.0,
            "bf16": False,
            "gradient_checkpointing": False,
        },
        callbacks=lambda: [
            StepTally("tally"),
            HookCounter("grpo"),
            ControlScript({3: ["should_save"], 5: ["should_log"]}),
        ],
        config_class="trl:GRPOConfig",
        task="grpo",
        fast=(),
    ),
    Scenario(
        "one_rank_stop",
        "an HF callback sets should_training_stop at step 3 on the last rank only",
        {"logging_steps": 2, "max_steps": 8, "ddp_timeout": 60},
        callbacks=lambda: [StopOnLastRank(3)],
        fast=(1, 2),
        trainer_fails=(2,),
        timeout_s=150.0,
    ),
)
"""Every scenario, in report order."""

SCENARIOS_BY_NAME: dict[str, Scenario] = {s.name: s for s in SCENARIOS}


def scenario(name: str) -> Scenario:
    """The scenario called ``name`` (``KeyError`` listing the names otherwise)."""
    try:
        return SCENARIOS_BY_NAME[name]
    except KeyError:
        raise KeyError(f"unknown compat scenario {name!r}; known: {', '.join(SCENARIOS_BY_NAME)}") from None


def _callback_names(build: Callable[[], list[TrainerCallback]]) -> list[str]:
    return [f"{type(cb).__module__}.{type(cb).__qualname__}" for cb in build()]


def scenario_fingerprint() -> str:
    """A short hash of every scenario's definition: name, what it covers, its ``TrainingArguments`` at each
    world size, its callbacks' classes, task, world sizes and expectations (not ``timeout_s``).

    ``compat/REPORT.md`` records it when written from a full run; ``test_the_report_is_as_new_as_the_scenarios``
    recomputes it, so a scenario added or changed without regenerating the report fails CI.
    """
    definitions = [
        {
            "name": spec.name,
            "covers": spec.covers,
            "arguments": {ws: spec.training_arguments("OUTPUT", ws) for ws in spec.world_sizes},
            "callbacks": _callback_names(spec.callbacks),
            "trainbridge_extra": _callback_names(spec.trainbridge_extra),
            "world_sizes": spec.world_sizes,
            "fast": spec.fast,
            "resume_from": spec.resume_from,
            "trainer_fails": spec.trainer_fails,
            "config_class": spec.config_class,
            "expected_callback_errors": spec.expected_callback_errors,
            "task": spec.task,
        }
        for spec in SCENARIOS
    ]
    text = json.dumps(definitions, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
