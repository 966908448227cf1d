"""Value conversion against real servers: text and binary pgoutput give the same JSON values,
and both equal what the server's own rendering (``::text``, ``to_json``) says, per docs/events.md.

One table of ~100 columns of every kind of type (arrays, enums, domains, composites, ranges,
numeric specials, timestamps at DST changes and ±infinity, Unicode text, bytea, json 'null',
network types, money, bit, interval...) gets three rows (two of values, one of NULLs). The
Insert messages are read twice with ``pg_logical_slot_peek_binary_changes`` (``binary
'false'`` and ``binary 'true'``) in a session with cdcd's GUCs, decoded by
:class:`cdcd.decoder.pgoutput.PgOutputDecoder` and converted by :class:`RowDecoder`.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import pytest

from cdcd.decoder.events import Insert, Relation
from cdcd.decoder.events import Type as TypeMessage
from cdcd.decoder.pgoutput import PgOutputDecoder
from cdcd.values.types import (
    BINARY_FALLBACK_PREFIX,
    RowDecoder,
    TypeInfo,
    TypeRegistry,
)

pytestmark = pytest.mark.pg

GUCS = (
    "SET DateStyle='ISO, MDY'",
    "SET TimeZone='UTC'",
    "SET IntervalStyle='iso_8601'",
    "SET extra_float_digits=3",
    "SET bytea_output='hex'",
    "SET lc_monetary='C'",
)

SETUP = """
CREATE TYPE mood AS ENUM ('happy', 'sad', 'ok ''quoted''');
CREATE DOMAIN posint AS int4 CHECK (VALUE > 0);
CREATE DOMAIN shorttext AS text;
CREATE DOMAIN money_num AS numeric(12, 2);
CREATE DOMAIN intarr AS int4[];
CREATE TYPE comp AS (a int4, b text, c numeric, d timestamptz, e mood, f int4[], g bytea);
CREATE TYPE comp2 AS (x comp, y text, z posint);
CREATE TYPE floatrange AS RANGE (subtype = float8);
"""

ALL_BYTES = "\\x" + bytes(range(256)).hex()
UNICODE_1 = "héllo wörld 日本語 😀 🏳️\u200d🌈 \U0001d518\U0001d52b\U0001d526 \U0010fffd"
UNICODE_2 = 'e\u0301 a\u0308\u0301 مرحبا שלום \u200f\u202e rtl\u202c \u00a0\ttab\nnl "q" \\b'


def _lit(v: str) -> str:
    return "'" + v.replace("'", "''") + "'"


# Expectation from the server's rendering: (text, to_json value) -> contract value.
Expect = Callable[[str, Any], Any]


def J(t: str, j: Any) -> Any:  # to_json already is the contract value
    return j


def T(t: str, j: Any) -> Any:  # the text form
    return t


def INT(t: str, j: Any) -> Any:
    return int(t)


def B64(t: str, j: Any) -> Any:
    return base64.b64encode(bytes.fromhex(t[2:])).decode()


def MONEY(t: str, j: Any) -> Any:
    neg = t.startswith("-")
    return ("-" if neg else "") + t.lstrip("-").lstrip("$").replace(",", "")


def TS(t: str, j: Any) -> Any:  # to_json, but BC as PostgreSQL's text
    return t if t.endswith(" BC") else j


def TSTZ(t: str, j: Any) -> Any:
    if t.endswith(" BC") or t.endswith("infinity"):
        return t
    assert j.endswith("+00:00"), j
    return j[: -len("+00:00")] + "Z"


# name, SQL type, row-1 literal, row-2 literal, expectation (function or explicit [row1, row2])
COLUMNS: list[tuple[str, str, str, str, Expect | list[Any]]] = [
    ("c_int2", "int2", "32767", "-32768", J),
    ("c_int4", "int4", "2147483647", "-2147483648", J),
    ("c_int8", "int8", "9223372036854775807", "-9223372036854775808", J),
    ("c_oid", "oid", "4294967295", "0", INT),
    ("c_xid", "xid", "'4294967295'", "'3'", INT),
    ("c_xid8", "xid8", "'18446744073709551615'", "'3'", INT),
    ("c_cid", "cid", "'7'", "'0'", INT),
    ("c_float4", "float4", "1.1", "'NaN'", J),
    ("c_float4b", "float4", "'-Infinity'", "1e-38", J),
    ("c_float4c", "float4", "3.4028235e38", "-0.1", J),
    ("c_float8", "float8", "3.141592653589793", "'Infinity'", J),
    ("c_float8b", "float8", "'-0'", "1e308", [-0.0, 1e308]),
    ("c_float8c", "float8", "5e-324", "0.1", J),
    ("c_numeric", "numeric", "123.4500", "'NaN'", T),
    ("c_numeric2", "numeric", "-0.000000001234", "'Infinity'", T),
    ("c_numeric3", "numeric", "'-Infinity'", "99999999999999999999999999999999999999.99999", T),
    ("c_numeric4", "numeric(5,-2)", "12345", "-99949", T),
    ("c_numeric5", "numeric(10,3)", "0", "-1.5", T),
    ("c_numeric6", "numeric", "1e100", "1e-100", T),
    ("c_numeric7", "numeric", "0.0", "-10000.00010000", T),
    ("c_money", "money", "1234.56", "'-92233720368547758.08'", MONEY),
    ("c_money2", "money", "0", "92233720368547758.07", MONEY),
    ("c_bool", "bool", "true", "false", J),
    ("c_text", "text", _lit(UNICODE_1), _lit(UNICODE_2), J),
    ("c_text2", "text", "''", "'NULL'", J),
    ("c_varchar", "varchar(10)", "'abc'", "'日本'", J),
    ("c_bpchar", "char(5)", "'ab'", "'日本'", J),
    ("c_name", "name", "'some_name'", "'名前'", J),
    ("c_char", '"char"', "'a'", "'\\200'", T),
    ("c_bytea", "bytea", _lit(ALL_BYTES), "''", B64),
    ("c_uuid", "uuid", "'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'", "gen_random_uuid()", T),
    ("c_json", "json", """'{"a": 1,  "b": [1, 2.50]}'""", "'null'", T),
    ("c_jsonb", "jsonb", """'{"b": 1, "a": [1, 2.50, "é"]}'""", "'null'", T),
    ("c_jsonpath", "jsonpath", "'$.a[*] ? (@ > 1)'", "'strict $'", T),
    ("c_date", "date", "'2024-02-29'", "'infinity'", J),
    ("c_date2", "date", "'0044-03-15 BC'", "'-infinity'", J),
    ("c_date3", "date", "'5874897-12-31'", "'0001-01-01'", J),
    ("c_date4", "date", "'4713-11-24 BC'", "'9999-12-31'", J),
    ("c_time", "time", "'24:00:00'", "'00:00:00.000001'", J),
    ("c_time2", "time(3)", "'12:34:56.789'", "'23:59:59.999'", J),
    ("c_timetz", "timetz", "'12:00:00.5+05:30'", "'23:59:59-08'", T),
    ("c_timetz2", "timetz", "'00:00:00+00:00:15'", "'01:02:03.000004-14:59'", T),
    ("c_ts", "timestamp", "'2024-03-10 02:30:00'", "'infinity'", TS),
    ("c_ts2", "timestamp", "'0044-03-15 12:00:00.5 BC'", "'-infinity'", TS),
    ("c_ts3", "timestamp", "'294276-12-31 23:59:59.999999'", "'1999-12-31 23:59:59.999999'", TS),
    ("c_ts4", "timestamp", "'2016-12-31 23:59:59.999999'", "'1970-01-01 00:00:00'", TS),
    ("c_ts5", "timestamp", "'4713-11-24 00:00:00 BC'", "'10000-01-01 00:00:00.1'", TS),
    ("c_tstz", "timestamptz", "'2024-03-10 02:30:00-05'", "'infinity'", TSTZ),
    ("c_tstz2", "timestamptz", "'0044-03-15 12:00:00+00 BC'", "'-infinity'", TSTZ),
    (
        "c_tstz3",
        "timestamptz",
        "'2024-03-31 02:30:00 Europe/Berlin'",
        "'2024-11-03 01:30:00 America/New_York'",
        TSTZ,
    ),
    (
        "c_tstz4",
        "timestamptz",
        "'2000-01-01 00:00:00.000001+00'",
        "'1999-12-31 23:59:59.999999+14'",
        TSTZ,
    ),
    ("c_tstz5", "timestamptz", "'2016-12-31 23:59:59.5-00:30'", "'12000-06-01 12:00+05:45'", TSTZ),
    (
        "c_interval",
        "interval",
        "'1 year 2 mons 3 days 04:05:06.5'",
        "'-1 year -2 mons +3 days -04:05:06.5'",
        T,
    ),
    ("c_interval2", "interval", "'0'", "'1 day -1 sec'", T),
    ("c_interval3", "interval", "'-0.5 sec'", "'1000000 hours 0.000001 sec'", T),
    ("c_interval4", "interval", "'-178000000 years'", "'P-1M2DT-0.000001S'", T),
    ("c_inet", "inet", "'192.168.1.1/24'", "'::ffff:1.2.3.4'", J),
    ("c_inet2", "inet", "'2001:db8::1'", "'::1'", J),
    ("c_inet3", "inet", "'0:0:0:1::'", "'fe80::1:0:0:1/64'", J),
    ("c_cidr", "cidr", "'10.0.0.0/8'", "'2001:db8::/32'", J),
    ("c_cidr2", "cidr", "'10.1.2.3'", "'::/0'", J),
    ("c_macaddr", "macaddr", "'08:00:2b:01:02:03'", "'ff:ff:ff:ff:ff:ff'", T),
    ("c_macaddr8", "macaddr8", "'08:00:2b:01:02:03:04:05'", "'00:00:00:00:00:00:00:00'", T),
    ("c_bit", "bit(4)", "B'1010'", "B'0001'", T),
    ("c_varbit", "varbit", "B''", "B'10101010101'", T),
    ("c_point", "point", "'(1.5,2)'", "'(-0,1e300)'", T),
    ("c_line", "line", "'{1,2,3}'", "'{0.1,-1,1e-5}'", T),
    ("c_lseg", "lseg", "'[(0,0),(1,1)]'", "'[(0.1,0.2),(1e20,1)]'", T),
    ("c_box", "box", "'(1,1),(0,0)'", "'(0.5,1e16),(-1,2)'", T),
    ("c_path", "path", "'[(0,0),(1,1)]'", "'((0,0),(1,1),(2,0))'", T),
    ("c_polygon", "polygon", "'((0,0),(1,1),(2,0))'", "'((1e-10,3))'", T),
    ("c_circle", "circle", "'<(0,0),1.5>'", "'<(1e15,123456789012345),0.1>'", T),
    ("c_pg_lsn", "pg_lsn", "'16/B374D848'", "'0/0'", T),
    ("c_tid", "tid", "'(0,1)'", "'(4294967295,65535)'", T),
    ("c_snapshot", "txid_snapshot", "'10:20:10,14,15'", "'10:10:'", T),
    ("c_pgsnapshot", "pg_snapshot", "'10:20:10,14,15'", "'5:5:'", T),
    ("c_int4range", "int4range", "'[1,5)'", "'empty'", T),
    ("c_int8range", "int8range", "'(,)'", "'[1,)'", T),
    ("c_numrange", "numrange", "'[1.5,2.25]'", "'(,-1.000]'", T),
    ("c_tsrange", "tsrange", "'[2020-01-01 00:00,2020-01-02 00:00.5)'", "'(,infinity]'", T),
    ("c_tstzrange", "tstzrange", "'[2020-01-01 00:00+02,)'", "'empty'", T),
    ("c_daterange", "daterange", "'[2020-01-01,2020-02-01)'", "'(-infinity,2020-01-01]'", T),
    ("c_int4mr", "int4multirange", "'{[1,3),[5,7)}'", "'{}'", T),
    ("c_datemr", "datemultirange", "'{[2020-01-01,2020-01-05)}'", "'{(,2020-01-01)}'", T),
    ("c_tsmr", "tsmultirange", "'{[2020-01-01 00:00,2020-01-02 00:00)}'", "'{}'", T),
    ("c_floatrange", "floatrange", "'[1.5,2.5)'", "'(,0.1]'", T),
    ("c_mood", "mood", "'happy'", "'ok ''quoted'''", T),
    ("c_posint", "posint", "5", "2147483647", J),
    ("c_shorttext", "shorttext", _lit(UNICODE_1), "''", J),
    ("c_money_num", "money_num", "12.5", "-0.01", T),
    ("c_intarr", "intarr", "'{1,2,NULL}'", "'{}'", [[1, 2, None], []]),
    (
        "c_comp",
        "comp",
        "ROW(1, 'a b', 1.50, '2020-01-01 00:00+00', 'happy', '{1,2}', '\\x00ff')",
        "ROW(NULL, '', NULL, 'infinity', 'ok ''quoted''', '{}', NULL)",
        T,
    ),
    (
        "c_comp2",
        "comp2",
        "ROW(ROW(1, 'x\"y\\z', 2, NULL, 'sad', '{3}', ''), '(', 7)",
        "ROW(NULL, NULL, NULL)",
        T,
    ),
    ("a_int4", "int4[]", "'{1,NULL,3}'", "'{}'", [[1, None, 3], []]),
    ("a_int4_2d", "int4[][]", "'{{1,2},{3,4}}'", "'{{NULL}}'", [[[1, 2], [3, 4]], [[None]]]),
    (
        "a_int4_3d",
        "int4[]",
        "'{{{1},{2}},{{3},{4}}}'",
        "'{{{5,6}}}'",
        [[[[1], [2]], [[3], [4]]], [[[5, 6]]]],
    ),
    ("a_int4_lb", "int4[]", "'[0:1]={1,2}'", "'[2:3][-1:0]={{1,NULL},{3,4}}'", T),
    ("a_text_lb", "text[]", """'[0:1]={"a b",NULL}'""", "'{x}'", ['[0:1]={"a b",NULL}', ["x"]]),
    (
        "a_text",
        "text[]",
        """'{"a b","","NULL","x\\"y","a\\\\b",é,"{"," ",😀}'""",
        "ARRAY[NULL, 'null']::text[]",
        [["a b", "", "NULL", 'x"y', "a\\b", "é", "{", " ", "😀"], [None, "null"]],
    ),
    (
        "a_text2",
        "text[]",
        "ARRAY[" + _lit(UNICODE_1) + ", " + _lit(UNICODE_2) + "]",
        "'{{a,b},{c,d}}'",
        [[UNICODE_1, UNICODE_2], [["a", "b"], ["c", "d"]]],
    ),
    ("a_varchar", "varchar[]", "'{abc,\"d,e\"}'", "'{}'", [["abc", "d,e"], []]),
    ("a_bpchar", "char(3)[]", "'{a,bb}'", "'{NULL}'", [["a  ", "bb "], [None]]),
    ("a_char", '"char"[]', "ARRAY['a'::\"char\", '\\200'::\"char\"]", "'{}'", [["a", "\\200"], []]),
    (
        "a_numeric",
        "numeric[]",
        "'{1.50,NaN,NULL,-Infinity}'",
        "'{{1e20},{-0.001}}'",
        [["1.50", "NaN", None, "-Infinity"], [["100000000000000000000"], ["-0.001"]]],
    ),
    (
        "a_float8",
        "float8[]",
        "'{1.5,NaN,-Infinity,-0}'",
        "'{1e300}'",
        [[1.5, "NaN", "-Infinity", -0.0], [1e300]],
    ),
    ("a_float4", "float4[]", "'{1.1,Infinity}'", "'{0.3}'", [[1.1, "Infinity"], [0.3]]),
    ("a_bool", "bool[]", "'{t,f,NULL}'", "'{}'", [[True, False, None], []]),
    (
        "a_bytea",
        "bytea[]",
        "ARRAY['\\x00ff'::bytea, '', NULL]",
        "ARRAY[" + _lit(ALL_BYTES) + "::bytea]",
        [["AP8=", "", None], [base64.b64encode(bytes(range(256))).decode()]],
    ),
    (
        "a_tstz",
        "timestamptz[]",
        "'{\"2020-01-01 00:00:00.5+02\",infinity}'",
        "'{}'",
        [["2019-12-31T22:00:00.5Z", "infinity"], []],
    ),
    (
        "a_ts",
        "timestamp[]",
        '\'{"2020-01-01 12:00","0044-03-15 00:00 BC"}\'',
        "'{-infinity}'",
        [["2020-01-01T12:00:00", "0044-03-15 00:00:00 BC"], ["-infinity"]],
    ),
    (
        "a_date",
        "date[]",
        "'{2020-01-01,infinity,NULL}'",
        "'{}'",
        [["2020-01-01", "infinity", None], []],
    ),
    ("a_time", "time[]", "'{12:00:00.25,24:00}'", "'{}'", [["12:00:00.25", "24:00:00"], []]),
    ("a_timetz", "timetz[]", "'{12:00:00.25+01}'", "'{}'", [["12:00:00.25+01"], []]),
    ("a_interval", "interval[]", '\'{"1 day","-1 sec"}\'', "'{}'", [["P1D", "PT-1S"], []]),
    (
        "a_uuid",
        "uuid[]",
        "'{a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11}'",
        "'{}'",
        [["a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"], []],
    ),
    (
        "a_jsonb",
        "jsonb[]",
        """ARRAY['{"a":1}'::jsonb, 'null', NULL]""",
        "'{}'",
        [['{"a": 1}', "null", None], []],
    ),
    ("a_json", "json[]", """ARRAY['{"a":1}'::json, '"s"']""", "'{}'", [['{"a":1}', '"s"'], []]),
    ("a_box", "box[]", "'{(1,1),(0,0);(3,3),(2,2)}'", "'{}'", [["(1,1),(0,0)", "(3,3),(2,2)"], []]),
    ("a_point", "point[]", "'{\"(1,2)\",NULL}'", "'{}'", [["(1,2)", None], []]),
    ("a_inet", "inet[]", "'{10.0.0.1,::1/64}'", "'{}'", [["10.0.0.1", "::1/64"], []]),
    ("a_money", "money[]", "'{1.5,-2}'", "'{}'", [["1.50", "-2.00"], []]),
    ("a_int8", "int8[]", "'{9223372036854775807}'", "'{}'", [[9223372036854775807], []]),
    ("a_oid", "oid[]", "'{4294967295}'", "'{}'", [[4294967295], []]),
    ("a_int4range", "int4range[]", "'{\"[1,2)\",empty}'", "'{}'", [["[1,2)", "empty"], []]),
    (
        "a_mood",
        "mood[]",
        "'{happy,sad,NULL}'",
        "ARRAY['ok ''quoted''']::mood[]",
        [["happy", "sad", None], ["ok 'quoted'"]],
    ),
    ("a_posint", "posint[]", "'{1,2}'", "'{}'", [[1, 2], []]),
    (
        "a_comp",
        "comp[]",
        "ARRAY[ROW(1,'a',NULL,NULL,'sad','{}',NULL)::comp]",
        "'{}'",
        [["(1,a,,,sad,{},)"], []],
    ),
    ("a_bit", "varbit[]", "'{101,\"\"}'", "'{}'", [["101", ""], []]),
]

# Binary mode cannot reproduce these exactly: the documented fallback is expected there.
BINARY_FALLBACK = {
    ("c_regclass", "regclass", "'pg_class'", "'pg_type'", T),
    ("c_tsvector", "tsvector", "'a fat cat'", "''", T),
    ("c_tsquery", "tsquery", "'fat & rat'", "'!x'", T),
}


def _optional_columns(db: Any) -> list[tuple[str, str, str, str, Expect | list[Any]]]:
    """Columns that depend on the server: interval infinity (17+), xml (libxml builds)."""
    out: list[tuple[str, str, str, str, Expect | list[Any]]] = []
    if db.cluster.major >= 17:
        out.append(("c_interval_inf", "interval", "'infinity'", "'-infinity'", T))
    try:
        db.execute("SELECT '<a/>'::xml")
    except Exception:
        pass  # built without libxml
    else:
        out.append(("c_xml", "xml", "'<a x=\"1\">é</a>'", "'text'", T))
    return out


def _register_catalog(db: Any, registry: TypeRegistry) -> None:
    """What the app does: every non-built-in type from pg_type, with arrays' element,
    domains' base, ranges' subtype and multiranges' range type."""
    rows = db.fetch(
        """SELECT t.oid, n.nspname, t.typname, t.typtype, t.typbasetype,
                  CASE WHEN t.typcategory = 'A' THEN t.typelem
                       WHEN t.typtype = 'r' THEN (SELECT rngsubtype FROM pg_range WHERE rngtypid = t.oid)
                       WHEN t.typtype = 'm' THEN (SELECT rngtypid FROM pg_range WHERE rngmultitypid = t.oid)
                       ELSE 0 END
           FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
           WHERE t.oid >= 16384"""
    )
    for oid, nsp, name, typtype, base, elem in rows:
        registry.register(TypeInfo(int(oid), nsp, name, typtype, int(base), int(elem or 0)))


