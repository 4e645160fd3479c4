"""``trainbridge.Trainer``: a real ``transformers.Trainer`` whose training loop is trainbridge's.

Port a script by changing its import; docs/porting.md says what differs.  The constructor and every method a
script calls or overrides outside training are Trainer's own, so ``isinstance(trainer, transformers.Trainer)``
holds.  Only ``train()`` is ours: trainbridge's loop, in place on every rank (``trainer.jobs``), calling back into
the instance where Trainer's loop would (``trainer.subclass``).  Plain ``python script.py`` asking for several
processes was re-executed under torchrun when ``Trainer`` was imported (``launch.script_launch``).
"""

from __future__ import annotations

import atexit
import inspect
import logging
import os
from collections.abc import Callable
from functools import cached_property, partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, cast

import transformers

from trainbridge.callbacks.neftune import NEFTune
from trainbridge.checkpoint.folders import list_checkpoints
from trainbridge.checkpoint.model_files import trainers_save
from trainbridge.core.config import TorchrunArgs, TrainingArgs
from trainbridge.core.config.loss import ForwardLoss, InstanceStep, Loss, TokenLoss
from trainbridge.core.distributed import DistributedEnv
from trainbridge.core.private_files import make_output_folder
from trainbridge.data import script_data
from trainbridge.data.stream_batches import is_stream
from trainbridge.hf import native_callbacks
from trainbridge.hf.memory_metrics import memory_metrics
from trainbridge.hf.trainer_state import train_metrics
from trainbridge.launch.script_launch import ScriptLaunchError, launch_script, world_problem
from trainbridge.modeling.saving import without_deepspeed_import
from trainbridge.trainer import hp_search, jobs, subclass
from trainbridge.trainer.job_args import LiveModel, TrainerPlan
from trainbridge.trainer.optimizers import optimizer_factory
from trainbridge.trainer.save_overrides import subclass_save
from trainbridge.trainer.scope import LoopScope

logger = logging.getLogger("trainbridge.trainer")


class UnsupportedTrainerFeatureError(ValueError):
    """A ``Trainer`` argument or override that trainbridge cannot honour; says what to do instead."""


if TYPE_CHECKING:
    import datasets
    import torch
    from torch.utils.data import Dataset, IterableDataset

    from trainbridge.core.config.plan import Collator

    ScriptDataset: TypeAlias = Dataset[Any] | IterableDataset[Any] | datasets.Dataset | datasets.IterableDataset
    """What Trainer takes as ``train_dataset`` / ``eval_dataset`` (a named ``eval_dataset`` is a dict of them)."""
    _TrainerBase = transformers.Trainer
else:
    _TrainerBase = object  # a mixin: the Trainer class follows it in the bases


