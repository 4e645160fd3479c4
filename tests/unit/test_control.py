"""Control requests and their agreement on a single rank (the 2-rank case is in tests/distributed)."""

from typing import NamedTuple

from trainbridge.core.agreement import ControlFlag, ControlRequests, NoValues, agree_control
from trainbridge.core.distributed import DistributedEnv


class Sums(NamedTuple):
    loss: float
    tokens: float


class Own(NamedTuple):
    grad_norm: float


def test_agreement_names_requesters_sums_extras_and_clears():
    requests = ControlRequests()
    requests.request(ControlFlag.SAVE, 2, "every 10 samples")
    requests.request(ControlFlag.STOP_TRAINING, 1)
    requests.request(ControlFlag.STOP_TRAINING, 2)  # first requester wins on a rank
    agreement = agree_control(DistributedEnv(), requests, ["loop", "A", "B"], summed=Sums(1.5, 4.0), own=Own(0.5))
    agreed = agreement.control
    assert agreed.flags == {ControlFlag.SAVE, ControlFlag.STOP_TRAINING}
    assert agreed.stop_training
    assert agreed.describe(ControlFlag.SAVE) == "rank 0 (B)"
    assert agreed.describe(ControlFlag.STOP_TRAINING) == "rank 0 (A)"
    assert agreement.summed == Sums(loss=1.5, tokens=4.0) and agreement.own.grad_norm == 0.5
    assert not requests.pending


def test_no_requests_agree_on_nothing():
    agreement = agree_control(DistributedEnv(), ControlRequests(), ["loop"])
    agreed = agreement.control
    assert not agreed.flags and agreement.summed == NoValues() and agreement.own == NoValues()
    assert not agreed.stop_training


def test_abort_counts_as_stop():
    requests = ControlRequests()
    requests.request(ControlFlag.ABORT, 0)
    assert agree_control(DistributedEnv(), requests, ["loop"]).control.stop_training
