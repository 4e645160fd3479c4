"""Building a run: tokenizer, data, model, engine and checkpoint manager, before anything runs.

``build_run`` is the set-up half of a training job (torchtune's ``setup()``): it loads the tokenizer
and model (``trainbridge.modeling.load``), the samples (``trainbridge.data.sources``), chooses padded or
padding-free batches for the model, builds the per-rank batch iterables, the engine (DDP / FSDP2 /
DeepSpeed, ``trainbridge.parallel``) and the checkpoint manager, and returns them as ``RunComponents``.
``TrainingLoop`` (``trainbridge.loop.loop``) only runs what it is given, so a test can build the
components of a tiny run in-process (world size 1) and drive the real loop.
"""

from __future__ import annotations

import functools
import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import transformers

from trainbridge.checkpoint.manager import CheckpointManager
from trainbridge.checkpoint.manifest import run_fingerprint
from trainbridge.checkpoint.weights_dtype import checkpoint_weights_dtype
from trainbridge.core.config import eval_set_names
from trainbridge.core.config.checks import check_consistent, check_world
from trainbridge.core.config.loss import (
    ForwardLoss,
    InstanceStep,
    Loss,
    LossFunction,
    OwnStep,
    StepFactory,
    TokenLoss,
    declared_loss,
    trains_on_items,
)
from trainbridge.core.config.plan import ExistingModel, Generate, RunPlan, predictions_of
from trainbridge.core.context import TrainingContext, count_parameters, flops_parameters
from trainbridge.core.random_state import SamplerDraw
from trainbridge.data import LoadStats, collate_padded, collate_padding_free
from trainbridge.data.loader import EvalBatches, TrainBatches
from trainbridge.data.loader_batches import LoaderBatches
from trainbridge.data.loader_workers import LoaderWorkers
from trainbridge.data.loss import install_loss_head, resolve_loss_implementation
from trainbridge.data.rows import run_rows
from trainbridge.data.sample_batches import ItemCollator, SampleBatches, SampleEvalBatches
from trainbridge.data.sample_order import SampleOrder, eval_order, sample_lengths, sample_order
from trainbridge.data.samples import as_source
from trainbridge.data.sources import load_run_data
from trainbridge.data.stream_batches import StreamBatches
from trainbridge.data.user_collate import collate_with
from trainbridge.modeling import (
    VARLEN_SDPA,
    enable_varlen_sdpa,
    model_supports_padding_free,
    packed_row_tokens,
)
from trainbridge.modeling.load import (
    is_causal_lm,
    load_model,
    load_processing_class,
    loads_on_rank0_only,
    text_tokenizer,
    unwrap_peft,
)
from trainbridge.parallel.build import build_engine
from trainbridge.parallel.engine import TrainingEngine
from trainbridge.step.base import EvalSource, TrainSource, TrainStep
from trainbridge.step.custom_loss import CustomLoss
from trainbridge.step.generated import Generation
from trainbridge.step.model_loss import (
    ModelLoss,
    default_label_names,
    forward_parameters,
    returns_loss,
    untrainable_reason,
)
from trainbridge.step.token_ce import TokenCrossEntropy
from trainbridge.step.trainer_methods import TrainerMethodsStep

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from trainbridge.core.config import TrainingArgs
    from trainbridge.core.distributed import DistributedEnv

logger = logging.getLogger(__name__)


