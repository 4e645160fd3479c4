"""Control requests and their agreement on a single rank (the 2-rank case is in tests/distributed)."""

from trainbridge.core.control import ControlFlag, ControlRequests, agree_control
from trainbridge.core.distributed import DistributedEnv


def test_agreement_names_requesters_sums_extras_and_clears():
    requests = ControlRequests()
    requests.request(ControlFlag.SAVE, 2, "every 10 samples")
    requests.request(ControlFlag.STOP_TRAINING, 1)
    requests.request(ControlFlag.STOP_TRAINING, 2)  # first requester wins on a rank
    agreed, sums = agree_control(DistributedEnv(), requests, ["loop", "A", "B"], extras=[1.5, 4.0])
    assert agreed.flags == {ControlFlag.SAVE, ControlFlag.STOP_TRAINING}
    assert agreed.stop_training
    assert agreed.describe(ControlFlag.SAVE) == "rank 0 (B)"
    assert agreed.describe(ControlFlag.STOP_TRAINING) == "rank 0 (A)"
    assert sums == [1.5, 4.0]
    assert not requests.pending


def test_no_requests_agree_on_nothing():
    agreed, sums = agree_control(DistributedEnv(), ControlRequests(), ["loop"])
    assert not agreed.flags and sums == []
    assert not agreed.stop_training


def test_abort_counts_as_stop():
    requests = ControlRequests()
    requests.request(ControlFlag.ABORT, 0)
    agreed, _ = agree_control(DistributedEnv(), requests, ["loop"])
    assert agreed.stop_training
