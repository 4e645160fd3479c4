"""``Trainer.hyperparameter_search`` on trainbridge's loop: each trial is a ``train(trial=...)`` in place.

The search is Trainer's own (the backend's study, ``_hp_search_setup``); ``train()`` builds the trial's model as
Trainer's does (``fresh_model``) and reports each evaluation's objective (``TrialReport``).  A pruned trial stops
by ``control``, agreed across ranks (Trainer's rank 0 would raise alone), then ``train()`` raises
``optuna.TrialPruned``.  Ray Tune runs trials in processes of its own, not in place: refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import transformers

if TYPE_CHECKING:
    from trainbridge.trainer.facade import LoopTrainer


def check_backend(backend: object) -> None:
    """Refuse a backend whose trials do not run in this process (Ray Tune), before anything starts."""
    from transformers.trainer_utils import HPSearchBackend

    if backend is not None and HPSearchBackend(backend) == HPSearchBackend.RAY:
        raise ValueError(
            "hyperparameter_search(backend='ray'): Ray Tune runs each trial in a process of its own, outside the "
            "script's launch, which trainbridge's in-place train() does not support; use backend='optuna' (each "
            "trial trains in place, on every rank of the launch) or keep transformers.Trainer for this search"
        )


def fresh_model(trainer: LoopTrainer, trial: Any) -> None:
    """Trainer's model re-init at the start of ``train()`` with a ``model_init``: seeded with ``args.seed``,
    ``model_init(trial)``, the optimizer and schedule built anew."""
    from transformers.trainer_utils import enable_full_determinism, set_seed

    args = trainer.args
    enable_full_determinism(args.seed) if args.full_determinism else set_seed(args.seed)
    trainer._loop = None  # the previous run's engine (and model) can go
    trainer.model = trainer.call_model_init(trial)
    trainer.model_wrapped = trainer.model
    trainer.optimizer, trainer.lr_scheduler = None, None


class TrialReport(transformers.TrainerCallback):
    """During a trial's ``train()``: each evaluation's objective to the study (Trainer's
    ``_report_to_hp_search``, optuna's part); a prune stops training (see the module doc)."""

    def __init__(self, trainer: LoopTrainer, trial: Any) -> None:
        self.trainer = trainer
        self.trial = trial
        self.pruned = False

    def on_evaluate(
        self,
        args: transformers.TrainingArguments,
        state: transformers.TrainerState,
        control: transformers.TrainerControl,
        metrics: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        objective = self.trainer.compute_objective(dict(metrics or {}))
        # what Trainer's optuna backend reads after train() (Trainer sets it untyped: mypy cannot infer it)
        self.trainer.objective = objective  # type: ignore[has-type]
        if not _reports_to_a_study(self.trial):
            return
        self.trial.report(objective, state.global_step)
        if self.trial.should_prune():
            self.pruned = True
            control.should_training_stop = True

    def raise_if_pruned(self) -> None:
        """After ``train()``: ``optuna.TrialPruned`` for a pruned trial, as Trainer raises it."""
        if self.pruned:
            import optuna

            raise optuna.TrialPruned()


def _reports_to_a_study(trial: Any) -> bool:
    """An optuna trial of a single-objective study (rank 0's; the other ranks hold a ``FixedTrial``)."""
    try:
        import optuna
    except ImportError:
        return False
    return isinstance(trial, optuna.trial.Trial) and not trial.study._is_multi_objective()
