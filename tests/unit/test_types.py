"""Value conversion (cdcd.values.types): table-driven text and binary cases per type, and
Hypothesis round trips through a reference encoder of PostgreSQL's send formats.

The reference encoders below follow the ``*_send`` functions of ``src/backend/utils/adt``;
the server-side agreement of text and binary forms is checked in
tests/integration/test_types_server.py.
"""

from __future__ import annotations

import base64
import datetime as dt
import math
import re
import struct
import uuid
from decimal import Decimal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdcd.decoder.events import Column, Relation, TupleData
from cdcd.decoder.events import Type as TypeMessage
from cdcd.errors import RemoteProtocolError
from cdcd.values import binary as vb
from cdcd.values.types import (
    BINARY_FALLBACK_PREFIX,
    UNCHANGED_TOAST,
    RowDecoder,
    TypeInfo,
    TypeRegistry,
)

T, B = ord("t"), ord("b")
REG = TypeRegistry()
PG_EPOCH = dt.datetime(2000, 1, 1)


def jt(oid: int, text: bytes | str) -> Any:
    return REG.json_converter(oid, -1, T)(text.encode() if isinstance(text, str) else text)


def jb(oid: int, data: bytes) -> Any:
    return REG.json_converter(oid, -1, B)(data)


def nt(oid: int, text: bytes | str) -> Any:
    return REG.native_converter(oid, -1, T)(text.encode() if isinstance(text, str) else text)


def nb(oid: int, data: bytes) -> Any:
    return REG.native_converter(oid, -1, B)(data)


# --- reference encoders (PostgreSQL send formats) ------------------------------------------


def enc_numeric(d: Decimal | str) -> bytes:
    if isinstance(d, str):
        sign = {"NaN": 0xC000, "Infinity": 0xD000, "-Infinity": 0xF000}[d]
        return struct.pack(">hhHH", 0, 0, sign, 0)
    sign_bit, digits, exp = d.as_tuple()
    assert isinstance(exp, int)
    dscale = max(0, -exp)
    intval = int("".join(map(str, digits)) or "0")
    # value = intval * 10**exp; express in base 10000 with the point on a group boundary
    shift = (4 - (-exp) % 4) % 4 if exp < 0 else 0
    intval *= 10**shift
    exp -= shift
    if exp > 0:
        intval *= 10 ** (exp % 4)
        exp -= exp % 4
    groups: list[int] = []
    while intval:
        intval, g = divmod(intval, 10000)
        groups.append(g)
    groups.reverse()
    frac_groups = -exp // 4
    weight = len(groups) - 1 - frac_groups
    while groups and groups[-1] == 0:
        groups.pop()
    while groups and groups[0] == 0:
        groups.pop(0)
        weight -= 1
    if not groups:
        weight = 0
    sign = 0x4000 if sign_bit and groups else 0
    return struct.pack(f">hhHH{len(groups)}h", len(groups), weight, sign, dscale, *groups)


def enc_array(
    values: list[Any], elem_oid: int, enc: Any, lbounds: list[int] | None = None
) -> bytes:
    dims: list[int] = []
    v: Any = values
    while isinstance(v, list):
        dims.append(len(v))
        if not v:
            break
        v = v[0]
    if dims == [0]:
        return struct.pack(">iiI", 0, 0, elem_oid)
    flat: list[Any] = values
    for _ in range(len(dims) - 1):
        flat = [x for sub in flat for x in sub]
    lbs = lbounds or [1] * len(dims)
    out = [struct.pack(">iiI", len(dims), int(any(x is None for x in flat)), elem_oid)]
    out += [struct.pack(">ii", d, lb) for d, lb in zip(dims, lbs, strict=True)]
    for x in flat:
        if x is None:
            out.append(struct.pack(">i", -1))
        else:
            e = enc(x)
            out.append(struct.pack(">i", len(e)) + e)
    return b"".join(out)


def enc_text_array(values: list[Any]) -> str:
    """array_out for text elements."""

    def one(x: Any) -> str:
        if isinstance(x, list):
            return "{" + ",".join(one(y) for y in x) + "}"
        if x is None:
            return "NULL"
        if x == "" or x.upper() == "NULL" or re.search(r'[{},"\\\s]', x):
            return '"' + x.replace("\\", "\\\\").replace('"', '\\"') + '"'
        return str(x)

    return one(values)


def i32(v: int) -> bytes:
    return struct.pack(">i", v)


def i64(v: int) -> bytes:
    return struct.pack(">q", v)


# --- table-driven cases ----------------------------------------------------------------------