def _peek(conn: Any, binary: bool) -> list[tuple[int, bytes]]:
    with conn.cursor() as cur:
        for g in GUCS:
            cur.execute(g)
        cur.execute(
            "SELECT lsn::text, data FROM pg_logical_slot_peek_binary_changes("
            "'types_slot', NULL, NULL, 'proto_version', '1', 'publication_names', 'types_pub', "
            f"'binary', '{'true' if binary else 'false'}')"
        )
        out = []
        for lsn, data in cur.fetchall():
            hi, lo = lsn.split("/")
            out.append(((int(hi, 16) << 32) | int(lo, 16), bytes(data)))
        return out


def _decode_inserts(
    messages: list[tuple[int, bytes]], registry: TypeRegistry
) -> tuple[Relation, list[Insert]]:
    decoder = PgOutputDecoder(1)
    relation: Relation | None = None
    inserts: list[Insert] = []
    for lsn, data in messages:
        msg = decoder.decode(data, lsn)
        if isinstance(msg, TypeMessage):
            registry.observe(msg)
        elif isinstance(msg, Relation):
            relation = msg
        elif isinstance(msg, Insert):
            inserts.append(msg)
    assert relation is not None
    return relation, inserts


def _same(a: Any, b: Any) -> bool:
    """Equality that also tells -0.0 from 0.0 and bool from int."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b and repr(a) == repr(b)
    return bool(a == b)


def test_text_and_binary_values_match_server_rendering(pg_db: Any) -> None:
    columns = COLUMNS + _optional_columns(pg_db)
    fallback = sorted(BINARY_FALLBACK)
    every = columns + fallback
    fallback_names = {c[0] for c in fallback}
    pg_db.execute(SETUP)
    col_sql = ", ".join(f"{name} {typ}" for name, typ, *_ in every)
    pg_db.execute(f"CREATE TABLE alltypes (id int PRIMARY KEY, {col_sql})")
    pg_db.execute("CREATE PUBLICATION types_pub FOR TABLE alltypes")
    pg_db.execute("SELECT pg_create_logical_replication_slot('types_slot', 'pgoutput')")
    names = [c[0] for c in every]
    with pg_db.connect() as conn, conn.cursor() as cur:
        cur.execute("BEGIN")
        for row, idx in ((1, 2), (2, 3)):
            vals = ", ".join(c[idx] for c in every)
            cur.execute(f"INSERT INTO alltypes (id, {', '.join(names)}) VALUES ({row}, {vals})")
        cur.execute("INSERT INTO alltypes (id) VALUES (3)")
        cur.execute("COMMIT")

    # The server's own rendering, under the same settings.
    with pg_db.connect() as conn:
        with conn.cursor() as cur:
            for g in GUCS:
                cur.execute(g)
            sel = ", ".join(f"{n}::text, to_json({n})::text" for n in names)
            cur.execute(f"SELECT {sel} FROM alltypes ORDER BY id")
            server = cur.fetchall()
        text_msgs = _peek(conn, binary=False)
        bin_msgs = _peek(conn, binary=True)

    registry = TypeRegistry()
    _register_catalog(pg_db, registry)
    rel_t, ins_t = _decode_inserts(text_msgs, registry)
    rel_b, ins_b = _decode_inserts(bin_msgs, registry)
    assert len(ins_t) == len(ins_b) == 3
    assert set(ins_t[0].new.kinds) == {ord("t")}
    assert ord("b") in set(ins_b[0].new.kinds)

    json_t = RowDecoder(rel_t, registry, "json")
    json_b = RowDecoder(rel_b, registry, "json")
    native_t = RowDecoder(rel_t, registry, "native")
    native_b = RowDecoder(rel_b, registry, "native")
    problems: list[str] = []
    for r in range(3):
        vt = json_t.decode(ins_t[r].new)
        vb = json_b.decode(ins_b[r].new)
        nt = native_t.decode(ins_t[r].new)
        nb = native_b.decode(ins_b[r].new)
        assert vt["id"] == vb["id"] == r + 1
        for i, (name, typ, _v1, _v2, expect) in enumerate(every):
            text, to_json = server[r][2 * i], server[r][2 * i + 1]
            if text is None:
                want = None
            elif isinstance(expect, list):
                want = expect[r]
            else:
                want = expect(text, json.loads(to_json))
            if not _same(vt[name], want):
                problems.append(f"row {r + 1} {name} ({typ}) text mode: {vt[name]!r} != {want!r}")
            if name in fallback_names and text is not None:
                if not (isinstance(vb[name], str) and vb[name].startswith(BINARY_FALLBACK_PREFIX)):
                    problems.append(f"row {r + 1} {name} binary: {vb[name]!r} is not the fallback")
                continue
            if not _same(vb[name], want):
                problems.append(f"row {r + 1} {name} ({typ}) binary mode: {vb[name]!r} != {want!r}")
            if repr(nt[name]) != repr(nb[name]):
                problems.append(
                    f"row {r + 1} {name} native: text {nt[name]!r} != binary {nb[name]!r}"
                )
    assert not problems, "\n".join(problems)


def test_snapshot_reads_give_the_streamed_values(pg_db: Any) -> None:
    """The snapshots' COPY reads (the initial snapshot's block ranges, the incremental
    snapshot's key-ordered chunks) render every column as pgoutput's text mode does: the same
    row read by a snapshot and by the stream converts to the same JSON. A cast to ``text`` in
    the reads would not: ``bool::text`` is ``true`` where the stream sends ``t``, ``inet::text``
    adds the netmask, ``char(n)::text`` drops the padding."""
    import asyncio

    import asyncpg

    from cdcd.decoder.copy_text import copy_rows
    from cdcd.source.copy import copy_batches
    from cdcd.source.snapshot import (
        SnapshotTable,
        TableChunk,
        chunk_query,
        chunk_sql,
        read_rows,
    )

    every = COLUMNS + _optional_columns(pg_db) + sorted(BINARY_FALLBACK)
    pg_db.execute(SETUP)
    col_sql = ", ".join(f"{name} {typ}" for name, typ, *_ in every)
    pg_db.execute(
        f"CREATE TABLE alltypes (id int PRIMARY KEY, {col_sql}, x_char char(6), x_inet inet)"
    )
    pg_db.execute("CREATE PUBLICATION types_pub FOR TABLE alltypes")
    pg_db.execute("SELECT pg_create_logical_replication_slot('types_slot', 'pgoutput')")
    names = [c[0] for c in every]
    with pg_db.connect() as conn, conn.cursor() as cur:
        for row, idx in ((1, 2), (2, 3)):
            vals = ", ".join(c[idx] for c in every)
            cur.execute(
                f"INSERT INTO alltypes (id, {', '.join(names)}, x_char, x_inet) "
                f"VALUES ({row}, {vals}, 'ab', '10.1.2.3')"
            )
        cur.execute("INSERT INTO alltypes (id) VALUES (3)")
        streamed = _peek(conn, binary=False)
    registry = TypeRegistry()
    _register_catalog(pg_db, registry)
    rel, inserts = _decode_inserts(streamed, registry)
    decoder = RowDecoder(rel, registry, "json")
    want = [decoder.decode(insert.new) for insert in inserts]
    table = SnapshotTable(rel, None)

    async def read(sql: str) -> list[Any]:
        conn = await asyncpg.connect(pg_db.dsn, server_settings=dict(GUC_SETTINGS))
        try:
            texts: list[bytes] = []

            async def take(batch: Any, size: int) -> None:
                texts.append(batch.text)

            await copy_batches(conn, sql, len(rel.columns), take)
        finally:
            await conn.close()
        return copy_rows(b"\n".join(texts).split(b"\n"), len(rel.columns))

    problems = []
    for how, sql in (
        ("initial snapshot", chunk_query(TableChunk(table, None, None))),
        ("incremental snapshot", chunk_sql(table, [("id", "integer")], None, 10)),
    ):
        assert sql is not None
        rows = asyncio.run(read(sql))
        got = sorted((decoder.decode(row) for row in rows), key=lambda r: r["id"])
        assert len(got) == 3
        problems += [
            f"{how}, row {r + 1}, {name}: {got[r][name]!r} != streamed {want[r][name]!r}"
            for r in range(3)
            for name in want[r]
            if not _same(got[r][name], want[r][name])
        ]

    async def select() -> list[Any]:  # read_rows: SELECT, for bench/snapshot_read_micro.py
        conn = await asyncpg.connect(pg_db.dsn, server_settings=dict(GUC_SETTINGS))
        try:
            async with conn.transaction():
                return [row async for batch in read_rows(conn, table) for row in batch]
        finally:
            await conn.close()

    got = sorted((decoder.decode(row) for row in asyncio.run(select())), key=lambda r: r["id"])
    problems += [
        f"read_rows, row {r + 1}, {name}: {got[r][name]!r} != streamed {want[r][name]!r}"
        for r in range(3)
        for name in want[r]
        if not _same(got[r][name], want[r][name])
    ]
    assert not problems, "\n".join(problems)


GUC_SETTINGS = tuple(
    (g.split(" ", 1)[1].split("=")[0], g.split("=", 1)[1].strip("'")) for g in GUCS
)
