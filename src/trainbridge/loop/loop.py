"""The training loop.  It reads top to bottom; every event it fires is visible here.

``TrainingLoop.run`` is the whole run over components built beforehand (``trainbridge.loop.build``):
``on_init_end``, resume, ``on_train_begin``, epochs of optimizer steps, and ``on_train_end`` (or
``on_exception`` on any exit that is not clean).  The loop
acts on control only after ``agree_control`` (``trainbridge.core.agreement``) has made every rank hold the
same decision, at the decision points marked ``DECISION POINT`` below.  Logging, evaluation and
checkpoint *triggers* are callbacks (``trainbridge.callbacks.ScheduleCallback``); the loop only carries
them out.
"""

from __future__ import annotations

import functools
import logging
import signal
import time
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from trainbridge.checkpoint.manager import PendingCheckpoint
from trainbridge.core.agreement import NO_VALUES, AgreedControl, Agreement, ControlFlag, Own, Summed, agree_control
from trainbridge.core.callback import Callback
from trainbridge.core.callback_errors import OWN_CAUSE_MARKER, TrainingInterrupted
from trainbridge.core.config import RunPlan, TrainingArgs
from trainbridge.core.dispatch import CallbackFatalError, CallbackManager
from trainbridge.core.distributed import DistributedEnv
from trainbridge.core.events import Event
from trainbridge.loop.build import RunComponents, build_run
from trainbridge.loop.evaluation_point import EvaluationPoint
from trainbridge.loop.predictions import PredictionCollector
from trainbridge.loop.result import RunResult
from trainbridge.loop.step_values import LossLog, StepOutcome, StepOwn, StepSums, agreed_sums, with_metrics
from trainbridge.loop.summary import announce_run
from trainbridge.modeling import sample_segments
from trainbridge.modeling.load import load_base_for_merge
from trainbridge.step.base import EvalSource
from trainbridge.step.finite import NOT_MEASURED, NonFiniteGuard

logger = logging.getLogger(__name__)


def train(args: TrainingArgs, plan: RunPlan, env: DistributedEnv, callbacks: Sequence[Callback]) -> RunResult:
    """Build and run one training job of ``args`` running ``plan`` on this worker; every rank returns the same
    ``RunResult``."""
    with _sigterm_raises():
        components = build_run(args, plan, env)
    announce_run(args, env, components)
    return TrainingLoop(args, env, callbacks, components).run()


