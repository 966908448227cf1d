"""A snapshot's batch of rows as a SnapshotRun: the same events as ``snapshot_events``, and its
``jsonl()`` (one call of cdcd._rowjson.snapshot_lines) the same bytes as their records.

The rows are generated as in test_rowjson.py (every column type of the C fast paths, values
around their edges, null, binary and unchanged-TOAST columns), on tables with and without a
key, so a record written by the batch path that differs from the event's own fails here. The
same from COPY's text (``copy_snapshot_lines``), with the values escaped as COPY writes them
and some lines no server writes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdcd.accel import pure_python_requested
from cdcd.assembler.transaction import Transaction
from cdcd.decoder.copy_batch import CopyBatch
from cdcd.decoder.copy_text import copy_rows
from cdcd.decoder.events import Column, Relation, TupleData
from cdcd.events.snapshot_run import SnapshotRun
from cdcd.sinks.file.layout import JsonlTableWriter
from cdcd.sinks.file.sink import FileSink, FileSinkConfig
from cdcd.values import types as vtypes
from tests.unit.sink_fixtures import CONTEXT, encoder, relation, tup
from tests.unit.test_rowjson import OIDS, draw_tuple

C_IN_USE = vtypes._c_snapshot_lines is not None


@st.composite
def tables(draw: st.DrawFn) -> tuple[Relation, list[TupleData], bool]:
    """A relation (its key: some of its columns, or none), rows of it, and whether a row
    should take the general path (unchanged TOAST somewhere)."""
    oids = draw(st.lists(st.sampled_from(OIDS), min_size=1, max_size=6))
    keyed = [draw(st.booleans()) for _ in oids]
    columns = tuple(
        Column(1 if k else 0, f'c{i}"{oid}', oid, -1)
        for i, (oid, k) in enumerate(zip(oids, keyed, strict=True))
    )
    rows = [
        draw_tuple(draw, oids, b"ttttttnbu" if draw(st.booleans()) else b"tttn")
        for _ in range(draw(st.integers(1, 6)))
    ]
    toast = any(ord("u") in row.kinds for row in rows)
    return Relation(None, 16400, "public", "t", "d", columns), rows, toast


def _joined(run: SnapshotRun) -> bytes | None:
    """The run's records as one piece (``jsonl()`` gives them in pieces of about 64 KiB)."""
    pieces = run.jsonl()
    return None if pieces is None else b"".join(pieces)


def _records(events: list) -> bytes | type[Exception]:
    try:
        return b"".join(e.record_json() + b"\n" for e in events)
    except Exception as exc:  # a value the event path rejects
        return type(exc)


@settings(max_examples=300, deadline=None)
@given(
    table=tables(),
    lsn=st.integers(1, 2**63 - 2),
    first=st.integers(0, 2**40),
    last=st.booleans(),
)
def test_jsonl_is_the_events_records(
    table: tuple[Relation, list[TupleData], bool], lsn: int, first: int, last: bool
) -> None:
    rel, rows, toast = table
    args = {"commit_lsn": lsn, "commit_time": first, "first_seq": first, "last": last}
    expected = _records(list(encoder().snapshot_events(rel, rows, **args)))
    made = _joined(encoder().snapshot_run(rel, rows, **args))
    if not C_IN_USE:
        assert made is None
    elif toast or not isinstance(expected, bytes):
        assert made is None  # the events' path: fills nothing in, names a failing value
    else:
        assert made == expected


def test_the_run_is_a_sequence_of_the_same_events() -> None:
    keyed = relation()
    rows = [tup(i, f"n{i}", None) for i in range(5)]
    args = {"commit_lsn": 1000, "commit_time": 7, "first_seq": 40, "last": True}
    expected = [e.record_json() for e in encoder().snapshot_events(keyed, rows, **args)]
    run = encoder().snapshot_run(keyed, rows, **args)
    assert isinstance(run, SnapshotRun)
    assert len(run) == 5
    assert run[0].record_json() == expected[0]
    assert run[-1].record_json() == expected[-1]
    assert run[-1].position == (1000, 44)
    assert [run[i].source()["snapshot"] for i in (0, 3, 4)] == ["true", "true", "last"]
    assert [e.record_json() for e in run[1:3]] == expected[1:3]
    assert [e.record_json() for e in run] == expected
    with pytest.raises(IndexError):
        run[5]
    with pytest.raises(IndexError):
        run[-6]