# (oid, text, binary, json, native)
CASES: list[tuple[int, str, bytes, Any, Any]] = [
    (21, "-32768", struct.pack(">h", -32768), -32768, -32768),
    (23, "2147483647", i32(2147483647), 2147483647, 2147483647),
    (20, "-9223372036854775808", i64(-(2**63)), -(2**63), -(2**63)),
    (26, "4294967295", b"\xff\xff\xff\xff", 4294967295, 4294967295),
    (28, "7", b"\x00\x00\x00\x07", 7, 7),
    (5069, "18446744073709551615", b"\xff" * 8, 2**64 - 1, 2**64 - 1),
    (701, "3.141592653589793", struct.pack(">d", math.pi), math.pi, math.pi),
    (701, "NaN", struct.pack(">d", math.nan), "NaN", None),
    (701, "Infinity", struct.pack(">d", math.inf), "Infinity", math.inf),
    (701, "-Infinity", struct.pack(">d", -math.inf), "-Infinity", -math.inf),
    (701, "-0", struct.pack(">d", -0.0), -0.0, -0.0),
    (701, "5e-324", struct.pack(">d", 5e-324), 5e-324, 5e-324),
    (700, "1.1", struct.pack(">f", 1.1), 1.1, 1.1),
    (700, "3.4028235e+38", struct.pack(">f", 3.4028234663852886e38), 3.4028235e38, 3.4028235e38),
    (700, "-Infinity", struct.pack(">f", -math.inf), "-Infinity", -math.inf),
    (1700, "123.4500", enc_numeric(Decimal("123.4500")), "123.4500", Decimal("123.4500")),
    (1700, "NaN", enc_numeric("NaN"), "NaN", "NaN"),
    (1700, "Infinity", enc_numeric("Infinity"), "Infinity", "Infinity"),
    (1700, "-Infinity", enc_numeric("-Infinity"), "-Infinity", "-Infinity"),
    (1700, "0", enc_numeric(Decimal("0")), "0", Decimal("0")),
    (1700, "0.000", enc_numeric(Decimal("0.000")), "0.000", Decimal("0.000")),
    (
        1700,
        "-0.000000001234",
        enc_numeric(Decimal("-1.234E-9")),
        "-0.000000001234",
        Decimal("-1.234E-9"),
    ),
    (1700, "1" + "0" * 100, enc_numeric(Decimal("1E+100")), "1" + "0" * 100, Decimal("1E+100")),
    (1700, "12300", struct.pack(">hhHHhh", 2, 1, 0, 0, 1, 2300), "12300", Decimal(12300)),
    (
        790,
        "-$92,233,720,368,547,758.08",
        i64(-(2**63)),
        "-92233720368547758.08",
        Decimal("-92233720368547758.08"),
    ),
    (790, "$0.05", i64(5), "0.05", Decimal("0.05")),
    (16, "t", b"\x01", True, True),
    (16, "f", b"\x00", False, False),
    (25, "😀 e\u0301 مرحبا", "😀 e\u0301 مرحبا".encode(), "😀 e\u0301 مرحبا", "😀 e\u0301 مرحبا"),
    (1042, "ab   ", b"ab   ", "ab   ", "ab   "),
    (18, "\\200", b"\x80", "\\200", "\\200"),
    (18, "a", b"a", "a", "a"),
    (18, "", b"", "", ""),
    (
        17,
        "\\x" + bytes(range(256)).hex(),
        bytes(range(256)),
        base64.b64encode(bytes(range(256))).decode(),
        bytes(range(256)),
    ),
    (17, "\\x", b"", "", b""),
    (
        2950,
        "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
        uuid.UUID("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11").bytes,
        "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
        "a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
    ),
    (114, "null", b"null", "null", "null"),
    (3802, '{"a": 1}', b'\x01{"a": 1}', '{"a": 1}', '{"a": 1}'),
    (1082, "2024-02-29", i32(8825), "2024-02-29", dt.date(2024, 2, 29)),
    (1082, "infinity", i32(2**31 - 1), "infinity", None),
    (1082, "-infinity", i32(-(2**31)), "-infinity", None),
    (1082, "0044-03-15 BC", i32(-746117), "0044-03-15 BC", None),
    (1082, "4713-11-24 BC", i32(-2451179), "4713-11-24 BC", None),
    (1082, "5874897-12-31", i32(2145031948), "5874897-12-31", None),
    (1083, "24:00:00", i64(86_400_000_000), "24:00:00", None),
    (1083, "00:00:00.000001", i64(1), "00:00:00.000001", dt.time(0, 0, 0, 1)),
    (1083, "12:34:56.5", i64(45_296_500_000), "12:34:56.5", dt.time(12, 34, 56, 500000)),
    (
        1266,
        "12:00:00.5+05:30",
        i64(43_200_500_000) + i32(-19800),
        "12:00:00.5+05:30",
        "12:00:00.5+05:30",
    ),
    (1266, "00:00:00+00:00:15", i64(0) + i32(-15), "00:00:00+00:00:15", "00:00:00+00:00:15"),
    (1266, "23:59:59-08", i64(86_399_000_000) + i32(28800), "23:59:59-08", "23:59:59-08"),
    (
        1114,
        "2024-03-10 02:30:00",
        i64(763_353_000_000_000),
        "2024-03-10T02:30:00",
        dt.datetime(2024, 3, 10, 2, 30),
    ),
    (
        1114,
        "1999-12-31 23:59:59.999999",
        i64(-1),
        "1999-12-31T23:59:59.999999",
        dt.datetime(1999, 12, 31, 23, 59, 59, 999999),
    ),
    (
        1114,
        "2000-01-01 00:00:00.1",
        i64(100_000),
        "2000-01-01T00:00:00.1",
        dt.datetime(2000, 1, 1, 0, 0, 0, 100000),
    ),
    (1114, "infinity", i64(2**63 - 1), "infinity", None),
    (1114, "-infinity", i64(-(2**63)), "-infinity", None),
    (
        1114,
        "0044-03-15 12:00:00.5 BC",
        i64(((-746117) * 86400 + 43200) * 10**6 + 500000),
        "0044-03-15 12:00:00.5 BC",
        None,
    ),
    (1114, "10000-01-01 00:00:00", i64((2921940 * 86400) * 10**6), "10000-01-01T00:00:00", None),
    (
        1184,
        "2024-03-10 07:30:00+00",
        i64(763_371_000_000_000),
        "2024-03-10T07:30:00Z",
        dt.datetime(2024, 3, 10, 7, 30, tzinfo=dt.UTC),
    ),
    (
        1184,
        "2000-01-01 00:00:00.000001+00",
        i64(1),
        "2000-01-01T00:00:00.000001Z",
        dt.datetime(2000, 1, 1, 0, 0, 0, 1, tzinfo=dt.UTC),
    ),
    (1184, "infinity", i64(2**63 - 1), "infinity", None),
    (
        1184,
        "0044-03-15 12:00:00+00 BC",
        i64(((-746117) * 86400 + 43200) * 10**6),
        "0044-03-15 12:00:00+00 BC",
        None,
    ),
    (
        1186,
        "P1Y2M3DT4H5M6.5S",
        i64(14_706_500_000) + i32(3) + i32(14),
        "P1Y2M3DT4H5M6.5S",
        "P1Y2M3DT4H5M6.5S",
    ),
    (
        1186,
        "P-1Y-2M3DT-4H-5M-6.5S",
        i64(-14_706_500_000) + i32(3) + i32(-14),
        "P-1Y-2M3DT-4H-5M-6.5S",
        "P-1Y-2M3DT-4H-5M-6.5S",
    ),
    (1186, "PT0S", i64(0) + i32(0) + i32(0), "PT0S", "PT0S"),
    (1186, "P1DT-1S", i64(-1_000_000) + i32(1) + i32(0), "P1DT-1S", "P1DT-1S"),
    (1186, "PT-0.5S", i64(-500_000) + i32(0) + i32(0), "PT-0.5S", "PT-0.5S"),
    (1186, "infinity", i64(2**63 - 1) + i32(2**31 - 1) + i32(2**31 - 1), "infinity", "infinity"),
    (
        869,
        "::ffff:1.2.3.4",
        bytes([3, 128, 0, 16]) + bytes(10) + b"\xff\xff\x01\x02\x03\x04",
        "::ffff:1.2.3.4",
        "::ffff:1.2.3.4",
    ),
    (869, "10.0.0.1/8", bytes([2, 8, 0, 4, 10, 0, 0, 1]), "10.0.0.1/8", "10.0.0.1/8"),
    (
        869,
        "0:0:0:1::",
        bytes([3, 128, 0, 16]) + bytes(6) + b"\x00\x01" + bytes(8),
        "0:0:0:1::",
        "0:0:0:1::",
    ),
    (650, "10.1.2.3/32", bytes([2, 32, 1, 4, 10, 1, 2, 3]), "10.1.2.3/32", "10.1.2.3/32"),
    (650, "::/0", bytes([3, 0, 1, 0]), "::/0", "::/0"),
    (
        829,
        "08:00:2b:01:02:03",
        bytes.fromhex("08002b010203"),
        "08:00:2b:01:02:03",
        "08:00:2b:01:02:03",
    ),
    (1560, "1010", i32(4) + b"\xa0", "1010", "1010"),
    (1562, "", i32(0), "", ""),
    (1562, "10101010101", i32(11) + b"\xaa\xa0", "10101010101", "10101010101"),
    (600, "(1.5,2)", struct.pack(">dd", 1.5, 2), "(1.5,2)", "(1.5,2)"),
    (600, "(-0,1e+300)", struct.pack(">dd", -0.0, 1e300), "(-0,1e+300)", "(-0,1e+300)"),
    (
        718,
        "<(1e+15,123456789012345),0.1>",
        struct.pack(">ddd", 1e15, 123456789012345, 0.1),
        "<(1e+15,123456789012345),0.1>",
        "<(1e+15,123456789012345),0.1>",
    ),
    (
        602,
        "[(0,0),(1,1)]",
        b"\x00" + i32(2) + struct.pack(">4d", 0, 0, 1, 1),
        "[(0,0),(1,1)]",
        "[(0,0),(1,1)]",
    ),
    (
        604,
        "((0,0),(1e-10,3))",
        i32(2) + struct.pack(">4d", 0, 0, 1e-10, 3),
        "((0,0),(1e-10,3))",
        "((0,0),(1e-10,3))",
    ),
    (603, "(1,1),(0,0)", struct.pack(">4d", 1, 1, 0, 0), "(1,1),(0,0)", "(1,1),(0,0)"),
    (628, "{1,2,3}", struct.pack(">3d", 1, 2, 3), "{1,2,3}", "{1,2,3}"),
    (3220, "16/B374D848", i64(0x16B374D848), "16/B374D848", "16/B374D848"),
    (27, "(4294967295,65535)", b"\xff" * 6, "(4294967295,65535)", "(4294967295,65535)"),
    (
        2970,
        "10:20:10,14,15",
        i32(3) + i64(10) + i64(20) + i64(10) + i64(14) + i64(15),
        "10:20:10,14,15",
        "10:20:10,14,15",
    ),
    (3904, "[1,5)", b"\x02" + i32(4) + i32(1) + i32(4) + i32(5), "[1,5)", "[1,5)"),
    (3904, "empty", b"\x01", "empty", "empty"),
    (3906, "(,)", b"\x18", "(,)", "(,)"),
    (
        3908,
        '["2020-01-01 00:00:00",)',
        b"\x12" + i32(8) + i64(631_152_000_000_000),
        '["2020-01-01 00:00:00",)',
        '["2020-01-01 00:00:00",)',
    ),
    (
        4451,
        "{[1,3),[5,7)}",
        i32(2)
        + (i32(17) + b"\x02" + i32(4) + i32(1) + i32(4) + i32(3))
        + (i32(17) + b"\x02" + i32(4) + i32(5) + i32(4) + i32(7)),
        "{[1,3),[5,7)}",
        "{[1,3),[5,7)}",
    ),
    (22, "1 2 3", enc_array([1, 2, 3], 21, lambda v: struct.pack(">h", v)), "1 2 3", "1 2 3"),
]