@dataclass
class RunComponents:
    """Everything a ``TrainingLoop`` runs with, built by ``build_run``."""

    tokenizer: Any
    """The run's processing class: its tokenizer, or the script's multimodal processor whole (saved into every
    checkpoint as Trainer saves it; ``processing_class`` for HF callbacks)."""
    engine: TrainingEngine
    """The wrapped model, its optimizer and LR scheduler."""
    step: TrainStep
    """The run's kind of optimizer step: how its batches are formed and what its loss is (``trainbridge.step``)."""
    eval_batches: EvalSource | None
    """This rank's validation micro-batches, or None without validation data (``eval_dataloader``)."""
    checkpoints: CheckpointManager
    """Writes, rotates, finds and loads the run's checkpoints."""
    max_steps: int
    """Optimizer steps the run takes unless stopped: ``max_steps`` or ``num_epochs`` epochs."""
    num_parameters: int
    """Parameters of the unwrapped model, every one (the run plan shows it)."""
    flops_parameters: int
    """Parameters the FLOPs estimate counts: input embeddings left out, as Trainer (``flops_parameters``)."""
    padded: bool
    """True for padded batches, False for padding-free packed rows."""
    data_stats: list[LoadStats]
    """What loading the training (then validation) data read and skipped."""
    plan: RunPlan = field(default_factory=RunPlan)
    """The code the run was built with (its evaluation, metrics and callbacks run in the loop)."""
    named_eval_batches: dict[str, EvalSource] = field(default_factory=dict)
    """This rank's micro-batches of each named validation set (``eval_data_paths``; ``eval_batches`` is then
    None), evaluated in turn at each evaluation."""

    @property
    def train_batches(self) -> TrainSource:
        """This rank's training micro-batches, step by step (``train_dataloader``): the step's."""
        return self.step.train_batches

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps in one epoch."""
        return self.train_batches.steps_per_epoch

    @property
    def num_epochs(self) -> int:
        """Epochs the run takes: ``ceil(max_steps / steps_per_epoch)``; batches without a length (``unsized``:
        a stream) repeat their passes until ``max_steps`` (Trainer's ``sys.maxsize`` epochs)."""
        if getattr(self.train_batches, "unsized", False):
            return sys.maxsize
        return math.ceil(self.max_steps / self.steps_per_epoch)

    def context(self, args: TrainingArgs, env: DistributedEnv) -> TrainingContext:
        """The run's ``TrainingContext`` over these components, at step 0 (a resume restores its progress)."""
        engine, plan = self.engine, self.plan
        ctx = TrainingContext(args=args, env=env, hf_args=plan.hf_args, eval_set_names=eval_set_names(args, plan))
        ctx.steps_per_epoch, ctx.max_steps, ctx.num_epochs = self.steps_per_epoch, self.max_steps, self.num_epochs
        ctx.model, ctx.unwrapped_model = engine.module, engine.unwrapped
        ctx.optimizer, ctx.lr_scheduler = engine.optimizer, engine.lr_scheduler
        ctx.train_dataloader = self.train_batches
        ctx.eval_dataloader = self.eval_batches or next(iter(self.named_eval_batches.values()), None)
        ctx.tokenizer = self.tokenizer
        ctx.num_parameters, ctx.flops_parameters = self.num_parameters, self.flops_parameters
        ctx.flops_input_positions = self.step.flops_input_positions
        ctx.restore_model_weights = lambda path: self.checkpoints.load_model_weights(Path(path), engine)
        return ctx


class RunBatches(NamedTuple):
    """The step and the validation batches of a run, as one kind of step forms them."""

    step: TrainStep
    eval_batches: EvalSource | None
    named_eval_batches: dict[str, EvalSource]
    data_stats: list[LoadStats]
    padded: bool


def build_run(args: TrainingArgs, plan: RunPlan, env: DistributedEnv) -> RunComponents:
    """Build this worker's tokenizer, model, step and data, engine and checkpoint manager (collective: the
    engine wraps the model across ranks) for ``args`` running ``plan``'s code (checked together first)."""
    check_consistent(args, plan)
    check_world(args, env.world_size)
    if not isinstance(plan.model_init, ExistingModel):  # seeded before it is built (an existing one: as it is)
        # full_determinism: deterministic kernels from here on too, as Trainer's __init__ (which a facade's ran)
        (transformers.enable_full_determinism if args.full_determinism else transformers.set_seed)(args.seed)
    items = trains_on_items(declared_loss(args, plan))  # a folder without a tokenizer is then fine (as Trainer)
    processing_class = load_processing_class(args, plan.script_data, items)  # saved whole; the data: its tokenizer
    tokenizer = text_tokenizer(processing_class)
    # FSDP2: rank 0 reads the weights, the other ranks build a meta skeleton and get shards from it.
    from_rank0 = loads_on_rank0_only(args, env.world_size, plan.model_init)
    skeleton = from_rank0 and not env.is_world_process_zero
    model = load_model(args, skeleton=skeleton, model_init=plan.model_init)
    model.train()  # from_pretrained returns the model in eval mode (dropout off)
    seams = choose_step(model, args, plan)
    drawn = SamplerDraw()  # the state an epoch's order was drawn from, kept in the checkpoints' RNG files
    if isinstance(seams.loss, OwnStep):
        batches = _factory_batches(model, tokenizer, args, env, plan, seams.loss.factory)
    elif isinstance(seams.loss, TokenLoss):
        batches = _token_batches(
            model, tokenizer, args, env, plan, seams.loss, from_rank0=from_rank0, skeleton=skeleton
        )
    else:
        batches = _sample_batches(model, tokenizer, args, env, plan, seams, drawn)
    train_batches = batches.step.train_batches
    max_steps = args.max_steps or train_batches.steps_per_epoch * args.num_epochs
    num_parameters = count_parameters(model)
    flops_params = flops_parameters(model)
    engine = build_engine(
        model, args, env, max_steps, weights_from_rank0=from_rank0, optimizer_factory=plan.optimizer_factory
    )
    engine.verify()
    logger.info("engine: %s; step: %s", engine.describe(), batches.step.describe())
    return RunComponents(
        tokenizer=processing_class,
        engine=engine,
        step=batches.step,
        eval_batches=batches.eval_batches,
        checkpoints=CheckpointManager(
            args.ckpt_output_dir,
            env,
            args.save_total_limit,
            fingerprint=run_fingerprint(
                args.model_path,
                args.data_path,
                model.config,
                plan.script_data.identity if plan.script_data is not None else None,
            ),
            checksums=args.checkpoint_checksums,
            weights_dtype=checkpoint_weights_dtype(args, engine.unwrapped),
            allow_unverified=args.resume_allow_unverified,
            share_with_group=args.share_run_dir_with_group,
            model_files=plan.checkpoint_model_files,
            model_only=args.save_only_model,
            sampler=drawn,
        ),
        plan=plan,
        max_steps=max_steps,
        num_parameters=num_parameters,
        flops_parameters=flops_params,
        padded=batches.padded,
        data_stats=batches.data_stats,
        named_eval_batches=batches.named_eval_batches,
    )


BatchesSeam = Literal["factory", "token_budget", "samples", "stream", "loader"]


class StepSeams(NamedTuple):
    """The run's step as three seams, each chosen from the plan on its own (``choose_step``)."""

    batches: BatchesSeam
    """The step factory's own, token-budget batches, Trainer's sample batches of the items, of the
    ``train_stream``, or the script's own DataLoader (``train_loader``)."""
    loss: Loss
    """What the step trains on (``core.config.loss``): the plan's, the one ``training_step`` names, else the
    model's choice."""
    predictions: Generate | None
    """The validation predictions: None, the step's forward outputs; else generated ids (``predictions_of``)."""


def choose_step(model: Any, args: TrainingArgs, plan: RunPlan) -> StepSeams:
    """The step's batches, loss and predictions (``StepSeams``), once, at build time: the declared loss
    (``declared_loss``: ``RunPlan.loss``, else ``args.training_step``'s), else (``auto``) the token loss for a
    causal LM whose plan brings no stream, loader or generation, the forward's own loss for every other model.
    A ``ValueError`` for a model the loss cannot train, saying why and what to do."""
    declared = declared_loss(args, plan)
    if isinstance(declared, OwnStep):
        return StepSeams("factory", declared, None)
    predictions = predictions_of(args, plan)
    causal = is_causal_lm(model)
    if isinstance(declared, TokenLoss) and not causal:
        raise ValueError(
            f"training_step: 'token_cross_entropy' trains causal LMs; {type(unwrap_peft(model)).__name__} "
            "is not one: use training_step='model_loss' (or 'auto')"
        )
    if isinstance(declared, TokenLoss) and predictions is not None:
        raise ValueError(
            "predict_with_generate: generated predictions need training_step='model_loss' (or 'auto' for a "
            "model that is not a causal LM); 'token_cross_entropy' predicts the forward's logits"
        )
    items = plan.train_stream is not None or plan.train_loader is not None or predictions is not None
    if isinstance(declared, TokenLoss) or (declared is None and causal and not items):
        return StepSeams("token_budget", declared or TokenLoss(), None)
    loss = declared or ForwardLoss()
    label_names = args.label_names or default_label_names(model)
    if isinstance(loss, ForwardLoss) and not returns_loss(model, label_names):
        raise ValueError(untrainable_reason(model, label_names))
    batches: BatchesSeam = "loader" if plan.train_loader is not None else "samples"
    if batches == "samples" and plan.train_stream is not None:
        batches = "stream"
    return StepSeams(batches, loss, predictions)


def _token_batches(
    model: PreTrainedModel,
    tokenizer: Any,
    args: TrainingArgs,
    env: DistributedEnv,
    plan: RunPlan,
    loss: TokenLoss,
    *,
    from_rank0: bool,
    skeleton: bool,
) -> RunBatches:
    """The token-budget step: samples tokenised through the cache, padding-free (or padded) micro-batches of
    the global plan, the summed token cross entropy."""
    data = load_run_data(args, tokenizer, report=env.is_world_process_zero, script=plan.script_data)
    padded = use_padded_batches(model, args, probe=not skeleton, collator=plan.data_collator)
    if from_rank0:  # collective: the attention rank 0's probe chose (a skeleton cannot run the probe)
        chosen = env.broadcast_object(model.config._attn_implementation)
        if model.config._attn_implementation != chosen:
            model.set_attn_implementation(chosen)
    loss_implementation = resolve_loss_implementation(args.loss_implementation, env.device)
    install_loss_head(model, loss_implementation, args.loss_chunk_tokens)
    collate = _collate_fn(model, tokenizer, padded, plan.data_collator)
    # compute_metrics needs one row per validation sample: validation batches are then padded (same loss)
    eval_padded = padded or plan.compute_metrics is not None
    eval_collate = collate if padded or not eval_padded else _collate_fn(model, tokenizer, True, None)
    train_batches = TrainBatches(
        data.train,
        collate,
        effective_batch_size=args.effective_batch_size,
        world_size=env.world_size,
        rank=env.rank,
        max_batch_len=args.max_batch_len,
        seed=args.data_order_seed,
        padded=padded,
        whole_batches_of=_whole_batches_of(env, plan),
        shuffle=args.train_sampling_strategy != "sequential",  # Trainer's SequentialSampler: steps in order
    )

    def eval_set(source: Any) -> EvalBatches:
        per_eval, grouped = args.per_device_eval_batch_size, args.train_sampling_strategy == "group_by_length"
        order = eval_order(args, as_source(source).lengths.tolist(), per_eval) if per_eval and grouped else None
        return EvalBatches(
            source,
            eval_collate,
            world_size=env.world_size,
            rank=env.rank,
            max_batch_len=args.max_batch_len,
            padded=eval_padded,
            per_device=args.per_device_eval_batch_size,
            row_per_sample=plan.compute_metrics is not None,
            order=order,
        )

    return RunBatches(
        TokenCrossEntropy(
            train_batches, args.max_batch_len, padded, loss.metrics, args.per_device_eval_batch_size is not None
        ),
        eval_set(data.val) if data.val else None,
        {name: eval_set(source) for name, source in data.named_val.items()},
        data.stats,
        padded,
    )


def _sample_batches(
    model: PreTrainedModel,
    tokenizer: Any,
    args: TrainingArgs,
    env: DistributedEnv,
    plan: RunPlan,
    seams: StepSeams,
    drawn: SamplerDraw,
) -> RunBatches:
    """The model's-own-loss step: the items (``run_rows``: the script's datasets in place, else the data files'
    rows), Trainer's sample batches formed by the collator (the script's, else Trainer's default), the loss the
    forward returns."""
    per_device, _ = sample_batch_shape(args, env.world_size)
    stream: Any = plan.train_stream
    train, val, named = run_rows(args, tokenizer, plan.script_data, streaming=stream is not None)
    label_names = args.label_names or default_label_names(model)
    keep = [*forward_parameters(model), "label", "label_ids", *label_names] if args.remove_unused_columns else None
    collate = ItemCollator(plan.data_collator or default_collator(tokenizer), keep)
    train_batches: SampleBatches | StreamBatches | LoaderBatches
    if seams.batches == "loader":  # the script's own DataLoader (a Trainer subclass's), this rank's share
        train_batches = _loader_batches(args, env, plan, train if train is not None else stream, collate, model)
    else:
        drop_last = _whole_batches_of(env, plan) is not None
        order = sample_order(args, train, tokenizer, collate.keep) if train is not None else None
        train_batches = _item_batches(args, env, train, stream, collate, drop_last, order, drawn)

    def eval_set(dataset: Any) -> SampleEvalBatches:
        per_eval = args.per_device_eval_batch_size or per_device
        order = None
        if args.train_sampling_strategy == "group_by_length":
            order = eval_order(args, sample_lengths(args, dataset, tokenizer, collate.keep), per_eval)
        return SampleEvalBatches(
            dataset, collate, per_device=per_eval, world_size=env.world_size, rank=env.rank, order=order
        )

    count = len(train) if train is not None else 0
    source = "train_stream" if stream is not None else "train_loader"
    where = "train_dataset" if plan.script_data is not None else str(args.data_path)
    stats = [LoadStats(path=where if train is not None else source, lines=count, samples=count)]
    if env.is_world_process_zero:
        described = {"train_stream": f"streaming {type(stream).__name__}", "train_loader": "the script's DataLoader"}
        logger.info(
            "data: %s, %s",
            f"{count} training items" if train is not None else described[source],
            f"{len(val)} validation items" if val is not None else "no validation data",
        )
    # the loss and the predictions, as chosen apart: generated ids come with the model's own loss (Seq2SeqTrainer)
    generation = _generation(seams.predictions, args, env) if seams.predictions is not None else None
    step: ModelLoss
    if isinstance(seams.loss, InstanceStep):
        step = TrainerMethodsStep(train_batches, model, env, seams.loss.methods, label_names, generation)
    elif isinstance(seams.loss, LossFunction):
        step = CustomLoss(train_batches, model, env, seams.loss.fn, label_names, generation)
    else:
        step = ModelLoss(train_batches, model, env, label_names, generation, args.average_tokens_across_devices)
    return RunBatches(
        step,
        eval_set(val) if val is not None else None,
        {name: eval_set(dataset) for name, dataset in named.items()},
        stats,
        True,
    )


def _generation(predictions: Generate, args: TrainingArgs, env: DistributedEnv) -> Generation:
    """Generated ids as the validation predictions (``predictions``), synced across ranks of a sharded model."""
    sharded = args.distributed_backend == "fsdp" or (
        args.distributed_backend == "deepspeed" and args.deepspeed_zero_stage == 3
    )
    return Generation(predictions.kwargs, synced_gpus=sharded and env.world_size > 1)


def _whole_batches_of(env: DistributedEnv, plan: RunPlan) -> int | None:
    """Under the script's ``dataloader_drop_last``: the samples of one whole batch on every rank, the unit an
    epoch keeps (the rest of its order is dropped, as Trainer's ``DataLoader`` drops its short batch)."""
    hf = plan.hf_args
    if hf is None or not hf.dataloader_drop_last:
        return None
    return int(hf.per_device_train_batch_size) * env.world_size


def _item_batches(
    args: TrainingArgs,
    env: DistributedEnv,
    train: Any,
    stream: Any,
    collate: ItemCollator,
    drop_last: bool,
    order: SampleOrder | None = None,
    drawn: SamplerDraw | None = None,
) -> SampleBatches | StreamBatches:
    """Trainer's sample batches of the items (``train``; whole batches only under ``drop_last``, the script's
    ``dataloader_drop_last``), or of the stream (``train_stream``)."""
    per_device, accumulation = sample_batch_shape(args, env.world_size)
    # both kinds deal this rank its share of each step's items alike
    shape: dict[str, Any] = dict(
        per_device=per_device, accumulation=accumulation, world_size=env.world_size, rank=env.rank
    )
    if train is None:
        scatter = env.scatter_objects if env.is_distributed else None  # rank 0 reads, as accelerate dispatches
        return StreamBatches(stream, collate, **shape, max_steps=args.max_steps, scatter=scatter)
    workers = LoaderWorkers.of(args)
    return SampleBatches(
        train,
        collate,
        **shape,
        seed=args.data_order_seed,
        order=order,
        drop_last=drop_last,
        workers=workers,
        drawn=drawn,
    )


def _loader_batches(
    args: TrainingArgs, env: DistributedEnv, plan: RunPlan, dataset: Any, collate: ItemCollator, model: PreTrainedModel
) -> LoaderBatches:
    """The batches of the DataLoader ``plan.train_loader`` builds on this rank; every rank's must be as long
    (collective: the lengths, so a mismatch fails here rather than hanging a later collective)."""
    assert plan.train_loader is not None
    _, accumulation = sample_batch_shape(args, env.world_size)
    loader = plan.train_loader(dataset, collate, model)
    batches = LoaderBatches(loader, accumulation=accumulation, world_size=env.world_size, max_steps=args.max_steps)
    lengths = env.all_gather_objects(None if batches.unsized else len(batches))
    if len(set(lengths)) > 1:
        raise ValueError(
            f"get_train_dataloader: the ranks' DataLoaders have different lengths {lengths}; prepare it with "
            "self.accelerator.prepare(...) (as Trainer's own) so every rank gets an even share"
        )
    return batches


def _factory_batches(
    model: PreTrainedModel, tokenizer: Any, args: TrainingArgs, env: DistributedEnv, plan: RunPlan, factory: StepFactory
) -> RunBatches:
    """The step ``factory`` builds (``OwnStep``: its own batches, loss and validation batches)."""
    step = factory(model, tokenizer, args, env, plan)
    if not isinstance(step, TrainStep):
        raise TypeError(f"loss: OwnStep's factory {factory!r} returned {type(step).__name__}, not a TrainStep")
    eval_batches, named_eval_batches = step.own_eval_sets()
    return RunBatches(step, eval_batches, named_eval_batches, [], False)


def sample_batch_shape(args: TrainingArgs, world_size: int) -> tuple[int, int]:
    """``(items per micro-batch, micro-batches per step)`` of the sample batches; a ``ValueError`` naming
    the fields when ``effective_batch_size`` is not a multiple of ``per_device_batch_size x world size``."""
    per_device = args.per_device_batch_size or max(1, args.effective_batch_size // world_size)
    accumulation, rest = divmod(args.effective_batch_size, per_device * world_size)
    if rest or accumulation == 0:
        raise ValueError(
            f"effective_batch_size: {args.effective_batch_size} is not a multiple of per_device_batch_size "
            f"({per_device}) x world size ({world_size}); set effective_batch_size to "
            f"{max(1, accumulation) * per_device * world_size} or change per_device_batch_size"
        )
    return per_device, accumulation


def default_collator(tokenizer: Any) -> Any:
    """Trainer's default collator: ``DataCollatorWithPadding`` with a tokenizer, else ``default_data_collator``."""
    if isinstance(tokenizer, transformers.PreTrainedTokenizerBase):
        return transformers.DataCollatorWithPadding(tokenizer)
    return transformers.default_data_collator


def use_padded_batches(model: PreTrainedModel, args: TrainingArgs, probe: bool = True, collator: Any = None) -> bool:
    """Padded or padding-free batches for ``model`` under ``args.packing``; registers the per-sample
    varlen attention when padding-free rows will use it (``probe=False``: without the start-up probe,
    for a meta-device skeleton that takes rank 0's probed choice afterwards)."""
    supported = model_supports_padding_free(model)
    if args.packing == "padding_free" and not supported:
        raise ValueError(f"packing: {type(model).__name__} does not support padding-free batches")
    padded = args.packing == "padded" or (args.packing == "auto" and not supported)
    padded = padded or collator is not None  # a user's collator pads
    if not padded and args.varlen_sdpa and enable_varlen_sdpa(model, args.max_seq_len, probe=probe):
        logger.info("attention: per-sample sdpa for padding-free rows (%s)", VARLEN_SDPA)
    return padded


def _pad_token_id(tokenizer: Any, data_collator: Any) -> int:
    """What batches are padded with: the run tokenizer's pad id, else that of the collator's own tokenizer (a
    script that hands its tokenizer only to its collator: no ``processing_class``, as Trainer needs none), else 0."""
    for source in (tokenizer, getattr(data_collator, "tokenizer", None)):
        pad_id = getattr(source, "pad_token_id", None)
        if pad_id is not None:
            return int(pad_id)
    return 0


def _collate_fn(model: PreTrainedModel, tokenizer: Any, padded: bool, data_collator: Any) -> Any:
    pad_id = _pad_token_id(tokenizer, data_collator)
    if data_collator is not None:  # the user's collator, called as written (data.user_collate)
        return functools.partial(collate_with, data_collator, pad_token_id=pad_id)
    if padded:
        return functools.partial(collate_padded, pad_token_id=pad_id)
    return functools.partial(
        collate_padding_free,
        row_tokens=packed_row_tokens(model),
        flash_kwargs=model.config._attn_implementation.startswith("flash_attention"),
    )
