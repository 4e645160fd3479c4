"""Sample sources: what the plans and loaders read samples from.

A ``SampleSource`` exposes two integer columns -- ``lengths`` and ``loss_tokens`` (numpy) -- from which
the step plans are built, and fetches the samples of one micro-batch on demand (``fetch``).  Nothing
holds every sample as Python objects:

* ``ArrowSamples``: the tokenised cache, a memory-mapped Arrow table (``data.cache``); every rank maps
  the same files, so the page cache holds the data once per machine, whatever the number of ranks;
* ``InMemorySamples``: a list of ``Sample``s (tests, small programmatic data).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np

from trainbridge.data.dataset import Sample

if TYPE_CHECKING:
    import pyarrow as pa


@runtime_checkable
class SampleSource(Protocol):
    """Samples by index: their lengths and loss-token counts as arrays, their tokens on demand."""

    @property
    def lengths(self) -> np.ndarray:
        """Tokens of each sample (int64)."""
        ...

    @property
    def loss_tokens(self) -> np.ndarray:
        """Loss tokens of each sample (int64; see ``Sample.loss_tokens``)."""
        ...

    def __len__(self) -> int: ...

    def fetch(self, indices: Sequence[int]) -> list[Sample]:
        """The samples at ``indices``, in that order."""
        ...

    def subset(self, indices: np.ndarray) -> SampleSource:
        """The samples at ``indices`` as a new source (sample ``k`` of it is ``indices[k]`` here)."""
        ...


class _LengthColumns:
    """The two integer columns every source keeps: ``lengths`` and ``loss_tokens``, one entry a sample."""

    def __init__(self, lengths: np.ndarray, loss_tokens: np.ndarray):
        self._lengths = np.asarray(lengths, dtype=np.int64)
        self._loss = np.asarray(loss_tokens, dtype=np.int64)

    @property
    def lengths(self) -> np.ndarray:
        return self._lengths

    @property
    def loss_tokens(self) -> np.ndarray:
        return self._loss

    def __len__(self) -> int:
        return len(self._lengths)


class InMemorySamples(_LengthColumns):
    """A ``SampleSource`` over a sequence of ``Sample``s."""

    def __init__(self, samples: Sequence[Sample]):
        self.samples = samples
        super().__init__(
            np.fromiter((s.length for s in samples), dtype=np.int64, count=len(samples)),
            np.fromiter((s.loss_tokens for s in samples), dtype=np.int64, count=len(samples)),
        )

    def __getitem__(self, index: int) -> Sample:
        return self.samples[index]

    def fetch(self, indices: Sequence[int]) -> list[Sample]:
        return [self.samples[i] for i in indices]

    def subset(self, indices: np.ndarray) -> InMemorySamples:
        return InMemorySamples([self.samples[int(i)] for i in indices])


class ArrowSamples(_LengthColumns):
    """A ``SampleSource`` over rows ``rows`` of an Arrow table with ``input_ids``/``labels`` list columns.

    ``lengths``/``loss_tokens`` are given (read once from the table's columns); ``fetch`` takes the
    micro-batch's rows from the (memory-mapped) table, so only those samples become Python objects.
    """

    def __init__(self, table: pa.Table, rows: np.ndarray, lengths: np.ndarray, loss_tokens: np.ndarray):
        if not len(rows) == len(lengths) == len(loss_tokens):
            raise ValueError(f"{len(rows)} rows, {len(lengths)} lengths, {len(loss_tokens)} loss_tokens")
        self.table = table
        self.rows = np.asarray(rows, dtype=np.int64)
        super().__init__(lengths, loss_tokens)

    def __getitem__(self, index: int) -> Sample:
        return self.fetch([index])[0]

    def fetch(self, indices: Sequence[int]) -> list[Sample]:
        import pyarrow as pa

        if len(indices) == 0:
            return []
        taken = self.table.take(pa.array(self.rows[np.asarray(indices, dtype=np.int64)]))
        input_ids = taken.column("input_ids").to_pylist()
        labels = taken.column("labels").to_pylist()
        return [Sample(tuple(ids), tuple(lab)) for ids, lab in zip(input_ids, labels)]

    def subset(self, indices: np.ndarray) -> ArrowSamples:
        indices = np.asarray(indices, dtype=np.int64)
        return ArrowSamples(self.table, self.rows[indices], self._lengths[indices], self._loss[indices])


def as_source(samples: SampleSource | Sequence[Sample]) -> SampleSource:
    """``samples`` as a ``SampleSource`` (a sequence of ``Sample``s is wrapped)."""
    if isinstance(samples, (InMemorySamples, ArrowSamples)):
        return samples
    if isinstance(samples, Sequence):
        return InMemorySamples(samples)
    return samples