@pytest.mark.parametrize(("oid", "text", "binary", "json", "native"), CASES)
def test_scalar_cases(oid: int, text: str, binary: bytes, json: Any, native: Any) -> None:
    assert_same(jt(oid, text), json)
    assert_same(jb(oid, binary), json)
    if isinstance(native, float) and math.isnan(native):
        assert math.isnan(nt(oid, text)) and math.isnan(nb(oid, binary))
    elif not (oid == 701 and text == "NaN"):
        assert_same(nt(oid, text), native)
        assert_same(nb(oid, binary), native)
    render = REG.renderer(oid)
    assert render is not None and render(binary) == text


def test_float_nan_native_is_a_float_nan() -> None:
    assert math.isnan(nt(701, "NaN")) and math.isnan(nb(701, struct.pack(">d", math.nan)))


def assert_same(got: Any, want: Any) -> None:
    assert type(got) is type(want), (got, want)
    assert got == want or repr(got) == repr(want), (got, want)
    if isinstance(want, float) and want == 0.0:
        assert math.copysign(1, got) == math.copysign(1, want)


def test_timestamptz_text_with_any_offset_becomes_utc() -> None:
    assert jt(1184, "2024-03-10 02:30:00-05") == "2024-03-10T07:30:00Z"
    assert jt(1184, "2016-12-31 23:59:59.5-00:30") == "2017-01-01T00:29:59.5Z"
    assert jt(1184, "2000-01-01 00:00:00+00:00:15") == "1999-12-31T23:59:45Z"
    assert jt(1184, "1999-12-31 23:59:59.999999+14") == "1999-12-31T09:59:59.999999Z"
    assert jt(1184, "12000-06-01 12:00:00+05:45") == "12000-06-01T06:15:00Z"
    assert jt(1184, "0001-01-01 00:30:00+01") == "0001-12-31 23:30:00+00 BC"
    assert nt(1184, "2024-03-10 02:30:00-05") == dt.datetime(2024, 3, 10, 7, 30, tzinfo=dt.UTC)
    with pytest.raises(RemoteProtocolError, match="unparsable timestamp"):
        jt(1184, "yesterday+01")


