"""``trainbridge.Trainer``: ``transformers.Trainer``'s constructor, methods and return values on our loop.

Port a script by changing its import (``from trainbridge import Trainer``); docs/porting.md lists every
argument and method as same / differs / not supported.

Where it runs: in place, always (``trainer.jobs``).

- **Under a launcher** (``torchrun script.py``, ``accelerate launch``, ``srun`` of torchrun: ``RANK``,
  ``LOCAL_RANK`` and ``WORLD_SIZE`` are set): every rank runs the script; ``train()`` starts the process
  group, rank 0 writes the run folder (model, datasets), and the loop runs on this rank.
- **Plain ``python script.py``**: with several processes (``TRAINBRIDGE_NPROC_PER_NODE``, else one per visible
  GPU) the script was re-executed under torchrun when ``Trainer`` was imported (``launch.script_launch``), so
  this is the case above; with one, the loop runs in the script's process, world size 1, as Trainer's.
  ``torchrun_args=`` is honoured when it is the running world, else refused naming what to do.

The run folder is ``output_dir/.trainbridge/`` (``core.run_dir.FacadeDir``): the model, the datasets' rows,
the final weights and the recorded state.  Here: the public API.  ``trainer.jobs`` runs the jobs (train,
evaluate; in place or launched), ``trainer.run_folder`` writes their inputs, ``trainer.job_args`` makes their
``TrainingArgs``, ``trainer.results`` turns what they return into Trainer's state and metrics.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainbridge.checkpoint.layout import TRAINER_STATE_FILE, TRAINING_ARGS_FILE
from trainbridge.core.config import TorchrunArgs, TrainingArgs
from trainbridge.core.distributed import DistributedEnv, launched_worker
from trainbridge.core.run_dir import FacadeDir, results_file
from trainbridge.data.stream_batches import is_stream
from trainbridge.hf.porting import HFPortingWarning
from trainbridge.launch.script_launch import ScriptLaunchError, launch_script, world_problem
from trainbridge.trainer import jobs, results, script_data, subclass, subclass_data, worker_methods
from trainbridge.trainer.optimizers import optimizer_factory
from trainbridge.trainer.run_folder import ModelSource, RowPreparation, is_dataset_dict
from trainbridge.trainer.script_events import ScriptEvents
from trainbridge.trainer.script_handles import CallbackList, ScriptAccelerator

logger = logging.getLogger("trainbridge.trainer")


class UnsupportedTrainerFeatureError(ValueError):
    """A ``Trainer`` argument or override that trainbridge cannot honour; says what to do instead."""


class Trainer:
    """``transformers.Trainer``'s API on trainbridge's loop (see the module doc)."""

    def __init__(
        self,
        model: Any = None,
        args: Any = None,
        data_collator: Callable[..., Any] | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        model_init: Callable[..., Any] | None = None,
        compute_loss_func: Callable[..., Any] | None = None,
        compute_metrics: Callable[..., Any] | None = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        optimizer_cls_and_kwargs: Any = None,
        preprocess_logits_for_metrics: Callable[..., Any] | None = None,
        *,
        tokenizer: Any = None,
        torchrun_args: TorchrunArgs | None = None,
        **kwargs: Any,
    ) -> None:
        self._reject_unsupported(kwargs)
        launch_script()  # python script.py with several processes: re-executed under torchrun from here, if not yet
        from transformers import TrainerState, TrainingArguments

        if args is None:
            args = TrainingArguments(output_dir="trainer_output")
        if not isinstance(args, TrainingArguments | TrainingArgs):
            raise TypeError(
                f"args: expected transformers.TrainingArguments (or a subclass) or "
                f"trainbridge.TrainingArgs, got {type(args).__name__}"
            )
        self.args = args
        if model is None and model_init is None:
            raise RuntimeError("`Trainer` requires either a `model` or `model_init` argument")
        if model is not None and model_init is not None:
            raise RuntimeError("`Trainer` requires either a `model` or `model_init` argument, not both")
        self.model_init = model_init
        self.model = model_init() if model is None and model_init is not None else model
        if isinstance(self.model, str | os.PathLike):
            self._model_source: Path | None = Path(self.model)
            self.model = None
        else:
            self._model_source = None
        self.processing_class = processing_class if processing_class is not None else tokenizer
        self.data_collator = data_collator
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.compute_metrics = compute_metrics
        self.compute_loss_func = compute_loss_func
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.callbacks: list[Any] = list(callbacks or [])
        self.torchrun_args = torchrun_args
        problem = world_problem(jobs.world_size_of(torchrun_args) if torchrun_args is not None else None)
        if problem:
            raise ScriptLaunchError(problem)
        script_data.check_stream_steps(train_dataset, args)
        self._peft_config = kwargs.get("peft_config")  # trl's SFTTrainer(peft_config=...)
        # optimizers= (in place under the script's launcher, else rebuilt in the workers) /
        # optimizer_cls_and_kwargs= / create_optimizer... overrides (trainer.optimizers)
        self._optimizer_factory = optimizer_factory(self, optimizers, optimizer_cls_and_kwargs, True)
        self._fallback_tokenizer: Any = None
        self.state = TrainerState()
        self._script_events = ScriptEvents()
        self.control = self._script_events.control
        self._env: DistributedEnv | None = None
        self._loop: Any = None
        self._weights_dir: Path | None = None
        self._collator_choice = script_data.classify_collator(data_collator)
        if data_collator is not None and (
            subclass.subclass_loss(self) is not None or subclass_data.subclass_loader(self) is not None
        ):
            # the loss sees Trainer's batches: the collator is called as written on the dataset's items
            self._collator_choice = script_data.CollatorChoice(False, description=type(data_collator).__name__)
        if self.is_world_process_zero():
            logger.info(
                "data collator: %s -> %s",
                self._collator_choice.description,
                "trainbridge's token-budget batching (reproduces it)"
                if self._collator_choice.reproduced
                else "called as written on padded micro-batches",
            )

    # ================================================================== construction checks
    def _reject_unsupported(self, kwargs: dict[str, Any]) -> None:
        unhonoured = subclass.unhonoured_overrides(type(self))
        if unhonoured:
            raise UnsupportedTrainerFeatureError(
                f"{type(self).__name__} overrides {', '.join(f'{n}()' for n in unhonoured)}: trainbridge's "
                "distributed loop does not call this Trainer method, so the override would never run. Move the "
                "logic into a callback (trainbridge.Callback, or a transformers.TrainerCallback) or into an "
                "override that runs in the workers (compute_loss, training_step, prediction_step, log, "
                "create_optimizer, create_scheduler)." + subclass.override_hints(unhonoured)
            )
        unknown = sorted(set(kwargs) - {"peft_config", "formatting_func", "quantization_config"})
        if unknown:
            raise TypeError(f"Trainer.__init__() got unexpected keyword arguments {unknown}")
        if kwargs.get("quantization_config") is not None:
            raise UnsupportedTrainerFeatureError(
                "quantization_config: quantized (k-bit) base models are not supported by the facade; train in "
                "full or bf16 precision (TrainingArgs.model_kwargs dtype), with a LoRA adapter for memory."
            )
        if kwargs.get("formatting_func") is not None:
            raise UnsupportedTrainerFeatureError(
                "formatting_func: format the rows before the Trainer (dataset.map) into 'text', 'messages' or "
                "'prompt'/'completion' columns; trainbridge tokenises those itself."
            )

    # Trainer methods a subclass may override (trainer.subclass: they run in the workers on a worker-side
    # instance, where super() runs these; the others are refused at construction, naming them)
    def compute_loss(
        self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        """``Trainer.compute_loss``: called in the workers by ``training_step`` / ``prediction_step`` when a
        subclass overrides one of them (or with ``compute_loss_func``); ``super()`` runs Trainer's there."""
        return worker_methods.default_compute_loss(self, model, inputs, return_outputs, num_items_in_batch)

    def create_optimizer(self) -> Any:
        """``Trainer.create_optimizer``: called in the workers (``trainer.optimizers.SubclassOptimizer``) when a
        subclass overrides it; ``super().create_optimizer()`` sets ``self.optimizer`` to what ``optim`` (or
        ``optimizers=`` / ``optimizer_cls_and_kwargs=``) builds on the worker's model."""
        if getattr(self, "optimizer", None) is None:
            if "_default_optimizer" not in vars(self):
                raise UnsupportedTrainerFeatureError("create_optimizer runs in the workers, inside train()")
            self.optimizer = vars(self)["_default_optimizer"]()
        return self.optimizer

    def create_optimizer_and_scheduler(self, num_training_steps: int) -> None:
        """``Trainer.create_optimizer_and_scheduler``: called in the workers when a subclass overrides it, with
        the run's optimizer steps; the default is ``create_optimizer()`` then ``create_scheduler()``."""
        self.create_optimizer()
        self.create_scheduler(num_training_steps=num_training_steps)

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        """``Trainer.create_scheduler``: called in the workers after ``create_optimizer``; ``super()`` sets
        ``self.lr_scheduler`` to ``lr_scheduler_type``'s schedule (or the script's scheduler)."""
        if getattr(self, "lr_scheduler", None) is None:
            if "_default_scheduler" not in vars(self):
                raise UnsupportedTrainerFeatureError("create_scheduler runs in the workers, inside train()")
            self.lr_scheduler = vars(self)["_default_scheduler"](optimizer if optimizer is not None else self.optimizer)
        return self.lr_scheduler

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        """``Trainer.training_step``: called in the workers on each micro-batch (``step.trainer_methods``) when
        a subclass overrides it or ``compute_loss``; ``super()`` runs Trainer's there."""
        if "_worker_accelerator" not in vars(self):
            raise UnsupportedTrainerFeatureError("training_step runs in the workers, inside train()")
        return worker_methods.default_training_step(self, model, inputs, num_items_in_batch)

    def prediction_step(self, model: Any, inputs: Any, prediction_loss_only: bool, ignore_keys: Any = None) -> Any:
        """``Trainer.prediction_step``: called in the workers on each validation batch when a subclass
        overrides it or ``compute_loss``; ``super()`` runs Trainer's there."""
        if "_worker_accelerator" not in vars(self):
            raise UnsupportedTrainerFeatureError("prediction_step runs in the workers, inside evaluation")
        return worker_methods.default_prediction_step(self, model, inputs, prediction_loss_only, ignore_keys)

    # ================================================================== process helpers
    def is_world_process_zero(self) -> bool:
        """True on global rank 0 (always, in the process that self-launches the workers)."""
        if self._env is not None:
            return self._env.is_world_process_zero
        return int(os.environ.get("RANK", "0")) == 0 if launched_worker() else True

    def is_local_process_zero(self) -> bool:
        """True on each node's local rank 0."""
        if self._env is not None:
            return self._env.is_local_process_zero
        return int(os.environ.get("LOCAL_RANK", "0")) == 0

    @property
    def output_dir(self) -> Path:
        """``args.output_dir`` (``ckpt_output_dir`` of a ``TrainingArgs``)."""
        if isinstance(self.args, TrainingArgs):
            return self.args.ckpt_output_dir
        return Path(self.args.output_dir or "trainer_output")

    @property
    def run_dir(self) -> Path:
        """The run folder (``output_dir/.trainbridge``)."""
        return self._folder.root

    def _device(self) -> str:
        """``TrainingArgs.device`` of the run: ``cpu`` under ``use_cpu``, else the args' own or ``auto``."""
        if getattr(self.args, "use_cpu", False):
            return "cpu"
        return self.args.device if isinstance(self.args, TrainingArgs) else "auto"

    def _start_env(self) -> DistributedEnv:
        if self._env is None:
            timeout_s: Any = getattr(self.args, "ddp_timeout", None) or getattr(self.args, "collective_timeout_s", 1800)
            self._env = DistributedEnv.initialize(self._device(), float(timeout_s))
            if self._env.started_group:  # in place: the script goes on after train(); leave the group at its exit,
                atexit.register(self._env.teardown, clean=False)  # not to gloo's threads at interpreter teardown
        return self._env

    # ================================================================== what the jobs read
    @property
    def _folder(self) -> FacadeDir:
        return FacadeDir.of(self.output_dir)

    def _tokenizer(self) -> Any:
        """The processing class's tokenizer; without one (Trainer needs none for tokenised rows), the
        tokenizer saved beside the model the script loaded, if its folder has one."""
        tok = self.processing_class
        if tok is None and self._fallback_tokenizer is None and self.model is not None:
            self._fallback_tokenizer = script_data.tokenizer_beside(self.model)
        if tok is None:
            tok = self._fallback_tokenizer
        return getattr(tok, "tokenizer", tok)  # a multimodal processor carries its tokenizer

    def _model_source_for_jobs(self) -> ModelSource:
        """The model and tokenizer as a job writes them (``run_folder.write_model``)."""
        return ModelSource(
            model=self.model,
            folder=self._model_source,
            trained=self._weights_dir,
            tokenizer=self._tokenizer(),
            save_tokenizer=self.processing_class is not None,
        )

    def _row_preparation(self) -> RowPreparation:
        """How the datasets' rows are prepared: the collator's choice, padded with the collator's own tokenizer."""
        collator_tokenizer = getattr(self.data_collator, "tokenizer", None)
        pad_id = getattr(collator_tokenizer or self._tokenizer(), "pad_token_id", None)
        return RowPreparation(
            self._collator_choice,
            pad_id,
            items=script_data.uses_sample_batches(self.model, self._collator_choice)
            or subclass.subclass_loss(self) is not None
            or is_stream(self.train_dataset)
            or subclass_data.subclass_loader(self) is not None,
        )  # the script's loss, a stream, its own DataLoader: its items

    # ================================================================== train
    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Train and return ``TrainOutput(global_step, training_loss, metrics)`` (see the module doc)."""
        from transformers.trainer_utils import TrainOutput

        if trial is not None:
            raise UnsupportedTrainerFeatureError("trial: hyper-parameter search is not supported")
        if kwargs:
            raise TypeError(f"train() got unexpected keyword arguments {sorted(kwargs)}")
        if resume_from_checkpoint is True and not results.has_checkpoint(self.output_dir):
            raise ValueError(f"No valid checkpoint found in output directory ({self.output_dir})")
        problem = script_data.model_travel_problem(self.model) if self.model is not None else None
        if problem is not None:  # before any job: the workers could not be given this model
            raise UnsupportedTrainerFeatureError(problem)
        result, state = jobs.train(self, resume_from_checkpoint)
        self._set_state(state)
        metrics = results.train_metrics(state["log_history"], bool(getattr(self.args, "disable_tqdm", False)))
        train_loss = float(result.train_loss if result.train_loss is not None else 0.0)
        return TrainOutput(result.global_step, train_loss, metrics)

    def _set_state(self, recorded: dict[str, Any]) -> None:
        self.state = results.trainer_state(
            recorded,
            getattr(self.args, "per_device_train_batch_size", None),
            self.is_world_process_zero(),
            self.is_local_process_zero(),
        )

    # ================================================================== evaluate / predict
    def evaluate(
        self, eval_dataset: Any = None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """Evaluate (loss plus ``compute_metrics``) on ``eval_dataset`` or the Trainer's; also after training.
        As Trainer: a dict evaluates each dataset (``<prefix>_<name>_`` keys); the metrics are logged
        (``state.log_history``, ``on_log``) and ``on_evaluate`` fires (``trainer.script_events``)."""
        if "_worker_accelerator" in vars(self):  # super().evaluate() of an override, during train() in a worker
            return subclass.evaluate_in_worker(self, eval_dataset, metric_key_prefix)
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        loop = self._loop
        if eval_dataset is None and loop is not None and (loop.eval_batches is not None or loop.named_eval_batches):
            # in place after training, the run's own sets: the loop logs and fires the events on every rank
            metrics: dict[str, Any] = dict(loop.evaluate_sets())  # not loop.evaluate(): an override is calling
            for part in results.per_set(metrics, list(loop.named_eval_batches)):
                self._record_log(results.prefixed(part, metric_key_prefix))
            return results.prefixed(metrics, metric_key_prefix)
        if is_dataset_dict(dataset):
            # one evaluation job over the named sets; each set's metrics logged and fired in turn, as Trainer does
            metrics = {}
            job_metrics, _ = jobs.evaluate(self, dataset, keep_predictions=False) if dataset else ({}, None)
            for part in results.per_set(job_metrics, [str(name) for name in dataset]):
                part.pop("epoch", None)
                part = results.prefixed(part, metric_key_prefix)
                self.log(part)
                self._fire("on_evaluate", metrics=part)
                metrics.update(part)
            return metrics
        job_metrics, _ = jobs.evaluate(self, dataset, keep_predictions=False)
        job_metrics.pop("epoch", None)  # the separate job's own 0.0; log() sets the trainer's, as Trainer.log
        metrics = results.prefixed(job_metrics, metric_key_prefix)
        self.log(metrics)
        self._fire("on_evaluate", metrics=metrics)
        return metrics

    def predict(self, test_dataset: Any, ignore_keys: list[str] | None = None, metric_key_prefix: str = "test") -> Any:
        """``PredictionOutput(predictions, label_ids, metrics)`` over ``test_dataset`` (every rank's share,
        in dataset order); ``on_predict`` fires, as under Trainer."""
        from transformers.trainer_utils import PredictionOutput

        metrics, gathered = jobs.evaluate(self, test_dataset, keep_predictions=True)
        metrics.pop("epoch", None)  # Trainer.predict reports no epoch (evaluate() does, through log())
        if gathered is None:
            raise RuntimeError("predict: no predictions came back from the evaluation job")
        metrics = results.prefixed(metrics, metric_key_prefix)
        self._fire("on_predict", metrics=metrics)
        return PredictionOutput(predictions=gathered.predictions, label_ids=gathered.label_ids, metrics=metrics)

    def _record_log(self, logs: dict[str, Any]) -> None:
        """Append ``logs`` to ``state.log_history`` as ``Trainer.log`` does (``epoch`` set on ``logs`` itself)."""
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch
        self.state.log_history.append({**logs, "step": self.state.global_step})

    def _fire(self, hook: str, **kwargs: Any) -> None:
        """Fire a Trainer event outside training on the script's TrainerCallbacks (``script_events``)."""
        self.state.is_world_process_zero = self.is_world_process_zero()
        self.state.is_local_process_zero = self.is_local_process_zero()
        self.control = self._script_events.fire(
            hook, self.args, self.state, self.callbacks, self.model, self.processing_class, **kwargs
        )

    # ================================================================== saving
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """``Trainer._save_checkpoint``: in a worker at a checkpoint (``trainer.save_overrides``), its model part:
        ``self.save_model(<output_dir>/checkpoint-<step>, _internal_call=True)``; the checkpoint manager
        writes the rest (optimizer, scheduler, RNG, ``trainer_state.json``) and rotates."""
        if "_checkpoint_write" not in vars(self):
            raise UnsupportedTrainerFeatureError("_save_checkpoint runs in the workers, at each checkpoint")
        self.save_model(os.path.join(self._get_output_dir(trial), f"checkpoint-{self.state.global_step}"), True)

    def _get_output_dir(self, trial: Any) -> str:
        """``Trainer._get_output_dir``: ``args.output_dir`` (no hyper-parameter search)."""
        return str(getattr(self.args, "output_dir", None) or self.output_dir)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the model (HF layout), tokenizer and ``training_args.bin`` to ``output_dir`` through
        ``self._save``, as Trainer (every rank calls it; after training in place the weights are gathered
        first, collectively).  In a worker at a checkpoint (``trainer.save_overrides``) ``output_dir`` is the
        checkpoint being written and ``state_dict`` its gathered weights."""
        writing = vars(self).get("_checkpoint_write")
        if writing is not None:
            self._save(output_dir, state_dict=writing.state)
            return
        state = self._loop.engine.full_model_state_dict() if self._loop is not None else None
        self._save(output_dir, state_dict=state)

    def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
        """``Trainer._save``: rank 0 writes the model's weights (``state_dict`` when given), its tokenizer and
        ``training_args.bin`` into ``output_dir``; in a worker at a checkpoint, the checkpoint's model files."""
        target = Path(output_dir) if output_dir is not None else self.output_dir
        writing = vars(self).get("_checkpoint_write")
        if writing is not None:
            writing.default_save(target, state_dict, self.args)
            return
        if not self.is_world_process_zero():
            return
        if self._loop is not None:
            model = self._loop.engine.unwrapped
        else:
            if self.model is None and self._model_source is not None:
                from trainbridge.modeling.load import load_saved_model

                self.model = load_saved_model(self._model_source)
            model = self.model
        target.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(target, state_dict=state_dict)
        tokenizer = self.processing_class or self._tokenizer()
        from transformers.tokenization_utils_base import TOKENIZER_CONFIG_FILE

        if (
            tokenizer is None
            and self._model_source is not None
            and (self._model_source / TOKENIZER_CONFIG_FILE).is_file()
        ):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self._model_source)  # SFTTrainer loads it from the model
        if tokenizer is not None:
            tokenizer.save_pretrained(target)
        torch.save(self.args, target / TRAINING_ARGS_FILE)

    def save_state(self) -> None:
        """Write ``trainer_state.json`` to ``output_dir`` (rank 0)."""
        if self.is_world_process_zero():
            self.output_dir.mkdir(parents=True, exist_ok=True)
            self.state.save_to_json(str(self.output_dir / TRAINER_STATE_FILE))

    def metrics_format(self, metrics: dict[str, float]) -> dict[str, float]:
        """Metrics formatted for humans, as ``Trainer.metrics_format``."""
        from transformers.trainer_pt_utils import metrics_format

        return metrics_format(metrics)

    def log_metrics(self, split: str, metrics: dict[str, float]) -> None:
        """Print the metrics of ``split`` (rank 0), as ``Trainer.log_metrics``."""
        from transformers.trainer_pt_utils import log_metrics

        log_metrics(self, split, metrics)

    def save_metrics(self, split: str, metrics: dict[str, float], combined: bool = True) -> None:
        """Write ``{split}_results.json`` (and ``all_results.json``) to ``output_dir``, as Trainer does."""
        if not self.is_world_process_zero():
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        results_file(self.output_dir, split).write_text(json.dumps(metrics, indent=4, sort_keys=True))
        if combined:
            path = results_file(self.output_dir)
            combined_metrics = json.loads(path.read_text()) if path.exists() else {}
            combined_metrics.update(metrics)
            path.write_text(json.dumps(combined_metrics, indent=4, sort_keys=True))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """As ``Trainer.log`` outside training: ``epoch`` added, appended to ``state.log_history``, ``on_log``
        fired on the script's callbacks (during training the loop logs; a worker-side instance hands ``logs``
        back to it, ``trainer.subclass.ScriptTrainerEvents``)."""
        if "_worker_accelerator" in vars(self):
            if not vars(self).get(subclass.IN_LOG_EVENT):
                warnings.warn(  # a call of the script's own (e.g. from compute_loss): not one of the loop's logs
                    f"{type(self).__name__}.log({sorted(logs)}) called during training in a worker is not logged: "
                    "trainbridge logs at the loop's logging steps; add values to those logs in a log() override "
                    "or a callback's on_log",
                    HFPortingWarning,
                    stacklevel=2,
                )
            self.__dict__["_logged"] = logs
            return
        self._record_log(logs)
        self._fire("on_log", logs=logs)

    def create_model_card(
        self,
        language: str | None = None,
        license: str | None = None,
        tags: str | list[str] | None = None,
        model_name: str | None = None,
        finetuned_from: str | None = None,
        tasks: str | list[str] | None = None,
        dataset_tags: Any = None,
        dataset: Any = None,
        dataset_args: Any = None,
    ) -> None:
        """Write ``README.md`` (a model card) to ``output_dir`` from the run's state (no network)."""
        if not self.is_world_process_zero():
            return
        lines = [f"# {model_name or self.output_dir.name}", ""]
        if finetuned_from:
            lines += [f"Fine-tuned from `{finetuned_from}`" + (f" on {dataset}." if dataset else "."), ""]
        lines += ["Trained with trainbridge (transformers.Trainer API).", "", "## Training results", ""]
        for entry in self.state.log_history:
            lines.append("- " + ", ".join(f"{k}: {v}" for k, v in entry.items()))
        meta = {"license": license, "language": language, "tags": tags, "tasks": tasks}
        front = "\n".join(f"{k}: {json.dumps(v)}" for k, v in meta.items() if v)
        text = (f"---\n{front}\n---\n" if front else "") + "\n".join(lines) + "\n"
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "README.md").write_text(text)

    def push_to_hub(self, *args: Any, **kwargs: Any) -> Any:
        """Not supported: trainbridge never reaches a model hub."""
        raise UnsupportedTrainerFeatureError(
            "push_to_hub: trainbridge does not upload to a model hub. trainer.save_model() and "
            "trainer.create_model_card() write everything locally; upload the folder with "
            "huggingface_hub.upload_folder where you have network access."
        )

    # ================================================================== callbacks
    def add_callback(self, callback: Any) -> None:
        """Add a callback (class or instance) for the next ``train()``."""
        self.callbacks.append(callback)

    def pop_callback(self, callback: Any) -> Any:
        """Remove and return a callback given as an instance or a class (its first instance)."""
        for i, existing in enumerate(self.callbacks):
            if existing is callback or (
                isinstance(callback, type) and (existing is callback or isinstance(existing, callback))
            ):
                return self.callbacks.pop(i)
        return None

    def remove_callback(self, callback: Any) -> None:
        """Remove a callback given as an instance or a class."""
        self.pop_callback(callback)

    @property
    def callback_handler(self) -> Any:
        """A stand-in with ``callbacks`` (the list this Trainer will run), for scripts that read it."""
        return CallbackList(self.callbacks)

    # ================================================================== misc Trainer API
    @property
    def accelerator(self) -> Any:
        """A stand-in for scripts calling ``trainer.accelerator.print`` / ``.is_main_process``; in a worker
        running an override, ``trainer.worker_methods.WorkerAccelerator`` (``backward``, ``gather``,
        ``unwrap_model``...)."""
        worker = self.__dict__.get("_worker_accelerator")
        return worker if worker is not None else ScriptAccelerator(self)

    def end(self) -> None:
        """Finish: under a launcher, leave the process group (every rank calls it, as Trainer's ``end``)."""
        if self._env is not None:
            self._env.shutdown()
            self._env = None
            self._loop = None

    def get_train_dataloader(self) -> Any:
        """``Trainer.get_train_dataloader``: called in the workers (``trainer.subclass_data``) when a subclass
        overrides it or ``_get_train_sampler``; ``super()`` builds Trainer's DataLoader there, this rank's share."""
        if not subclass_data.in_worker(self):
            raise UnsupportedTrainerFeatureError(
                "get_train_dataloader: batches are formed inside the workers; there is no DataLoader in the "
                "script's process (a subclass's override runs there, inside train())"
            )
        return subclass_data.default_train_dataloader(self)

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        """``Trainer._get_train_sampler``: called in the workers by ``get_train_dataloader``."""
        if not subclass_data.in_worker(self):
            raise UnsupportedTrainerFeatureError("_get_train_sampler runs in the workers, inside train()")
        return subclass_data.default_train_sampler(self, train_dataset)

    def num_examples(self, dataloader: Any) -> int:
        return len(dataloader.dataset)

    @property
    def is_deepspeed_enabled(self) -> bool:
        return bool(getattr(self.args, "deepspeed", None))

    @property
    def is_fsdp_enabled(self) -> bool:
        return bool(getattr(self.args, "fsdp", None))
