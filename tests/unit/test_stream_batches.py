"""Streaming training data (``data.stream_batches``, ``TrainingArgs.train_stream``): a generator-backed
``IterableDataset`` trains ``max_steps`` steps through the real loop in-process, ranks take disjoint items,
a resumed run skips what was consumed and reaches the weights of an uninterrupted one, a stream shorter than
``max_steps`` is iterated again epoch after epoch (``set_epoch`` twice as it begins, as under Trainer) and
resumes exactly across a pass, an empty one ends the run, and a stream without ``max_steps`` is refused when
the arguments are built (``data_path`` is not needed beside a stream)."""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.run_inputs import RunInputs, as_run, split_run
from trainbridge.callbacks import ScheduleCallback
from trainbridge.core.config import TrainingArgs
from trainbridge.core.config.loss import ForwardLoss
from trainbridge.core.distributed import DistributedEnv
from trainbridge.data.stream_batches import StreamBatches
from trainbridge.demos.tiny_model import build_tokenizer, tiny_bert_config
from trainbridge.loop.build import build_run
from trainbridge.loop.loop import TrainingLoop
from trainbridge.step.model_loss import ModelLoss


class Numbers(torch.utils.data.IterableDataset):
    """A generator-backed stream of classification items; ``idx`` says which item it is."""

    def __init__(self, count: int = 1000) -> None:
        self.count = count

    def __iter__(self) -> Any:
        rng = random.Random(0)
        for i in range(self.count):
            label = rng.randrange(2)
            ids = [2 + label * 10 + rng.randrange(8) for _ in range(rng.randrange(3, 9))]
            yield {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": label, "idx": i}


def _collate_idx(items: list[Any]) -> dict[str, Any]:
    return {"idx": [item["idx"] for item in items]}


def _batches(rank: int, world: int, max_steps: int = 5) -> StreamBatches:
    return StreamBatches(
        Numbers(), _collate_idx, per_device=2, accumulation=3, world_size=world, rank=rank, max_steps=max_steps
    )


def _seen(batches: StreamBatches, start: int = 0) -> list[list[int]]:
    return [
        [i for micro in batches.micro_batches(step) for i in micro["idx"]]
        for step in batches.set_epoch(0).steps[start:]
    ]


def test_ranks_take_disjoint_micro_batches_covering_the_stream_in_order():
    ranks = [_seen(_batches(rank, 2)) for rank in range(2)]
    assert [len(steps) for steps in ranks] == [5, 5]
    flat = [sorted(i for step in steps for i in step) for steps in ranks]
    assert not set(flat[0]) & set(flat[1])
    assert sorted(flat[0] + flat[1]) == list(range(5 * 2 * 3 * 2))
    assert ranks[0][0] == [0, 1, 4, 5, 8, 9] and ranks[1][0] == [2, 3, 6, 7, 10, 11]


class _Unread(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """A stream whose items must not be read (a ``DataLoader`` still opens it, as accelerate's on every rank)."""

    def __iter__(self) -> Any:
        return self

    def __next__(self) -> Any:
        raise AssertionError("a rank other than 0 read the stream")


def _dispatching(stream: Numbers, collate: Any, rounds: list[list[Any]]) -> Any:
    """``on_rank(rank)``: rank ``rank``'s ``StreamBatches`` of ``stream`` on 2 ranks (2 a micro-batch, 3 a step), its
    scatter played in turn through ``rounds``: rank 0 reads and collates, rank 1 takes its part of each round."""

    def on_rank(rank: int) -> StreamBatches:
        def scatter(round_: list[Any] | None) -> Any:
            if rank == 0:
                rounds.append(list(round_ or []))
                return rounds[-1][0]
            return rounds.pop(0)[1]

        return StreamBatches(
            stream if rank == 0 else _Unread(),
            functools.partial(collate, rank),
            per_device=2,
            accumulation=3,
            world_size=2,
            rank=rank,
            max_steps=5,
            scatter=scatter,  # type: ignore[arg-type]
        )

    return on_rank


def test_on_several_ranks_rank_0_reads_and_collates_every_micro_batch_and_sends_each_its_own():
    """accelerate's ``dispatch_batches`` (its default for a stream under Trainer), the collective played in turn: rank 0
    reads the stream and collates each round, every rank receives its own micro-batch, the same ones each rank
    reads itself without it; rank 1 neither reads the stream nor collates, and meets rank 0 in every round."""
    rounds: list[list[Any]] = []
    collated = {0: 0, 1: 0}

    def collate(rank: int, items: list[Any]) -> dict[str, Any]:
        collated[rank] += 1
        return _collate_idx(items)

    on_rank = _dispatching(Numbers(), collate, rounds)
    dispatched = [_seen(on_rank(rank)) for rank in range(2)]
    assert not rounds  # rank 1 met rank 0 in each of its rounds
    assert dispatched == [_seen(_batches(rank, 2)) for rank in range(2)]
    assert collated == {0: 2 * (5 * 3 + 1), 1: 0}  # both ranks' micro-batches of 5 steps and a round ahead


def test_the_round_a_stream_runs_out_in_is_split_over_the_ranks_as_accelerate_dispatches_it():
    """9 items, 2 a micro-batch, 2 ranks, 3 micro-batches a step: 2 whole rounds, then item 8 alone.  As accelerate's
    ``DataLoaderDispatcher`` (``drop_last=False``): the last round's items do not divide over the ranks, so they are
    completed from the pass's first items (0, 1) and each rank gets one: rank 0 item 8, rank 1 item 0; the pass's
    3 micro-batches a rank are one whole step."""
    rounds: list[list[Any]] = []

    def collate(rank: int, items: list[Any]) -> dict[str, Any]:
        return {"idx": torch.tensor([item["idx"] for item in items])}

    on_rank = _dispatching(Numbers(9), collate, rounds)
    steps = [list(on_rank(rank).set_epoch(0).steps[0:]) for rank in range(2)]
    for rank, own in enumerate([[[0, 1], [4, 5], [8]], [[2, 3], [6, 7], [0]]]):
        (step,) = steps[rank]
        assert not step.carried and [batch["idx"].tolist() for batch in step.batches] == own


def test_slicing_the_plan_skips_the_consumed_steps():
    whole = _seen(_batches(1, 2))
    assert _seen(_batches(1, 2), start=3) == whole[3:]


def test_a_stream_needs_max_steps_naming_the_field():
    with pytest.raises(ValueError, match="max_steps"):
        _batches(0, 1, max_steps=0)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import BertForSequenceClassification

    torch.manual_seed(0)
    config = tiny_bert_config()
    folder = tmp_path_factory.mktemp("cls")
    BertForSequenceClassification(config).save_pretrained(folder)
    build_tokenizer(folder)
    return folder


def _args(classifier: Path, tmp_path: Path, out: str, **overrides: Any) -> TrainingArgs:
    fields: dict[str, Any] = dict(
        model_path=classifier,
        train_stream=Numbers(),
        ckpt_output_dir=tmp_path / out,
        effective_batch_size=4,
        per_device_batch_size=2,
        learning_rate=5e-3,
        lr_scheduler="constant",
        max_steps=6,
        save_strategy="steps",
        save_steps=3,
        disable_tqdm=True,
        seed=3,
    )
    fields.update(overrides)
    return split_run(**fields)


def _train(args: TrainingArgs) -> Any:
    components = build_run(*as_run(args), DistributedEnv())
    assert isinstance(components.step, ModelLoss)
    assert isinstance(components.train_batches, StreamBatches)
    return TrainingLoop(as_run(args).args, DistributedEnv(), [ScheduleCallback()], components).run()


def test_a_stream_trains_max_steps_and_a_resumed_run_reaches_the_same_weights(classifier, tmp_path):
    whole = _train(_args(classifier, tmp_path, "whole"))
    assert whole.global_step == 6
    cut = _train(_args(classifier, tmp_path, "cut", max_steps=3))
    assert cut.global_step == 3
    resumed = _train(_args(classifier, tmp_path, "cut", resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-3")))
    assert resumed.global_step == 6
    a = load_file(tmp_path / "whole" / "checkpoint-6" / "model.safetensors")
    b = load_file(tmp_path / "cut" / "checkpoint-6" / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


def test_a_stream_without_max_steps_is_refused_before_launch(classifier, tmp_path):
    with pytest.raises(ValueError, match="max_steps: a streaming train_stream"):
        _args(classifier, tmp_path, "out", max_steps=None)


def test_a_datasets_stream_over_local_files_trains_max_steps(classifier, tmp_path):
    import json

    import datasets

    rows = tmp_path / "stream.jsonl"
    rows.write_text("".join(json.dumps({k: v for k, v in item.items() if k != "idx"}) + "\n" for item in Numbers(64)))
    stream = datasets.load_dataset("json", data_files=str(rows), split="train", streaming=True)
    assert isinstance(stream, datasets.IterableDataset)
    result = _train(_args(classifier, tmp_path, "hf", train_stream=stream, max_steps=4, save_strategy="no"))
    assert result.global_step == 4


class ShortStream(Numbers):
    """``Numbers`` of ``count`` items that records each ``set_epoch``."""

    def __init__(self, count: int) -> None:
        super().__init__(count)
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


class EpochsAndLogs(ScheduleCallback):
    def __init__(self) -> None:
        super().__init__()
        self.step_epochs: list[tuple[int, float]] = []
        self.epoch_ends = 0

    def on_step_end(self, context: Any, **kwargs: Any) -> None:
        self.step_epochs.append((context.global_step, round(context.epoch, 4)))
        super().on_step_end(context, **kwargs)

    def on_epoch_end(self, context: Any, **kwargs: Any) -> None:
        self.epoch_ends += 1
        super().on_epoch_end(context, **kwargs)


def test_a_stream_shorter_than_max_steps_is_iterated_again_each_epoch_as_trainer_does(classifier, tmp_path):
    stream = ShortStream(10)  # 4 items a step: 2 steps a pass, its last 2 items carried into the next pass
    args = _args(classifier, tmp_path, "short", train_stream=stream, max_steps=5, save_strategy="no")
    recorder = EpochsAndLogs()
    components = build_run(*as_run(args), DistributedEnv())
    result = TrainingLoop(as_run(args).args, DistributedEnv(), [recorder], components).run()
    assert result.global_step == 5 and not result.stopped_early
    assert stream.epochs == [0, 0, 1, 1, 2, 2]  # twice a pass, as under Trainer
    # Trainer's epoch over a stream: epoch + steps taken in it / max_steps
    assert recorder.step_epochs == [(1, 0.2), (2, 0.4), (3, 1.2), (4, 1.4), (5, 2.2)]
    assert recorder.epoch_ends == 3


def test_a_resumed_run_skips_what_was_consumed_across_passes(classifier, tmp_path):
    def args(out: str, **overrides: Any) -> TrainingArgs:
        return _args(classifier, tmp_path, out, train_stream=ShortStream(10), **overrides)

    whole = _train(args("whole", max_steps=5, save_steps=5))
    _train(args("cut", max_steps=3, save_steps=3))  # checkpoint-3: epoch 1, one step into its pass
    resumed = _train(
        args("cut", max_steps=5, save_steps=5, resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-3"))
    )
    assert whole.global_step == resumed.global_step == 5
    a = load_file(tmp_path / "whole" / "checkpoint-5" / "model.safetensors")
    b = load_file(tmp_path / "cut" / "checkpoint-5" / "model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)


def test_a_stream_with_no_full_step_ends_the_run_at_once(classifier, tmp_path):
    # one micro-batch a pass, where a step takes two: trained and carried, never an optimizer step (Trainer's
    # would go on pass after pass)
    args = _args(classifier, tmp_path, "empty", train_stream=ShortStream(2), max_steps=4, save_strategy="no")
    result = _train(args)
    assert result.global_step == 0 and result.stopped_early
    assert "ran out" in (result.stop_reason or "")


def test_data_path_is_required_without_a_stream(classifier, tmp_path):
    with pytest.raises(ValueError, match="data_path: the training data is required"):
        _args(classifier, tmp_path, "out", train_stream=None)


def test_the_facade_needs_max_steps_for_a_stream_and_hands_it_to_its_job(classifier, tmp_path):
    from transformers import TrainingArguments

    from trainbridge import Trainer
    from trainbridge.trainer import job_args

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="max_steps has to be specified"):  # as Trainer, at construction
        Trainer(
            model=model, args=TrainingArguments(output_dir=str(tmp_path), report_to="none"), train_dataset=Numbers()
        )
    stream = Numbers()
    hf = TrainingArguments(output_dir=str(tmp_path), max_steps=3, report_to="none", use_cpu=True)
    trainer = Trainer(model=model, args=hf, train_dataset=stream)
    assert trainer.run_plan().rows.items  # Trainer's sample batches of the items the stream yields
    args = RunInputs(*job_args.training_job(trainer, 2, None))
    assert args.plan.train_stream is stream and args.data_path is None and isinstance(args.plan.loss, ForwardLoss)