def test_the_file_writer_takes_the_records_without_the_events(tmp_path: Path) -> None:
    keyed = relation()
    rows = [tup(i, f"n\t{i}", "é" if i % 2 else None) for i in range(50)]
    args = {"commit_lsn": 1000, "commit_time": 7, "first_seq": 0, "last": True}
    expected = _records(list(encoder().snapshot_events(keyed, rows, **args)))
    run = encoder().snapshot_run(keyed, rows, **args)
    writer = JsonlTableWriter(tmp_path / "f.jsonl", keyed, FileSinkConfig(path=str(tmp_path)))
    writer.write(run)
    writer.finish()
    assert (tmp_path / "f.jsonl").read_bytes() == expected
    assert writer.rows == 50
    assert writer.size() == len(expected)
    if not pure_python_requested() and C_IN_USE:
        assert run._events is None  # no event was made


def test_the_file_sink_writes_a_copy_batch_without_parsing_it(tmp_path: Path) -> None:
    """Through the whole file sink (the folder asks the run for its first and last events):
    the file holds the events' records, and the COPY lines were never parsed into rows."""
    keyed = relation()
    lines = [b"%d\tn\\t%d\t\\N" % (i, i) for i in range(40)]
    args = {"commit_lsn": 1000, "commit_time": 7, "first_seq": 0, "last": True}
    expected = _records(list(encoder().snapshot_events(keyed, copy_rows(lines, 3), **args)))
    batch = CopyBatch(b"\n".join(lines), len(lines), 3)
    run = encoder().snapshot_run(keyed, batch, **args)
    sink = FileSink(FileSinkConfig(path=str(tmp_path), fsync=False), CONTEXT)

    async def go() -> None:
        await sink.start()
        txn = Transaction(
            kind="snapshot", xid=0, commit_lsn=1000, end_lsn=1001, commit_time=7, size=0
        )
        await sink.begin(txn)
        await sink.write(run)
        await sink.commit(txn)
        await sink.flush()
        await sink.close()

    asyncio.run(go())
    (written,) = [p for p in tmp_path.rglob("*.jsonl") if not p.name.startswith(".")]
    assert written.read_bytes() == expected
    if C_IN_USE:
        assert not batch.parsed


# --- from COPY's text ---------------------------------------------------------------------

_COPY_ESCAPES = {
    ord("\\"): b"\\\\",
    ord("\b"): b"\\b",
    ord("\f"): b"\\f",
    ord("\n"): b"\\n",
    ord("\r"): b"\\r",
    ord("\t"): b"\\t",
    ord("\v"): b"\\v",
}


def copy_text(value: bytes | None) -> bytes:
    """A value as COPY TO writes it in text format."""
    if value is None:
        return b"\\N"
    return b"".join(_COPY_ESCAPES.get(c, bytes([c])) for c in value)


@st.composite
def copy_tables(draw: st.DrawFn) -> tuple[Relation, list[bytes]]:
    """A relation and COPY text lines: its rows escaped as COPY writes them, or now and then
    a line as no server writes it (stray backslashes, another number of fields)."""
    oids = draw(st.lists(st.sampled_from(OIDS), min_size=1, max_size=6))
    keyed = [draw(st.booleans()) for _ in oids]
    columns = tuple(
        Column(1 if k else 0, f"c{i}", oid, -1)
        for i, (oid, k) in enumerate(zip(oids, keyed, strict=True))
    )
    lines = []
    for _ in range(draw(st.integers(1, 6))):
        if draw(st.integers(0, 9)) == 0:
            lines.append(draw(st.binary(max_size=20).map(lambda b: b.replace(b"\n", b"\\"))))
            continue
        row = draw_tuple(draw, oids, b"tttn")
        lines.append(b"\t".join(copy_text(v) for v in row.values))
    return Relation(None, 16400, "public", "t", "d", columns), lines