# --- arrays ----------------------------------------------------------------------------------

ARRAYS: list[tuple[int, int, str, list[Any], Any, list[Any]]] = [
    # (array oid, elem oid, text, value for the encoder, binary encoder, json)
    (1007, 23, "{1,NULL,3}", [1, None, 3], i32, [1, None, 3]),
    (1007, 23, "{}", [], i32, []),
    (1007, 23, "{{1,2},{3,4}}", [[1, 2], [3, 4]], i32, [[1, 2], [3, 4]]),
    (
        1007,
        23,
        "{{{1},{2}},{{3},{NULL}}}",
        [[[1], [2]], [[3], [None]]],
        i32,
        [[[1], [2]], [[3], [None]]],
    ),
    (
        1009,
        25,
        '{"a b","","NULL","x\\"y","a\\\\b",é,"{"," ",😀}',
        ["a b", "", "NULL", 'x"y', "a\\b", "é", "{", " ", "😀"],
        str.encode,
        ["a b", "", "NULL", 'x"y', "a\\b", "é", "{", " ", "😀"],
    ),
    (
        1009,
        25,
        "{{a,NULL},{c,d}}",
        [["a", None], ["c", "d"]],
        str.encode,
        [["a", None], ["c", "d"]],
    ),
    (
        1231,
        1700,
        "{1.50,NaN,NULL,-Infinity}",
        [Decimal("1.50"), "NaN", None, "-Infinity"],
        enc_numeric,
        ["1.50", "NaN", None, "-Infinity"],
    ),
    (
        1022,
        701,
        "{1.5,NaN,-Infinity,-0}",
        [1.5, math.nan, -math.inf, -0.0],
        lambda v: struct.pack(">d", v),
        [1.5, "NaN", "-Infinity", -0.0],
    ),
    (1000, 16, "{t,f,NULL}", [True, False, None], lambda v: bytes([v]), [True, False, None]),
    (1001, 17, '{"\\\\x00ff","\\\\x"}', [b"\x00\xff", b""], bytes, ["AP8=", ""]),
    (
        1185,
        1184,
        '{"2020-01-01 00:00:00.5+00",infinity}',
        [631_152_000_500_000, 2**63 - 1],
        i64,
        ["2020-01-01T00:00:00.5Z", "infinity"],
    ),
    (
        1020,
        603,
        "{(1,1),(0,0);(3,3),(2,2)}",
        [(1, 1, 0, 0), (3, 3, 2, 2)],
        lambda v: struct.pack(">4d", *v),
        ["(1,1),(0,0)", "(3,3),(2,2)"],
    ),
    (
        3807,
        3802,
        '{"{\\"a\\": 1}","null"}',
        ['{"a": 1}', "null"],
        lambda v: b"\x01" + v.encode(),
        ['{"a": 1}', "null"],
    ),
]


