"""``TrainingContext``: what every callback sees, kept up to date by the loop.

Field validity (which events see a meaningful value) is documented per field.  "always" means from
``on_init_end`` on.  The loop updates the context; callbacks read it and *request* control through
``request_*`` methods (agreed across ranks before the loop acts, see ``trainbridge.core.agreement``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainbridge.core.agreement import AgreedControl, ControlFlag, ControlRequests

if TYPE_CHECKING:
    import torch

    from trainbridge.core.config import TrainingArgs
    from trainbridge.core.distributed import DistributedEnv


def count_parameters(model: Any, trainable_only: bool = False) -> int:
    """Parameters of ``model`` (``ds_numel`` under DeepSpeed ZeRO-3, where ``numel()`` is 0 on a shard)."""
    return sum(
        int(getattr(p, "ds_numel", p.numel())) for p in model.parameters() if p.requires_grad or not trainable_only
    )


def flops_parameters(model: Any) -> int:
    """Parameters counted by the ``total_flos`` estimate: as ``transformers.Trainer.floating_point_ops``,
    the input embeddings are left out (``num_parameters(exclude_embeddings=True)``) where the model has it."""
    if callable(getattr(model, "num_parameters", None)):
        return int(model.num_parameters(exclude_embeddings=True))
    return sum(p.numel() for p in model.parameters())


@dataclass
class TrainingContext:
    """The state of the run, shared by the loop and every callback on one rank."""

    args: TrainingArgs
    """The run's validated ``TrainingArgs`` (always)."""
    env: DistributedEnv
    """Rank, world size, device (always)."""
    hf_args: Any = None
    """The ``transformers.TrainingArguments`` the run's settings came from (``RunPlan.hf_args``: a
    ``trainbridge.Trainer`` or ported script), else None."""

    # ------------------------------------------------------------------ progress
    eval_set_names: list[str] = field(default_factory=list)
    """The named validation sets, each evaluated in turn (``core.config.eval_set_names``; empty: none)."""
    global_step: int = 0
    """Completed optimizer steps (always; advanced just before ``on_step_end``)."""
    epoch: float = 0.0
    """Fractional epoch: ``epoch_index + steps done in epoch / steps per epoch`` (always)."""
    epoch_index: int = 0
    """Zero-based index of the current epoch (from ``on_epoch_begin``)."""
    step_in_epoch: int = 0
    """Optimizer steps completed in the current epoch."""
    micro_step: int = 0
    """Index of the current micro-batch inside the optimizer step (forward/backward events)."""
    micro_steps_in_step: int = 0
    """Micro-batches in the current optimizer step (same on every rank)."""
    steps_per_epoch: int = 0
    """Optimizer steps in one epoch (always)."""
    max_steps: int = 0
    """Optimizer steps the run will take unless stopped (always)."""
    num_epochs: int = 0
    """Epochs the run will take (``ceil(max_steps / steps_per_epoch)``; always)."""
    samples_seen: int = 0
    """Training samples consumed, all ranks together (updated at ``on_step_end``)."""
    tokens_seen: int = 0
    """Input tokens consumed (non-padding), all ranks together (from the plan, once the step's micro-batches
    have run: ``on_pre_optimizer_step`` onwards includes the step)."""
    loss_tokens_seen: int = 0
    """Loss-counted tokens (labels != -100), all ranks together."""
    num_parameters: int = 0
    """Parameters of the model being trained, counted before wrapping (always)."""
    flops_parameters: int = 0
    """Parameters the FLOPs estimate counts (input embeddings left out, as Trainer's ``floating_point_ops``)."""
    flops_input_positions: bool = False
    """Whether the FLOPs estimate counts input positions (the step's ``flops_input_positions``)."""
    input_tokens_seen: int = 0
    """Input positions fed to the model (``input_ids`` elements, padding included), all ranks together
    (updated after the step's agreement, which sums it over ranks: at ``on_step_end`` it does not include
    that step yet; ``TrainerState.num_input_tokens_seen`` under ``include_num_input_tokens_seen='all'``)."""

    # ------------------------------------------------------------------ measurements
    loss: float | None = None
    """Mean per-token loss of the last step, averaged across ranks (valid after the step's agreement:
    ``on_log``, ``on_evaluate``, ``on_save``, ``on_epoch_end``, ``on_train_end``; at ``on_step_end`` it
    still holds the previous step's value)."""
    deferred_local_loss: float | torch.Tensor | None = field(default=None, repr=False)
    """Storage of ``local_loss``: the loop leaves a device tensor here (read it through ``local_loss``)."""
    deferred_grad_norm: float | torch.Tensor | None = field(default=None, repr=False)
    """Storage of ``grad_norm``: the loop leaves a device tensor here (read it through ``grad_norm``)."""
    learning_rate: float | None = None
    """Learning rate used by the last optimizer step (from ``on_optimizer_step``)."""
    tokens_per_second: float | None = None
    """Non-padding tokens per second, all ranks, over the last step (after the step's agreement)."""
    samples_per_second: float | None = None
    """Samples per second, all ranks, over the last step (after the step's agreement)."""
    step_time_s: float | None = None
    """Wall time of the last optimizer step (after the step's agreement)."""
    memory_bytes: int | None = None
    """This rank's memory: CUDA allocated bytes, or the process RSS on CPU (updated every step end)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Last validation metrics (``eval_loss``...; from ``on_evaluate`` on)."""
    logs: dict[str, float] = field(default_factory=dict)
    """Last logged values with transformers' keys (from ``on_log`` on)."""
    best_metric: float | None = None
    """Best value of ``args.best_metric_name`` so far (when best tracking is on)."""
    best_global_step: int | None = None
    """Step at which ``best_metric`` was reached."""
    best_checkpoint: Path | None = None
    """Checkpoint saved at ``best_global_step`` (protected from rotation)."""
    last_checkpoint: Path | None = None
    """Most recent complete checkpoint directory (from ``on_save``)."""
    checkpoints: list[Path] = field(default_factory=list)
    """Every checkpoint written by this run and still on disk, oldest first."""
    train_start_time: float | None = None
    """``time.time()`` at ``on_train_begin``."""
    resumed_from: Path | None = None
    """Checkpoint this run resumed from (from ``on_train_begin``), else None."""

    # ------------------------------------------------------------------ live objects
    model: torch.nn.Module | None = None
    """The wrapped model (DDP / FSDP2 module / DeepSpeed engine module) (always)."""
    unwrapped_model: torch.nn.Module | None = None
    """The underlying ``PreTrainedModel`` (always)."""
    optimizer: torch.optim.Optimizer | None = None
    """The optimizer (always)."""
    lr_scheduler: Any = None
    """The learning-rate scheduler (always)."""
    train_dataloader: Any = None
    """The training batch iterable (always)."""
    eval_dataloader: Any = None
    """The validation batch iterable, or None (always)."""
    tokenizer: Any = None
    """The tokenizer, or the script's multimodal processor whole (Trainer's ``processing_class``) (always)."""
    restore_model_weights: Callable[[Path], None] | None = None
    """Loads a checkpoint's model weights into the live model on every rank (collective; call it from an
    event that fires on every rank at the same point)."""

    # ------------------------------------------------------------------ control and user state
    requests: ControlRequests = field(default_factory=ControlRequests)
    """This rank's pending control requests (use the ``request_*`` methods)."""
    agreed: AgreedControl = field(default_factory=AgreedControl)
    """The last agreed control decision (every rank holds the same)."""
    stop_reason: str | None = None
    """Why training stopped early (set when a stop is agreed)."""
    user_state: dict[str, Any] = field(default_factory=dict)
    """Free-form state shared by callbacks across events (persists for the run)."""
    current_source: int = 0
    """Index of the callback being dispatched (set by the callback manager; names requesters)."""

    # ------------------------------------------------------------------ derived
    @property
    def total_flos(self) -> float:
        """Estimated training floating-point operations so far: ``6 x flops_parameters x tokens``, the tokens
        being ``input_tokens_seen`` (every input position, padding included, as ``transformers.Trainer``
        counts ``input_ids.numel()`` of its batches) when the step trains on Trainer's batches
        (``flops_input_positions``), else ``tokens_seen``."""
        tokens = self.input_tokens_seen if self.flops_input_positions else self.tokens_seen
        return float(6 * self.flops_parameters * tokens)

    # ------------------------------------------------------------------ values kept on the device
    # The loop keeps the loss and the gradient norm on the device until the step's one reduction
    # (``loop.step_accounting``), so a step has a single host-device synchronisation.  Reading one of
    # these before that converts it -- one synchronisation, paid only by a callback that asks.
    @property
    def local_loss(self) -> float | None:
        """This rank's loss of the current micro-batch (``on_after_forward`` .. ``on_after_backward``) and
        its per-token step loss at ``on_step_end`` (not averaged across ranks)."""
        value = self.deferred_local_loss
        if value is not None and not isinstance(value, float):
            value = self.deferred_local_loss = float(value)
        return value

    @local_loss.setter
    def local_loss(self, value: float | torch.Tensor | None) -> None:
        self.deferred_local_loss = value

    @property
    def grad_norm(self) -> float | None:
        """Total gradient norm before clipping (from ``on_pre_optimizer_step``; same on every rank;
        under DeepSpeed, which clips inside its step, from ``on_optimizer_step``)."""
        value = self.deferred_grad_norm
        if value is not None and not isinstance(value, float):
            value = self.deferred_grad_norm = float(value)
        return value

    @grad_norm.setter
    def grad_norm(self, value: float | torch.Tensor | None) -> None:
        self.deferred_grad_norm = value

    # ------------------------------------------------------------------ progress (checkpoints, resume)
    def progress(self) -> dict[str, Any]:
        """The run's position and counters, as a checkpoint keeps them (``restore_progress`` reads them back)."""
        return {
            "global_step": self.global_step,
            "epoch_index": self.epoch_index,
            "step_in_epoch": self.step_in_epoch,
            "epoch": self.epoch,
            "samples_seen": self.samples_seen,
            "tokens_seen": self.tokens_seen,
            "loss_tokens_seen": self.loss_tokens_seen,
            "input_tokens_seen": self.input_tokens_seen,
        }

    def restore_progress(self, state: dict[str, Any]) -> None:
        """A checkpoint's ``progress()``; a checkpoint at an epoch's last step resumes at the next epoch's start."""
        self.global_step = state["global_step"]
        self.epoch_index, self.step_in_epoch = state["epoch_index"], state["step_in_epoch"]
        if self.step_in_epoch >= self.steps_per_epoch:
            self.epoch_index, self.step_in_epoch = self.epoch_index + 1, 0
        self.epoch = self.epoch_index + self.step_in_epoch / self.steps_per_epoch
        self.samples_seen, self.tokens_seen = state["samples_seen"], state["tokens_seen"]
        self.loss_tokens_seen = state["loss_tokens_seen"]
        self.input_tokens_seen = state.get("input_tokens_seen", self.tokens_seen)

    # ------------------------------------------------------------------ rank shortcuts
    @property
    def rank(self) -> int:
        """Global rank."""
        return self.env.rank

    @property
    def local_rank(self) -> int:
        """Rank on this node."""
        return self.env.local_rank

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self.env.world_size

    @property
    def is_world_process_zero(self) -> bool:
        """Global rank 0."""
        return self.env.is_world_process_zero

    @property
    def is_local_process_zero(self) -> bool:
        """Rank 0 of this node."""
        return self.env.is_local_process_zero

    # ------------------------------------------------------------------ control requests
    def request(self, flag: ControlFlag, reason: str = "") -> None:
        """Request ``flag`` on this rank; the loop acts once it is agreed (any rank asks, all act)."""
        self.requests.request(flag, self.current_source, reason)

    def request_stop_training(self, reason: str = "") -> None:
        """Stop training on every rank at the next decision point."""
        self.request(ControlFlag.STOP_TRAINING, reason)

    def request_stop_epoch(self, reason: str = "") -> None:
        """End the current epoch on every rank at the next decision point."""
        self.request(ControlFlag.STOP_EPOCH, reason)

    def request_save(self, reason: str = "") -> None:
        """Write a checkpoint at the next decision point."""
        self.request(ControlFlag.SAVE, reason)

    def request_evaluate(self, reason: str = "") -> None:
        """Run validation at the next decision point."""
        self.request(ControlFlag.EVALUATE, reason)

    def request_log(self, reason: str = "") -> None:
        """Log at the next decision point."""
        self.request(ControlFlag.LOG, reason)