def _made(call: object) -> bytes | type[Exception] | None:
    try:
        return call()  # type: ignore[operator, no-any-return]
    except Exception as exc:  # the general path's error, e.g. a line of another width
        return type(exc)


@settings(max_examples=600, deadline=None)
@given(table=copy_tables(), first=st.integers(0, 2**40), last=st.booleans())
def test_jsonl_from_copy_text_is_the_events_records(
    table: tuple[Relation, list[bytes]], first: int, last: bool
) -> None:
    rel, lines = table
    args = {"commit_lsn": 5000, "commit_time": 7, "first_seq": first, "last": last}
    parsed = _made(lambda: copy_rows(lines, len(rel.columns)))
    batch = CopyBatch(b"\n".join(lines), len(lines), len(rel.columns))
    made = _joined(encoder().snapshot_run(rel, batch, **args))
    assert not batch.parsed or not C_IN_USE  # the C path parsed nothing into rows
    if not isinstance(parsed, list):  # a line of another width: the rows' parse names it
        assert made is None
        return
    expected = _records(list(encoder().snapshot_events(rel, parsed, **args)))
    if not C_IN_USE or not isinstance(expected, bytes):
        assert made is None
    else:
        assert made == expected


def test_a_copy_batch_is_its_rows() -> None:
    lines = [b"1\ta\\tb\t\\N", b"2\t\\\\x\t"]
    batch = CopyBatch(b"\n".join(lines), 2, 3)
    assert len(batch) == 2
    assert not batch.parsed
    assert batch[1] == copy_rows(lines, 3)[1]
    assert batch[-2] == copy_rows(lines, 3)[0]
    assert not batch.parsed  # one row: only its line
    assert batch[0:1] == copy_rows(lines, 3)[0:1]
    assert batch.parsed
    assert list(batch) == copy_rows(lines, 3)
    assert batch[0].values == (b"1", b"a\tb", None)


@pytest.mark.parametrize(
    "line",
    [
        b"1\tab\\\tc\\",  # a backslash that ends a field, then the last field's
        b"2\t\\N\t\\\\N",  # null, then the text \N
        b"3\t\\x\\q\t\\",  # unknown escapes: the character
        b"4\t\\b\\f\\n\\r\\t\\v\t",  # every escape; an empty last field
        b"5\t\t",
    ],
)
def test_copy_text_edges(line: bytes) -> None:
    rel = relation(columns=(("id", 23), ("a", 25), ("b", 25)))
    args = {"commit_lsn": 9, "commit_time": 7, "first_seq": 0, "last": True}
    expected = _records(list(encoder().snapshot_events(rel, copy_rows([line], 3), **args)))
    made = _joined(encoder().snapshot_run(rel, CopyBatch(line, 1, 3), **args))
    assert made == (expected if C_IN_USE else None)


@pytest.mark.skipif(not C_IN_USE, reason="cdcd._rowjson is not in use")
@pytest.mark.parametrize("from_copy", [False, True])
def test_the_records_come_in_pieces_of_about_64_kib(from_copy: bool) -> None:
    """A large batch's records are written in heap-sized pieces, a record larger than a piece
    in a piece of its own size; joined, they are the events' records."""
    rel = relation(columns=(("id", 23), ("a", 25), ("b", 25)))
    values = [
        (i, f"value {i}" * (1 + i % 7), "x" * (200_000 if i == 1500 else 3)) for i in range(3000)
    ]
    lines = [f"{i}\t{a}\t{b}".encode() for i, a, b in values]
    rows = CopyBatch(b"\n".join(lines), len(lines), 3) if from_copy else [tup(*v) for v in values]
    args = {"commit_lsn": 77, "commit_time": 7, "first_seq": 10, "last": True}
    pieces = encoder().snapshot_run(rel, rows, **args).jsonl()
    assert pieces is not None and len(pieces) > 10
    assert all(0 < len(piece) <= 64 * 1024 for piece in pieces if b"x" * 70_000 not in piece)
    assert any(len(piece) > 200_000 for piece in pieces)  # the large record, whole
    expected = _records(list(encoder().snapshot_events(rel, copy_rows(lines, 3), **args)))
    assert b"".join(pieces) == expected