class TrainingLoop:
    """One worker's training run over components built by ``trainbridge.loop.build.build_run``."""

    def __init__(
        self, args: TrainingArgs, env: DistributedEnv, callbacks: Sequence[Callback], components: RunComponents
    ):
        self.args = args
        self.env = env
        self.callbacks = CallbackManager.of_run(callbacks, args, env.is_world_process_zero)
        self.tokenizer = components.tokenizer
        self.engine = components.engine
        self.step = components.step
        self._main_input = str(getattr(self.engine.unwrapped, "main_input_name", None) or "input_ids")
        """The input ``total_flos`` counts without ``input_ids`` (``pixel_values``), as Trainer's estimate."""
        self.train_batches = components.train_batches
        self.eval_batches = components.eval_batches
        self.named_eval_batches = components.named_eval_batches
        # compute_metrics: per-sample validation predictions (build_run pads validation batches for it)
        self.plan = components.plan
        """The run's code: its evaluation seam, ``compute_metrics`` (``core.config.plan``)."""
        self.predictions = PredictionCollector.of(args, self.plan, env.world_size)
        self.checkpoints = components.checkpoints
        self.losses = LossLog()
        self.finite = NonFiniteGuard(args.nonfinite_policy)
        self._last_saved_step = -1
        # checkpoint_async: the checkpoint begun and not yet published (its dcp/ part written in the background)
        self._pending_checkpoint: PendingCheckpoint | None = None
        self._stop_training = False
        self._stop_requesters = ""
        self._merged: Path | None = None
        self._carried: StepOutcome | None = None
        """A stream's last micro-batches of a pass (``StepBatches.carried``): trained, not yet stepped; their
        gradients, loss and input tokens go into the next step's, as Trainer's."""
        self.context = components.context(args, env)

    # ================================================================== the run
    def run(self) -> RunResult:
        """Train, and end with ``on_train_end`` or ``on_exception``."""
        ctx, fire = self.context, self.callbacks.fire
        runtime = 0.0
        with _sigterm_raises():
            try:
                fire(Event.INIT_END, ctx)
                self._resume()
                ctx.train_start_time = time.time()
                fire(Event.TRAIN_BEGIN, ctx)
                if self.args.eval_on_start:
                    self.evaluate()
                    self._agree()  # DECISION POINT: after the start-up evaluation
                while ctx.epoch_index < ctx.num_epochs and ctx.global_step < ctx.max_steps and not self._stop_training:
                    self._run_epoch()
                if self.args.save_final_checkpoint and self._last_saved_step != ctx.global_step:
                    self._save()
                self._publish_checkpoint()  # one still written in the background: waited for, then published
                runtime = time.time() - ctx.train_start_time
                fire(Event.LOG, ctx, logs=self.losses.train_summary(ctx, runtime))
                self._load_best_model()
                self._keep_only_best()
                fire(Event.TRAIN_END, ctx)
                if self.args.merge_adapter_at_end:
                    base = functools.partial(load_base_for_merge, self.args, self.plan.model_init)
                    self._merged = self.checkpoints.export_merged(self.engine, self.tokenizer, base)
            except BaseException as exc:
                fire(Event.EXCEPTION, ctx, exception=exc)
                raise
            finally:
                self.callbacks.drain()
                self.callbacks.close(ctx)
        return self._result(runtime)

    def _run_epoch(self) -> None:
        """One epoch: ``on_epoch_begin``, its optimizer steps, ``on_epoch_end`` and its log/eval/save."""
        ctx, fire = self.context, self.callbacks.fire
        plan = self.train_batches.set_epoch(ctx.epoch_index)
        fire(Event.EPOCH_BEGIN, ctx)
        first_step = ctx.global_step
        cut_short = False  # by max_steps or a training stop: the epoch's position is kept (see below)
        for step_plan in plan.steps[ctx.step_in_epoch :]:
            if ctx.global_step >= ctx.max_steps:
                cut_short = True
                break
            outcome = self._train_step(step_plan)
            if outcome is None:  # a stream's carried micro-batches: no optimizer step
                continue
            # DECISION POINT: the step's one collective — agreed control plus the loss and input sums — and
            # its one host-device synchronisation (the loss and grad norm ride in it from the device).
            # The same collective counts the ranks whose background checkpoint write is still going on.
            # The step's own metric sums (``TrainStep.metric_sums``) ride in it too.
            metric_sums = self.step.metric_sums()
            sums = StepSums(outcome.loss_sum, outcome.input_tokens, self._checkpoint_unwritten())
            agreement = self._agree(with_metrics(sums, metric_sums), StepOwn(outcome.loss_sum, outcome.grad_norm))
            (summed, step_metrics), own = agreed_sums(agreement.summed, metric_sums), agreement.own
            if step_metrics:
                self.step.add_metric_sums(step_metrics)
            finite = self.finite.check(ctx.global_step, float(summed.loss_sum), float(own.grad_norm))
            if not finite and self.finite.stops:  # nonfinite_policy="error": nothing saved, no rotation
                self._publish_checkpoint()  # an earlier (finite) one still written in the background
                self.finite.raise_error(ctx.global_step)
            self.losses.account(ctx, outcome, summed, own, counted=finite or self.finite.counts_nonfinite)
            if self._pending_checkpoint is not None and summed.checkpoint_unwritten == 0:
                self._publish_checkpoint()  # every rank's background write has finished: publish, on_save
            flags = self._log_evaluate_save(agreement.control)
            if ControlFlag.STOP_EPOCH in flags or self._stop_training:
                cut_short = ControlFlag.STOP_EPOCH not in flags
                break
        if ctx.global_step == first_step and ctx.global_step < ctx.max_steps and not self._stop_training:
            # as Trainer: an epoch without one step (a stream that ran out) ends the run
            logger.warning("the training data ran out: an epoch had no step; stopping at step %d", ctx.global_step)
            self._stop_training = True
            ctx.stop_reason = f"the training data ran out at step {ctx.global_step} (an epoch had no step)"
        fire(Event.EPOCH_END, ctx)
        self._log_evaluate_save(self._agree().control)  # DECISION POINT: after on_epoch_end
        if cut_short:  # the run ends inside this epoch: a final checkpoint resumes at the next step, as Trainer's
            return
        ctx.epoch_index += 1
        ctx.step_in_epoch = 0

    def _train_step(self, step_plan: Any) -> StepOutcome | None:
        """One optimizer step: every micro-batch of this rank, then clip, step, schedule.  The batches and
        the loss are the run's ``TrainStep`` (``trainbridge.step``), chosen at build time.

        Nothing here waits for the device: counts come from the CPU-side batches, the batch moves to the
        device without blocking, and the loss and the grad norm stay device tensors until the step's
        agreement reads them (``ctx.local_loss`` / ``ctx.grad_norm`` convert on a callback's read)."""
        ctx, fire, engine = self.context, self.callbacks.fire, self.engine
        started = time.perf_counter()
        # the step's batches are read first, then on_step_begin, as Trainer (``get_batch_samples``): a random
        # transform or a DataLoader's seed draws from torch's stream before the callbacks, not after them
        batches = self.step.prepare(step_plan)
        micro_batches = batches.micro_batches
        ctx.micro_steps_in_step = len(micro_batches)
        fire(Event.STEP_BEGIN, ctx)
        scale = self.env.world_size / max(batches.loss_units, 1e-12)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.env.device)
        for i, cpu_batch in enumerate(micro_batches):
            ctx.micro_step = i
            is_last = i == len(micro_batches) - 1
            batch = _to_device(cpu_batch, self.env.device)
            units = batches.micro_units[i]
            with engine.micro_batch(is_last):
                fire(Event.BEFORE_FORWARD, ctx, batch=batch)
                micro_sum = self.step.micro_step(
                    engine.module,
                    batch,
                    units,
                    scale,
                    forward=functools.partial(_forward_context, engine, cpu_batch),
                    backward=functools.partial(self._backward, batch=batch, units=units, scale=scale),
                )
            loss_sum += micro_sum.to(torch.float64)
            if not is_last or batches.carried:
                fire(Event.SUBSTEP_END, ctx)
        ctx.tokens_seen += batches.num_tokens  # every rank's: known without a collective
        input_tokens = sum(_input_tokens(b, self._main_input) for b in micro_batches)
        if batches.carried:  # the stream ran out inside the step: its gradients wait for the next pass's first step
            self._carried = StepOutcome(batches, loss_sum, NOT_MEASURED, input_tokens, started)
            return None
        if self._carried is not None:  # that step logs their mean loss added to its own, as Trainer's
            carried, self._carried = self._carried, None
            loss_sum += carried.loss_sum * (batches.loss_units / max(carried.batches.loss_units, 1e-12))
            input_tokens += carried.input_tokens
        grad_norm: torch.Tensor | float | None = engine.clip_grad_norm(self.args.max_grad_norm)
        ctx.grad_norm = grad_norm
        fire(Event.PRE_OPTIMIZER_STEP, ctx)
        ctx.learning_rate = engine.current_lr()
        if self.finite.allows_update(grad_norm):  # False only under nonfinite_policy="skip", non-finite norm
            engine.optimizer_step()
        if grad_norm is None:  # DeepSpeed clips inside its step and reports the norm after it
            grad_norm = ctx.grad_norm = engine.reported_grad_norm()
        fire(Event.OPTIMIZER_STEP, ctx)
        engine.scheduler_step()
        engine.zero_grad()
        ctx.local_loss = loss_sum / max(sum(batches.micro_units), 1e-12)
        ctx.global_step += 1
        ctx.step_in_epoch += 1
        ctx.samples_seen += batches.num_samples
        ctx.epoch = ctx.epoch_index + ctx.step_in_epoch / ctx.steps_per_epoch
        ctx.memory_bytes = self.env.memory_bytes()
        fire(Event.STEP_END, ctx)
        return StepOutcome(
            batches,
            loss_sum,
            grad_norm if grad_norm is not None else NOT_MEASURED,
            input_tokens,
            started,
        )

    def _backward(self, micro_sum: torch.Tensor, batch: dict[str, Any], units: float, scale: float) -> None:
        """Backpropagate one micro-batch's loss sum, scaled by ``world_size / loss_units`` (the step calls it
        from ``TrainStep.micro_step``), between its forward and backward events."""
        ctx, fire = self.context, self.callbacks.fire
        loss = micro_sum * scale
        ctx.local_loss = micro_sum.detach() / units if units else 0.0
        fire(Event.AFTER_FORWARD, ctx, batch=batch, loss=loss)
        fire(Event.BEFORE_BACKWARD, ctx, loss=loss)
        self.engine.backward(loss)
        fire(Event.AFTER_BACKWARD, ctx)

    def _log_evaluate_save(self, agreed: AgreedControl) -> set[ControlFlag]:
        """Carry out agreed log / evaluate / save, in Trainer's order; returns every flag agreed."""
        flags = set(agreed.flags)
        ran = False
        if ControlFlag.LOG in flags and self.context.global_step > self.losses.last_logged_step:
            logs = self.losses.training_logs(self.context, self.engine.current_lr, self.step.metric_logs())
            self.callbacks.fire(Event.LOG, self.context, logs=logs)
            ran = True
        if ControlFlag.EVALUATE in flags:
            self.evaluate()
            flags |= self._agree().control.flags  # DECISION POINT: after on_evaluate (early stopping, best save)
            ran = True
        if ControlFlag.SAVE in flags:
            # checkpoint_async: in the background, unless the run is stopping (then written at once)
            self._save(
                background=self.args.checkpoint_async
                and ControlFlag.STOP_TRAINING not in flags
                and not self._stop_training
            )
            ran = True
        if ran:
            flags |= self._agree().control.flags  # DECISION POINT: requests made in on_log / on_save
        if ControlFlag.STOP_TRAINING in flags and not self._stop_training:
            self._stop_training = True
            self.context.stop_reason = f"stop_training requested by {self._stop_requesters}"
        return flags

    def evaluate(self) -> dict[str, float]:
        """One evaluation: the plan's ``evaluation`` (a Trainer subclass's ``evaluate``, trl's) around
        ``evaluate_sets``.  What that evaluation logs and evaluates itself reaches every callback as the loop's
        own ``on_log``/``on_evaluate`` (``EvaluationPoint``); one that fires no ``on_evaluate`` has the metrics it
        returns fired, as Trainer judges the best metric by what ``evaluate()`` returns."""
        if self.plan.evaluation is None:
            return self.evaluate_sets()
        point = EvaluationPoint(self.evaluate_sets, self.callbacks, self.context, self.engine)
        try:
            metrics = dict(self.plan.evaluation(point))
        finally:
            self.engine.module.train()  # Trainer's own evaluation loop leaves the model in eval mode
        if not point.evaluated:
            point.evaluate(metrics)
        return metrics

    def evaluate_sets(self) -> dict[str, float]:
        """Evaluate the validation set (``eval_`` metrics) or, with named sets (``eval_data_paths``), each set
        in turn (``eval_<name>_`` metrics, each with its own ``on_log``/``on_evaluate``, as Trainer evaluates a
        dict ``eval_dataset``); returns the metrics of every set."""
        if self.named_eval_batches:
            metrics: dict[str, float] = {}
            for name, batches in self.named_eval_batches.items():
                metrics.update(self._evaluate_set(batches, f"eval_{name}", earlier=metrics))
            return metrics
        if self.eval_batches is None:
            raise RuntimeError("evaluation requested but no validation data is configured")
        return self._evaluate_set(self.eval_batches, "eval")

    def _evaluate_set(
        self, eval_batches: EvalSource, prefix: str, earlier: dict[str, float] | None = None
    ) -> dict[str, float]:
        """Validation loss of one set over every rank's share, reduced by the step's loss units (tokens, or
        samples for the model's own loss); fires the eval events with this set's metrics (``ctx.metrics``
        also holds the ``earlier`` sets' of this evaluation)."""
        ctx, fire, engine = self.context, self.callbacks.fire, self.engine
        ctx.eval_dataloader = eval_batches
        start = time.time()
        loss_units, steps = 0.0, 0
        device_loss_sum = torch.zeros((), dtype=torch.float64, device=self.env.device)
        predictions = self.predictions  # compute_metrics: per-sample predictions (loop.predictions)
        engine.module.eval()
        with torch.no_grad():
            for indices, cpu_batch in eval_batches.indexed():
                batch = _to_device(cpu_batch, self.env.device)
                with _forward_context(engine, cpu_batch):
                    out = self.step.eval_batch(
                        engine.module, batch, cpu_batch, outputs=predictions is not None, rows=len(indices)
                    )
                if predictions is not None:
                    predictions.add(indices, batch, out.predictions, out.labels, out.inputs_aligned)
                device_loss_sum += out.loss_sum.detach().to(torch.float64)
                loss_units += out.units
                steps += 1
                fire(Event.PREDICTION_STEP, ctx, batch=batch)
        engine.module.train()
        loss_sum = float(device_loss_sum)  # one read of the device after the whole evaluation
        # collective: every rank's validation loss sum and units (and the step's metric sums), in one all_reduce
        step_sums = self.step.eval_metric_sums()
        total_sum, total_units, total_samples, *reduced = self.env.sum_floats(
            [loss_sum, loss_units, eval_batches.num_samples_local, *step_sums.values()]
        )
        step_logs = self.step.eval_metric_logs(dict(zip(step_sums, reduced, strict=True)))
        runtime = max(time.time() - start, 1e-9)
        computed = predictions.compute(self.env) if predictions is not None else {}
        metrics = {
            f"{prefix}_loss": total_sum / max(total_units, 1.0),
            **{f"{prefix}_{key.removeprefix('eval_')}": value for key, value in computed.items()},
            f"{prefix}_runtime": round(runtime, 4),
            f"{prefix}_samples_per_second": round(total_samples / runtime, 3),
            f"{prefix}_steps_per_second": round(steps / runtime, 3),
            **{f"{prefix}_{key}": value for key, value in step_logs.items()},
            "epoch": ctx.epoch,
        }
        ctx.metrics = {**(earlier or {}), **metrics}
        fire(Event.LOG, ctx, logs=metrics)
        fire(Event.EVALUATE, ctx, metrics=metrics)
        return metrics

    def _save(self, background: bool = False) -> None:
        """Write a checkpoint atomically (collective), then publish it (``_publish_checkpoint``).  With
        ``background`` (``checkpoint_async``) its ``dcp/`` part is still being written when this returns;
        it is published at the first step end at which every rank's write has finished.  A checkpoint
        still pending from an earlier save is published first (its write waited for)."""
        ctx = self.context
        self._publish_checkpoint()
        self._pending_checkpoint = self.checkpoints.begin_save(
            self.engine,
            self.tokenizer,
            ctx.global_step,
            training_state=self._training_state(),
            extra_files=self.callbacks.checkpoint_files(ctx),
            background=background,
        )
        self._last_saved_step = ctx.global_step
        if self._pending_checkpoint.background_write is None:  # nothing left in the background
            self._publish_checkpoint()

    def _checkpoint_unwritten(self) -> float:
        """1.0 while this rank's background checkpoint write is still going on, else 0.0."""
        pending = self._pending_checkpoint
        return 0.0 if pending is None or pending.written() else 1.0

    def _publish_checkpoint(self) -> None:
        """Publish the pending checkpoint, if any (collective; waits for its background write): ``COMPLETE``,
        renamed into place, then ``on_save`` naming it, and rotation of old ones."""
        pending, self._pending_checkpoint = self._pending_checkpoint, None
        if pending is None:
            return
        ctx = self.context
        path = self.checkpoints.finish_save(pending)
        ctx.last_checkpoint = path
        self.callbacks.fire(Event.SAVE, ctx, checkpoint_path=path)
        protected = {ctx.best_checkpoint} if ctx.best_checkpoint is not None else set()
        self.checkpoints.rotate(protected)
        ctx.checkpoints = self.checkpoints.list_checkpoints()

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the best checkpoint's weights, loaded (on every rank) before any
        ``on_train_end``, as ``Trainer._finalize_training`` does, so every callback sees them there."""
        ctx = self.context
        if self.args.load_best_model_at_end and ctx.best_checkpoint is not None:
            logger.info(
                "loading best model from %s (%s=%s)", ctx.best_checkpoint, self.args.best_metric_name, ctx.best_metric
            )
            self.checkpoints.load_model_weights(Path(ctx.best_checkpoint), self.engine)

    def _keep_only_best(self) -> None:
        """``save_total_limit=1`` with a best checkpoint: every other checkpoint deleted before ``on_train_end``,
        as ``Trainer._finalize_training`` does (rotation keeps the newest for resuming until then)."""
        ctx = self.context
        if self.args.save_total_limit == 1 and ctx.best_checkpoint is not None:
            self.checkpoints.keep_only(Path(ctx.best_checkpoint))
            ctx.checkpoints = self.checkpoints.list_checkpoints()

    # ================================================================== resume
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
        ctx.restore_progress(state)
        if args.ignore_data_skip:  # as Trainer: the resumed epoch's data starts from its beginning
            ctx.step_in_epoch, ctx.epoch = 0, float(ctx.epoch_index)
        self.losses.last_logged_step = self._last_saved_step = ctx.global_step
        ctx.resumed_from = path
        ctx.last_checkpoint = path
        ctx.checkpoints = self.checkpoints.list_checkpoints()
        states = self.checkpoints.settle_best(state.get("callbacks", {}), path)  # before any step
        self.callbacks.load_state_dict(states, restore_user_states=args.restore_callback_states)
        logger.info("resumed from %s at step %d (epoch %.3f)", path, ctx.global_step, ctx.epoch)

    def _training_state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the loop: the run's progress, the world size, the callbacks' state."""
        ctx = self.context
        return {**ctx.progress(), "world_size": self.env.world_size, "callbacks": self.callbacks.state_dict()}

    # ================================================================== bookkeeping
    def _agree(self, summed: Summed = NO_VALUES, own: Own = NO_VALUES) -> Agreement[Summed, Own]:  # type: ignore[assignment]
        """Agree pending control requests across ranks (one collective); abort on a fatal callback error.
        ``summed`` / ``own`` ride in the same collective (``agree_control``)."""
        agreement = agree_control(self.env, self.context.requests, self.callbacks.source_names, summed, own)
        self.context.agreed = agreed = agreement.control
        if ControlFlag.STOP_TRAINING in agreed and not self._stop_training:
            # collective (once per run, only when a stop is agreed): every rank's reason for it
            reasons = self.env.all_gather_objects(agreed.local_reasons.get(ControlFlag.STOP_TRAINING))
            self._stop_requesters = ", ".join(
                f"rank {r.rank} ({r.source}{': ' + reasons[r.rank] if reasons[r.rank] else ''})"
                for r in agreed.requesters[ControlFlag.STOP_TRAINING]
            )
        if ControlFlag.ABORT in agreed:
            local = agreed.local_reasons.get(ControlFlag.ABORT)
            raise CallbackFatalError(
                f"callback error under callback_error_policy='fatal' on "
                f"{agreed.describe(ControlFlag.ABORT)}; every rank stopped at step {self.context.global_step}"
                + (f"{OWN_CAUSE_MARKER}{local})" if local else "")
            )
        return agreement

    def _result(self, runtime: float) -> RunResult:
        # collective: every rank's isolated callback errors, for the result
        gathered = self.env.all_gather_objects(self.callbacks.error_reports(self.env.rank))
        errors = [r for rank_errors in gathered for r in rank_errors]
        return RunResult.of_run(self.context, self.checkpoints.list_checkpoints(), errors, runtime, self._merged)


def _input_tokens(cpu_batch: dict[str, Any], main_input: str = "input_ids") -> int:
    """Input positions of a CPU batch (``input_ids`` elements; without them, the model's main input's
    elements, as ``transformers``' ``estimate_tokens``; 0 for neither)."""
    input_ids = cpu_batch.get("input_ids", cpu_batch.get(main_input))
    return int(input_ids.numel()) if isinstance(input_ids, torch.Tensor) else 0


def _to_device(cpu_batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The batch's tensors on ``device`` (queued, not waited for); Python values (flash attention's
    ``max_length_*``) as they are."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in cpu_batch.items()}


@contextmanager
def _forward_context(engine: Any, cpu_batch: dict[str, Any]) -> Any:
    """The context a micro-batch's forward runs in: the engine's autocast and the batch's sample segments."""
    with engine.autocast(), sample_segments(cpu_batch):
        yield


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
