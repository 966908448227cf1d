"""Pure parts of the parallel initial snapshot: COPY text rows parsed into TupleData
(cdcd.source.copy.copy_rows), the read-ahead bound between the workers and the writer
(cdcd.snapshot.initial._Chunks), key-range chunks, and the progress recorded for a resume
(cdcd.snapshot.initial_progress)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from cdcd.decoder.copy_batch import CopyBatch
from cdcd.decoder.events import KIND_NULL, KIND_TEXT, Column, Relation, TupleData
from cdcd.snapshot.initial import _Chunks, take_chunks
from cdcd.snapshot.initial_progress import InitialProgress, key_indexes
from cdcd.source.copy import copy_rows
from cdcd.source.snapshot import SnapshotState, SnapshotTable, TableChunk, chunk_query


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


def test_chunk_query_key_ranges_in_key_order() -> None:
    rel = Relation(None, 1, "public", "T", "d", (Column(1, "id", 23, -1), Column(0, "v", 25, -1)))
    keys = (("id", "integer"), ("v", "text"))
    table = SnapshotTable(rel, None)
    assert chunk_query(TableChunk(table, None, None, keys)) == (
        'SELECT "id", "v" FROM "public"."T" ORDER BY "id", "v"'
    )
    assert chunk_query(TableChunk(table, None, None, keys, ["1", "a'b"], ["9", "z"])) == (
        'SELECT "id", "v" FROM "public"."T" WHERE ("id", "v") > (\'1\'::integer, '
        "'a''b'::text) AND (\"id\", \"v\") <= ('9'::integer, 'z'::text) ORDER BY \"id\", \"v\""
    )


def test_one_reader_merges_the_rest_of_a_table_into_one_key_range() -> None:
    rel = Relation(None, 1, "public", "t", "d", (Column(1, "id", 23, -1),))
    table, other = SnapshotTable(rel, None), SnapshotTable(rel, "id > 0")
    keys = (("id", "integer"),)
    chunks = [
        TableChunk(table, None, None, keys, None, ["10"]),
        TableChunk(table, None, None, keys, ["10"], ["20"]),
        TableChunk(table, None, None, keys, ["20"], None),
        TableChunk(other, None, None, keys, None, None),
    ]
    assert take_chunks(chunks, 1, alone=False) == (chunks[1], 2)
    merged, after = take_chunks(chunks, 1, alone=True)
    assert after == 3 and (merged.after, merged.upto, merged.keys) == (["10"], None, keys)


def _batch(*lines: bytes) -> CopyBatch:
    return CopyBatch(b"\n".join(lines), len(lines), 3)


def test_progress_records_the_last_key_handed_and_bounds_what_is_not_durable() -> None:
    # public.a is read in key order (key: columns 2 then 0), public.k has no key
    progress = InitialProgress(
        {"public.a": key_indexes(["x", "v", "y"], [("y", "int"), ("x", "int")])}, 10
    )
    progress.hand("public.k", _batch(b"1\t2\t3", b"4\t5\t6"))
    progress.finish("public.k")
    assert not progress.due()
    progress.hand("public.a", _batch(b"1\tv\t7", b"2\tw\\tx\t7"))
    progress.hand("public.a", _batch(b"3\tv\t8"))
    assert progress.due() and not progress.must_wait()  # 5 of every 10 rows
    handed, entries = progress.take()
    assert handed == 5
    assert entries == {
        "public.k": {"status": "done", "rows": 2},
        "public.a": {"status": "running", "last_key": ["8", "3"], "rows": 3},
    }
    assert not progress.due()
    progress.hand("public.a", _batch(*[b"%d\tv\t9" % i for i in range(4, 9)]))
    assert progress.must_wait()  # 10 handed, none durable yet: the writer waits
    progress.recorded(handed)
    assert not progress.must_wait() and progress.due()
    handed, entries = progress.take()
    assert entries["public.a"] == {"status": "running", "last_key": ["9", "8"], "rows": 8}
    progress.finish("public.a")
    assert progress.take()[1]["public.a"] == {"status": "done", "rows": 8}


def test_snapshot_state_records_progress(tmp_path: Path) -> None:
    state = SnapshotState(tmp_path, "s")
    assert state.recorded() is None
    state.start(100)
    assert state.running() and state.recorded() is None  # no progress: taken again
    state.progress(100, {"public.a": {"status": "running", "last_key": ["5"], "rows": 5}})
    assert state.running()
    assert state.recorded() == (
        100,
        {"public.a": {"status": "running", "last_key": ["5"], "rows": 5}},
    )
    state.finish(100)
    assert not state.running() and state.recorded() is None
