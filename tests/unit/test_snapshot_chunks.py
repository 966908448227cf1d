"""Pure parts of the parallel initial snapshot: COPY text rows parsed into TupleData
(cdcd.source.copy.copy_rows) and the read-ahead bound between the workers and the writer
(cdcd.snapshot.initial._Chunks)."""

from __future__ import annotations

import asyncio
import random

import pytest

from cdcd.decoder.events import KIND_NULL, KIND_TEXT, Column, Relation, TupleData
from cdcd.snapshot.initial import _Chunks
from cdcd.source.copy import copy_rows
from cdcd.source.snapshot import SnapshotTable, TableChunk, chunk_query


def test_copy_rows_unescapes_and_reads_nulls() -> None:
    lines = [
        b"1\tplain\t\\N",
        b"2\ttab\\there\\\\back\\nline\\rcr\t",
        b"3\t\\b\\f\\v\t\\\\N",  # the text "\N", not a null
    ]
    rows = copy_rows(lines, 3)
    assert rows[0].values == (b"1", b"plain", None)
    assert rows[0].kinds == bytes((KIND_TEXT, KIND_TEXT, KIND_NULL))
    assert rows[1].values == (b"2", b"tab\there\\back\nline\rcr", b"")
    assert rows[1].kinds == bytes([KIND_TEXT] * 3)
    assert rows[2].values == (b"3", b"\b\f\v", b"\\N")


def test_copy_rows_rejects_a_row_of_another_width() -> None:
    with pytest.raises(ValueError, match="2 fields, expected 3"):
        copy_rows([b"1\t2"], 3)


def test_chunk_query_ranges() -> None:
    rel = Relation(None, 1, "public", "T", "d", (Column(1, "id", 23, -1), Column(0, "v", 25, -1)))
    table = SnapshotTable(rel, "id > 5")
    assert chunk_query(TableChunk(table, None, None)) == (
        'SELECT "id", "v" FROM "public"."T" WHERE (id > 5)'
    )
    assert chunk_query(TableChunk(table, 10, 20)) == (
        'SELECT "id", "v" FROM "public"."T" WHERE ctid >= \'(10,0)\'::tid '
        "AND ctid < '(20,0)'::tid AND (id > 5)"
    )
    assert "ctid >=" not in (chunk_query(TableChunk(table, None, 20)) or "")
    empty = SnapshotTable(Relation(None, 2, "public", "e", "d", ()), None)
    assert chunk_query(TableChunk(empty, None, None)) is None


def _rows(n: int) -> list[TupleData]:
    return [TupleData(bytes([KIND_TEXT]), (b"x" * 100,)) for _ in range(n)]


async def test_read_ahead_stays_within_the_limit_and_never_blocks_the_writer() -> None:
    batch = 1000  # accounted bytes of a batch
    chunks = _Chunks(12, limit=3 * batch, most=100)
    rng = random.Random(1)
    peak = 0
    written: list[int] = []
    next_chunk = 0

    async def worker(delay: float) -> None:
        nonlocal next_chunk, peak
        while next_chunk < 12:  # chunks taken in order, as the snapshot's workers do
            index = next_chunk
            next_chunk += 1
            for _ in range(5):
                await chunks.put(index, _rows(10), batch)
                peak = max(peak, chunks.held)
                await asyncio.sleep(rng.random() * delay)
            await chunks.finish(index)

    async def writer() -> None:
        for index in range(12):
            while await chunks.take(index) is not None:
                written.append(index)
                await asyncio.sleep(rng.random() / 500)  # slower than the readers

    await asyncio.wait_for(
        asyncio.gather(worker(0.0), worker(1 / 2000), worker(1 / 1000), writer()), timeout=20
    )
    assert written == sorted(written) and len(written) == 60
    assert 3 * batch <= peak <= 4 * batch  # read ahead to the limit, plus the writer's batch


async def test_read_ahead_stays_within_a_number_of_batches() -> None:
    chunks = _Chunks(3, limit=10**9, most=2)
    await chunks.put(1, _rows(1), 100)
    await chunks.put(2, _rows(1), 100)
    third = asyncio.ensure_future(chunks.put(2, _rows(1), 100))
    await asyncio.sleep(0.01)
    assert not third.done()  # two batches wait already
    await chunks.put(0, _rows(1), 100)  # the writer's chunk: one batch always gets through
    assert await chunks.take(0) is not None
    await chunks.finish(0)
    assert await chunks.take(0) is None
    assert await chunks.take(1) is not None  # room again
    await asyncio.wait_for(third, 1)


async def test_rows_of_a_finished_chunk_fail_rather_than_vanish() -> None:
    """A chunk finished while a reader still had rows for it (the writer may have gone past):
    an error, never rows silently lost (the snapshot is not recorded done, so it is taken
    again)."""
    queue = _Chunks(2, 1 << 20, 8)
    await queue.put(0, _rows(1), 10)
    await queue.finish(0)
    with pytest.raises(RuntimeError, match="chunk 0: rows read after it was finished"):
        await queue.put(0, _rows(1), 10)
