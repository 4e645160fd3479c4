"""The training loop.  It reads top to bottom; every event it fires is visible here.

``TrainingLoop.run`` is the whole run: set-up, ``on_init_end``, resume, ``on_train_begin``, epochs of
optimizer steps, and ``on_train_end`` (or ``on_exception`` on any exit that is not clean).  The loop
acts on control only after ``agree_control`` (``trainbridge.core.control``) has made every rank hold the
same decision, at the decision points marked ``DECISION POINT`` below.  Logging, evaluation and
checkpoint *triggers* are callbacks (``callbacks.builtin.ScheduleCallback``); the loop only carries
them out.
"""

from __future__ import annotations

import functools
import logging
import math
import signal
import time
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainbridge.checkpoint.manager import CheckpointManager
from trainbridge.checkpoint.manifest import run_fingerprint
from trainbridge.core.callback import Callback
from trainbridge.core.config import TrainingArgs
from trainbridge.core.context import TrainingContext
from trainbridge.core.control import AgreedControl, ControlFlag, agree_control
from trainbridge.core.distributed import DistributedEnv
from trainbridge.core.errors import TrainingInterrupted
from trainbridge.core.events import Event
from trainbridge.core.manager import CallbackFatalError, CallbackManager
from trainbridge.data import (
    Sample,
    StepPlan,
    collate_padded,
    collate_padding_free,
    load_jsonl,
    split_validation,
    token_loss_sum,
)
from trainbridge.data.loader import EvalBatches, TrainBatches
from trainbridge.loop.result import RunResult
from trainbridge.modeling import (
    VARLEN_SDPA,
    enable_varlen_sdpa,
    model_supports_padding_free,
    packed_row_tokens,
)
from trainbridge.parallel.engine import build_engine

logger = logging.getLogger(__name__)


def train(args: TrainingArgs, env: DistributedEnv, callbacks: Sequence[Callback]) -> RunResult:
    """Run one training job on this worker; every rank returns the same ``RunResult``."""
    return TrainingLoop(args, env, callbacks).run()


