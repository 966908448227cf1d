"""Column values: from pgoutput TupleData bytes to JSON values and native Python values.

API (others build on exactly this)::

    UNCHANGED_TOAST = "__debezium_unavailable_value"
    TypeInfo(oid, namespace, name, category, base_oid=0, elem_oid=0)
    TypeRegistry(): observe(Type), register(TypeInfo), type_name(oid),
                    json_converter(oid, typmod, kind), native_converter(oid, typmod, kind),
                    numeric_precision_scale(typmod), binary_exact(oid)
    RowDecoder(relation, registry, "json" | "native"): names, decode(tup), unchanged(tup),
                    row_json(tup), columns_json(tup, idx, prefixes), json_prefixes(names)

Values follow docs/events.md. The decisions the contract leaves open:

- Fractions of seconds are rendered as PostgreSQL prints them: trailing zeros trimmed, no
  fraction when zero (``12:00:00.5``, ``2024-01-01T00:00:00Z``).
- date/timestamp/timestamptz: ``infinity``/``-infinity`` as those strings; BC values as
  PostgreSQL's ISO text under TimeZone=UTC (``0044-03-15 BC``, ``0044-03-15 12:00:00 BC``,
  ``0044-03-15 12:00:00+00 BC``); years after 9999 in ISO form (``10000-01-01T00:00:00``).
- timetz: PostgreSQL's text (``12:00:00.5+05:30``); native: the same string.
- interval: IntervalStyle=iso_8601 text (``P1Y2M3DT4H5M6.5S``, ``PT0S``,
  ``P-1Y-2M3DT-4H-5M-6.5S``); native: the same string (months and days have no timedelta).
- money: exact decimal string with two fraction digits (``"-1234.56"``), assuming
  ``lc_monetary=C`` (or any locale with ``.`` as decimal point and 2 fraction digits).
- float4 from binary: the double of float4's shortest decimal digits, i.e. the same number the
  text form gives (1.1, not 1.100000023841858).
- ``"char"``: its text (bytes >= 0x80 as ``\\ooo``); json/jsonb/jsonpath/xml: their text.
- Arrays whose type is an array of a *registered* element type become lists; arrays of types
  only known from a Type message are their text form (the element type is unknown).
- Ranges, multiranges, composites, enums, domains' base, geometric, network, bit, tid, pg_lsn,
  tsvector, etc.: the text form (composites/ranges from binary are re-rendered as text).
- Native (Parquet): int, float (nan/inf floats), Decimal for numeric and money (numeric
  NaN/±Infinity as str), bool, str, bytes (bytea), str (uuid), date/time/naive datetime/aware
  UTC datetime, ``None`` when the value has no Python equivalent (±infinity, BC, year > 9999,
  time 24:00:00); interval/timetz/json as str; arrays as lists (text when lower bound != 1).
- Binary columns of a type with no faithful binary decoder here (reg* types send an OID, not a
  name; tsvector, tsquery, extension types; types only observed by name) become
  ``BINARY_FALLBACK_PREFIX + base64(bytes)``. ``binary_exact(oid)`` tells the app whether a
  column type decodes exactly in binary mode, so it can choose text mode for such publications.

Converters are pure functions of the column bytes, cached per (oid, typmod, kind, target).
Register catalog information before building RowDecoders: ``register``/``observe`` clear the
converter cache, but RowDecoders already built keep their converters.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any, Final, Literal

import orjson

from cdcd._purepy import c_module
from cdcd.decoder.events import (
    KIND_BINARY,
    KIND_NULL,
    KIND_TEXT,
    KIND_UNCHANGED_TOAST,
    Relation,
    TupleData,
)
from cdcd.decoder.events import Type as TypeMessage
from cdcd.errors import RemoteProtocolError
from cdcd.values import binary as vb
from cdcd.values import text as vt
from cdcd.values.builtin_types import BUILTIN_TYPES

UNCHANGED_TOAST: Final = "__debezium_unavailable_value"

#: A binary value cdcd cannot decode exactly: this prefix, then the bytes in base64.
BINARY_FALLBACK_PREFIX: Final = "__cdcd_binary_base64:"

Converter = Callable[[bytes], Any]
Target = Literal["json", "native"]


@dataclass(frozen=True, slots=True)
class TypeInfo:
    """A type from the catalog (pg_type), registered by the app.

    ``category`` is pg_type.typtype: ``b`` base, ``e`` enum, ``d`` domain, ``c`` composite,
    ``r`` range, ``m`` multirange, ``p`` pseudo. ``base_oid`` is typbasetype for domains.
    ``elem_oid`` is typelem for array types (typcategory ``A``); for ranges cdcd reads it as
    the subtype (pg_range.rngsubtype) and for multiranges as the range type
    (pg_range.rngtypid), which their binary forms need.
    """

    oid: int
    namespace: str
    name: str
    category: str
    base_oid: int = 0
    elem_oid: int = 0


# --- per-type converter table for built-in scalar types -----------------------------------------


@dataclass(frozen=True, slots=True)
class _Codec:
    text_json: Converter
    text_native: Converter
    bin_json: Converter
    bin_native: Converter


def _decode(b: bytes) -> str:
    return b.decode()


_INT_SIGNED: Final = _Codec(int, int, vb.int_signed, vb.int_signed)
_INT_UNSIGNED: Final = _Codec(int, int, vb.int_unsigned, vb.int_unsigned)
_TEXTLIKE: Final = _Codec(_decode, _decode, _decode, _decode)
_JSONB: Final = _Codec(_decode, _decode, vb.render_jsonb, vb.render_jsonb)


def _float8_native(b: bytes) -> float:
    return float(vb.unpack_f64(b)[0])


def _float_bin_json(value: Callable[[bytes], float]) -> Converter:
    def convert(b: bytes) -> float | str:
        x = value(b)
        if x - x == 0.0:
            return x
        return "NaN" if x != x else ("Infinity" if x > 0 else "-Infinity")

    return convert


def _numeric_bin_native(b: bytes) -> Decimal | str:
    s = vb.render_numeric(b)
    return s if s[-1] in "Ny" else Decimal(s)


def _money_bin_native(b: bytes) -> Decimal:
    return Decimal(vb.money_value(b))


def _bytea_bin_native(b: bytes) -> bytes:
    return bytes(b)


def _interval_json(b: bytes) -> str:
    return vb.render_interval(b)


def _date_bin_json(b: bytes) -> str:
    return vb.render_date(b)


def _build_codecs() -> dict[int, _Codec]:
    c: dict[int, _Codec] = {}
    for oid in (20, 21, 23):
        c[oid] = _INT_SIGNED
    for oid in (26, 28, 29, 5069):  # oid, xid, cid, xid8
        c[oid] = _INT_UNSIGNED
    for oid in (19, 25, 1042, 1043, 114, 142, 1790):  # name text bpchar varchar json xml refcursor
        c[oid] = _TEXTLIKE
    c[3802] = _JSONB
    c[4072] = _JSONB  # jsonpath
    c[700] = _Codec(vt.float_json, float, _float_bin_json(vb.float4_value), vb.float4_value)
    c[701] = _Codec(vt.float_json, float, _float_bin_json(_float8_native), _float8_native)
    c[1700] = _Codec(_decode, vt.numeric_native, vb.render_numeric, _numeric_bin_native)
    c[790] = _Codec(vt.money_json, vt.money_native, vb.money_value, _money_bin_native)
    c[16] = _Codec(vt.bool_value, vt.bool_value, vb.bool_value, vb.bool_value)
    c[17] = _Codec(vt.bytea_json, vt.bytea_native, vb.bytea_base64, _bytea_bin_native)
    c[18] = _Codec(_decode, _decode, vb.render_char, vb.render_char)
    c[2950] = _Codec(_decode, _decode, vb.render_uuid, vb.render_uuid)
    c[1082] = _Codec(_decode, vt.date_native, _date_bin_json, vb.date_native)
    c[1083] = _Codec(_decode, vt.time_native, vb.render_time, vb.time_native)
    c[1266] = _Codec(_decode, _decode, vb.render_timetz, vb.render_timetz)
    c[1114] = _Codec(vt.timestamp_json, vt.timestamp_native, vb.timestamp_json, vb.timestamp_native)
    c[1184] = _Codec(
        vt.timestamptz_json, vt.timestamptz_native, vb.timestamptz_json, vb.timestamptz_native
    )
    c[1186] = _Codec(_decode, _decode, _interval_json, _interval_json)
    # Everything else the binary module renders exactly: its text form, both targets.
    for oid, render in vb.RENDERERS.items():
        if oid not in c:
            c[oid] = _Codec(_decode, _decode, render, render)
    return c


_CODECS: Final = _build_codecs()

#: Built-in ranges → subtype, multiranges → range type.
_RANGE_SUBTYPES: Final = {3904: 23, 3906: 1700, 3908: 1114, 3910: 1184, 3912: 1082, 3926: 20}
_MULTIRANGE_RANGES: Final = {4451: 3904, 4532: 3906, 4533: 3908, 4534: 3910, 4535: 3912, 4536: 3926}
_BOX_OID: Final = 603
_BUILTIN_BY_NAME: Final = {name: oid for oid, (name, _t, _e) in BUILTIN_TYPES.items()}
_CONTAINERS: Final[dict[str, Callable[[bytes, Callable[[bytes], str]], str]]] = {
    "r": vb.render_range,
    "m": vb.render_multirange,
}


def _null(_: bytes | None) -> None:
    return None


def _fallback(b: bytes) -> str:
    return BINARY_FALLBACK_PREFIX + vb.bytea_base64(b)


class TypeRegistry:
    """Every type cdcd knows: built-in OIDs (fixed), Type messages, and catalog registrations."""

    __slots__ = ("_cache", "_infos", "_renderers")

    def __init__(self) -> None:
        self._infos: dict[int, TypeInfo] = {}
        for oid, (name, typtype, elem) in BUILTIN_TYPES.items():
            self._infos[oid] = TypeInfo(oid, "pg_catalog", name, typtype, 0, elem)
        for oid, sub in _RANGE_SUBTYPES.items():
            self._infos[oid] = TypeInfo(oid, "pg_catalog", BUILTIN_TYPES[oid][0], "r", 0, sub)
        for oid, rng in _MULTIRANGE_RANGES.items():
            self._infos[oid] = TypeInfo(oid, "pg_catalog", BUILTIN_TYPES[oid][0], "m", 0, rng)
        self._cache: dict[tuple[int, int, int, bool], Converter] = {}
        self._renderers: dict[int, Callable[[bytes], str] | None] = {}

    # --- catalog ------------------------------------------------------------------------------

    def observe(self, msg: TypeMessage) -> None:
        """A pgoutput Type message: a name for a non-built-in OID. Information already
        registered from the catalog wins. For a domain, pgoutput names the domain's *base*
        type (``int4`` in ``pg_catalog``, sent as namespace ``""``): such a message makes the
        OID a domain over that built-in type, so text and binary values decode as the base
        type even without catalog information. Anything else stays of unknown category."""
        known = self._infos.get(msg.oid)
        if known is not None and known.category != "?":
            return
        info = TypeInfo(msg.oid, msg.namespace, msg.name, "?")
        if msg.namespace in ("", "pg_catalog"):
            base = _BUILTIN_BY_NAME.get(msg.name)
            if base is not None and base != msg.oid:
                info = TypeInfo(msg.oid, msg.namespace, msg.name, "d", base_oid=base)
        if known != info:
            self._infos[msg.oid] = info
            self._invalidate()

    def register(self, info: TypeInfo) -> None:
        if self._infos.get(info.oid) != info:
            self._infos[info.oid] = info
            self._invalidate()

    def _invalidate(self) -> None:
        self._cache.clear()
        self._renderers.clear()

    def type_name(self, oid: int) -> str:
        """``int4``, ``_text``, ``public.mood``; ``oid:<n>`` for an OID never seen."""
        info = self._infos.get(oid)
        if info is None:
            return f"oid:{oid}"
        if info.namespace in ("pg_catalog", ""):
            return info.name
        return f"{info.namespace}.{info.name}"

    def info(self, oid: int) -> TypeInfo | None:
        return self._infos.get(oid)

    def _resolve(self, oid: int) -> TypeInfo | None:
        """The type behind any chain of domains."""
        info = self._infos.get(oid)
        for _ in range(32):
            if info is None or info.category != "d" or not info.base_oid:
                return info
            info = self._infos.get(info.base_oid)
        raise RemoteProtocolError(f"domain chain too deep at type {oid}")

    @staticmethod
    def numeric_precision_scale(typmod: int) -> tuple[int, int] | None:
        """numeric(p, s) from an attribute typmod; None when unconstrained. Scale may be
        negative or exceed the precision (PostgreSQL 15+)."""
        if typmod < 4:
            return None
        t = typmod - 4
        precision = (t >> 16) & 0xFFFF
        scale = ((t & 0x7FF) ^ 1024) - 1024
        return precision, scale

    def binary_exact(self, oid: int) -> bool:
        """Does a binary value of this type decode exactly (same value as text mode)?"""
        info = self._resolve(oid)
        if info is None:
            return False
        if info.category == "e":
            return True
        if self._is_array(info):
            return self.binary_exact(info.elem_oid)
        if info.category in ("r", "m"):
            return bool(info.elem_oid) and self.binary_exact(info.elem_oid)
        if info.category == "c":
            return True  # fields carry their OIDs; checked per value
        return info.oid in _CODECS

    # --- converters ---------------------------------------------------------------------------

    def json_converter(self, oid: int, typmod: int, kind: int) -> Converter:
        """bytes of a ``t`` (kind ``ord('t')``) or ``b`` column → its JSON value."""
        return self._converter(oid, typmod, kind, True)

    def native_converter(self, oid: int, typmod: int, kind: int) -> Converter:
        """bytes of a ``t`` or ``b`` column → its native Python value (Parquet)."""
        return self._converter(oid, typmod, kind, False)

    def _converter(self, oid: int, typmod: int, kind: int, json: bool) -> Converter:
        key = (oid, typmod, kind, json)
        conv = self._cache.get(key)
        if conv is None:
            if kind not in (KIND_TEXT, KIND_BINARY):
                raise ValueError(f"converter kind must be ord('t') or ord('b'), not {kind!r}")
            conv = self._build(oid, kind == KIND_BINARY, json)
            self._cache[key] = conv
        return conv

    @staticmethod
    def _is_array(info: TypeInfo) -> bool:
        return info.elem_oid != 0 and info.category in ("b", "?")

    def _build(self, oid: int, binary: bool, json: bool) -> Converter:
        info = self._resolve(oid)
        if info is None:
            return _fallback if binary else _decode
        codec = _CODECS.get(info.oid)
        if codec is not None:
            if binary:
                return codec.bin_json if json else codec.bin_native
            return codec.text_json if json else codec.text_native
        if self._is_array(info):
            return self._array_converter(info, binary, json)
        if info.category == "e":
            return _decode  # enum: label in both formats
        if not binary:
            return _decode  # every other type: its text form
        render = self.renderer(info.oid)
        if render is None:
            return _fallback
        exact = render

        def convert(b: bytes) -> str:
            try:
                return exact(b)
            except vb.NoRendererError:
                return _fallback(b)

        return convert

    def _array_converter(self, info: TypeInfo, binary: bool, json: bool) -> Converter:
        delim = ";" if info.elem_oid == _BOX_OID else ","
        if not binary:
            return vt.array_converter(self._converter(info.elem_oid, -1, KIND_TEXT, json), delim)
        registry = self
        elem_convs: dict[int, Converter] = {}

        def convert(b: bytes) -> Any:
            elem, dims, lbs, off = vb.array_header(b)
            if not dims:
                return []
            for lb in lbs:
                if lb != 1:
                    try:
                        return vb.render_array(b, registry.renderer, delim)
                    except vb.NoRendererError:
                        return _fallback(b)
            conv = elem_convs.get(elem)
            if conv is None:
                conv = elem_convs[elem] = registry._converter(elem, -1, KIND_BINARY, json)
            total = 1
            for d in dims:
                total *= d
            flat = [None if v is None else conv(v) for v in vb.array_elements(b, off, total)]
            return vb.nest(flat, dims) if len(dims) > 1 else flat

        return convert

    def renderer(self, oid: int) -> Callable[[bytes], str] | None:
        """Binary value of ``oid`` → the exact text the server would send; None if unknown."""
        if oid in self._renderers:
            return self._renderers[oid]
        self._renderers[oid] = None  # breaks cycles while building
        render = self._build_renderer(oid)
        self._renderers[oid] = render
        return render

    def _build_renderer(self, oid: int) -> Callable[[bytes], str] | None:
        info = self._resolve(oid)
        if info is None:
            return None
        builtin = vb.RENDERERS.get(info.oid)
        if builtin is not None:
            return builtin
        if info.category == "e":
            return _decode
        registry = self
        if self._is_array(info):
            delim = ";" if info.elem_oid == _BOX_OID else ","

            def render_array(b: bytes) -> str:
                return vb.render_array(b, registry.renderer, delim)

            return render_array
        if info.category == "c":

            def render_record(b: bytes) -> str:
                return vb.render_record(b, registry.renderer)

            return render_record
        outer = _CONTAINERS.get(info.category)
        if outer is not None and info.elem_oid:
            inner = self.renderer(info.elem_oid)  # range: subtype; multirange: range type
            if inner is None:
                return None
            inner_render, outer_render = inner, outer

            def render_container(b: bytes) -> str:
                return outer_render(b, inner_render)

            return render_container
        return None


# --- rows ------------------------------------------------------------------------------------

RowJson = Callable[..., "bytes | None"]
SnapshotLines = Callable[..., "list[bytes] | None"]


#: The module cdcd._rowjson (hand-written C, cdcd/_rowjson.c), or None where it is not in use:
#: its callers then take their Python path, which gives the same bytes.
_ROWJSON: Final = c_module("cdcd._rowjson")
_c_row_json: Final[RowJson | None] = None if _ROWJSON is None else _ROWJSON.row_json
#: cdcd._rowjson.event_body, or None: ChangeEvent._body formats row events in Python then.
C_EVENT_BODY: Final[Callable[..., bytes] | None] = None if _ROWJSON is None else _ROWJSON.event_body
_c_snapshot_lines: Final[SnapshotLines | None] = (
    None if _ROWJSON is None else _ROWJSON.snapshot_lines
)
_c_copy_snapshot_lines: Final[SnapshotLines | None] = (
    None if _ROWJSON is None else _ROWJSON.copy_snapshot_lines
)

#: The fast path of each column in cdcd._rowjson.row_json (the codes of cdcd/_rowjson.c), by
#: the column's text converter: the integer text as it is, ``true``/``false``, the text as a
#: JSON string, a timestamp rewritten in ISO form, a float's digits as orjson writes them; any
#: other converter: called, then orjson.
JSON_CONVERT: Final = 0
_JSON_CODES: Final[dict[Callable[[Any], Any], int]] = {
    int: 1,
    vt.bool_value: 2,
    _decode: 3,
    vt.timestamptz_json: 4,
    vt.timestamp_json: 5,
    vt.float_json: 6,
}


def json_prefixes(names: tuple[str, ...]) -> tuple[bytes, ...]:
    """What comes before each value in a JSON object of these names: ``{"a":``, ``,"b":``..."""
    return tuple((b"," if i else b"{") + orjson.dumps(n) + b":" for i, n in enumerate(names))


class RowDecoder:
    """Precomputed per-relation converters: built once per Relation message and target."""

    __slots__ = (
        "_binary",
        "_json_codes",
        "_json_prefixes",
        "_plans",
        "_registry",
        "_relation",
        "_text",
        "_unchanged",
        "names",
    )

    _MAX_PLANS: Final = 256

    def __init__(self, relation: Relation, registry: TypeRegistry, target: Target) -> None:
        if target not in ("json", "native"):
            raise ValueError(f"target must be 'json' or 'native', not {target!r}")
        make = registry.json_converter if target == "json" else registry.native_converter
        cols = relation.columns
        self._relation = relation
        self._registry = registry
        self.names: tuple[str, ...] = tuple(c.name for c in cols)
        self._text = tuple(make(c.type_oid, c.typmod, KIND_TEXT) for c in cols)
        self._binary = tuple(make(c.type_oid, c.typmod, KIND_BINARY) for c in cols)
        # For 'n' and 'u' the value is None: a dict lookup maps it without a Python frame.
        unchanged: Callable[[Any], Any] = {None: UNCHANGED_TOAST}.get if target == "json" else _null
        self._unchanged = unchanged
        n = len(cols)
        self._plans: dict[bytes, tuple[Callable[[Any], Any], ...]] = {
            bytes([KIND_TEXT]) * n: self._text,
            bytes([KIND_BINARY]) * n: self._binary,
        }
        # row_json: one fast-path code per column (JSON target with the C module only)
        self._json_codes: bytes | None = None
        self._json_prefixes: tuple[bytes, ...] = ()
        if target == "json" and _c_row_json is not None:
            self._json_codes = bytes(_JSON_CODES.get(c, JSON_CONVERT) for c in self._text)
            self._json_prefixes = json_prefixes(self.names)

    def _plan(self, kinds: bytes) -> tuple[Callable[[Any], Any], ...]:
        if len(kinds) != len(self.names):
            raise RemoteProtocolError(
                f"tuple of {len(kinds)} columns for relation "
                f"{self._relation.namespace}.{self._relation.name} of {len(self.names)} columns"
            )
        plan: list[Callable[[Any], Any]] = []
        for i, k in enumerate(kinds):
            if k == KIND_TEXT:
                plan.append(self._text[i])
            elif k == KIND_BINARY:
                plan.append(self._binary[i])
            elif k == KIND_NULL:
                plan.append(_null)
            elif k == KIND_UNCHANGED_TOAST:
                plan.append(self._unchanged)
            else:
                raise RemoteProtocolError(
                    f"unknown TupleData kind {bytes([k])!r} for column {self.names[i]!r} of "
                    f"{self._relation.namespace}.{self._relation.name}"
                )
        if len(self._plans) >= self._MAX_PLANS:
            self._plans.clear()
        result = self._plans[kinds] = tuple(plan)
        return result

    def decode(self, tup: TupleData) -> dict[str, Any]:
        """Column name → value. ``n`` → None; ``u`` → UNCHANGED_TOAST (json) / None (native)."""
        plan = self._plans.get(tup.kinds)
        if plan is None:
            plan = self._plan(tup.kinds)
        try:
            # len(kinds) == len(names) holds for every plan; TupleData keeps kinds and values
            # the same length.
            return dict(zip(self.names, map(operator.call, plan, tup.values)))  # noqa: B905
        except Exception as exc:
            raise self._explain(tup, exc) from exc

    def row_json(self, tup: TupleData) -> bytes | None:
        """``orjson.dumps(self.decode(tup))``, written by cdcd._rowjson from the column bytes.
        None where that module is not in use (see cdcd/_purepy.py), for the native target, and
        for a row with unchanged TOAST (the caller fills those in): take :meth:`decode` then."""
        return self._written(tup, None, self._json_prefixes)

    def columns_json(
        self, tup: TupleData, idx: tuple[int, ...], prefixes: tuple[bytes, ...]
    ) -> bytes | None:
        """:meth:`row_json` of the columns ``idx`` only (a key), ``prefixes`` from
        :func:`json_prefixes` of their names; None as there."""
        return self._written(tup, idx, prefixes)

    def _written(
        self, tup: TupleData, idx: tuple[int, ...] | None, prefixes: tuple[bytes, ...]
    ) -> bytes | None:
        row_json = _c_row_json
        if row_json is None or self._json_codes is None:
            return None
        try:
            return row_json(
                prefixes,
                idx,
                self._json_codes,
                self._text,
                self._binary,
                tup.kinds,
                tup.values,
                orjson.dumps,
            )
        except Exception as exc:
            raise self._explain(tup, exc) from exc

    def snapshot_lines(
        self,
        batch: list[TupleData] | bytes,
        from_copy: bool,
        key_idx: tuple[int, ...] | None,
        key_prefixes: tuple[bytes, ...],
        head: bytes,
        last_head: bytes,
        final: int,
        commit_lsn: int,
        first_seq: int,
        ts_ms: int,
        extra: bytes,
        pieces: tuple[bytes, ...],
    ) -> list[bytes] | None:
        """The JSON Lines records of a snapshot's op ``r`` events of the rows ``batch``
        (TupleData; with ``from_copy``, COPY's text of them, not parsed into rows), each with its
        newline and without a transaction block: what each event's record_json() gives
        (cdcd._rowjson.snapshot_lines, copy_snapshot_lines), in pieces of about 64 KiB to be
        written one after the other (a record may span two). None where :meth:`row_json`
        would be, for a COPY line of another number of fields, or where a value fails to
        convert: the caller's per-event path then names it. ``pieces``: the envelope's constant
        bytes (cdcd.events.envelope.ROW), which the compiled code splices."""
        make = _c_copy_snapshot_lines if from_copy else _c_snapshot_lines
        if make is None or self._json_codes is None:
            return None
        try:
            return make(
                batch,
                self._json_prefixes,
                self._json_codes,
                self._text,
                self._binary,
                key_idx,
                key_prefixes,
                head,
                last_head,
                final,
                commit_lsn,
                first_seq,
                ts_ms,
                extra,
                orjson.dumps,
                pieces,
            )
        except Exception:
            return None

    def _explain(self, tup: TupleData, exc: Exception) -> Exception:
        """Name the column, type and value that failed to convert."""
        plan = self._plans.get(tup.kinds) or self._plan(tup.kinds)
        for i, (conv, value) in enumerate(zip(plan, tup.values, strict=False)):
            try:
                conv(value)
            except Exception as inner:
                col = self._relation.columns[i]
                shown = value if value is None or len(value) <= 64 else value[:64] + b"..."
                return RemoteProtocolError(
                    f"cannot convert column {col.name!r} of "
                    f"{self._relation.namespace}.{self._relation.name} "
                    f"(type {self._registry.type_name(col.type_oid)}, oid {col.type_oid}, "
                    f"kind {chr(tup.kinds[i])!r}) value {shown!r}: {inner}"
                )
        return exc

    def unchanged(self, tup: TupleData) -> list[str]:
        """Names of the unchanged-TOAST (``u``) columns."""
        return [n for n, k in zip(self.names, tup.kinds, strict=False) if k == KIND_UNCHANGED_TOAST]
