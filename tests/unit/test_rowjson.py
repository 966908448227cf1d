"""cdcd._rowjson (hand-written C) writes exactly what the general Python path writes.

``RowDecoder.row_json(tup)`` must equal ``orjson.dumps(RowDecoder.decode(tup))`` for every row,
raise the same error where ``decode`` raises, and be None for a row with unchanged TOAST; the
same for ``columns_json`` against the dict of a few columns. The values are generated around
each fast path's edges (integers with signs and leading zeros, text that is not UTF-8 or holds
control characters, timestamps in every form PostgreSQL prints), so a fast path that takes a
value it should have left to the converter fails here.
"""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdcd.accel import pure_python_requested
from cdcd.decoder.events import Column, Relation, TupleData
from cdcd.errors import RemoteProtocolError
from cdcd.values import types as vtypes
from cdcd.values.types import RowDecoder, TypeRegistry, json_prefixes

# oid: int2, int4, int8, oid, xid8, bool, text, varchar, name, json, jsonb, uuid, numeric, date,
# timestamptz, timestamp, float8, float4, bytea, interval, an unknown type
OIDS = (21, 23, 20, 26, 5069, 16, 25, 1043, 19, 114, 3802, 2950, 1700, 1082, 1184, 1114, 701,
        700, 17, 1186, 99999)  # fmt: skip

