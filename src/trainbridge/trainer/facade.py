"""``trainbridge.Trainer``: ``transformers.Trainer``'s constructor, methods and return values on our loop.

Port a script by changing its import (``from trainbridge import Trainer``); docs/porting.md lists every
argument and method as same / differs / not supported.

Two ways to run, chosen by the environment ``train()`` finds:

- **Under a launcher** (``torchrun script.py``, ``accelerate launch``, ``srun`` of torchrun: ``RANK``,
  ``LOCAL_RANK`` and ``WORLD_SIZE`` are set): every rank runs the script; ``train()`` starts the process
  group, rank 0 writes the run folder (model, datasets), and the loop runs *in place* on this rank.
  No nested launch.
- **Plain ``python script.py`` or a notebook**: ``train()`` writes the run folder and launches torchrun
  workers itself (``run_training`` with the facade's worker ``trainbridge.trainer.runner``): one per
  visible GPU, else ``TRAINBRIDGE_NPROC_PER_NODE`` (default 1) on CPU.  Their output streams to this
  process; the result comes back: ``trainer.state``, the metrics, and ``trainer.model`` holding the
  final (or, with ``load_best_model_at_end``, the best) weights.

The run folder is ``output_dir/.trainbridge/``: ``model/`` (``save_pretrained`` of the model and
tokenizer), ``train/`` and ``eval/`` (the datasets' rows), ``final-model/`` and the recorded state.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from trainbridge.core.config import TorchrunArgs, TrainingArgs
from trainbridge.core.distributed import DistributedEnv
from trainbridge.hf.handler import is_hf_callback
from trainbridge.trainer import inputs
from trainbridge.trainer.launch_env import in_launched_worker, self_launch_nproc
from trainbridge.trainer.runner import (
    EVAL_FILE,
    FINAL_MODEL_DIR,
    STATE_FILE,
    FacadeJob,
    JobOutcome,
    job_environment,
    run_job,
)
from trainbridge.trainer.script_events import ScriptEvents

logger = logging.getLogger("trainbridge.trainer")

RUN_DIR_NAME = ".trainbridge"
"""The run folder inside ``output_dir``."""

_UNSUPPORTED_OVERRIDES = ("compute_loss", "training_step", "prediction_step")


class UnsupportedTrainerFeatureError(ValueError):
    """A ``Trainer`` argument or override that trainbridge cannot honour; says what to do instead."""


def no_metrics(eval_prediction: Any) -> dict[str, float]:
    """The ``compute_metrics`` of a ``predict()`` job without the user's own: predictions only."""
    return {}


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
        self._reject_unsupported(compute_loss_func, optimizers, optimizer_cls_and_kwargs, kwargs)
        from transformers import TrainerState, TrainingArguments

        if args is None:
            args = TrainingArguments(output_dir="trainer_output")
        if not isinstance(args, TrainingArguments | TrainingArgs):
            raise TypeError(f"args: expected transformers.TrainingArguments (or a subclass) or "
                            f"trainbridge.TrainingArgs, got {type(args).__name__}")
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
        self.preprocess_logits_for_metrics = preprocess_logits_for_metrics
        self.callbacks: list[Any] = list(callbacks or [])
        self.torchrun_args = torchrun_args
        self._peft_config = kwargs.get("peft_config")  # trl's SFTTrainer(peft_config=...)
        self._fallback_tokenizer: Any = None
        self.state = TrainerState()
        self._script_events = ScriptEvents()
        self.control = self._script_events.control
        self._env: DistributedEnv | None = None
        self._loop: Any = None
        self._weights_dir: Path | None = None
        self._build_args: Callable[[], TrainingArgs] = self._no_run_folder
        self._collator_choice = inputs.classify_collator(data_collator)
        if self.is_world_process_zero():
            logger.info("data collator: %s -> %s", self._collator_choice.description,
                        "trainbridge's token-budget batching (reproduces it)" if self._collator_choice.reproduced
                        else "called as written on padded micro-batches")

    def _no_run_folder(self) -> TrainingArgs:
        raise RuntimeError("the run folder was not prepared")

    # ================================================================== construction checks
    def _reject_unsupported(self, compute_loss_func: Any, optimizers: Any, optimizer_cls_and_kwargs: Any,
                            kwargs: dict[str, Any]) -> None:
        if compute_loss_func is not None:
            raise UnsupportedTrainerFeatureError(
                "compute_loss_func: the loss is token-level cross entropy normalised over each optimizer step's "
                "tokens on every rank; a custom loss is not supported. Shape the loss through 'labels' (-100 "
                "masks tokens) or use transformers.Trainer for this script."
            )
        if any(o is not None for o in optimizers or ()) or optimizer_cls_and_kwargs is not None:
            raise UnsupportedTrainerFeatureError(
                "optimizers / optimizer_cls_and_kwargs: live optimizer and scheduler objects cannot be moved "
                "into the training processes (and would be built before the model is wrapped). Set "
                "learning_rate, weight_decay, adam_beta1/adam_beta2/adam_epsilon and lr_scheduler_type "
                "(constant, constant_with_warmup, linear, cosine, cosine_with_min_lr) in the TrainingArguments."
            )
        for name in _UNSUPPORTED_OVERRIDES:
            if getattr(type(self), name) is not getattr(Trainer, name):
                raise UnsupportedTrainerFeatureError(
                    f"{type(self).__name__} overrides {name}(): the training step runs inside trainbridge's "
                    "distributed loop, which does not call Trainer methods. Move per-step logic into a "
                    "callback (trainbridge.Callback on_before_forward/on_after_forward, or a "
                    "transformers.TrainerCallback) or shape the loss through 'labels'."
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

    # Trainer methods a subclass may override; an override is rejected at construction (see above).
    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kwargs: Any) -> Any:
        """Not called: the loss is computed by trainbridge's loop (token-level cross entropy)."""
        raise UnsupportedTrainerFeatureError("compute_loss is computed inside trainbridge's loop")

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        """Not called: optimizer steps run inside trainbridge's loop."""
        raise UnsupportedTrainerFeatureError("training_step runs inside trainbridge's loop")

    def prediction_step(self, model: Any, inputs: Any, prediction_loss_only: bool,
                        ignore_keys: Any = None) -> Any:
        """Not called: evaluation runs inside trainbridge's loop."""
        raise UnsupportedTrainerFeatureError("prediction_step runs inside trainbridge's loop")

    # ================================================================== process helpers
    def is_world_process_zero(self) -> bool:
        """True on global rank 0 (always, in the process that self-launches the workers)."""
        if self._env is not None:
            return self._env.is_world_process_zero
        return int(os.environ.get("RANK", "0")) == 0 if in_launched_worker() else True

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
        return self.output_dir / RUN_DIR_NAME

    def _start_env(self) -> DistributedEnv:
        if self._env is None:
            device = "cpu" if getattr(self.args, "use_cpu", False) else getattr(self.args, "device", "auto")
            timeout_s: Any = getattr(self.args, "ddp_timeout", None) or getattr(self.args, "collective_timeout_s", 1800)
            timeout = float(timeout_s)
            self._env = DistributedEnv.initialize(device if device in ("auto", "cpu", "cuda") else "auto", timeout)
        return self._env

    # ================================================================== run folder
    def _tokenizer(self) -> Any:
        """The processing class's tokenizer; without one (Trainer needs none for tokenised rows), the
        tokenizer saved beside the model the script loaded, if its folder has one."""
        tok = self.processing_class
        if tok is None and self._fallback_tokenizer is None and self.model is not None:
            self._fallback_tokenizer = _tokenizer_beside(self.model)
        if tok is None:
            tok = self._fallback_tokenizer
        return getattr(tok, "tokenizer", tok)  # a multimodal processor carries its tokenizer

    def _write_model(self) -> tuple[Path, Path | None]:
        """``(model_path, tokenizer_path)`` for the workers (written now, on the writing rank)."""
        if self._model_source is not None and self._weights_dir is None:
            tok_dir = None
            if self.processing_class is not None:
                tok_dir = self.run_dir / "tokenizer"
                self._tokenizer().save_pretrained(tok_dir)
            return self._model_source, tok_dir
        source = self._weights_dir
        if source is None or self.model is not None:
            source = inputs.write_model(self.model, self._tokenizer(), self.run_dir / "model")
        return source, None

    def _write_data(self, dataset: Any, name: str, what: str) -> tuple[Path, int | None]:
        collator_tokenizer = getattr(self.data_collator, "tokenizer", None)  # the collator pads with its own
        pad_id = getattr(collator_tokenizer or self._tokenizer(), "pad_token_id", None)
        rows, longest = inputs.prepare_rows(inputs.as_hf_dataset(dataset, what), self._collator_choice, pad_id)
        return inputs.write_dataset(rows, self.run_dir / name), longest

    def _write_eval_sets(self, data: Any, name: str) -> tuple[str | None, dict[str, str], int | None]:
        """Write evaluation data as Arrow: one dataset into ``name`` -> ``(its path, {}, longest)``; a dict
        (Trainer's named sets) each into ``name-{i}`` -> ``(None, {set: path}, longest of all)``."""
        if not _is_dataset_dict(data):
            path, longest = self._write_data(data, name, "eval_dataset")
            return str(path), {}, longest
        paths, longest_of_all = {}, 0
        for i, (set_name, part) in enumerate(data.items()):
            path, longest = self._write_data(part, f"{name}-{i}", f"eval_dataset[{set_name!r}]")
            paths[str(set_name)] = str(path)
            longest_of_all = max(longest_of_all, longest or 0)
        return None, paths, longest_of_all or None

    def _write_eval_data(self) -> dict[str, Any]:
        """The layout entries of the Trainer's ``eval_dataset``: one dataset -> ``val_data_path``; a dict ->
        ``eval_data_paths`` (each set evaluated in turn during training, ``eval_<name>_`` metrics)."""
        if self.eval_dataset is None:
            return {"val_data_path": None, "eval_data_paths": {}, "longest": None}
        path, sets, longest = self._write_eval_sets(self.eval_dataset, "eval")
        return {"val_data_path": path, "eval_data_paths": sets, "longest": longest}

    def _prepare(self, world_size: int, resume: Any) -> Callable[[], None]:
        """``write``: writes the run folder (call it on the writing rank only); ``self._build_args()`` then
        validates the ``TrainingArgs`` (its paths must exist)."""
        layout: dict[str, Any] = {}

        def write() -> None:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            for stale in (STATE_FILE, EVAL_FILE):
                (self.run_dir / stale).unlink(missing_ok=True)
            model_path, tokenizer_path = self._write_model()
            if self.train_dataset is None:
                raise ValueError("Trainer: training requires a train_dataset")
            data_path, longest = self._write_data(self.train_dataset, "train", "train_dataset")
            evals = self._write_eval_data()
            layout.update(model_path=str(model_path), tokenizer_path=str(tokenizer_path) if tokenizer_path else None,
                          data_path=str(data_path), val_data_path=evals["val_data_path"],
                          eval_data_paths=evals["eval_data_paths"],
                          longest=max(longest or 0, evals["longest"] or 0) or None)
            (self.run_dir / "layout.json").write_text(json.dumps(layout))

        def build() -> TrainingArgs:
            if not layout:
                layout.update(json.loads((self.run_dir / "layout.json").read_text()))
            return self._training_args(layout, world_size, resume)

        self._build_args = build
        return write

    def _training_args(self, layout: dict[str, Any], world_size: int, resume: Any) -> TrainingArgs:
        from trainbridge.hf.porting import training_args_from_hf

        fields: dict[str, Any] = {
            "model_path": Path(layout["model_path"]),
            "tokenizer_path": Path(layout["tokenizer_path"]) if layout.get("tokenizer_path") else None,
            "data_path": Path(layout["data_path"]),
            "val_data_path": Path(layout["val_data_path"]) if layout.get("val_data_path") else None,
            "callbacks": list(self.callbacks),
            "compute_metrics": self.compute_metrics,
            "preprocess_logits_for_metrics": self.preprocess_logits_for_metrics,
            "data_collator": None if self._collator_choice.reproduced else self.data_collator,
        }
        if layout.get("eval_data_paths"):  # a dict eval_dataset: named sets, each evaluated in turn
            fields["eval_data_paths"] = {name: Path(p) for name, p in layout["eval_data_paths"].items()}
        if self._peft_config is not None:
            fields["peft_config"] = self._peft_config
        model_kwargs = getattr(self.args, "model_init_kwargs", None)  # trl configs: from_pretrained kwargs
        if self._model_source is not None and isinstance(model_kwargs, dict):
            fields["model_kwargs"] = _model_kwargs(model_kwargs)
        if resume is True:
            fields["resume_from_checkpoint"] = "auto"
        elif resume:
            fields["resume_from_checkpoint"] = Path(resume)
        if isinstance(self.args, TrainingArgs):
            data = {name: getattr(self.args, name) for name in TrainingArgs.model_fields}
            data.update({k: v for k, v in fields.items() if v is not None or k == "data_collator"})
            data["callbacks"] = [*self.args.callbacks, *self.callbacks]
            return TrainingArgs.model_validate(data)
        hf = self.args
        # Always run through HuggingFaceCallbacks, as a Trainer script expects: it adds Trainer's own printer /
        # progress bar, and each checkpoint gets trainer_state.json as under Trainer
        from transformers import TrainerCallback

        if not any(is_hf_callback(c) for c in self.callbacks):
            fields["callbacks"] = [*self.callbacks, TrainerCallback()]
        per_device = int(hf.per_device_train_batch_size)
        accumulation = int(hf.gradient_accumulation_steps)
        fields["effective_batch_size"] = per_device * accumulation * world_size
        longest = layout.get("longest")
        max_len = getattr(hf, "max_length", None) or getattr(hf, "max_seq_length", None)
        max_seq_len = int(longest or max_len or 512)
        fields["max_seq_len"] = max_seq_len
        fields["max_batch_len"] = max(per_device * max_seq_len, max_seq_len)
        if resume is None:
            fields["resume_from_checkpoint"] = None  # Trainer's args.resume_from_checkpoint is for scripts
        return training_args_from_hf(hf, **fields)

    # ================================================================== train
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> Any:
        """Train and return ``TrainOutput(global_step, training_loss, metrics)`` (see the module doc)."""
        from transformers.trainer_utils import TrainOutput

        if trial is not None:
            raise UnsupportedTrainerFeatureError("trial: hyper-parameter search is not supported")
        if kwargs:
            raise TypeError(f"train() got unexpected keyword arguments {sorted(kwargs)}")
        if resume_from_checkpoint is True and not _has_checkpoint(self.output_dir):
            raise ValueError(f"No valid checkpoint found in output directory ({self.output_dir})")
        if in_launched_worker():
            outcome = self._train_in_place(resume_from_checkpoint)
            result, state = outcome.result, outcome.state
        else:
            result, state = self._train_launched(resume_from_checkpoint)
        assert result is not None and state is not None
        self._set_state(state)
        metrics = _train_metrics(state["log_history"], bool(getattr(self.args, "disable_tqdm", False)))
        train_loss = float(result.train_loss if result.train_loss is not None else 0.0)
        return TrainOutput(result.global_step, train_loss, metrics)

    def _train_in_place(self, resume: Any) -> JobOutcome:
        env = self._start_env()
        write = self._prepare(env.world_size, resume)
        error: BaseException | None = None
        if env.is_world_process_zero:
            try:
                write()
            except BaseException as exc:  # every rank must learn of it, or the others wait forever
                error = exc
        failed = env.all_reduce_max(torch.tensor([1.0 if error else 0.0], device=env.device)).item() > 0
        if error is not None:
            raise error
        if failed:
            raise RuntimeError("Trainer.train(): rank 0 failed to write the run folder (see its error)")
        args = self._build_args()
        outcome = run_job(FacadeJob("train", args, self.run_dir), env)
        self._loop = outcome.loop
        self._take_trained_weights(outcome)
        return outcome

    def _take_trained_weights(self, outcome: JobOutcome) -> None:
        """In place: ``self.model`` gets the loop's trained weights (the same object, as under Trainer)."""
        unwrapped = outcome.loop.engine.unwrapped
        if self.model is None or not hasattr(self.model, "load_state_dict"):
            self.model = unwrapped
            return
        state = unwrapped.state_dict()
        mine = self.model.state_dict()
        sharded = any(type(t).__name__ == "DTensor" for t in state.values()) or any(
            key in mine and tuple(mine[key].shape) != tuple(value.shape) for key, value in state.items()
        )
        if sharded:
            self.model = unwrapped  # FSDP2 / ZeRO-3 shards: Trainer's model is the sharded module too
            return
        self.model.load_state_dict(state, strict=False)

    def _train_launched(self, resume: Any) -> tuple[Any, dict[str, Any]]:
        from trainbridge.loop.result import RunResult

        nproc = self_launch_nproc()
        write = self._prepare(nproc, resume)
        write()
        args = self._build_args()
        launch = self.torchrun_args or TorchrunArgs(nproc_per_node=nproc)
        result = self._launch(FacadeJob("train", args, self.run_dir), launch)
        assert isinstance(result, RunResult)
        state = json.loads((self.run_dir / STATE_FILE).read_text())
        weights = self.run_dir / FINAL_MODEL_DIR
        if args.load_best_model_at_end and result.best_checkpoint:
            weights = Path(result.best_checkpoint)
        self._load_weights(weights)
        return result, state

    def _launch(self, job: FacadeJob, launch: TorchrunArgs) -> Any:
        from trainbridge.launch.launcher import run_training
        from trainbridge.trainer.runner import JOB_ENV

        previous = os.environ.get(JOB_ENV)
        os.environ[JOB_ENV] = job_environment(job)
        try:
            return run_training(job.args, launch, worker_module="trainbridge.trainer.runner")
        finally:
            if previous is None:
                os.environ.pop(JOB_ENV, None)
            else:
                os.environ[JOB_ENV] = previous

    def _load_weights(self, folder: Path) -> None:
        """Load the weights in ``folder`` into ``self.model`` (the caller's object) or load the model."""
        from trainbridge.checkpoint.manager import fill_tied_weights, read_safetensors_weights

        self._weights_dir = folder
        adapter_file = folder / "adapter_model.safetensors"
        if adapter_file.is_file() and self.model is not None and hasattr(self.model, "peft_config"):
            from peft import set_peft_model_state_dict
            from safetensors.torch import load_file

            set_peft_model_state_dict(self.model, load_file(str(adapter_file)))
            return
        if self.model is None:
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(folder)
            return
        state = read_safetensors_weights(folder)
        fill_tied_weights(state, self.model)
        self.model.load_state_dict(state, strict=False)

    def _set_state(self, recorded: dict[str, Any]) -> None:
        from transformers import TrainerState

        state = TrainerState()
        for key, value in recorded.items():
            if hasattr(state, key):
                setattr(state, key, value)
        state.train_batch_size = getattr(self.args, "per_device_train_batch_size", None)
        state.is_world_process_zero = self.is_world_process_zero()
        state.is_local_process_zero = self.is_local_process_zero()
        self.state = state

    # ================================================================== evaluate / predict
    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Evaluate (loss plus ``compute_metrics``) on ``eval_dataset`` or the Trainer's; also after training.
        As Trainer: a dict evaluates each dataset (``<prefix>_<name>_`` keys); the metrics are logged
        (``state.log_history``, ``on_log``) and ``on_evaluate`` fires (``trainer.script_events``)."""
        dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        if dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        loop = self._loop
        if eval_dataset is None and loop is not None and (loop.eval_batches is not None or loop.named_eval_batches):
            # in place after training, the run's own sets: the loop logs and fires the events on every rank
            metrics: dict[str, Any] = dict(loop.evaluate())
            for part in _per_set(metrics, list(loop.named_eval_batches)):
                self._record_log(_prefixed(part, metric_key_prefix))
            return _prefixed(metrics, metric_key_prefix)
        if _is_dataset_dict(dataset):
            # one evaluation job over the named sets; each set's metrics logged and fired in turn, as Trainer does
            metrics = {}
            job_metrics, _ = self._evaluate_job(dataset, keep_predictions=False) if dataset else ({}, None)
            for part in _per_set(job_metrics, [str(name) for name in dataset]):
                part.pop("epoch", None)
                part = _prefixed(part, metric_key_prefix)
                self.log(part)
                self._fire("on_evaluate", metrics=part)
                metrics.update(part)
            return metrics
        job_metrics, _ = self._evaluate_job(dataset, keep_predictions=False)
        job_metrics.pop("epoch", None)  # the separate job's own 0.0; log() sets the trainer's, as Trainer.log
        metrics = _prefixed(job_metrics, metric_key_prefix)
        self.log(metrics)
        self._fire("on_evaluate", metrics=metrics)
        return metrics

    def predict(self, test_dataset: Any, ignore_keys: list[str] | None = None,
                metric_key_prefix: str = "test") -> Any:
        """``PredictionOutput(predictions, label_ids, metrics)`` over ``test_dataset`` (every rank's share,
        in dataset order); ``on_predict`` fires, as under Trainer."""
        from transformers.trainer_utils import PredictionOutput

        metrics, gathered = self._evaluate_job(test_dataset, keep_predictions=True)
        metrics.pop("epoch", None)  # Trainer.predict reports no epoch (evaluate() does, through log())
        if gathered is None:
            raise RuntimeError("predict: no predictions came back from the evaluation job")
        metrics = _prefixed(metrics, metric_key_prefix)
        self._fire("on_predict", metrics=metrics)
        return PredictionOutput(predictions=gathered.predictions, label_ids=gathered.label_ids, metrics=metrics)

    def _evaluate_job(self, dataset: Any, keep_predictions: bool) -> tuple[dict[str, Any], Any]:
        in_place = in_launched_worker()
        env = self._start_env() if in_place else None
        folder = self.run_dir / "evaluate"
        writer = env is None or env.is_world_process_zero
        if self._loop is not None:  # in place after training: the current weights, written collectively
            from trainbridge.trainer.runner import export_model

            export_model(self._loop, folder / "model")
            model_path: Path = folder / "model"
            tok_path = None
        elif writer:
            model_path, tok_path = self._write_model()
        if writer:
            layout: dict[str, Any] = {"model_path": str(model_path), **self._write_evaluation_data(dataset)}
            if self._loop is None:
                layout["tokenizer_path"] = str(tok_path) if tok_path else None
            (folder / "layout.json").write_text(json.dumps(layout))
        if env is not None:
            env.barrier()
        layout = json.loads((folder / "layout.json").read_text())
        args = self._training_args(layout, env.world_size if env else self_launch_nproc(), None)
        updates: dict[str, Any] = {
            "eval_strategy": "no", "save_strategy": "no", "load_best_model_at_end": False,
            "metric_for_best_model": None, "callbacks": [], "report_to": [], "eval_on_start": False,
            "ckpt_output_dir": folder / "output", "resume_from_checkpoint": None,
        }
        if keep_predictions and args.compute_metrics is None:
            updates["compute_metrics"] = no_metrics
        data = {name: getattr(args, name) for name in TrainingArgs.model_fields}
        data.update(updates)
        args = TrainingArgs.model_validate(data)
        job = FacadeJob("evaluate", args, folder, keep_predictions=keep_predictions)
        if env is not None:
            outcome = run_job(job, env)
            return dict(outcome.metrics or {}), outcome.predictions
        (folder / EVAL_FILE).unlink(missing_ok=True)
        self._launch(job, self.torchrun_args or TorchrunArgs(nproc_per_node=self_launch_nproc()))
        with (folder / EVAL_FILE).open("rb") as handle:
            out = pickle.load(handle)
        return dict(out["metrics"]), out["predictions"]

    def _write_evaluation_data(self, dataset: Any) -> dict[str, Any]:
        """The layout entries of an evaluation job's data: one dataset (``val_data_path``) or a dict of them
        (``eval_data_paths``, evaluated in turn in the one job); ``data_path`` is the first (it is not trained)."""
        path, sets, longest = self._write_eval_sets(dataset, "evaluate/data")
        if path is not None:
            return {"data_path": path, "val_data_path": path, "longest": longest}
        return {"data_path": next(iter(sets.values())), "val_data_path": None, "eval_data_paths": sets,
                "longest": longest}

    def _record_log(self, logs: dict[str, Any]) -> None:
        """Append ``logs`` to ``state.log_history`` as ``Trainer.log`` does (``epoch`` set on ``logs`` itself)."""
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch
        self.state.log_history.append({**logs, "step": self.state.global_step})

    def _fire(self, hook: str, **kwargs: Any) -> None:
        """Fire a Trainer event outside training on the script's TrainerCallbacks (``script_events``)."""
        self.state.is_world_process_zero = self.is_world_process_zero()
        self.state.is_local_process_zero = self.is_local_process_zero()
        self.control = self._script_events.fire(hook, self.args, self.state, self.callbacks, self.model,
                                                self.processing_class, **kwargs)

    # ================================================================== saving
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the model (HF layout), tokenizer and ``training_args.bin`` to ``output_dir``."""
        target = Path(output_dir) if output_dir is not None else self.output_dir
        if self._loop is not None:
            from trainbridge.trainer.runner import export_model

            export_model(self._loop, target)
        elif self.is_world_process_zero():
            if self.model is None and self._model_source is not None:
                from transformers import AutoModelForCausalLM

                self.model = AutoModelForCausalLM.from_pretrained(self._model_source)
            target.mkdir(parents=True, exist_ok=True)
            self.model.save_pretrained(target)
            tokenizer = self.processing_class or self._tokenizer()
            if (tokenizer is None and self._model_source is not None
                    and (self._model_source / "tokenizer_config.json").is_file()):
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self._model_source)  # SFTTrainer loads it from the model
            if tokenizer is not None:
                tokenizer.save_pretrained(target)
        if self.is_world_process_zero():
            torch.save(self.args, target / "training_args.bin")

    def save_state(self) -> None:
        """Write ``trainer_state.json`` to ``output_dir`` (rank 0)."""
        if self.is_world_process_zero():
            self.output_dir.mkdir(parents=True, exist_ok=True)
            self.state.save_to_json(str(self.output_dir / "trainer_state.json"))

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
        (self.output_dir / f"{split}_results.json").write_text(json.dumps(metrics, indent=4, sort_keys=True))
        if combined:
            path = self.output_dir / "all_results.json"
            combined_metrics = json.loads(path.read_text()) if path.exists() else {}
            combined_metrics.update(metrics)
            path.write_text(json.dumps(combined_metrics, indent=4, sort_keys=True))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """As ``Trainer.log`` outside training: ``epoch`` added, appended to ``state.log_history``, ``on_log``
        fired on the script's callbacks (during training the loop logs)."""
        self._record_log(logs)
        self._fire("on_log", logs=logs)

    def create_model_card(self, language: str | None = None, license: str | None = None,
                          tags: str | list[str] | None = None, model_name: str | None = None,
                          finetuned_from: str | None = None, tasks: str | list[str] | None = None,
                          dataset_tags: Any = None, dataset: Any = None, dataset_args: Any = None) -> None:
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
            if existing is callback or (isinstance(callback, type) and
                                        (existing is callback or isinstance(existing, callback))):
                return self.callbacks.pop(i)
        return None

    def remove_callback(self, callback: Any) -> None:
        """Remove a callback given as an instance or a class."""
        self.pop_callback(callback)

    @property
    def callback_handler(self) -> Any:
        """A stand-in with ``callbacks`` (the list this Trainer will run), for scripts that read it."""
        return _CallbackList(self.callbacks)

    # ================================================================== misc Trainer API
    @property
    def accelerator(self) -> Any:
        """A stand-in for scripts calling ``trainer.accelerator.print`` / ``.is_main_process``."""
        return _ProcessPrinter(self)

    def end(self) -> None:
        """Finish: under a launcher, leave the process group (every rank calls it, as Trainer's ``end``)."""
        if self._env is not None:
            self._env.shutdown()
            self._env = None
            self._loop = None

    def get_train_dataloader(self) -> Any:
        raise UnsupportedTrainerFeatureError(
            "get_train_dataloader: batches are planned by token budget inside the workers; there is no "
            "DataLoader in the script's process"
        )

    def num_examples(self, dataloader: Any) -> int:
        return len(dataloader.dataset)

    @property
    def is_deepspeed_enabled(self) -> bool:
        return bool(getattr(self.args, "deepspeed", None))

    @property
    def is_fsdp_enabled(self) -> bool:
        return bool(getattr(self.args, "fsdp", None))


