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

from trainbridge.data.types import Sample

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

    ``lengths``/``loss_tokens`` are given (the cache stores them as a memory-mapped index, so opening a
    million-sample cache reads no column); ``fetch`` slices the micro-batch's rows out of the
    (memory-mapped) table's flat value buffers, so only those samples become Python objects and a fetch
    costs the same whatever the size of the table (``Table.take`` on a chunked list column concatenates
    the chunks first, which would read the whole column for every micro-batch).
    """

    def __init__(self, table: pa.Table, rows: np.ndarray, lengths: np.ndarray, loss_tokens: np.ndarray):
        if not len(rows) == len(lengths) == len(loss_tokens):
            raise ValueError(f"{len(rows)} rows, {len(lengths)} lengths, {len(loss_tokens)} loss_tokens")
        self.table = table
        self.rows = np.asarray(rows, dtype=np.int64)
        self._chunks = _ChunkedLists(table)
        super().__init__(lengths, loss_tokens)

    def __getitem__(self, index: int) -> Sample:
        return self.fetch([index])[0]

    def fetch(self, indices: Sequence[int]) -> list[Sample]:
        rows = self.rows[np.asarray(indices, dtype=np.int64)] if len(indices) else ()
        return [self._chunks.sample(int(row)) for row in rows]

    def subset(self, indices: np.ndarray) -> ArrowSamples:
        indices = np.asarray(indices, dtype=np.int64)
        subset = ArrowSamples.__new__(ArrowSamples)
        subset.table, subset.rows, subset._chunks = self.table, self.rows[indices], self._chunks
        _LengthColumns.__init__(subset, self._lengths[indices], self._loss[indices])
        return subset


class _ChunkedLists:
    """Row ``i`` of a table's ``input_ids``/``labels`` (and ``seq_lengths``, where the table has it) list
    columns, read from the chunks' flat buffers.

    A chunk's offsets and values become numpy views (no copy: the pages stay the memory map's) the first
    time one of its rows is read; a row is found by bisecting the chunks' first-row numbers.
    """

    COLUMNS = ("input_ids", "labels", "seq_lengths")

    def __init__(self, table: pa.Table):
        columns = [table.column(name) for name in self.COLUMNS if name in table.column_names]
        sizes = [len(chunk) for chunk in columns[0].chunks]
        if any([len(c) for c in column.chunks] != sizes for column in columns[1:]):  # not as the cache writes
            table = table.combine_chunks()
            columns = [table.column(name) for name in self.COLUMNS if name in table.column_names]
            sizes = [len(chunk) for chunk in columns[0].chunks]
        self._columns = columns
        self._starts = np.cumsum([0, *sizes], dtype=np.int64)
        self._views: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}

    def _view(self, chunk: int) -> list[tuple[np.ndarray, np.ndarray]]:
        views = self._views.get(chunk)
        if views is None:
            views = []
            for column in self._columns:
                array = column.chunk(chunk)
                views.append((_numpy_view(array.offsets), _numpy_view(array.values)))
            self._views[chunk] = views
        return views

    def sample(self, row: int) -> Sample:
        """Table row ``row`` as a ``Sample`` (an empty ``seq_lengths`` is one sequence)."""
        chunk = int(np.searchsorted(self._starts, row, side="right")) - 1
        local = row - int(self._starts[chunk])
        ids, labels, *seq_lengths = (
            tuple(values[offsets[local] : offsets[local + 1]].tolist()) for offsets, values in self._view(chunk)
        )
        return Sample(ids, labels, seq_lengths[0] if seq_lengths and len(seq_lengths[0]) > 1 else None)


def _numpy_view(array: pa.Array) -> np.ndarray:
    """An integer Arrow array (no nulls) as a numpy view of its data buffer (``Array.to_numpy`` would import
    pandas, a second of start-up)."""
    dtype = np.dtype(f"int{array.type.bit_width}")
    return np.frombuffer(array.buffers()[1], dtype=dtype)[array.offset : array.offset + len(array)]


def as_source(samples: SampleSource | Sequence[Sample]) -> SampleSource:
    """``samples`` as a ``SampleSource`` (a sequence of ``Sample``s is wrapped)."""
    if isinstance(samples, (InMemorySamples, ArrowSamples)):
        return samples
    if isinstance(samples, Sequence):
        return InMemorySamples(samples)
    return samples
