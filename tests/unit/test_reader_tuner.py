"""How many snapshot workers read at once (cdcd.snapshot.initial.ReaderTuner): one more while
it raises the rate by 5 %, else back to the best count, for good; and what a reader takes
(take_chunks): one for good reads the rest of a table in one COPY."""

from __future__ import annotations

import pytest

from cdcd.decoder.events import Relation
from cdcd.snapshot.initial import ReaderTuner, take_chunks
from cdcd.source.snapshot import SnapshotTable, TableChunk


@pytest.mark.parametrize(
    ("most", "rates", "counts"),
    [
        # cdcd is the limit (a 2-core host): a second reader makes it slower, back to one
        (4, [900, 780, 2000], [2, 1, 1]),
        # the server is the limit: each reader adds, up to the most configured
        (4, [300, 580, 850, 1100, 1100], [2, 3, 4, 4, 4]),
        # the third adds less than 5 %: two
        (4, [300, 580, 600, 9999], [2, 3, 2, 2]),
        # a gain measured against the best, not the last window
        (4, [500, 1000, 980, 5000], [2, 3, 2, 2]),
        # one worker configured: nothing to tune
        (1, [100, 200], [1, 1]),
    ],
)
def test_readers_follow_the_rate(most: int, rates: list[float], counts: list[int]) -> None:
    tuner = ReaderTuner(most)
    assert tuner.active == 1
    assert [tuner.observe(rate) for rate in rates] == counts
    assert tuner.settled or counts[-1] < most


def test_not_tuned_reads_with_all_at_once() -> None:
    tuner = ReaderTuner(4, tune=False)
    assert tuner.active == 4 and tuner.settled
    assert tuner.observe(1) == 4


def test_settles_at_the_most() -> None:
    tuner = ReaderTuner(2)
    assert tuner.observe(100) == 2 and not tuner.settled
    assert tuner.observe(300) == 2 and tuner.settled
    assert tuner.observe(1) == 2  # settled: a slow window later changes nothing


def _table(name: str) -> SnapshotTable:
    return SnapshotTable(Relation(None, len(name), "public", name, "d", ()), None)


def test_one_reader_for_good_reads_the_rest_of_a_table_at_once() -> None:
    a, b = _table("a"), _table("b")
    chunks = [
        TableChunk(a, None, 10),
        TableChunk(a, 10, 20),
        TableChunk(a, 20, None),
        TableChunk(b, None, None),
    ]
    # several readers (or still tuning): chunk by chunk
    assert take_chunks(chunks, 0, alone=False) == (chunks[0], 1)
    assert take_chunks(chunks, 1, alone=False) == (chunks[1], 2)
    # alone: from the chunk on to the table's end, one open range; the next table as it is
    assert take_chunks(chunks, 0, alone=True) == (TableChunk(a, None, None), 3)
    assert take_chunks(chunks, 1, alone=True) == (TableChunk(a, 10, None), 3)
    assert take_chunks(chunks, 2, alone=True) == (chunks[2], 3)
    assert take_chunks(chunks, 3, alone=True) == (chunks[3], 4)
