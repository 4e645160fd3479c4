"""agree_control across 2 real gloo processes: any rank asks, every rank acts, in one collective."""

from typing import NamedTuple

import pytest
import torch.distributed as dist

from tests.distributed.conftest import run_on_ranks
from trainbridge.core.agreement import ControlFlag, ControlRequests, agree_control

pytestmark = pytest.mark.distributed


class Sums(NamedTuple):
    rank_plus_one: float
    ten: float


class Own(NamedTuple):
    twice_rank: float


def _one_rank_requests(env):
    calls = []
    original = dist.all_reduce

    def counting(*a, **k):
        calls.append(1)
        return original(*a, **k)

    dist.all_reduce = counting
    try:
        requests = ControlRequests()
        if env.rank == 1:
            requests.request(ControlFlag.STOP_TRAINING, 2, "rank 1 only")
        if env.rank == 0:
            requests.request(ControlFlag.SAVE, 1)
        agreement = agree_control(
            env, requests, ["loop", "Saver", "Stopper"], summed=Sums(env.rank + 1.0, 10.0), own=Own(env.rank * 2.0)
        )
        agreed, sums, own = agreement.control, list(agreement.summed), agreement.own.twice_rank
    finally:
        dist.all_reduce = original
    return (
        sorted(f.value for f in agreed.flags),
        agreed.describe(ControlFlag.STOP_TRAINING),
        agreed.describe(ControlFlag.SAVE),
        sums,
        len(calls),
        own,
    )


def test_request_on_one_rank_is_agreed_by_both_in_one_collective():
    results = run_on_ranks(_one_rank_requests)
    assert results[0][:-1] == results[1][:-1]
    flags, stopper, saver, sums, collectives, _ = results[0]
    assert flags == ["save", "stop_training"]
    assert stopper == "rank 1 (Stopper)"
    assert saver == "rank 0 (Saver)"
    assert sums == [3.0, 20.0]
    assert [r[-1] for r in results] == [0.0, 2.0]  # own values stay each rank's
    assert collectives == 1