@pytest.mark.parametrize(("oid", "elem", "text", "values", "enc", "json"), ARRAYS)
def test_array_cases(
    oid: int, elem: int, text: str, values: list[Any], enc: Any, json: Any
) -> None:
    assert_same_tree(jt(oid, text), json)
    binary = enc_array(values, elem, enc)
    assert_same_tree(jb(oid, binary), json)
    render = REG.renderer(oid)
    assert render is not None and render(binary) == text


def assert_same_tree(got: Any, want: Any) -> None:
    if isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (got, want)
        for g, w in zip(got, want, strict=True):
            assert_same_tree(g, w)
    elif want is None:
        assert got is None
    else:
        assert_same(got, want)


def test_arrays_with_lower_bounds_not_one_are_their_text() -> None:
    assert jt(1007, "[0:1]={1,2}") == "[0:1]={1,2}"
    binary = enc_array([[1, None], [3, 4]], 23, i32, lbounds=[2, -1])
    assert jb(1007, binary) == "[2:3][-1:0]={{1,NULL},{3,4}}"
    assert nb(1007, binary) == "[2:3][-1:0]={{1,NULL},{3,4}}"
    text_arr = enc_array(["a b", None], 25, str.encode, lbounds=[0])
    assert jb(1009, text_arr) == '[0:1]={"a b",NULL}'


