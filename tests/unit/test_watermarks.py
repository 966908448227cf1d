"""The reader's side of incremental snapshots (cdcd.snapshot.watermarks): which rows of a
chunk survive its window, what replaces the high watermark, what is dropped."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cdcd.assembler.transaction import ChangeRecord, Transaction
from cdcd.decoder.copy_batch import CopyBatch
from cdcd.decoder.copy_text import copy_rows
from cdcd.decoder.events import (
    KIND_NULL,
    KIND_TEXT,
    Column,
    Delete,
    Insert,
    Message,
    Relation,
    Truncate,
    TupleData,
    Update,
)
from cdcd.snapshot.watermarks import (
    _C_COPY_KEPT,
    SIGNAL,
    WATERMARK,
    Chunk,
    Watermarks,
    _kept,
    kept_lines,
    marker,
    parse_snapshot,
    visible,
)

REL = Relation(None, 42, "public", "t", "d", (Column(0, "v", 25, -1), Column(1, "id", 23, -1)))
OTHER = Relation(None, 43, "public", "u", "d", (Column(1, "id", 23, -1),))


#: a read snapshot that sees every transaction of these tests (their xids are below 1000)
SEES_ALL = parse_snapshot("1000:1000:")


def row(key: int, value: str = "x") -> TupleData:
    return TupleData(bytes((KIND_TEXT, KIND_TEXT)), (value.encode(), str(key).encode()))


def key_image(key: int) -> TupleData:
    return TupleData(bytes((KIND_NULL, KIND_TEXT)), (None, str(key).encode()))


def txn(lsn: int, *records: ChangeRecord) -> Transaction:
    return Transaction(
        kind="regular",
        xid=lsn,
        commit_lsn=lsn,
        end_lsn=lsn + 8,
        commit_time=0,
        size=len(records),
        _records=list(records),
    )


def mark(lsn: int, prefix: str, payload: dict[str, object]) -> Transaction:
    message = Message(lsn, True, lsn, prefix, json.dumps(payload).encode())
    return txn(lsn, ChangeRecord(lsn, message, ()))


def change(lsn: int, c: object, rel: Relation = REL) -> Transaction:
    return txn(lsn, ChangeRecord(lsn, c, (rel,)))  # type: ignore[arg-type]


def fill(chunk: Chunk, rows: list[TupleData]) -> None:
    """The chunk's rows read (as the snapshot sets them before its high watermark)."""
    chunk.rows = [rows]
    chunk.count = len(rows)


def feed(marks: Watermarks, t: Transaction) -> Transaction | None:
    return marks.observe(t, marker(t))


@pytest.mark.parametrize("as_text", [False, True], ids=["rows", "copy_text"])
async def test_rows_changed_in_the_window_are_dropped(as_text: bool) -> None:
    """Rows still in COPY's text are dropped by their key columns alone, and stay text."""
    marks = Watermarks(lambda tables, lsn: None)
    chunk = Chunk("c1", REL, ("id",))
    marks.arm(chunk)
    before = change(50, Update(None, 42, None, None, row(1, "before")))
    assert feed(marks, before) is before  # before the low watermark: not noted
    assert feed(marks, mark(100, WATERMARK, {"id": "c1", "mark": "low"})) is None
    assert marks.window_open
    if as_text:  # two batches as read with COPY (v, id): not parsed until asked
        text = [b"\n".join(b"x\t%d" % k for k in keys) for keys in ((1, 2, 3), (4, 5, 6, 7))]
        chunk.rows = [CopyBatch(text[0], 3, 2), CopyBatch(text[1], 4, 2)]
        chunk.count = 7
    else:
        fill(chunk, [row(k) for k in range(1, 8)])
    chunk.snapshot = SEES_ALL  # the change before the low watermark was read
    inside = [
        change(110, Update(None, 42, None, None, row(2, "new"))),
        change(120, Delete(None, 42, "K", key_image(3))),
        change(130, Update(None, 42, "K", key_image(4), row(40))),  # key change 4 -> 40
        change(140, Insert(None, 42, row(5, "again"))),
        change(150, Delete(None, 43, "K", TupleData(bytes((KIND_TEXT,)), (b"6",))), OTHER),
    ]
    for t in inside:
        assert feed(marks, t) is t  # changes always go on to the sinks
    out = feed(marks, mark(200, WATERMARK, {"id": "c1", "mark": "high"}))
    assert out is not None and out.kind == "snapshot"
    assert (out.commit_lsn, out.end_lsn) == (200, 208)  # the high watermark's position
    if as_text:  # still text: the JSON Lines writer renders it without parsing
        assert out.rows is not None
        assert all(isinstance(b, CopyBatch) and not b.parsed for b in out.rows[1])
    kept = [int(r.change.new.values[1]) for r in out.changes()]  # type: ignore[union-attr]
    assert kept == [1, 6, 7]  # 2..5 changed in the window; 6 was another table's
    assert out.rows is not None and out.size == 3
    batches = out.rows[1]
    assert [int(r.values[1]) for batch in batches for r in batch] == kept  # what the writer takes
    assert chunk.done.result().emitted == 3 and chunk.done.result().dropped == 4
    assert not marks.window_open
    after = change(210, Delete(None, 42, "K", key_image(1)))
    assert feed(marks, after) is after