class TrainingLoop:
    """One worker's training run."""

    def __init__(self, args: TrainingArgs, env: DistributedEnv, callbacks: Sequence[Callback]):
        self.args = args
        self.env = env
        self.callbacks = CallbackManager(
            callbacks,
            error_policy=args.callback_error_policy,
            max_consecutive_errors=args.callback_max_consecutive_errors,
            is_world_process_zero=env.is_world_process_zero,
            queue_size=args.nonblocking_queue_size,
            drain_timeout_s=args.nonblocking_drain_timeout_s,
        )
        self.context = TrainingContext(args=args, env=env)
        self._loss_since_log = 0.0
        self._last_logged_step = 0
        self._total_loss = 0.0
        self._steps_this_run = 0
        self._last_saved_step = -1
        self._stop_training = False
        self._stop_requesters = ""

    # ================================================================== the run
    def run(self) -> RunResult:
        """Set up, train, and end with ``on_train_end`` or ``on_exception``."""
        ctx, fire = self.context, self.callbacks.fire
        runtime = 0.0
        with _sigterm_raises():
            try:
                self._set_up()
                fire(Event.INIT_END, ctx)
                self._resume()
                ctx.train_start_time = time.time()
                fire(Event.TRAIN_BEGIN, ctx)
                if self.args.eval_on_start:
                    self._evaluate()
                    self._agree()  # DECISION POINT: after the start-up evaluation
                while ctx.epoch_index < ctx.num_epochs and not self._stop_training:
                    self._run_epoch()
                if self.args.save_final_checkpoint and self._last_saved_step != ctx.global_step:
                    self._save()
                runtime = time.time() - ctx.train_start_time
                fire(Event.LOG, ctx, logs=self._train_summary(runtime))
                fire(Event.TRAIN_END, ctx)
            except BaseException as exc:
                fire(Event.EXCEPTION, ctx, exception=exc)
                self.callbacks.drain()
                raise
        self.callbacks.drain()
        return self._result(runtime)

    def _run_epoch(self) -> None:
        """One epoch: ``on_epoch_begin``, its optimizer steps, ``on_epoch_end`` and its log/eval/save."""
        ctx, fire = self.context, self.callbacks.fire
        plan = self.train_batches.set_epoch(ctx.epoch_index)
        fire(Event.EPOCH_BEGIN, ctx)
        for step_plan in plan.steps[ctx.step_in_epoch:]:
            if ctx.global_step >= ctx.max_steps:
                break
            self._train_step(step_plan)
            # DECISION POINT: the step's one collective — agreed control plus the loss sum.
            agreed, (loss_sum,) = self._agree(extras=[self._step_loss_sum])
            self._account_step(step_plan, loss_sum)
            flags = self._log_evaluate_save(agreed)
            if ControlFlag.STOP_EPOCH in flags or self._stop_training:
                break
        fire(Event.EPOCH_END, ctx)
        agreed, _ = self._agree()  # DECISION POINT: after on_epoch_end
        self._log_evaluate_save(agreed)
        ctx.epoch_index += 1
        ctx.step_in_epoch = 0

    def _train_step(self, step: StepPlan) -> None:
        """One optimizer step: every micro-batch of this rank, then clip, step, schedule."""
        ctx, fire, engine = self.context, self.callbacks.fire, self.engine
        self._step_start = time.perf_counter()
        fire(Event.STEP_BEGIN, ctx)
        micro_batches = self.train_batches.micro_batches(step)
        ctx.micro_steps_in_step = len(micro_batches)
        scale = self.env.world_size / max(step.loss_tokens, 1)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.env.device)
        for i, cpu_batch in enumerate(micro_batches):
            ctx.micro_step = i
            is_last = i == len(micro_batches) - 1
            batch = {k: v.to(self.env.device, non_blocking=True) for k, v in cpu_batch.items()}
            with engine.micro_batch(is_last):
                fire(Event.BEFORE_FORWARD, ctx, batch=batch)
                with engine.autocast():
                    token_sum, n_tokens = token_loss_sum(engine.module, batch)
                loss = token_sum * scale
                ctx.local_loss = float(token_sum.detach()) / n_tokens if n_tokens else 0.0
                fire(Event.AFTER_FORWARD, ctx, batch=batch, loss=loss)
                fire(Event.BEFORE_BACKWARD, ctx, loss=loss)
                engine.backward(loss)
                fire(Event.AFTER_BACKWARD, ctx)
            loss_sum += token_sum.detach().to(torch.float64)
            if not is_last:
                fire(Event.SUBSTEP_END, ctx)
        ctx.grad_norm = engine.clip_grad_norm(self.args.max_grad_norm)
        fire(Event.PRE_OPTIMIZER_STEP, ctx)
        ctx.learning_rate = engine.current_lr()
        engine.optimizer_step()
        fire(Event.OPTIMIZER_STEP, ctx)
        engine.scheduler_step()
        engine.zero_grad()
        self._step_loss_sum = float(loss_sum)
        ctx.local_loss = self._step_loss_sum / max(sum(self._local_loss_tokens(step)), 1)
        ctx.global_step += 1
        ctx.step_in_epoch += 1
        ctx.samples_seen += step.num_samples
        ctx.epoch = ctx.epoch_index + ctx.step_in_epoch / ctx.steps_per_epoch
        ctx.memory_bytes = self.env.memory_bytes()
        fire(Event.STEP_END, ctx)

    def _log_evaluate_save(self, agreed: AgreedControl) -> set[ControlFlag]:
        """Carry out agreed log / evaluate / save, in Trainer's order; returns every flag agreed."""
        flags = set(agreed.flags)
        ran = False
        if ControlFlag.LOG in flags and self.context.global_step > self._last_logged_step:
            self.callbacks.fire(Event.LOG, self.context, logs=self._training_logs())
            ran = True
        if ControlFlag.EVALUATE in flags:
            self._evaluate()
            after_eval, _ = self._agree()  # DECISION POINT: after on_evaluate (early stopping, best save)
            flags |= after_eval.flags
            ran = True
        if ControlFlag.SAVE in flags:
            self._save()
            ran = True
        if ran:
            after, _ = self._agree()  # DECISION POINT: requests made in on_log / on_save
            flags |= after.flags
        if ControlFlag.STOP_TRAINING in flags and not self._stop_training:
            self._stop_training = True
            self.context.stop_reason = f"stop_training requested by {self._stop_requesters}"
        return flags

    def _evaluate(self) -> dict[str, float]:
        """Validation loss over every rank's share, reduced by token count; fires the eval events."""
        ctx, fire, engine = self.context, self.callbacks.fire, self.engine
        if self.eval_batches is None:
            raise RuntimeError("evaluation requested but no validation data is configured")
        start = time.time()
        loss_sum, loss_tokens, steps = 0.0, 0, 0
        engine.module.eval()
        with torch.no_grad():
            for cpu_batch in self.eval_batches:
                batch = {k: v.to(self.env.device) for k, v in cpu_batch.items()}
                with engine.autocast():
                    token_sum, n_tokens = token_loss_sum(engine.module, batch)
                loss_sum += float(token_sum)
                loss_tokens += n_tokens
                steps += 1
                fire(Event.PREDICTION_STEP, ctx, batch=batch)
        engine.module.train()
        # collective: every rank's validation loss sum and token count, in one all_reduce
        total_sum, total_tokens, total_samples = self.env.sum_floats(
            [loss_sum, loss_tokens, self.eval_batches.num_samples_local]
        )
        runtime = max(time.time() - start, 1e-9)
        metrics = {
            "eval_loss": total_sum / max(total_tokens, 1.0),
            "eval_runtime": round(runtime, 4),
            "eval_samples_per_second": round(total_samples / runtime, 3),
            "eval_steps_per_second": round(steps / runtime, 3),
            "epoch": ctx.epoch,
        }
        ctx.metrics = dict(metrics)
        fire(Event.LOG, ctx, logs=metrics)
        fire(Event.EVALUATE, ctx, metrics=metrics)
        return metrics

    def _save(self) -> Path:
        """Write a checkpoint atomically (collective), rotate old ones, fire ``on_save``."""
        ctx = self.context
        path = self.checkpoints.save(
            self.engine, self.tokenizer, ctx.global_step,
            training_state=self._training_state(), extra_files=self.callbacks.checkpoint_files(ctx),
        )
        self._last_saved_step = ctx.global_step
        ctx.last_checkpoint = path
        self.callbacks.fire(Event.SAVE, ctx, checkpoint_path=path)
        protected = {ctx.best_checkpoint} if ctx.best_checkpoint is not None else set()
        self.checkpoints.rotate(protected)
        ctx.checkpoints = self.checkpoints.list_checkpoints()
        return path

    # ================================================================== set-up and resume
    def _set_up(self) -> None:
        args, env, ctx = self.args, self.env, self.context
        transformers.set_seed(args.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(args.resolved_tokenizer_path)
        train_samples, val_samples = self._load_data()
        model = AutoModelForCausalLM.from_pretrained(args.model_path, dtype=torch.float32)
        padded = args.packing == "padded" or (args.packing == "auto" and not model_supports_padding_free(model))
        if args.packing == "padding_free" and not model_supports_padding_free(model):
            raise ValueError(f"packing: {type(model).__name__} does not support padding-free batches")
        if not padded and args.varlen_sdpa and enable_varlen_sdpa(model, args.max_seq_len):
            logger.info("attention: per-sample sdpa for padding-free rows (%s)", VARLEN_SDPA)
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        collate: Any = (
            (lambda s: collate_padded(s, pad_id)) if padded
            else functools.partial(collate_padding_free, row_tokens=packed_row_tokens(model))
        )
        self.train_batches = TrainBatches(
            train_samples, collate, effective_batch_size=args.effective_batch_size, world_size=env.world_size,
            rank=env.rank, max_batch_len=args.max_batch_len, seed=args.seed, padded=padded,
        )
        self.eval_batches = (
            EvalBatches(val_samples, collate, world_size=env.world_size, rank=env.rank,
                        max_batch_len=args.max_batch_len, padded=padded)
            if val_samples else None
        )
        ctx.steps_per_epoch = self.train_batches.steps_per_epoch
        ctx.max_steps = args.max_steps or ctx.steps_per_epoch * args.num_epochs
        ctx.num_epochs = math.ceil(ctx.max_steps / ctx.steps_per_epoch)
        self.engine = build_engine(model, args, env, total_steps=ctx.max_steps)
        self.engine.verify()
        self._num_parameters = sum(p.numel() for p in model.parameters())
        logger.info("engine: %s; %s batches", self.engine.describe(), "padded" if padded else "padding-free")
        self.checkpoints = CheckpointManager(args.ckpt_output_dir, env, args.save_total_limit,
                                             fingerprint=run_fingerprint(args.model_path, args.data_path, model.config))
        ctx.model, ctx.unwrapped_model = self.engine.module, self.engine.unwrapped
        ctx.optimizer, ctx.lr_scheduler = self.engine.optimizer, self.engine.lr_scheduler
        ctx.train_dataloader, ctx.eval_dataloader = self.train_batches, self.eval_batches
        ctx.tokenizer = self.tokenizer
        ctx.restore_model_weights = lambda path: self.checkpoints.load_model_weights(Path(path), self.engine)

    def _load_data(self) -> tuple[list[Sample], list[Sample]]:
        args = self.args
        train, stats = load_jsonl(args.data_path, self.tokenizer, args.max_seq_len, args.overlong_policy)
        self._data_stats = [stats]
        if args.val_data_path is not None:
            val, val_stats = load_jsonl(args.val_data_path, self.tokenizer, args.max_seq_len, args.overlong_policy)
            self._data_stats.append(val_stats)
        elif args.validation_split > 0:
            train, val = split_validation(train, args.validation_split, args.seed)
        else:
            val = []
        for s in self._data_stats:
            if self.env.is_world_process_zero and (s.dropped_overlong or s.truncated or s.empty_skipped):
                logger.warning("%s: %d samples dropped as longer than max_seq_len=%d, %d truncated, "
                               "%d without loss tokens skipped", s.path, s.dropped_overlong, args.max_seq_len,
                               s.truncated, s.empty_skipped)
        return train, val

    def _resume(self) -> None:
        """Restore model, optimizer, RNG, counters and callback state from a checkpoint, if asked."""
        args, ctx = self.args, self.context
        if args.resume_from_checkpoint is None:
            return
        path = self.checkpoints.resume_path(args.resume_from_checkpoint, args.resume_allow_mismatch)
        if path is None:
            logger.info("resume_from_checkpoint=auto: no checkpoint in %s, starting fresh", args.ckpt_output_dir)
            return
        state = self.checkpoints.load(path, self.engine)
        ctx.global_step = state["global_step"]
        ctx.epoch_index, ctx.step_in_epoch = state["epoch_index"], state["step_in_epoch"]
        if ctx.step_in_epoch >= ctx.steps_per_epoch:
            ctx.epoch_index, ctx.step_in_epoch = ctx.epoch_index + 1, 0
        ctx.epoch = ctx.epoch_index + ctx.step_in_epoch / ctx.steps_per_epoch
        ctx.samples_seen, ctx.tokens_seen = state["samples_seen"], state["tokens_seen"]
        ctx.loss_tokens_seen = state["loss_tokens_seen"]
        self._last_logged_step = self._last_saved_step = ctx.global_step
        ctx.resumed_from = path
        ctx.last_checkpoint = path
        ctx.checkpoints = self.checkpoints.list_checkpoints()
        self.callbacks.load_state_dict(state.get("callbacks", {}), restore_user_states=args.restore_callback_states)
        logger.info("resumed from %s at step %d (epoch %.3f)", path, ctx.global_step, ctx.epoch)

    def _training_state(self) -> dict[str, Any]:
        ctx = self.context
        return {
            "global_step": ctx.global_step,
            "epoch_index": ctx.epoch_index,
            "step_in_epoch": ctx.step_in_epoch,
            "epoch": ctx.epoch,
            "samples_seen": ctx.samples_seen,
            "tokens_seen": ctx.tokens_seen,
            "loss_tokens_seen": ctx.loss_tokens_seen,
            "world_size": self.env.world_size,
            "callbacks": self.callbacks.state_dict(),
        }

    # ================================================================== bookkeeping
    def _agree(self, extras: Sequence[float] = ()) -> tuple[AgreedControl, list[float]]:
        """Agree pending control requests across ranks (one collective); abort on a fatal callback error."""
        agreed, sums = agree_control(self.env, self.context.requests, self.callbacks.source_names, extras)
        self.context.agreed = agreed
        if ControlFlag.STOP_TRAINING in agreed and not self._stop_training:
            # collective (once per run, only when a stop is agreed): every rank's reason for it
            reasons = self.env.all_gather_objects(agreed.local_reasons.get(ControlFlag.STOP_TRAINING))
            self._stop_requesters = ", ".join(
                f"rank {r.rank} ({r.source}{': ' + reasons[r.rank] if reasons[r.rank] else ''})"
                for r in agreed.requesters[ControlFlag.STOP_TRAINING]
            )
        if ControlFlag.ABORT in agreed:
            raise CallbackFatalError(
                f"callback error under callback_error_policy='fatal' on {agreed.describe(ControlFlag.ABORT)}; "
                f"every rank stopped at step {self.context.global_step}"
            )
        return agreed, sums

    def _local_loss_tokens(self, step: StepPlan) -> list[int]:
        samples = self.train_batches.samples
        return [samples[i].loss_tokens for group in step.micro_batches[self.env.rank] for i in group]

    def _account_step(self, step: StepPlan, global_loss_sum: float) -> None:
        ctx = self.context
        ctx.loss = global_loss_sum / max(step.loss_tokens, 1)
        ctx.tokens_seen += step.num_tokens
        ctx.loss_tokens_seen += step.loss_tokens
        ctx.step_time_s = time.perf_counter() - self._step_start
        ctx.tokens_per_second = step.num_tokens / ctx.step_time_s
        ctx.samples_per_second = step.num_samples / ctx.step_time_s
        self._loss_since_log += ctx.loss
        self._total_loss += ctx.loss
        self._steps_this_run += 1

    def _training_logs(self) -> dict[str, float]:
        """Trainer's training log: mean loss since the last log, grad norm, learning rate, epoch."""
        ctx = self.context
        logs = {
            "loss": self._loss_since_log / (ctx.global_step - self._last_logged_step),
            "grad_norm": ctx.grad_norm if ctx.grad_norm is not None else float("nan"),
            "learning_rate": ctx.learning_rate if ctx.learning_rate is not None else self.engine.current_lr(),
            "epoch": ctx.epoch,
        }
        self._loss_since_log = 0.0
        self._last_logged_step = ctx.global_step
        ctx.logs = dict(logs)
        return logs

    def _train_summary(self, runtime: float) -> dict[str, float]:
        """Trainer's final log: runtime, throughput, total flos and mean train loss of this run."""
        ctx = self.context
        steps = self._steps_this_run
        samples = ctx.samples_seen
        logs = {
            "train_runtime": round(runtime, 4),
            "train_samples_per_second": round(samples / max(runtime, 1e-9), 3),
            "train_steps_per_second": round(steps / max(runtime, 1e-9), 3),
            "total_flos": float(6 * self._num_parameters * ctx.tokens_seen),
            "train_loss": self._total_loss / max(steps, 0.001),
            "epoch": ctx.epoch,
        }
        ctx.logs = dict(logs)
        return logs

    def _result(self, runtime: float) -> RunResult:
        ctx = self.context
        # collective: every rank's isolated callback errors, for the result
        errors = [r for rank_errors in self.env.all_gather_objects(self.callbacks.error_reports(self.env.rank))
                  for r in rank_errors]
        stopped_early = ctx.agreed.stop_training and ctx.global_step < ctx.max_steps
        return RunResult(
            global_step=ctx.global_step,
            epoch=ctx.epoch,
            max_steps=ctx.max_steps,
            train_loss=ctx.logs.get("train_loss"),
            final_loss=ctx.loss,
            final_eval_loss=ctx.metrics.get("eval_loss"),
            stopped_early=stopped_early or (ctx.stop_reason is not None and ctx.global_step < ctx.max_steps),
            stop_reason=ctx.stop_reason if ctx.global_step < ctx.max_steps else None,
            checkpoints=[str(p) for p in self.checkpoints.list_checkpoints()],
            best_checkpoint=str(ctx.best_checkpoint) if ctx.best_checkpoint else None,
            best_metric=ctx.best_metric,
            metrics_file=str(self.args.resolved_metrics_file),
            callback_errors=errors,
            train_runtime_s=runtime,
            resumed_from=str(ctx.resumed_from) if ctx.resumed_from else None,
        )


@contextmanager
def _sigterm_raises() -> Any:
    """Turn SIGTERM into ``TrainingInterrupted`` so ``on_exception`` runs (main thread only)."""

    def handler(signum: int, frame: Any) -> None:
        raise TrainingInterrupted(f"received signal {signum}")

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