def test_native_arrays_are_lists_of_natives() -> None:
    assert nt(1231, "{1.50,NaN}") == [Decimal("1.50"), "NaN"]
    assert nb(1182, enc_array([0, None], 1082, i32)) == [dt.date(2000, 1, 1), None]
    assert nt(1001, '{"\\\\x00ff"}') == [b"\x00\xff"]


# --- catalog-dependent types -----------------------------------------------------------------


def registry_with_user_types() -> TypeRegistry:
    reg = TypeRegistry()
    reg.register(TypeInfo(20000, "public", "mood", "e"))
    reg.register(TypeInfo(20001, "public", "_mood", "b", elem_oid=20000))
    reg.register(TypeInfo(20002, "public", "posint", "d", base_oid=23))
    reg.register(TypeInfo(20003, "public", "comp", "c"))
    reg.register(TypeInfo(20004, "public", "floatrange", "r", elem_oid=701))
    reg.register(TypeInfo(20005, "public", "intarr", "d", base_oid=1007))
    return reg


def test_enum_domain_composite_range() -> None:
    reg = registry_with_user_types()
    j = reg.json_converter
    assert j(20000, -1, T)(b"happy") == "happy" == j(20000, -1, B)(b"happy")
    assert j(20001, -1, T)(b'{happy,"ok x",NULL}') == ["happy", "ok x", None]
    assert j(20001, -1, B)(enc_array(["happy", None], 20000, str.encode)) == ["happy", None]
    assert j(20002, -1, T)(b"5") == 5 == j(20002, -1, B)(i32(5))
    assert j(20005, -1, T)(b"{1,2}") == [1, 2] == j(20005, -1, B)(enc_array([1, 2], 23, i32))
    record = i32(4)
    for oid, val in (
        (23, i32(1)),
        (25, b'x"y\\z'),
        (20002, i32(2)),
        (1009, enc_array(["a b"], 25, str.encode)),
    ):
        record += struct.pack(">Ii", oid, len(val)) + val
    record += b""  # trailing nothing
    assert j(20003, -1, B)(record) == '(1,"x""y\\\\z",2,"{""a b""}")'
    assert j(20003, -1, T)(b"(1,a)") == "(1,a)"
    rng = b"\x02" + i32(8) + struct.pack(">d", 1.5) + i32(8) + struct.pack(">d", 2.5)
    assert j(20004, -1, B)(rng) == "[1.5,2.5)"
    assert reg.type_name(20000) == "public.mood"
    assert reg.type_name(23) == "int4" and reg.type_name(1009) == "_text"
    assert reg.type_name(99999) == "oid:99999"
    assert all(reg.binary_exact(o) for o in (23, 20000, 20001, 20002, 20004, 20005, 1007, 3904))
    assert not reg.binary_exact(2205)  # regclass sends an OID, shows a name
    assert not reg.binary_exact(3614)  # tsvector


def test_type_message_of_a_domain_names_its_base_type() -> None:
    reg = TypeRegistry()
    reg.observe(TypeMessage(None, 30000, "", "int4"))  # what pgoutput sends for a domain
    assert reg.json_converter(30000, -1, B)(i32(7)) == 7
    reg.observe(TypeMessage(None, 30001, "public", "thing"))  # unknown extension type
    assert reg.json_converter(30001, -1, T)(b"abc") == "abc"
    assert reg.json_converter(30001, -1, B)(b"\x00\x01") == BINARY_FALLBACK_PREFIX + "AAE="
    # the catalog's richer information wins over a later Type message
    reg.register(TypeInfo(30002, "public", "mood", "e"))
    reg.observe(TypeMessage(None, 30002, "public", "mood"))
    assert reg.info(30002) == TypeInfo(30002, "public", "mood", "e")


def test_unknown_binary_types_fall_back_to_marked_base64() -> None:
    assert jb(2205, i32(1259)) == BINARY_FALLBACK_PREFIX + base64.b64encode(i32(1259)).decode()
    assert jt(2205, "pg_class") == "pg_class"


