"""``RunPlan``: the code a run executes, as typed seams chosen at build time; ``TrainingArgs`` holds data only.

A seam is a Protocol: the step, the training data (a collator, a stream, a DataLoader factory, the script's
own datasets), prediction (``compute_metrics``, logits preprocessing), the optimizer, the checkpoint's model
files, the evaluation, the callbacks and event functions, the model (``model_init``).  The plan travels beside
the arguments: ``run_training(args, torchrun_args, callbacks=[...], on_save=fn, compute_metrics=fn)`` builds
it (``RunPlan.from_keywords``), ``build_run(args, plan, env)`` runs it; ``trainbridge.Trainer`` builds its
plan from the script's live instance.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from trainbridge.core.config.imports import CallbackSpec, resolve_import_path
from trainbridge.core.config.loss import LOSSES, Loss
from trainbridge.core.events import Event, event_from_name

if TYPE_CHECKING:
    from pathlib import Path

    import torch

    from trainbridge.core.config.training import TrainingArgs


class ModelInit(Protocol):
    """``model_init()`` (or ``model_init(trial)``, called with None): the model to train, in every worker."""

    def __call__(self, *args: Any) -> Any: ...


class ExistingModel:
    """A ``model_init`` returning a model object that exists already (``trainbridge.Trainer``'s: the script's own,
    trained in place).  The build seeds (``args.seed``) before building a model, as Trainer seeds around its
    ``model_init``; it does not re-seed before this one, as Trainer's ``train()`` does not re-seed its model: the
    random state is the one the script left (trl's ``seed + rank`` for sampling, its own ``set_seed``)."""

    def __call__(self, *args: Any) -> Any:
        raise NotImplementedError


class Collator(Protocol):
    """A data collator: a list of items -> a batch (``transformers``' collators, a function)."""

    def __call__(self, features: list[Any]) -> Any: ...


class TrainLoaderFactory(Protocol):
    """``fn(dataset, collate, model) -> DataLoader``: this rank's training batches as a script builds them."""

    def __call__(self, dataset: Any, collate: Any, model: Any) -> Iterable[Any]: ...


class EvaluationRun(Protocol):
    """What ``Evaluation`` gets (``loop.evaluation_point.EvaluationPoint``): ``run()`` is the loop's own
    evaluation; ``run.log(logs)`` / ``run.evaluate(metrics)`` fire ``on_log`` / ``on_evaluate`` to every callback for an
    evaluation of the seam's own; ``model`` is the engine's (wrapped) model and ``autocast()`` its forward
    precision."""

    model: Any

    def __call__(self) -> dict[str, float]: ...

    def log(self, logs: dict[str, Any]) -> None: ...

    def evaluate(self, metrics: dict[str, Any]) -> None: ...

    def autocast(self) -> Any: ...


class Evaluation(Protocol):
    """``evaluation(run) -> metrics``: how each evaluation during training runs (``EvaluationRun``)."""

    def __call__(self, run: EvaluationRun) -> dict[str, float]: ...


class OptimizerFactory(Protocol):
    """The script's optimizer and, where it gives one, schedule (``parallel.optim``)."""

    def optimizer(self, model: Any, groups: Any, default: Any, total_steps: int) -> Any: ...

    def scheduler(self, optimizer: Any, total_steps: int, default: Any) -> Any: ...


@dataclass(frozen=True)
class ModelPart:
    """A checkpoint's model part, to be written inside its temporary folder (``ModelFiles.write``)."""

    model: Any
    folder: Path
    """The temporary folder of the checkpoint of ``step``."""
    step: int
    state: dict[str, torch.Tensor] | None
    """The model's gathered full weights on rank 0 (a PEFT model's adapter weights), None on the others."""
    tokenizer: Any
    """The run's processing class (None: none to save)."""
    weights_dtype: torch.dtype | None
    """The dtype the weights are written in (None: as they are)."""
    is_rank_zero: bool


class ModelFiles(Protocol):
    """What writes a checkpoint's model part inside its temporary folder (``checkpoint.model_files``; HF layout
    by default)."""

    keeps_model_state: bool
    """The checkpoint keeps the model's own weights in ``dcp/`` (resume reads them there)."""

    def write(self, part: ModelPart) -> None:
        """Write ``part``'s files into ``part.folder`` (called on every rank)."""


class ComputeMetrics(Protocol):
    """``fn(EvalPrediction) -> dict`` as in ``transformers.Trainer``."""

    def __call__(self, eval_prediction: Any, *args: Any, **kwargs: Any) -> dict[str, Any]: ...


@dataclass(frozen=True)
class ScriptData:
    """The data of an in-place run (``trainbridge.Trainer.train()``): the script's own objects, read where
    ``run_training``'s workers read ``data_path``, ``val_data_path``, ``eval_data_paths`` and ``tokenizer_path``.
    Sample batches index a dataset live (``dataset[i]`` at each micro-batch, every epoch); the token step
    tokenises ``datasets.Dataset`` rows into the data cache, once per node, keyed by fingerprint
    (``data.in_place``).  Nothing goes into ``output_dir``."""

    train: Any
    """The training dataset (None: a ``train_stream`` or the script's own ``train_loader`` reads it)."""
    eval: Any = None
    """The validation dataset (None: none, or the named sets)."""
    named_eval: dict[str, Any] = field(default_factory=dict)
    """Named validation sets (a dict ``eval_dataset``), each evaluated in turn."""
    processing_class: Any = None
    """The live tokenizer or processor (None: the rows need none), saved into every checkpoint."""
    identity: str | None = None
    """What the training data is, for the checkpoint fingerprint (a resume on other data is flagged)."""


class PreprocessLogits(Protocol):
    """``fn(logits, labels) -> predictions`` on each validation batch, as in ``transformers.Trainer``."""

    def __call__(self, logits: Any, labels: Any) -> Any: ...


@dataclass(frozen=True)
class Generate:
    """The predictions seam: each validation batch's predictions are the token ids ``model.generate`` returns
    for its inputs without the labels (``Seq2SeqTrainer``'s ``predict_with_generate``); the loss is still the
    step's.  ``TrainingArgs.predict_with_generate`` asks for one with its ``generation_kwargs``."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    """``model.generate``'s keyword arguments (``max_length``, ``num_beams``); the generation config gives the rest."""


@dataclass
class RunPlan:
    """The run's code, one typed seam each; None (or empty): trainbridge's default for that seam."""

    model_init: ModelInit | None = None
    """The model, built in every worker instead of loading ``model_path``."""
    loss: Loss | None = None
    """What each step trains on (``core.config.loss``): the token cross entropy, the forward's own loss, a
    ``compute_loss`` function, a Trainer instance's ``training_step`` or a step factory's own; None:
    ``TrainingArgs.training_step`` names it (``declared_loss``), ``auto`` chosen from the model at build time."""
    data_collator: Collator | None = None
    """The script's collator, called as written (padded batches)."""
    train_stream: Iterable[Any] | None = None
    """A streaming training set (an ``IterableDataset``) instead of ``data_path``'s rows; needs ``max_steps``."""
    train_loader: TrainLoaderFactory | None = None
    """The script's own DataLoader of the training items (``model_loss`` batches)."""
    script_data: ScriptData | None = None
    """The script's own datasets and tokenizer, instead of the data and tokenizer paths (in place)."""
    evaluation: Evaluation | None = None
    """Each evaluation during training, around the loop's own (a Trainer subclass's ``evaluate``)."""
    optimizer_factory: OptimizerFactory | None = None
    """The script's optimizer and schedule."""
    checkpoint_model_files: ModelFiles | None = None
    """What writes the model part of each checkpoint (HF layout by default)."""
    compute_metrics: ComputeMetrics | None = None
    """Metrics of the whole validation set's predictions, merged into the evaluation metrics."""
    preprocess_logits_for_metrics: PreprocessLogits | None = None
    """Applied to each validation batch's logits before the predictions are kept."""
    predictions: Generate | None = None
    """How validation predictions are made: None, the step's forward outputs; ``Generate``, generated ids
    (``Seq2SeqTrainer``'s; ``TrainingArgs.predict_with_generate`` asks for one: ``predictions_of``)."""
    hf_args: Any = None
    """The ``transformers.TrainingArguments`` (or subclass: trl's configs) the settings were ported from, which
    Hugging Face callbacks see (``hf.arguments``)."""
    callbacks: list[Any] = field(default_factory=list)
    """Every callback in dispatch order: objects, classes and the ``CallbackSpec`` import paths."""
    event_functions: dict[Event, list[Callable[..., Any]]] = field(default_factory=dict)
    """Plain functions per event (``on_<event>=fn``)."""

    def replace(self, **changes: Any) -> RunPlan:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_keywords(cls, **code: Any) -> RunPlan:
        """The plan of ``run_training``'s code keywords: ``callbacks=[...]`` (objects, classes, ``CallbackSpec``s),
        ``on_<event>=fn`` (or a list), ``event_functions={event: fns}``, and each seam by its field name
        (``model_init`` may be a ``package.module:function`` import path).  A ``ValueError`` names a bad one."""
        functions: dict[Event, list[Any]] = {}
        for key, value in (code.pop("event_functions", None) or {}).items():
            functions.setdefault(event_from_name(str(getattr(key, "value", key))), []).extend(
                value if isinstance(value, list | tuple) else [value]
            )
        for key in [k for k in code if k.startswith("on_")]:
            value = code.pop(key)
            try:
                event = event_from_name(key)
            except ValueError as exc:
                raise ValueError(f"{key}: {exc}") from None
            functions.setdefault(event, []).extend(value if isinstance(value, list | tuple) else [value])
        for event, fns in functions.items():
            for fn in fns:
                if not callable(fn):
                    raise ValueError(f"{event.value}: expected a callable, got {type(fn).__name__} {fn!r}")
        unknown = sorted(set(code) - CODE_KEYWORDS - {"callbacks"})
        if unknown:
            raise ValueError(
                f"{unknown[0]}: not a RunPlan keyword (the code of a run: {', '.join(sorted(CODE_KEYWORDS))}, "
                "callbacks, on_<event>); settings go into TrainingArgs"
            )
        model_init = code.get("model_init")
        if isinstance(model_init, str):
            code["model_init"] = model_init = resolve_import_path(model_init)
        if model_init is not None and not callable(model_init):
            raise ValueError(f"model_init: expected a function returning the model, got {type(model_init).__name__}")
        loss = code.get("loss")
        if loss is not None and not isinstance(loss, LOSSES):
            raise ValueError(
                f"loss: expected one of {', '.join(c.__name__ for c in LOSSES)} (trainbridge.core.config.loss), got "
                f"{type(loss).__name__}; wrap a compute_loss function as LossFunction(fn)"
            )
        hf_args = code.get("hf_args")
        if hf_args is not None:
            from transformers import TrainingArguments

            if not isinstance(hf_args, TrainingArguments):
                raise ValueError(
                    f"hf_args: expected a transformers.TrainingArguments (or subclass) instance, got "
                    f"{type(hf_args).__name__}; pass the object your script built, or leave it unset"
                )
        given = code.pop("callbacks", None)
        items = [] if given is None else list(given) if isinstance(given, list | tuple) else [given]
        callbacks = [
            CallbackSpec.model_validate(c if isinstance(c, dict) else {"class": c}) if isinstance(c, dict | str) else c
            for c in items
        ]
        return cls(callbacks=callbacks, event_functions=functions, **code)

    def keywords(self) -> dict[str, Any]:
        """The plan as ``run_training`` keywords (what ``RunPlan.from_keywords`` takes back)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


CODE_KEYWORDS = frozenset(f.name for f in dataclasses.fields(RunPlan)) - {"callbacks"}
"""The keywords that are code (``RunPlan``'s seams): ``run_training`` takes them, ``TrainingArgs`` refuses them."""


def predictions_of(args: TrainingArgs, plan: RunPlan) -> Generate | None:
    """The run's predictions seam, chosen once at build time: the plan's, else ``Generate`` when
    ``args.predict_with_generate`` asks for it; a ``ValueError`` when both give one."""
    if not args.predict_with_generate:
        return plan.predictions
    if plan.predictions is not None:
        raise ValueError(
            "predict_with_generate: the run's code already makes its predictions by generation (RunPlan.predictions "
            "from Seq2SeqTrainer or predictions=); leave predict_with_generate False"
        )
    return Generate(dict(args.generation_kwargs))


def eval_set_names(args: TrainingArgs, plan: RunPlan) -> list[str]:
    """The names of the named validation sets: ``eval_data_paths``'s, or in place the script's
    (``RunPlan.script_data.named_eval``)."""
    script = plan.script_data
    return list(script.named_eval) if script is not None else list(args.eval_data_paths)
