"""agree_control across 2 real gloo processes: any rank asks, every rank acts, in one collective."""

import pytest
import torch.distributed as dist

from tests.distributed.conftest import run_on_ranks
from trainbridge.core.control import ControlFlag, ControlRequests, agree_control

pytestmark = pytest.mark.distributed


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
        agreed, sums = agree_control(env, requests, ["loop", "Saver", "Stopper"], extras=[env.rank + 1.0, 10.0])
    finally:
        dist.all_reduce = original
    return sorted(f.value for f in agreed.flags), agreed.describe(ControlFlag.STOP_TRAINING), \
        agreed.describe(ControlFlag.SAVE), sums, len(calls)


def test_request_on_one_rank_is_agreed_by_both_in_one_collective():
    results = run_on_ranks(_one_rank_requests)
    assert results[0] == results[1]
    flags, stopper, saver, sums, collectives = results[0]
    assert flags == ["save", "stop_training"]
    assert stopper == "rank 1 (Stopper)"
    assert saver == "rank 0 (Saver)"
    assert sums == [3.0, 20.0]
    assert collectives == 1