def test_numeric_precision_scale() -> None:
    assert REG.numeric_precision_scale(-1) is None
    assert REG.numeric_precision_scale(((10 << 16) | 2) + 4) == (10, 2)
    assert REG.numeric_precision_scale(((5 << 16) | (-2 & 0x7FF)) + 4) == (5, -2)
    assert REG.numeric_precision_scale(((3 << 16) | 5) + 4) == (3, 5)


# --- RowDecoder ------------------------------------------------------------------------------


def relation(*oids: int) -> Relation:
    cols = tuple(Column(0, f"c{i}", oid, -1) for i, oid in enumerate(oids))
    return Relation(None, 16384, "public", "t", "d", cols)


def test_row_decoder_kinds_per_column() -> None:
    rel = relation(23, 25, 1184, 17, 25)
    tup = TupleData(b"tbnub", (b"1", b"x", None, None, "é".encode()))
    dec = RowDecoder(rel, REG, "json")
    assert dec.names == ("c0", "c1", "c2", "c3", "c4")
    assert dec.decode(tup) == {"c0": 1, "c1": "x", "c2": None, "c3": UNCHANGED_TOAST, "c4": "é"}
    assert dec.unchanged(tup) == ["c3"]
    native = RowDecoder(rel, REG, "native")
    assert native.decode(tup) == {"c0": 1, "c1": "x", "c2": None, "c3": None, "c4": "é"}
    # the same decoder serves all-text and all-binary tuples
    all_b = TupleData(b"bbbbb", (i32(2), b"y", i64(0), b"\x01", b""))
    assert dec.decode(all_b) == {
        "c0": 2,
        "c1": "y",
        "c2": "2000-01-01T00:00:00Z",
        "c3": "AQ==",
        "c4": "",
    }


def test_row_decoder_errors_name_the_column() -> None:
    dec = RowDecoder(relation(23, 1082), REG, "json")
    with pytest.raises(
        RemoteProtocolError,
        match=r"column 'c0' of public\.t \(type int4, oid 23, kind 't'\) value b'x1'",
    ):
        dec.decode(TupleData(b"tt", (b"x1", b"2020-01-01")))
    with pytest.raises(RemoteProtocolError, match="tuple of 3 columns"):
        dec.decode(TupleData(b"ttt", (b"1", b"2", b"3")))
    with pytest.raises(RemoteProtocolError, match="unknown TupleData kind"):
        dec.decode(TupleData(b"tz", (b"1", b"2")))
    with pytest.raises(RemoteProtocolError, match="kind 'b'"):
        dec.decode(TupleData(b"tb", (b"1", b"\x00")))


# --- Hypothesis round trips ------------------------------------------------------------------

TS_MIN_US = -211_813_488_000_000_000  # 4714-11-24 00:00:00 BC
TS_MAX_US = 9_223_371_331_200_000_000 - 1  # 294277-01-01 00:00:00 exclusive


@given(st.integers(-(2**63), 2**63 - 1))
def test_int8_round_trip(v: int) -> None:
    assert jb(20, i64(v)) == v == jt(20, str(v))


@given(
    st.decimals(allow_nan=False, allow_infinity=False, places=None).filter(
        lambda d: abs(d.adjusted()) < 2000
    )
)
def test_numeric_round_trip(d: Decimal) -> None:
    text = format(d, "f")
    if d.is_zero():
        text = text.lstrip("-")
    got = jb(1700, enc_numeric(d))
    assert got == text
    assert Decimal(got) == d


@given(st.floats())
def test_float8_round_trip(x: float) -> None:
    got = jb(701, struct.pack(">d", x))
    if math.isnan(x):
        assert got == "NaN"
    elif math.isinf(x):
        assert got == ("Infinity" if x > 0 else "-Infinity")
    else:
        assert got == x
        text = vb.float8_text(x)
        assert float(text) == x and jt(701, text) == x


@given(st.floats(width=32, allow_nan=False, allow_infinity=False))
def test_float4_round_trip(x: float) -> None:
    got = jb(700, struct.pack(">f", x))
    assert struct.pack(">f", got) == struct.pack(">f", x)
    assert jt(700, vb.float4_text(x)) == got