class LoopTrainer(_TrainerBase):
    """What a ``transformers.Trainer`` subclass gets from trainbridge: ``train()`` is trainbridge's loop (see the
    module doc).  Put it first in the bases, before the Trainer class (``class T(LoopTrainer, trl.X)``): call
    ``_check_launch`` before that class's constructor and ``_init_loop`` after it."""

    torchrun_args: TorchrunArgs | None
    stands_in_for: tuple[str, ...] = ()
    """The library's (trl's) methods trainbridge's step can stand in for (``_stand_in``, ``subclass.overrides``)."""
    rows_are_items: bool = False
    """The datasets' rows are the job's items, written as they are (every column: trl's prepared pairs)."""
    counts_step: bool = True
    """The loader's batches carry loss items and input tokens summed over the ranks at each step; False where
    they are raw rows and the loss reads its own counts (trl's GRPO/RLOO: ``step.step_totals.uncounted``)."""
    _in_loop: LoopScope | None = None
    """Set only while the loop calls into the instance (``trainer.scope``); None when the script calls."""

    @cached_property
    def _script(self) -> subclass.ScriptTrainer:
        """The loop's calls into this instance (``trainer.subclass``)."""
        return subclass.ScriptTrainer(self)

    @cached_property
    def _column_items(self) -> dict[str, tuple[Any, bool]]:
        """``subclass.items_are_columns``'s answer per dataset attribute, with the dataset it was for."""
        return {}

    @staticmethod
    def _check_launch(cls: type, torchrun_args: TorchrunArgs | None) -> None:
        """Before anything is built: overrides of Trainer's own loop are refused; ``python script.py`` with
        several processes is re-executed under torchrun from here (if not yet); ``torchrun_args`` must be the
        running world."""
        unhonoured = subclass.unhonoured_overrides(cls)
        if unhonoured:
            raise UnsupportedTrainerFeatureError(
                f"{cls.__name__} overrides {', '.join(f'{n}()' for n in unhonoured)}: these are parts of "
                "Trainer's own training loop, which trainbridge replaces, so the override would never run. Move the "
                "logic into a callback (trainbridge.Callback, or a transformers.TrainerCallback) or into a method "
                "the loop calls (training_step, compute_loss, prediction_step, evaluate, log, create_optimizer, "
                "create_scheduler, get_train_dataloader, _save_checkpoint)."
            )
        launch_script()
        problem = world_problem(torchrun_args.max_world_size() if torchrun_args is not None else None)
        if problem:
            raise ScriptLaunchError(problem)

    @staticmethod
    def _private_output_dir(config: object) -> None:
        """Create ``config.output_dir`` private (0700) before the Trainer class's constructor creates it with
        the umask's mode (a ``TrainingArguments`` that saves from this process; anything else: nothing)."""
        if isinstance(config, transformers.TrainingArguments) and config.output_dir and config.should_save:
            make_output_folder(config.output_dir, f"{type(config).__name__}.output_dir")

    def _init_loop(self, torchrun_args: TorchrunArgs | None, peft_config: object = None) -> None:
        """trainbridge's part of the construction, once the Trainer class's own ``__init__`` ran."""
        self.torchrun_args = torchrun_args
        self._peft_config = peft_config  # trl's SFTTrainer(peft_config=...)
        self._given_optimizers = (self.optimizer, self.lr_scheduler)
        self._optimizer_factory = optimizer_factory(self, self._given_optimizers, self.optimizer_cls_and_kwargs)
        self._fallback_tokenizer: Any = None
        self._env: DistributedEnv | None = None
        self._loop: Any = None

    # ================================================================== what the jobs read
    _trial: Any = None
    """Trainer's: the trial of the current ``train()`` (``_hp_search_setup``), None outside a search."""

    @property
    def output_dir(self) -> Path:
        """``args.output_dir``; during a search's trial ``<output_dir>/run-<n>`` (Trainer's ``_get_output_dir``)."""
        return Path(self._get_output_dir(self._trial) or "trainer_output")

    def _start_env(self) -> DistributedEnv:
        if self._env is None:
            device = "cpu" if self.args.use_cpu else "auto"
            self._env = DistributedEnv.initialize(device, float(self.args.ddp_timeout or 1800))
            if self._env.started_group:  # in place: the script goes on after train(); leave the group at its exit,
                atexit.register(self._env.teardown, clean=False)  # not to gloo's threads at interpreter teardown
        return self._env

    def _script_callbacks(self, stand_in: subclass.StandIn) -> list[Any]:
        """The callbacks this Trainer's handler holds that are the script's (``native_callbacks.script_callbacks``)."""
        return native_callbacks.script_callbacks(self.callback_handler, self.args)

    _holding_natives = staticmethod(native_callbacks.held_in_arguments)

    def add_callback(self, callback: native_callbacks.AnyCallback) -> None:
        """Trainer's ``add_callback``; a native callback (``trainbridge.Callback``, a function) too."""
        super().add_callback(native_callbacks.held(callback))

    def pop_callback(self, callback: native_callbacks.AnyCallback) -> Any:
        """Trainer's ``pop_callback``; a native callback (object or class) too, returned as it was added."""
        holder = native_callbacks.find(self.callback_handler, callback)
        if isinstance(holder, native_callbacks.NativeCallback):
            self.callback_handler.callbacks.remove(holder)
            return holder.native
        return super().pop_callback(cast("transformers.TrainerCallback", callback))

    def remove_callback(self, callback: native_callbacks.AnyCallback) -> None:
        """Trainer's ``remove_callback``; a native callback (object or class) too."""
        holder = native_callbacks.find(self.callback_handler, callback)
        if isinstance(holder, native_callbacks.NativeCallback):
            self.callback_handler.callbacks.remove(holder)
            return
        super().remove_callback(cast("transformers.TrainerCallback", callback))

    def _loop_processing_class(self) -> Any:
        """What Trainer saves into each checkpoint and hands its callbacks: the processing class as given (a
        multimodal processor whole), else the collator's tokenizer, else the one saved beside the script's model."""
        processing = self.processing_class
        if processing is None:
            processing = getattr(self.data_collator, "tokenizer", None)
        if processing is None and self._fallback_tokenizer is None and self.model is not None:
            self._fallback_tokenizer = script_data.tokenizer_beside(self.model)
        return processing if processing is not None else self._fallback_tokenizer

    def _generates(self) -> bool:
        """Whether the class makes its validation predictions by ``model.generate`` (``Seq2SeqTrainer``)."""
        return False

    def _row_preparation(self, instance_batches: bool, stand_in: subclass.StandIn) -> script_data.RowPreparation:
        """How the datasets' rows are prepared: the choice for ``data_collator`` as it is now (Trainer's default
        when the script gave none; reproduced where trainbridge's step stands in for it), padded with the
        collator's own tokenizer; ``instance_batches``: the loop steps through the instance or reads its loader."""
        from trainbridge.modeling.load import is_causal_lm, text_tokenizer

        collator_tokenizer = getattr(self.data_collator, "tokenizer", None)
        pad_id = getattr(collator_tokenizer or text_tokenizer(self._loop_processing_class()), "pad_token_id", None)
        choice = script_data.classify_collator(self.data_collator)
        if stand_in.loss:
            choice = script_data.CollatorChoice(True, description=f"{choice.description} (trainbridge's step for it)")
        return script_data.RowPreparation(
            choice,
            pad_id,
            items=self.rows_are_items
            or instance_batches
            or not choice.reproduced  # the script's collator, called on the items as they are
            or (self.model is not None and not is_causal_lm(self.model))  # the model's own loss
            or bool(self._columns_past_the_token_step())  # columns Trainer would hand the model: its batches
            or is_stream(self.train_dataset),
        )

    def _columns_past_the_token_step(self) -> list[str]:
        """Columns Trainer's batches would hand the model that the token step does not (``remove_unused_columns``
        as Trainer's own signature columns apply it): a run with any trains on Trainer's sample batches."""
        kept = None
        if self.args.remove_unused_columns:
            if self.model is None:
                return []
            self._set_signature_columns_if_needed()
            kept = self._signature_columns
        evaluation: Any = self.eval_dataset
        sets = [*evaluation.values()] if script_data.is_dataset_dict(evaluation) else [evaluation]
        return script_data.columns_past_the_token_step(self.data_collator, [self.train_dataset, *sets], kept)

    def _optimizers(self) -> Any:
        """The run's ``optimizer_factory``: the constructor's; once ``self.optimizer`` is another (an earlier
        ``train()``'s, or ``create_optimizer()``'s), that one in place with its state and a new scheduler unless the
        script gave one, as Trainer's ``train()`` keeps its optimizer across calls."""
        given_optimizer, given_scheduler = self._given_optimizers
        if self.optimizer is None or self.optimizer is given_optimizer or self.model_init is not None:
            return self._optimizer_factory  # (model_init: a new model, a new optimizer, as Trainer's train())
        return optimizer_factory(self, (self.optimizer, given_scheduler), None)

    def run_plan(self) -> TrainerPlan:
        """The code of this instance's run and its settings (``job_args.TrainerPlan``), decided at each ``train()``
        from its class (``subclass.overrides``), objects and datasets.  trl's classes override ``_stand_in`` and
        ``_loss_seam`` (``TrlLoop``); ``Seq2SeqTrainer`` overrides this and calls ``super()``."""
        script, cls = self._script, type(self)
        stand_in = self._stand_in()
        own_loader = subclass.overrides(cls, subclass.LOADER_METHODS, stand_in.methods)
        own_loader = own_loader or not subclass.items_are_columns(self, "train_dataset")
        own_step = self._steps_through_instance(stand_in)
        rows = self._row_preparation(own_step or own_loader, stand_in)
        loss = self._loss_seam(rows.items, own_step, stand_in)
        evaluation = self._evaluation(rows.items)
        calls = own_step or own_loader or evaluation is not None or subclass.overrides(cls, subclass.OWN_METHODS)
        # the instance's log, optimizer... (ScriptTrainerEvents), after the final log's memory metrics
        # (skip_memory_metrics=False), as Trainer adds them before log()
        events = [subclass.ScriptTrainerEvents(script)] if calls else []
        alpha = self.neftune_noise_alpha
        neftune = [NEFTune(float(alpha))] if alpha is not None else []  # as Trainer.train attaches it
        callbacks = [*memory_metrics(self), *events, *neftune, *self._script_callbacks(stand_in)]
        reproduced = rows.collator.reproduced and not rows.items
        if self.is_world_process_zero():
            batches = "trainbridge's token-budget batching (reproduces it)" if reproduced else "Trainer's batches"
            logger.info("data collator: %s -> %s", rows.collator.description, batches)
        seams: dict[str, Any] = dict(  # transformers types them as callables of its own
            model_init=LiveModel(self),  # the script's model object
            loss=loss,
            data_collator=None if reproduced else self.data_collator,
            train_stream=self.train_dataset if is_stream(self.train_dataset) else None,
            train_loader=script.train_loader if own_loader else None,
            evaluation=evaluation,
            optimizer_factory=self._optimizers(),
            checkpoint_model_files=subclass_save(self),  # a subclass's _save / save_model
            compute_metrics=self.compute_metrics,
            preprocess_logits_for_metrics=self.preprocess_logits_for_metrics,
            callbacks=callbacks,
        )
        honoured = (
            *(NEFTune.honours_hf_fields if neftune else ()),
            *(subclass.INSTANCE_STEP_HONOURS if isinstance(loss, InstanceStep) else ()),
        )
        return TrainerPlan(**seams, rows=rows, honours_hf_fields=honoured)

    def _stand_in(self) -> subclass.StandIn:
        """What trainbridge's own code stands in for on this ``train()``: all the class declares (``stands_in_for``;
        Trainer's classes: nothing); trl's classes decide per run (``TrlLoop``)."""
        return subclass.StandIn(self.stands_in_for)

    def _steps_through_instance(self, stand_in: subclass.StandIn) -> bool:
        """Whether the loop steps through the instance's ``training_step`` on Trainer's sample batches
        (``InstanceStep``): for an override of ``subclass.STEP_METHODS`` (not ``stand_in``'s), items that are not
        dicts of columns, or a loss of Trainer's other than the forward's (``compute_loss_func``, NEFTune's noise
        scaled by Trainer's padded length, ``label_smoothing_factor`` unless ``Seq2SeqTrainer`` generates)."""
        own = subclass.overrides(type(self), subclass.STEP_METHODS, stand_in.methods)
        if own or not subclass.items_are_columns(self, "train_dataset"):
            return True
        if self.compute_loss_func is not None or self.neftune_noise_alpha is not None:
            return True
        return self.label_smoother is not None and not self._generates()

    def _loss_seam(self, items: bool, instance_step: bool, stand_in: subclass.StandIn) -> Loss:
        """The run's loss seam, from the class: the instance's ``training_step`` (``instance_step``), the forward's
        own loss on the datasets' items (``items``) or with generated predictions (``Seq2SeqTrainer``), else the
        token loss on the prepared token rows; a class with a step of its own (``stand_in.step``) overrides this."""
        if instance_step:
            return InstanceStep(self._script)
        if items or self._generates():
            return ForwardLoss()
        return TokenLoss()

    def _evaluation(self, items: bool) -> Callable[..., Any] | None:
        """``RunPlan.evaluation``: Trainer's own code throughout where the evaluation items are not dicts of
        columns, or the run trains on Trainer's sample batches (``items``) with Trainer's ``evaluate`` and no
        DeepSpeed (whose ``evaluation_loop`` would start an engine of its own); the instance's ``evaluate()`` for
        an override of ``subclass.EVALUATION_METHODS``; else None: the loop's own (padding-free) evaluation."""
        trainers = self.eval_dataset is not None and items and type(self).evaluate is LoopTrainer.evaluate
        if not subclass.items_are_columns(self, "eval_dataset") or (trainers and not self.is_deepspeed_enabled):
            return partial(self._script.evaluation, trainers_own=True)
        return self._script.evaluation if subclass.overrides(type(self), subclass.EVALUATION_METHODS) else None

    # ================================================================== train: trainbridge's loop
    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: object,
    ) -> Any:
        """Train with trainbridge's loop, in place; returns ``TrainOutput(global_step, training_loss, metrics)``
        as Trainer's ``train`` (see the module doc)."""
        from transformers.trainer_utils import TrainOutput

        if kwargs:
            raise TypeError(f"train() got unexpected keyword arguments {sorted(kwargs)}")
        if self.model_init is not None:  # a trial's model, or Trainer's re-init at each train()
            hp_search.fresh_model(self, trial)
        self._hp_search_setup(trial)  # Trainer's: a trial's values into self.args
        report = hp_search.TrialReport(self, trial) if trial is not None else None
        if self.model is None or not hasattr(self.model, "config"):
            raise UnsupportedTrainerFeatureError(
                f"model: a plain {type(self.model).__name__} (torch.nn.Module, no config) is not supported by "
                "trainbridge's loop, whose checkpoints and batching read the model's PretrainedConfig; make it a "
                "transformers.PreTrainedModel (a PretrainedConfig and a PreTrainedModel subclass), or keep "
                "transformers.Trainer for this script"
            )
        if resume_from_checkpoint is True and not list_checkpoints(self.output_dir):
            raise ValueError(f"No valid checkpoint found in output directory ({self.output_dir})")
        self._memory_tracker.start()  # Trainer's own (skip_memory_metrics=False): stopped at the final log
        self.is_in_train = True
        if report is not None:
            self.add_callback(report)
        try:
            result, state = jobs.train(self, resume_from_checkpoint)
        finally:
            self.is_in_train = False
            if report is not None:
                self.remove_callback(report)
        if report is not None:
            report.raise_if_pruned()
        metrics = train_metrics(state.log_history, bool(self.args.disable_tqdm))
        train_loss = float(result.train_loss if result.train_loss is not None else 0.0)
        return TrainOutput(result.global_step, train_loss, metrics)

    def hyperparameter_search(
        self,
        hp_space: Callable[[Any], dict[str, float]] | None = None,
        compute_objective: Callable[[dict[str, float]], float] | None = None,
        n_trials: int = 20,
        direction: str | list[str] = "minimize",
        backend: Any = None,
        hp_name: Callable[[Any], str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Trainer's ``hyperparameter_search``; each trial is a ``train()`` in place (``trainer.hp_search``)."""
        hp_search.check_backend(backend)
        self._start_env()  # the process group Trainer's optuna backend broadcasts each trial over
        return super().hyperparameter_search(
            hp_space, compute_objective, n_trials, direction, backend, hp_name, **kwargs
        )

    # ================================================================== the loop's calls into the instance
    def evaluate(
        self,
        eval_dataset: ScriptDataset | dict[str, ScriptDataset] | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
        **kwargs: Any,
    ) -> dict[str, float]:
        """Trainer's ``evaluate``; at an evaluation point of ``train()`` with the run's own sets, the loop's
        evaluation of them (padding-free where it applies; it logs and fires ``on_evaluate`` as Trainer's)."""
        scope = self._in_loop
        run_sets = eval_dataset is None and metric_key_prefix == "eval" and not kwargs
        if scope is not None and scope.evaluation is not None and run_sets:
            return dict(scope.evaluation())
        return dict(
            super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix, **kwargs)
        )

    def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader: Any = None) -> torch.nn.Module:
        """Trainer's ``_wrap_model``; inside one of the loop's calls, the engine's model: for evaluation without
        the DDP/DeepSpeed wrapper, as Trainer evaluates during ``train()``, else with it."""
        scope = self._in_loop
        if scope is None or scope.model is None:
            return cast("torch.nn.Module", super()._wrap_model(model, training, dataloader))
        return cast("torch.nn.Module", scope.model if training else self.accelerator.unwrap_model(scope.model))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Trainer's ``log``; for one of the loop's logs (``subclass.ScriptTrainerEvents``), what the chain
        below (an override's ``super().log``, trl's, Trainer's) hands to ``on_log`` is what the loop logs."""
        scope = self._in_loop
        if scope is None or scope.log is None:
            super().log(logs, start_time)
            return
        capture = scope.log
        capture.control = self.control
        handler, history = self.callback_handler, len(self.state.log_history)
        self.callback_handler = capture  # type: ignore[assignment]
        try:
            super().log(logs, start_time)
        finally:
            self.callback_handler = handler
            del self.state.log_history[history:]  # the loop records the log itself
        if capture.logs is None:
            capture.logs = logs

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Trainer's ``save_model``; at a checkpoint of ``train()`` (``trainer.save_overrides``) the checkpoint's
        model files; after ``train()`` with a sharded engine (FSDP2, ZeRO-3) the gathered weights go to
        ``_save``, as Trainer does under FSDP (collective: every rank calls it)."""
        scope = self._in_loop
        if scope is not None and scope.checkpoint is not None:
            self._save(output_dir, state_dict=scope.checkpoint.state)
            return
        if self._loop is not None and self._loop.engine.sharded_model:
            state = self._loop.engine.full_model_state_dict()
            self._save(output_dir, state_dict=state if self.args.should_save else None)
            return
        with without_deepspeed_import():  # the script's own save, on a run that may not use DeepSpeed
            super().save_model(output_dir, _internal_call)

    def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
        """Trainer's ``_save``; at a checkpoint of ``train()``, the checkpoint's default model files."""
        scope = self._in_loop
        if scope is not None and scope.checkpoint is not None:
            target = Path(output_dir) if output_dir is not None else self.output_dir
            trainers_save(scope.checkpoint, target, state_dict, self.args)
            return
        with without_deepspeed_import():
            super()._save(output_dir, state_dict=state_dict)

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """Its model part, at a checkpoint of ``train()`` (``trainer.save_overrides``)."""
        if self._in_loop is None or self._in_loop.checkpoint is None:
            raise UnsupportedTrainerFeatureError("_save_checkpoint runs inside train(), at each checkpoint")
        self.save_model(os.path.join(self._get_output_dir(trial), f"checkpoint-{self.state.global_step}"), True)

    def push_to_hub(self, *args: object, **kwargs: object) -> Any:
        """Not supported: trainbridge never reaches a model hub."""
        raise UnsupportedTrainerFeatureError(
            "push_to_hub: trainbridge does not upload to a model hub. trainer.save_model() and "
            "trainer.create_model_card() write everything locally; upload the folder with "
            "huggingface_hub.upload_folder where you have network access."
        )


class Trainer(LoopTrainer, transformers.Trainer):
    """``transformers.Trainer`` with trainbridge's training loop (see the module doc)."""

    def __init__(
        self,
        model: torch.nn.Module | str | os.PathLike[str] | None = None,
        args: transformers.TrainingArguments | None = None,
        data_collator: Collator | None = None,
        train_dataset: ScriptDataset | None = None,
        eval_dataset: ScriptDataset | dict[str, ScriptDataset] | None = None,
        processing_class: transformers.PreTrainedTokenizerBase | transformers.ProcessorMixin | None = None,
        model_init: Callable[..., transformers.PreTrainedModel] | None = None,
        compute_loss_func: Callable[..., torch.Tensor] | None = None,
        compute_metrics: Callable[[transformers.EvalPrediction], dict[str, Any]] | None = None,
        callbacks: list[native_callbacks.AnyCallback] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        optimizer_cls_and_kwargs: tuple[type[torch.optim.Optimizer], dict[str, Any]] | None = None,
        preprocess_logits_for_metrics: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        *,
        tokenizer: transformers.PreTrainedTokenizerBase | None = None,
        torchrun_args: TorchrunArgs | None = None,
        **kwargs: Any,
    ) -> None:
        _reject_unsupported(kwargs)
        self._check_launch(type(self), torchrun_args)
        if isinstance(args, TrainingArgs):
            raise TypeError(
                "args: trainbridge.Trainer is a transformers.Trainer and takes transformers.TrainingArguments (or "
                "a subclass: trl's configs); trainbridge.TrainingArgs is run_training's"
            )
        if args is not None and not isinstance(args, transformers.TrainingArguments):
            raise TypeError(f"args: expected transformers.TrainingArguments (or a subclass), got {type(args).__name__}")
        if args is None:
            args = transformers.TrainingArguments(output_dir="trainer_output")
        script_data.check_stream_steps(train_dataset, args)
        self._private_output_dir(args)
        if isinstance(model, str | os.PathLike):  # trl's Trainers take a path: loaded here, as trl loads it
            from trainbridge.modeling.load import from_pretrained_kwargs, load_saved_model

            model = load_saved_model(Path(model), **from_pretrained_kwargs(getattr(args, "model_init_kwargs", None)))
        init: dict[str, Any] = dict(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class if processing_class is not None else tokenizer,
            model_init=model_init,
            compute_loss_func=compute_loss_func,
            compute_metrics=compute_metrics,
            callbacks=native_callbacks.held_all(callbacks),
            optimizers=optimizers,
            optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
            preprocess_logits_for_metrics=preprocess_logits_for_metrics,
        )
        accepted = inspect.signature(super().__init__).parameters  # transformers.Seq2SeqTrainer takes fewer
        later = {name: init.pop(name) for name in list(init) if name not in accepted}
        super().__init__(**init)
        for name, value in later.items():
            setattr(self, name, value)
        self._init_loop(torchrun_args, kwargs.get("peft_config"))


def _reject_unsupported(kwargs: dict[str, Any]) -> None:
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