async def test_a_truncate_in_the_window_makes_the_chunk_read_again() -> None:
    marks = Watermarks(lambda tables, lsn: None)
    chunk = Chunk("c1", REL, ("id",))
    marks.arm(chunk)
    feed(marks, mark(100, WATERMARK, {"id": "c1", "mark": "low"}))
    fill(chunk, [row(1)])
    feed(marks, change(110, Truncate(None, 0, (42,))))
    assert feed(marks, mark(200, WATERMARK, {"id": "c1", "mark": "high"})) is None
    assert chunk.done.result().retry


async def test_an_abandoned_chunk_is_read_again_and_its_watermarks_ignored() -> None:
    """A recreated slot may never carry the chunk's watermarks: the chunk is given up."""
    marks = Watermarks(lambda tables, lsn: None)
    chunk = Chunk("c1", REL, ("id",))
    marks.arm(chunk)
    feed(marks, mark(100, WATERMARK, {"id": "c1", "mark": "low"}))
    fill(chunk, [row(1)])
    marks.abandon()
    assert chunk.done.result().retry and not marks.window_open
    assert feed(marks, mark(200, WATERMARK, {"id": "c1", "mark": "high"})) is None
    marks.abandon()  # nothing in flight: nothing happens


async def test_stale_watermarks_and_signals_never_reach_the_sinks() -> None:
    asked: list[tuple[bytes, int]] = []
    marks = Watermarks(lambda content, lsn: asked.append((content, lsn)))
    assert feed(marks, mark(100, WATERMARK, {"id": "old", "mark": "high"})) is None
    chunk = Chunk("c2", REL, ("id",))
    marks.arm(chunk)
    assert feed(marks, mark(110, WATERMARK, {"id": "old", "mark": "low"})) is None
    assert not chunk.opened  # another chunk's watermark opens nothing
    assert feed(marks, mark(120, SIGNAL, {"tables": ["public.t"]})) is None
    # handed on unchecked, whatever it holds (cdcd.snapshot.signals checks it)
    assert asked == [(b'{"tables": ["public.t"]}', 128)]
    # a user's own message is published as usual
    own = mark(140, "app", {"x": 1})
    assert marker(own) is None and feed(marks, own) is own


async def test_overlapping_windows_of_chunks_read_at_once() -> None:
    """``snapshot.workers``: two chunks between their watermarks at once, each its own window."""
    marks = Watermarks(lambda tables, lsn: None)
    first, second = Chunk("a", REL, ("id",)), Chunk("b", REL, ("id",))
    marks.arm(first)
    marks.arm(second)
    feed(marks, mark(100, WATERMARK, {"id": "a", "mark": "low"}))
    feed(marks, change(105, Update(None, 42, None, None, row(1, "x"))))  # a's window only
    feed(marks, mark(110, WATERMARK, {"id": "b", "mark": "low"}))
    fill(first, [row(1), row(2)])
    fill(second, [row(1), row(11), row(12)])
    first.snapshot = second.snapshot = SEES_ALL
    feed(marks, change(115, Delete(None, 42, "K", key_image(11))))  # both windows
    out_a = feed(marks, mark(120, WATERMARK, {"id": "a", "mark": "high"}))
    assert out_a is not None and out_a.commit_lsn == 120
    assert [int(r.change.new.values[1]) for r in out_a.changes()] == [2]  # type: ignore[union-attr]
    assert marks.window_open  # b's is still open
    feed(marks, change(125, Update(None, 42, None, None, row(12, "y"))))  # b's window only
    out_b = feed(marks, mark(130, WATERMARK, {"id": "b", "mark": "high"}))
    assert out_b is not None and out_b.commit_lsn == 130
    # 1 was changed before b's window opened: b keeps it (its image is newer than the change)
    assert [int(r.change.new.values[1]) for r in out_b.changes()] == [1]  # type: ignore[union-attr]
    assert not marks.window_open