@given(st.integers(TS_MIN_US, TS_MAX_US))
def test_timestamp_round_trip(us: int) -> None:
    text = vb.timestamp_text(us, utc_suffix=False)
    assert jb(1114, i64(us)) == jt(1114, text)
    tz_text = vb.timestamp_text(us, utc_suffix=True)
    assert jb(1184, i64(us)) == jt(1184, tz_text)
    try:
        ref = PG_EPOCH + dt.timedelta(microseconds=us)
    except OverflowError:
        assert nb(1114, i64(us)) is None
        return
    iso = ref.isoformat()
    if ref.microsecond:
        iso = iso.rstrip("0")
    assert jb(1114, i64(us)) == iso
    assert jb(1184, i64(us)) == iso + "Z"
    assert nb(1114, i64(us)) == ref == nt(1114, text)
    assert nb(1184, i64(us)) == ref.replace(tzinfo=dt.UTC) == nt(1184, tz_text)


@given(
    st.datetimes(min_value=dt.datetime(1, 1, 2), max_value=dt.datetime(9999, 12, 30)),
    st.integers(-15 * 3600, 15 * 3600),
)
def test_timestamptz_text_offsets(local: dt.datetime, offset: int) -> None:
    sign = "-" if offset < 0 else "+"
    h, rem = divmod(abs(offset), 3600)
    m, s = divmod(rem, 60)
    text = local.isoformat(sep=" ") + f"{sign}{h:02d}:{m:02d}:{s:02d}"
    utc = local - dt.timedelta(seconds=offset)
    want = utc.isoformat()
    if utc.microsecond:
        want = want.rstrip("0")
    assert jt(1184, text) == want + "Z"


@given(st.integers(-2451545, 2145031948))
def test_date_round_trip(days: int) -> None:
    text = vb.render_date(i32(days))
    assert jb(1082, i32(days)) == jt(1082, text) == text
    if -730119 <= days <= 2921939:
        ref = dt.date(2000, 1, 1) + dt.timedelta(days=days)
        assert text == ref.isoformat() and nt(1082, text) == ref == nb(1082, i32(days))


_ISO_INTERVAL = re.compile(
    r"P(?:(-?\d+)Y)?(?:(-?\d+)M)?(?:(-?\d+)D)?(?:T(?:(-?\d+)H)?(?:(-?\d+)M)?(?:(-?\d+(?:\.\d+)?)S)?)?"
)


@given(
    st.integers(-(2**63) + 1, 2**63 - 2),
    st.integers(-(2**31) + 1, 2**31 - 2),
    st.integers(-(2**31) + 1, 2**31 - 2),
)
def test_interval_round_trip(us: int, days: int, months: int) -> None:
    text = jb(1186, i64(us) + i32(days) + i32(months))
    m = _ISO_INTERVAL.fullmatch(text)
    assert m is not None, text
    y, mo, d, h, mi, s = (g or "0" for g in m.groups())
    assert int(y) * 12 + int(mo) == months
    assert int(d) == days
    sec = Decimal(s.replace("-", "")) * (-1 if s.startswith("-") else 1)
    assert int(h) * 3_600_000_000 + int(mi) * 60_000_000 + int(sec * 1_000_000) == us


@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")))
def test_text_round_trip(s: str) -> None:
    assert jb(25, s.encode()) == s == jt(25, s.encode())


@given(st.binary(max_size=300))
def test_bytea_round_trip(b: bytes) -> None:
    want = base64.b64encode(b).decode()
    assert jb(17, b) == want == jt(17, "\\x" + b.hex())
    assert nb(17, b) == b == nt(17, "\\x" + b.hex())


_elem_text = st.one_of(
    st.none(),
    st.text(
        alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
        max_size=8,
    ),
)


@settings(max_examples=200)
@given(
    st.integers(1, 3)
    .flatmap(lambda nd: st.lists(st.integers(1, 3), min_size=nd, max_size=nd))
    .flatmap(
        lambda dims: st.lists(_elem_text, min_size=math.prod(dims), max_size=math.prod(dims)).map(
            lambda flat: (dims, flat)
        )
    )
)
def test_text_array_round_trip(shape: tuple[list[int], list[str | None]]) -> None:
    dims, flat = shape
    nested: Any = flat
    for d in reversed(dims[1:]):
        nested = [nested[i : i + d] for i in range(0, len(nested), d)]
    text = enc_text_array(nested)
    binary = enc_array(nested, 25, str.encode)
    assert jt(1009, text) == nested == jb(1009, binary)
    render = REG.renderer(1009)
    assert render is not None and render(binary) == text


@given(st.lists(st.one_of(st.none(), st.integers(-(2**31), 2**31 - 1))))
def test_int_array_round_trip(values: list[int | None]) -> None:
    assert jb(1007, enc_array(values, 23, i32)) == values
    assert jt(1007, enc_text_array([None if v is None else str(v) for v in values])) == values
