"""The global step plan: token budgets, exactly-once coverage, determinism, equal micro-batch counts."""

from __future__ import annotations

import random

import pytest

from trainbridge.data import EpochPlan, StepPlan, plan_epoch, steps_per_epoch

MAX_BATCH_LEN = 64


def make_dataset(count: int, seed: int = 0) -> tuple[list[int], list[int]]:
    rng = random.Random(seed)
    lengths = [rng.randint(1, 40) for _ in range(count)]
    loss_tokens = [rng.randint(0, length - 1) if length > 1 else 0 for length in lengths]
    return lengths, loss_tokens


def plan(
    lengths: list[int],
    loss_tokens: list[int],
    *,
    world_size: int,
    padded: bool,
    epoch: int = 0,
    seed: int = 7,
    effective_batch_size: int = 16,
    shuffle: bool = True,
) -> EpochPlan:
    return plan_epoch(
        lengths,
        loss_tokens,
        effective_batch_size=effective_batch_size,
        world_size=world_size,
        max_batch_len=MAX_BATCH_LEN,
        seed=seed,
        epoch=epoch,
        padded=padded,
        shuffle=shuffle,
    )


def micro_batch_cost(micro: tuple[int, ...], lengths: list[int], padded: bool) -> int:
    if not micro:
        return 0
    if padded:
        return len(micro) * max(lengths[i] for i in micro)
    return sum(lengths[i] for i in micro)


@pytest.mark.parametrize("padded", [False, True], ids=["padding_free", "padded"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_plan_invariants(world_size: int, padded: bool) -> None:
    lengths, loss_tokens = make_dataset(101)
    epoch_plan = plan(lengths, loss_tokens, world_size=world_size, padded=padded)

    assert epoch_plan.epoch == 0
    assert len(epoch_plan.steps) == steps_per_epoch(101, 16) == 7
    seen: list[int] = []
    for step in epoch_plan.steps:
        assert isinstance(step, StepPlan)
        assert step.world_size == world_size
        # every rank runs the same number of micro-batches; padding is at the end
        counts = {len(rank) for rank in step.micro_batches}
        assert counts == {step.micro_batches_per_rank}
        for rank in step.micro_batches:
            real = [micro for micro in rank if micro]
            assert list(rank[: len(real)]) == real
            for micro in rank:
                assert micro_batch_cost(micro, lengths, padded) <= MAX_BATCH_LEN
        indices = step.sample_indices()
        assert step.num_samples == len(indices)
        assert step.loss_tokens == sum(loss_tokens[i] for i in indices)
        assert step.num_tokens == sum(lengths[i] for i in indices)
        seen.extend(indices)
    # every sample exactly once per epoch, across all ranks and steps
    assert sorted(seen) == list(range(101))
    assert [step.num_samples for step in epoch_plan.steps] == [16] * 6 + [5]
    assert epoch_plan.num_samples == 101


@pytest.mark.parametrize("padded", [False, True], ids=["padding_free", "padded"])
def test_budget_is_used_not_one_sample_per_micro_batch(padded: bool) -> None:
    lengths = [8] * 32
    epoch_plan = plan(lengths, [7] * 32, world_size=2, padded=padded, effective_batch_size=32)
    (step,) = epoch_plan.steps
    # 16 samples of 8 tokens per rank, 64-token budget: 8 per micro-batch, 2 micro-batches
    assert step.micro_batches_per_rank == 2
    assert all(len(micro) == 8 for rank in step.micro_batches for micro in rank)


def test_padded_budget_counts_the_longest_row() -> None:
    lengths = [40, 10, 10, 10]
    (step,) = plan(lengths, [1] * 4, world_size=1, padded=True, effective_batch_size=4).steps
    assert step.micro_batches == (((0,), (1, 2, 3)),)
    (step,) = plan(lengths, [1] * 4, world_size=1, padded=False, effective_batch_size=4).steps
    assert step.micro_batches == (((0, 1, 2), (3,)),)


def test_ranks_are_balanced_by_tokens() -> None:
    lengths = [30, 20, 10, 10, 10, 5, 5, 5, 5]
    (step,) = plan(lengths, [1] * 9, world_size=3, padded=False, effective_batch_size=9).steps
    rank_tokens = [sum(lengths[i] for micro in rank for i in micro) for rank in step.micro_batches]
    assert sorted(rank_tokens) == [30, 35, 35]


def test_same_seed_and_epoch_give_identical_plans() -> None:
    lengths, loss_tokens = make_dataset(60)
    first = plan(lengths, loss_tokens, world_size=2, padded=False, epoch=3)
    assert first == plan(lengths, loss_tokens, world_size=2, padded=False, epoch=3)
    other_epoch = plan(lengths, loss_tokens, world_size=2, padded=False, epoch=4)
    other_seed = plan(lengths, loss_tokens, world_size=2, padded=False, epoch=3, seed=8)
    step_sets = [[set(step.sample_indices()) for step in p.steps] for p in (first, other_epoch, other_seed)]
    assert step_sets[0] != step_sets[1]
    assert step_sets[0] != step_sets[2]


def test_no_shuffle_keeps_file_order_per_step() -> None:
    lengths, loss_tokens = make_dataset(20)
    epoch_plan = plan(lengths, loss_tokens, world_size=2, padded=True, shuffle=False, effective_batch_size=8)
    assert [sorted(step.sample_indices()) for step in epoch_plan.steps] == [
        list(range(0, 8)),
        list(range(8, 16)),
        list(range(16, 20)),
    ]


def test_step_smaller_than_world_gives_dummy_micro_batches() -> None:
    lengths = [5, 6, 7, 8, 9]
    epoch_plan = plan(lengths, [1] * 5, world_size=3, padded=False, effective_batch_size=4, shuffle=False)
    last = epoch_plan.steps[-1]
    assert last.num_samples == 1
    assert last.micro_batches_per_rank == 1
    assert sorted(last.micro_batches) == [((),), ((),), ((4,),)]


def test_resume_skips_steps_by_slicing() -> None:
    lengths, loss_tokens = make_dataset(50)
    full = plan(lengths, loss_tokens, world_size=2, padded=False, epoch=1)
    resumed = plan(lengths, loss_tokens, world_size=2, padded=False, epoch=1).steps[2:]
    assert resumed == full.steps[2:]


def test_steps_per_epoch() -> None:
    assert steps_per_epoch(16, 8) == 2
    assert steps_per_epoch(17, 8) == 3
    assert steps_per_epoch(3, 8) == 1
    with pytest.raises(ValueError, match="effective_batch_size"):
        steps_per_epoch(3, 0)


def test_sample_longer_than_budget_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"sample 1 has 65 tokens, more than max_batch_len=64"):
        plan([10, 65, 3], [1, 1, 1], world_size=1, padded=False)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 0}, "world_size must be positive"),
        ({"effective_batch_size": 0}, "effective_batch_size must be positive"),
    ],
)
def test_invalid_arguments(kwargs: dict[str, int], message: str) -> None:
    arguments = {"world_size": 1, "padded": False, **kwargs}
    with pytest.raises(ValueError, match=message):
        plan([1, 2], [0, 1], **arguments)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="2 lengths but 1 loss_tokens"):
        plan([1, 2], [0], world_size=1, padded=False)