def txn_of(xid: int, lsn: int, c: object) -> Transaction:
    t = change(lsn, c)
    t.xid = xid
    return t


async def test_a_change_committed_before_the_window_but_not_read_is_dropped() -> None:
    """Commit order is not visibility order: a transaction whose commit precedes the low
    watermark may be invisible to the chunk's read; its keys are dropped from the chunk."""
    marks = Watermarks(lambda tables, lsn: None)
    chunk = Chunk("c1", REL, ("id",))
    marks.arm(chunk)
    assert marks.window_open  # armed: transactions are observed from now on
    feed(marks, txn_of(90, 50, Update(None, 42, None, None, row(1, "unseen"))))  # in progress
    feed(marks, txn_of(80, 60, Update(None, 42, None, None, row(2, "seen"))))  # seen by the read
    feed(marks, mark(100, WATERMARK, {"id": "c1", "mark": "low"}))
    chunk.snapshot = parse_snapshot("4294967375:4294967392:4294967386")  # epoch 1, xip 90
    fill(chunk, [row(1), row(2), row(3)])
    out = feed(marks, mark(200, WATERMARK, {"id": "c1", "mark": "high"}))
    assert out is not None
    assert [int(r.change.new.values[1]) for r in out.changes()] == [2, 3]  # type: ignore[union-attr]


def test_snapshot_visibility_in_32_bit_xid_order() -> None:
    snap = parse_snapshot("100:110:103,105")
    assert snap == (100, 110, frozenset({103, 105}))
    assert visible(snap, 99) and visible(snap, 104) and visible(snap, 109)
    assert not visible(snap, 103) and not visible(snap, 110) and not visible(snap, 200)
    wrapped = parse_snapshot(f"{2**32 - 5}:{2**32 + 5}:{2**32 + 1}")  # across the wraparound
    assert visible(wrapped, 2**32 - 6) and visible(wrapped, 2**32 - 1) and visible(wrapped, 3)
    assert not visible(wrapped, 1) and not visible(wrapped, 5) and not visible(wrapped, 6)


async def test_a_clean_window_keeps_the_batches_as_read() -> None:
    """No change in the window: the rows go on in the batches they were read in, not looked
    at; a key with COPY's escapes (a backslash) is compared by its value."""
    rel = Relation(None, 44, "public", "k", "d", (Column(1, "id", 25, -1), Column(0, "v", 25, -1)))
    marks = Watermarks(lambda tables, lsn: None)
    chunk = Chunk("c1", rel, ("id",))
    marks.arm(chunk)
    feed(marks, mark(100, WATERMARK, {"id": "c1", "mark": "low"}))
    batch = CopyBatch(b"a\\\\b\tx\nc\ty", 2, 2)  # keys a\b (escaped in COPY) and c
    chunk.rows, chunk.count, chunk.snapshot = [batch], 2, SEES_ALL
    out = feed(marks, mark(200, WATERMARK, {"id": "c1", "mark": "high"}))
    assert out is not None and out.rows is not None and out.rows[1][0] is batch
    assert not batch.parsed

    chunk = Chunk("c2", rel, ("id",))
    marks.arm(chunk)
    feed(marks, mark(300, WATERMARK, {"id": "c2", "mark": "low"}))
    image = TupleData(bytes((KIND_TEXT, KIND_TEXT)), (b"a\\b", b"z"))
    feed(marks, change(310, Update(None, 44, None, None, image), rel))
    batch = CopyBatch(b"a\\\\b\tx\nc\ty", 2, 2)
    chunk.rows, chunk.count, chunk.snapshot = [batch], 2, SEES_ALL
    out = feed(marks, mark(400, WATERMARK, {"id": "c2", "mark": "high"}))
    assert out is not None
    assert [r.change.new.values for r in out.changes()] == [(b"c", b"y")]  # type: ignore[union-attr]