DIGITS = st.text("0123456789", min_size=0, max_size=22)
INTEGER_TEXT = st.one_of(
    st.integers(-(2**63), 2**63 - 1).map(str),
    st.integers(0, 2**70).map(str),
    st.tuples(st.sampled_from(["", "-", "+", " ", "0", "-0", "00"]), DIGITS).map("".join),
    st.sampled_from(["0", "-0", "007", "1_000", "", "-", " 1", "1 ", "9" * 18, "9" * 19, "9" * 20]),
)
TEXT = st.one_of(
    st.text(max_size=12),
    st.text(st.characters(max_codepoint=0x7F), max_size=12),
    st.sampled_from(['"', "\\", "\x00", "\x1f", "\x7f", "é", "\u2028", "a\tb\nc\r\x08\x0c"]),
)
RAW = st.one_of(
    st.binary(max_size=12),
    st.sampled_from([b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82"]),
)
FLOAT_TEXT = st.one_of(
    st.floats().map(repr),
    st.floats(allow_nan=False, allow_infinity=False).map(lambda x: f"{x:.17g}"),
    st.floats(-1e16, 1e16).map(lambda x: f"{x:.6f}"),
    st.tuples(
        st.sampled_from(["", "-", "+"]),
        st.text("0123456789", min_size=0, max_size=17),
        st.sampled_from(["", "."]),
        st.text("0123456789", min_size=0, max_size=17),
        st.sampled_from(["", "e5", "e-05", " "]),
    ).map("".join),
    st.sampled_from(
        [
            "NaN",
            "Infinity",
            "-Infinity",
            "-0",
            "0.00001",
            "0.000001",
            "1e-05",
            "123456789012345",
            "1234567890123456",
            "0.123456789012345",
            "0.1234567890123456",
            "100",
            "100.000",
            ".5",
            "5.",
        ]
    ),
)
TIMESTAMP_TEXT = st.one_of(
    st.tuples(
        st.integers(1, 12000).map(lambda y: f"{y:04d}"),
        st.sampled_from(["-01-02", "-12-31"]),
        st.sampled_from([" ", "T", ""]),
        st.sampled_from(["03:04:05", "00:00:00", "23:59:59"]),
        st.sampled_from(["", ".5", ".123456", ".1"]),
        st.sampled_from(["", "+00", "+05:30", "-08", "+00:00", "+0"]),
        st.sampled_from(["", " BC"]),
    ).map("".join),
    st.sampled_from(["infinity", "-infinity", "", "+00", "x-00+00", "2024-01-01 00:00:00+00 "]),
)


def _text_for(oid: int) -> st.SearchStrategy[bytes]:
    if oid in (21, 23, 20, 26, 5069):
        return INTEGER_TEXT.map(str.encode)
    if oid == 16:
        return st.sampled_from([b"t", b"f", b"", b"true", b"T"])
    if oid in (1184, 1114):
        return st.one_of(TIMESTAMP_TEXT.map(str.encode), RAW)
    if oid in (700, 701):
        return st.one_of(FLOAT_TEXT.map(str.encode), RAW)
    return st.one_of(TEXT.map(str.encode), RAW)


def draw_tuple(draw: st.DrawFn, oids: list[int], kinds_from: bytes = b"tttttnbu") -> TupleData:
    """A row of columns of these types, each of a kind drawn from ``kinds_from``."""
    kinds = bytearray()
    values: list[bytes | None] = []
    for oid in oids:
        kind = draw(st.sampled_from(kinds_from))
        kinds.append(kind)
        if kind in b"nu":
            values.append(None)
        elif kind == ord("b"):
            values.append(draw(st.binary(max_size=16)))
        else:
            values.append(draw(_text_for(oid)))
    return TupleData(bytes(kinds), tuple(values))


@st.composite
def rows(draw: st.DrawFn) -> tuple[Relation, TupleData]:
    oids = draw(st.lists(st.sampled_from(OIDS), min_size=0, max_size=6))
    columns = tuple(Column(0, f'c{i}"{oid}', oid, -1) for i, oid in enumerate(oids))
    relation = Relation(None, 16400, "public", "t", "d", columns)
    return relation, draw_tuple(draw, oids)


def _expected(dec: RowDecoder, tup: TupleData) -> bytes | type[Exception]:
    try:
        return orjson.dumps(dec.decode(tup))
    except RemoteProtocolError:
        return RemoteProtocolError
    except orjson.JSONEncodeError:  # an integer orjson cannot write (beyond 64 bits)
        return orjson.JSONEncodeError


def _actual(call: object) -> bytes | type[Exception] | None:
    try:
        return call()  # type: ignore[operator, no-any-return]
    except RemoteProtocolError:
        return RemoteProtocolError
    except orjson.JSONEncodeError:
        return orjson.JSONEncodeError


def test_the_c_module_is_in_use_where_cdcd_is_compiled() -> None:
    from cdcd import accel

    if pure_python_requested() or not all(accel.status().values()):
        pytest.skip("cdcd runs its pure-Python form here (the C module is not in use)")
    assert vtypes._c_row_json is not None


needs_c = pytest.mark.skipif(vtypes._c_row_json is None, reason="cdcd._rowjson is not in use")


@needs_c
@settings(max_examples=1500, deadline=None)
@given(row=rows())
def test_row_json_equals_the_dict_path(row: tuple[Relation, TupleData]) -> None:
    relation, tup = row
    dec = RowDecoder(relation, TypeRegistry(), "json")
    expected = None if b"u" in tup.kinds else _expected(dec, tup)
    assert _actual(lambda: dec.row_json(tup)) == expected


@needs_c
@settings(max_examples=500, deadline=None)
@given(row=rows(), data=st.data())
def test_columns_json_equals_the_dict_of_those_columns(
    row: tuple[Relation, TupleData], data: st.DataObject
) -> None:
    relation, tup = row
    dec = RowDecoder(relation, TypeRegistry(), "json")
    idx = (
        tuple(data.draw(st.lists(st.integers(0, len(tup) - 1), max_size=3, unique=True)))
        if len(tup)
        else ()
    )
    names = tuple(dec.names[i] for i in idx)
    actual = _actual(lambda: dec.columns_json(tup, idx, json_prefixes(names)))
    if any(tup.kinds[i] == ord("u") for i in idx):
        assert actual is None  # unchanged TOAST: the caller fills it in
        return
    try:
        row_dict = dec.decode(tup)
    except RemoteProtocolError:
        # decode converts every column; of a few, only theirs can fail
        assert actual in (RemoteProtocolError, orjson.JSONEncodeError) or isinstance(actual, bytes)
        return
    try:
        expected: object = orjson.dumps({name: row_dict[name] for name in names})
    except orjson.JSONEncodeError:
        expected = orjson.JSONEncodeError
    assert actual == expected


@needs_c
def test_unchanged_toast_and_other_shapes_go_to_the_general_path() -> None:
    relation = Relation(
        None, 1, "public", "t", "d", (Column(1, "id", 23, -1), Column(0, "b", 25, -1))
    )
    dec = RowDecoder(relation, TypeRegistry(), "json")
    assert dec.row_json(TupleData(b"tu", (b"1", None))) is None
    assert dec.columns_json(TupleData(b"tu", (b"1", None)), (0,), json_prefixes(("id",))) == (
        b'{"id":1}'
    )  # the key column is there: only the selected columns matter
    assert dec.row_json(TupleData(b"t", (b"1",))) is None  # not this relation's shape
    assert (
        RowDecoder(relation, TypeRegistry(), "native").row_json(TupleData(b"tt", (b"1", b"x")))
        is None
    )


@needs_c
def test_a_value_that_cannot_convert_is_named_as_decode_names_it() -> None:
    relation = Relation(
        None, 1, "public", "t", "d", (Column(1, "id", 23, -1), Column(0, "b", 25, -1))
    )
    dec = RowDecoder(relation, TypeRegistry(), "json")
    with pytest.raises(RemoteProtocolError, match=r"column 'b' of public\.t"):
        dec.row_json(TupleData(b"tt", (b"1", b"\xff")))
    with pytest.raises(RemoteProtocolError, match=r"column 'id' of public\.t"):
        dec.row_json(TupleData(b"tt", (b"x1", b"ok")))


@needs_c
@settings(max_examples=3000, deadline=None)
@given(text=FLOAT_TEXT, oid=st.sampled_from([700, 701]))
def test_a_float_is_written_as_orjson_writes_it(text: str, oid: int) -> None:
    """The float fast path copies digits only where they are the double's shortest form in
    orjson's fixed notation (at most 15 significant digits, 1e-5 <= |x| < 1e15)."""
    relation = Relation(None, 1, "public", "t", "d", (Column(0, "x", oid, -1),))
    dec = RowDecoder(relation, TypeRegistry(), "json")
    tup = TupleData(b"t", (text.encode(),))
    assert _actual(lambda: dec.row_json(tup)) == _expected(dec, tup)


@needs_c
@pytest.mark.parametrize(
    "text",
    ["0.00001", "0.000001", "0.10000000000000001", "0.30000000000000004", "123456789012345",
     "1234567890123456", "-0", "-0.000", "100", "100.50", "00.5", "5.", ".5", "1e-05"],
)  # fmt: skip
def test_float_edges(text: str) -> None:
    test_a_float_is_written_as_orjson_writes_it.hypothesis.inner_test(text, 701)  # type: ignore[attr-defined]
