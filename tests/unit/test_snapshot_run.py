"""A snapshot's batch of rows as a SnapshotRun: the same events as ``snapshot_events``, and its
``jsonl()`` (one call of cdcd._rowjson.snapshot_lines) the same bytes as their records.

The rows are generated as in test_rowjson.py (every column type of the C fast paths, values
around their edges, null, binary and unchanged-TOAST columns), on tables with and without a
key, so a record written by the batch path that differs from the event's own fails here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdcd.accel import pure_python_requested
from cdcd.decoder.events import Column, Relation, TupleData
from cdcd.events.snapshot_run import SnapshotRun
from cdcd.sinks.file import FileSinkConfig
from cdcd.sinks.file_layout import JsonlTableWriter
from cdcd.values import types as vtypes
from tests.unit.sink_fixtures import encoder, relation, tup
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
    made = encoder().snapshot_run(rel, rows, **args).jsonl()
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
