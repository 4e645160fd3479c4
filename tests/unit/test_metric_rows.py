"""``step.metric_rows.MetricRows``: a step's metric sums declared once by name, read back by name."""

from __future__ import annotations

import pytest
import torch

from trainbridge.loop.step_values import StepSums, agreed_sums, with_metrics
from trainbridge.step.metric_rows import MetricRows


def test_rows_travel_by_name_through_the_agreement_row_and_back() -> None:
    rows = MetricRows(("pairs", "rewards/chosen"))
    cpu = torch.device("cpu")
    rows.record({"rewards/chosen": torch.tensor(0.5), "pairs": 2.0}, cpu)  # any order: by name
    rows.record({"pairs": 3.0, "rewards/chosen": torch.tensor(-1.0)}, cpu)
    sums = rows.sums()
    assert list(sums) == ["0/pairs", "0/rewards/chosen", "1/pairs", "1/rewards/chosen"] and rows.sums() == {}
    agreed = with_metrics(StepSums(1.0, 7.0, 0.0), sums)  # the loop's agreement row: its sums, then the step's
    loop, named = agreed_sums(tuple(2 * float(v) for v in agreed), sums)  # two ranks with equal values
    assert loop == StepSums(2.0, 14.0, 0.0)
    rows.add(named)
    assert rows.take() == [{"pairs": 4.0, "rewards/chosen": 1.0}, {"pairs": 6.0, "rewards/chosen": -2.0}]
    assert rows.take() == []


def test_a_row_must_have_the_declared_columns() -> None:
    rows = MetricRows(("pairs", "ranks"))
    with pytest.raises(KeyError, match=r"columns \['pairs'\] given, \['pairs', 'ranks'\] declared"):
        rows.record({"pairs": 1.0}, torch.device("cpu"))
    with pytest.raises(ValueError, match="3 sums are not rows of 2 columns"):
        rows.rows_of({"0/pairs": 1.0, "0/ranks": 1.0, "1/pairs": 1.0})
