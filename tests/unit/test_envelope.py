"""The envelope (cdcd.events.envelope): the constant pieces derived from the value's spec, the
Python template and the compiled one, against ``orjson.dumps`` of the value the spec builds.

Events of every kind against :meth:`ChangeEvent.value` are tests/unit/test_encoding_fast_paths.py
(on whichever path is in use), snapshot batches tests/unit/test_snapshot_run.py, and rows
rendered on arrival tests/integration/test_rendered_streams.py.
"""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdcd._purepy import c_module
from cdcd.events.envelope import (
    HEAD_TAIL,
    ROW,
    row_body,
    row_value,
    sequence,
    source_block,
    source_fixed,
    source_head,
    transaction_block,
)

ROWJSON = c_module("cdcd._rowjson")

U64 = st.integers(0, 2**64 - 1)
I63 = st.integers(0, 2**63 - 2)
JSON_ROW = st.none() | st.dictionaries(
    st.text(max_size=4), st.none() | st.integers(-(2**63), 2**63 - 1) | st.text(max_size=6)
)
NAME = st.text(max_size=6)


def test_the_pieces_are_the_documented_envelope() -> None:
    """docs/events.md, as the spec yields it: a change here is a change of the contract."""
    assert b"".join(ROW) == (
        b'{"before":,"after":,"source":"lsn":,"sequence":"[null,\\",'
        b'"sequence":"[\\"\\",\\"\\"]","xmin":null,"commit_lsn":,"seq":},"op":"","ts_ms":'
        b',"transaction":null,"transaction":{"id":"","total_order":,"data_collection_order":}'
        b',"key":}'
    )
    assert HEAD_TAIL == b',"ts_ms":%d,"ts_us":%d,"snapshot":%s,"txId":%s,'


@st.composite
def bodies(draw: st.DrawFn) -> tuple[tuple[object, ...], bytes]:
    """row_body's arguments and the record the spec's dict serialises to."""
    before, after, key = draw(JSON_ROW), draw(JSON_ROW), draw(JSON_ROW)
    name, db, schema, table = (draw(NAME) for _ in range(4))
    ts_ms, ts_us, lsn, commit_lsn, seq = (draw(I63) for _ in range(5))
    dco = draw(U64)
    prev = draw(st.none() | U64)
    xid = draw(st.none() | st.integers(0, 2**32 - 1))
    snapshot = draw(st.sampled_from(["false", "true", "last", "reset"]))
    origin = draw(st.none() | NAME)
    op = draw(st.sampled_from(["c", "u", "d", "r"]))
    txid = None if xid is None else f"{xid}:{commit_lsn}"
    fixed = source_fixed(name, db, schema, table)
    head = orjson.dumps(fixed)[:-1] + HEAD_TAIL % (
        ts_ms,
        ts_us,
        orjson.dumps(snapshot),
        b"null" if xid is None else b"%d" % xid,
    )
    extra = b"" if origin is None else b',"origin":' + orjson.dumps(origin)
    source = source_block(
        source_head(fixed, ts_ms, ts_us, snapshot, xid, origin),
        lsn,
        sequence(prev, lsn),
        commit_lsn,
        seq,
    )
    txn = None if txid is None else transaction_block(txid, seq + 1, dco)
    record = orjson.dumps({**row_value(before, after, source, op, ts_ms, txn), "key": key})
    args = (
        orjson.dumps(before), orjson.dumps(after), head, lsn, prev, commit_lsn, seq, extra, op,
        ts_ms, txid, dco,
    )  # fmt: skip
    return args, record


@settings(max_examples=300, deadline=None)
@given(case=bodies())
def test_the_template_writes_what_the_spec_serialises(
    case: tuple[tuple[object, ...], bytes],
) -> None:
    args, record = case
    key = record[record.rindex(b',"key":') + len(b',"key":') : -1]
    assert row_body(*args, None) + b"}" == record[: record.rindex(b',"key":')] + b"}"  # type: ignore[arg-type]
    assert row_body(*args, key) == record  # type: ignore[arg-type]


@pytest.mark.skipif(ROWJSON is None, reason="cdcd._rowjson is not in use (CDCD_PURE_PYTHON)")
@settings(max_examples=300, deadline=None)
@given(case=bodies())
def test_the_compiled_writer_splices_the_same_pieces(
    case: tuple[tuple[object, ...], bytes],
) -> None:
    args, record = case
    key = record[record.rindex(b',"key":') + len(b',"key":') : -1]
    assert ROWJSON.event_body(*args, key, ROW) == record
    assert ROWJSON.event_body(*args, None, ROW) == row_body(*args, None)  # type: ignore[arg-type]


@pytest.mark.skipif(ROWJSON is None, reason="cdcd._rowjson is not in use (CDCD_PURE_PYTHON)")
def test_the_compiled_writer_takes_only_the_pieces() -> None:
    """Other pieces, other bytes: nothing of the envelope is written in C."""
    marked = ROW._replace(op=b"|OP|", txn_none=b"|NOTXN|")
    body = ROWJSON.event_body(
        b"null", b"{}", b"{", 1, None, 2, 0, b"", "c", 3, None, 1, None, marked
    )
    assert b"|OP|c" in body and body.endswith(b"|NOTXN|")
    with pytest.raises(TypeError, match="pieces"):
        ROWJSON.event_body(b"null", b"{}", b"{", 1, None, 2, 0, b"", "c", 3, None, 1, None, ())
