"""``MetricRows``: a step's logged values per micro-batch (or validation batch), declared once by column name.

A step records one row per batch by name (``record``); ``sums`` hands this rank's rows to the reduction over
ranks (the step's agreement, or the evaluation's) keyed ``"<row>/<column>"``; ``rows_of`` reads the reduced
values back as rows of named values, and ``add``/``take`` keep the training rows until the next log.  trl's
DPO, KTO and ORPO/CPO steps and the token step share it (trl keys its ``_metrics`` by name too).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

MetricValue = torch.Tensor | float


class MetricRows:
    """Rows of named sums, one per batch (see the module doc)."""

    def __init__(self, columns: Sequence[str]) -> None:
        self.columns = tuple(columns)
        self._local: list[torch.Tensor] = []
        self.agreed: list[dict[str, float]] = []
        """Rows reduced over every rank and not logged yet (``add``, ``take``)."""

    def record(self, values: Mapping[str, MetricValue], device: torch.device) -> None:
        """One batch's row on this rank (0-dim tensors stay on ``device``, unread until the reduction)."""
        if set(values) != set(self.columns):
            raise KeyError(f"metric row: columns {sorted(values)} given, {list(self.columns)} declared")
        self._local.append(
            torch.stack([_tensor(values[column]).detach().to(device, torch.float64) for column in self.columns])
        )

    def record_zeros(self, device: torch.device) -> None:
        """A row that counts as nothing (a rank's dummy validation batch)."""
        self._local.append(torch.zeros(len(self.columns), dtype=torch.float64, device=device))

    def drop_last(self) -> None:
        """Forget the row just recorded."""
        self._local.pop()

    def sums(self, read: bool = False) -> dict[str, MetricValue]:
        """This rank's rows by ``"<row>/<column>"`` (``read``: as floats, in one device read), then forgotten."""
        rows, self._local = self._local, []
        if not rows:
            return {}
        values: list[MetricValue] = list(torch.stack(rows).flatten().tolist() if read else torch.cat(rows).unbind())
        width = len(self.columns)
        return {f"{i // width}/{self.columns[i % width]}": value for i, value in enumerate(values)}

    def rows_of(self, sums: Mapping[str, float]) -> list[dict[str, float]]:
        """``sums`` (``sums``' names, reduced over ranks) as rows of named values."""
        count, rest = divmod(len(sums), len(self.columns))
        if rest:
            raise ValueError(f"metric rows: {len(sums)} sums are not rows of {len(self.columns)} columns")
        return [{column: float(sums[f"{i}/{column}"]) for column in self.columns} for i in range(count)]

    def add(self, sums: Mapping[str, float]) -> None:
        """The rows of a step's agreement (``rows_of``), kept until ``take``."""
        self.agreed += self.rows_of(sums)

    def take(self) -> list[dict[str, float]]:
        """The agreed rows since the last ``take``."""
        rows, self.agreed = self.agreed, []
        return rows


def _tensor(value: MetricValue) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else torch.tensor(float(value))


class RecordsMetricRows:
    """A step (``TrainStep`` subclass, listed before it in the bases) whose training metrics are the rows of
    ``self.metrics``: its sums go to the step's agreement and come back by name."""

    metrics: MetricRows

    def metric_sums(self) -> dict[str, MetricValue]:
        return self.metrics.sums()

    def add_metric_sums(self, sums: Mapping[str, float]) -> None:
        self.metrics.add(sums)