def _tokenizer_beside(model: Any) -> Any:
    """``AutoTokenizer`` of the local folder ``model`` was loaded from (a PEFT model: its base), or None."""
    from transformers import AutoTokenizer

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    source = getattr(base, "name_or_path", None) or getattr(getattr(base, "config", None), "_name_or_path", None)
    if not source or not Path(source).is_dir():
        return None
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError):
        return None


def _model_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """trl's ``model_init_kwargs`` as ``TrainingArgs.model_kwargs`` (None values dropped, dtypes as names)."""
    out = {k: v for k, v in kwargs.items() if v is not None}
    dtype = out.get("dtype", out.pop("torch_dtype", None))
    if dtype is not None:
        out["dtype"] = str(dtype).removeprefix("torch.")
    return out


class _ProcessPrinter:
    """``trainer.accelerator`` for scripts that use it to print or to ask for the main process."""

    def __init__(self, trainer: Trainer) -> None:
        self._trainer = trainer

    @property
    def is_main_process(self) -> bool:
        return self._trainer.is_world_process_zero()

    @property
    def is_local_main_process(self) -> bool:
        return self._trainer.is_local_process_zero()

    @property
    def num_processes(self) -> int:
        env = self._trainer._env
        return env.world_size if env is not None else int(os.environ.get("WORLD_SIZE", "1"))

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self.is_local_main_process:
            print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        if self._trainer._env is not None:
            self._trainer._env.barrier()