@given(
    keys=st.lists(
        st.text("ab\\\t\n", min_size=1, max_size=4), unique=True, min_size=1, max_size=12
    ),
    picks=st.lists(st.integers(0, 11), max_size=6),
)
def test_copy_text_is_filtered_as_its_parsed_rows(keys: list[str], picks: list[int]) -> None:
    """Keys compared in COPY's text (escapes included) drop the same rows as parsed rows."""
    rel = Relation(None, 44, "public", "k", "d", (Column(0, "v", 25, -1), Column(1, "id", 25, -1)))
    escape = {"\\": "\\\\", "\t": "\\t", "\n": "\\n"}
    lines = [f"v{i}\t{''.join(escape.get(c, c) for c in k)}".encode() for i, k in enumerate(keys)]
    changed = {(keys[i].encode(),) for i in picks if i < len(keys)}
    loop = asyncio.new_event_loop()
    chunk = Chunk("c", rel, ("id",), done=loop.create_future())  # a chunk needs a loop
    loop.close()
    parsed = copy_rows(lines, 2)
    by_text = _kept(chunk, CopyBatch(b"\n".join(lines), len(lines), 2), changed)
    assert list(by_text) == _kept(chunk, parsed, changed)
    assert [r.values[1].decode() for r in by_text] == [  # type: ignore[union-attr]
        k for k in keys if (k.encode(),) not in changed
    ]


needs_c = pytest.mark.skipif(_C_COPY_KEPT is None, reason="cdcd._rowjson is not in use")
_FIELD = st.one_of(st.just("\\N"), st.text("ab\\\t\n1", max_size=3))


def _copy_text(rows: list[list[str]]) -> bytes:
    escape = {"\\": "\\\\", "\t": "\\t", "\n": "\\n"}
    return "\n".join(
        "\t".join(f if f == "\\N" else "".join(escape.get(c, c) for c in f) for f in r)
        for r in rows
    ).encode()


@needs_c
@given(
    rows=st.lists(st.lists(_FIELD, min_size=3, max_size=3), min_size=1, max_size=10),
    positions=st.sampled_from([(0,), (2,), (1, 0), (0, 2), (2, 1, 0)]),
    picks=st.lists(st.integers(0, 9), max_size=5),
    extra=st.lists(st.tuples(st.sampled_from([b"a", b"1", b"a\tb"])), max_size=2),
    mangle=st.sampled_from(["", "short", "long", "raw"]),
)
def test_the_compiled_key_check_keeps_what_its_twin_keeps(
    rows: list[list[str]],
    positions: tuple[int, ...],
    picks: list[int],
    extra: list[tuple[bytes]],
    mangle: str,
) -> None:
    """cdcd._rowjson.copy_kept against kept_lines, its pure-Python twin: the same lines kept
    (escapes, null keys, several key columns in any order), the same text object when all are
    kept, and where a line has fewer fields the twin's error."""
    text = _copy_text(rows)
    if mangle == "short":  # a line with too few fields
        text += b"\nonly"
    elif mangle == "long":  # an extra field, and a backslash in the key
        text += b"\na\\\\\tb\tc\td"
    elif mangle == "raw":  # a trailing backslash, an unknown escape
        text += b"\nx\\\ty\\q\tz"
    parsed = copy_rows(text.split(b"\n")[: len(rows)], 3)
    changed: set[Any] = set(extra)
    for i in picks:
        if i < len(parsed) and all(parsed[i].values[p] is not None for p in positions):
            changed.add(tuple(parsed[i].values[p] for p in positions))
    try:
        expected = kept_lines(text, 3, positions, changed)
    except ValueError:
        assert _C_COPY_KEPT(text, 3, positions, changed) is None
        return
    got = _C_COPY_KEPT(text, 3, positions, changed)
    assert got == expected
    assert (got[0] is text) == (expected[0] is text)