class _CallbackList:
    def __init__(self, callbacks: list[Any]) -> None:
        self.callbacks = callbacks


def _is_dataset_dict(data: Any) -> bool:
    """A dict of named datasets (Trainer's ``eval_dataset={name: dataset}``; a ``DatasetDict`` too, as Trainer)."""
    return isinstance(data, Mapping)


def _per_set(metrics: dict[str, Any], names: list[str]) -> list[dict[str, Any]]:
    """An evaluation's metrics split into one dict per named set (``eval_<name>_...``, each with ``epoch``), as
    each set's ``log()`` records them; ``[metrics]`` without named sets."""
    if not names:
        return [dict(metrics)]
    by_length = sorted(names, key=len, reverse=True)  # 'a_b' before 'a': the longest name that prefixes a key
    parts: dict[str, dict[str, Any]] = {name: {} for name in names}
    for key, value in metrics.items():
        owner = next((n for n in by_length if key.startswith(f"eval_{n}_")), None)
        if owner is not None:
            parts[owner][key] = value
    return [{**parts[name], "epoch": metrics["epoch"]} if "epoch" in metrics else parts[name] for name in names]


def _prefixed(metrics: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    out = {}
    for key, value in metrics.items():
        if key.startswith("eval_"):
            key = f"{prefix}_{key[len('eval_'):]}"
        out[key] = value
    return out


def _train_metrics(log_history: list[dict[str, Any]], disable_tqdm: bool) -> dict[str, Any]:
    """The metrics ``Trainer.train()`` returns: its final log entry without ``step``. ``total_flos`` stays in
    (``train_results.json`` of example scripts has it) unless ``disable_tqdm``: then Trainer's ``PrinterCallback``
    pops it in ``on_log`` from the very dict ``train()`` returns (``ProgressCallback`` pops from a copy)."""
    metrics = dict(next((e for e in reversed(log_history) if "train_runtime" in e), {}))
    metrics.pop("step", None)
    if disable_tqdm:
        metrics.pop("total_flos", None)
    return metrics


def _has_checkpoint(output_dir: Path) -> bool:
    from trainbridge.checkpoint.manager import is_complete_checkpoint

    return output_dir.is_dir() and any(is_complete_checkpoint(p) for p in output_dir.iterdir())

