"""Column-at-a-time conversion of change events to an Arrow record batch (the Parquet hot path).

:class:`ColumnBuilder` turns a run of events of one table into one ``pa.RecordBatch`` with the
schema of :class:`cdcd.sinks.file.parquet.RowLayout`, and gives exactly the batch that
``RowLayout.batch`` (one dict per event, converted value by value) gives for the same events:
the same values, the same nulls, the same ``unrepresentable`` sidecar entries in the same order.
``RowLayout.batch`` stays the reference; the unit tests compare the two over many types.

How: the raw pgoutput values of each column (bytes, as the server sent them) are gathered for
the whole run into an Arrow binary array (by ``cdcd._arrowcols.arrow_columns`` in C, or by
``pa.array`` where that is not in use) and converted by Arrow casts in C when the column's type
has an exact cast:

    text-like types (converter = UTF-8 decode)  bytes → string (validates UTF-8, as decode does)
    int2/int4/int8/oid/xid/cid/xid8             string → int (fails on overflow, like Arrow did)
    float8, float4                              string → float64 (→ float32: the same rounding as
                                                a Python float stored in a float32 column)
    bool                                        value == "t" (exactly ``vt.bool_value``)
    numeric(p, s) → decimal128(p, s)            string → decimal (fails on NaN, ±Infinity, more
                                                than s fraction digits or p digits)
    numeric → string (unconstrained)            the text itself when every value is plain digits
                                                (``format(Decimal(t), "f") == t`` for those)
    date, timestamp                             string → date32 / timestamp(us) (fails on
                                                ±infinity, BC, years after 9999)
    timestamptz                                 string → timestamp(us, UTC), only when every value
                                                ends in ``+00`` (cdcd sets TimeZone=UTC)

A column falls back to the value-by-value path (the same steps as ``RowLayout._row``: native
converter, type check, JSON value into the sidecar when something is lost) when it holds a
binary (``b``) or unchanged-TOAST (``u``) value, when a cast fails or a guard does not hold,
and for every other type (arrays, bytea, money, time, ...). Any other surprise (a tuple of the
wrong width, a value no converter accepts, a value Arrow refuses) hands the whole run to
``RowLayout.batch``, which raises the error the row path always raised.

Unchanged TOAST columns are filled from the TOAST fill image exactly as
``ChangeEvent._fill_unchanged`` does, on the raw values (a converter is a pure function of the
kind and the bytes); the rest are null and listed in ``source.unchanged_toast``.

This module reads the raw parts of :class:`cdcd.events.ChangeEvent` (its tuples, its
transaction and table info): see :func:`_raw_parts`, the one place that does.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from decimal import Decimal
from typing import TYPE_CHECKING, Any, Final, Protocol

import orjson
import pyarrow as pa
import pyarrow.compute as pc

from cdcd import __version__
from cdcd._purepy import c_module
from cdcd.decoder.events import KIND_BINARY, KIND_NULL, KIND_TEXT, KIND_UNCHANGED_TOAST
from cdcd.values.types import UNCHANGED_TOAST, TypeRegistry

if TYPE_CHECKING:
    from cdcd.events import ChangeEvent


class Layout(Protocol):
    """What the builder reads of :class:`cdcd.sinks.file.parquet.RowLayout` (a protocol, so that
    compiling this module does not type-check the file sink and its pydantic models, which the
    package build's environment does not have)."""

    columns: tuple[Any, ...]
    key_names: tuple[str, ...]
    row_type: pa.StructType
    schema: pa.Schema

    def batch(self, events: Sequence[ChangeEvent]) -> pa.RecordBatch: ...

    def linked_key(self, event: ChangeEvent) -> tuple[str, Any] | None: ...


Converter = Callable[[bytes], Any]
Fits = Callable[[Any], bool]

_NUMERIC_OID = 1700
_INT_OIDS = frozenset({20, 21, 23, 26, 28, 29, 5069})
#: the native converter of text-like types (text, varchar, uuid, json, enum, ...): UTF-8 decode
_TEXT_DECODE = TypeRegistry().native_converter(25, -1, KIND_TEXT)
_PLAIN_DECIMAL = r"^-?[0-9]+(\.[0-9]+)?$"
_FAST_KINDS = frozenset({KIND_TEXT, KIND_NULL})
_ARROWCOLS: Final = c_module("cdcd._arrowcols")
#: cdcd._arrowcols.arrow_columns (hand-written C), or None: the columns are gathered in Python
_c_arrow_columns: Callable[..., list[tuple[bytes | None, bytes, bytes, int]] | None] | None = (
    None if _ARROWCOLS is None else _ARROWCOLS.arrow_columns
)
_CAST_ERRORS = (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, OverflowError)


# --- value helpers shared with the row path (RowLayout) --------------------------------------


def as_text(v: Any) -> Any:
    """String columns: native values that are not str yet (e.g. unconstrained numeric)."""
    if v is None or isinstance(v, str):
        return v
    if isinstance(v, Decimal):
        return format(v, "f")  # plain digits as PostgreSQL prints them, never 1E-7
    if isinstance(v, list | dict):
        return orjson.dumps(v, default=str).decode()
    return str(v)


def lost(native: Any, json_value: Any) -> bool:
    """Did the native value drop something the JSON value has (None where JSON is not)?"""
    if native is None:
        return json_value is not None
    if isinstance(native, list) and isinstance(json_value, list):
        return len(native) != len(json_value) or any(
            lost(n, j) for n, j in zip(native, json_value, strict=False)
        )
    return False


def has_none(v: Any) -> bool:
    return v is None or (isinstance(v, list) and any(has_none(x) for x in v))


# --- per-column plans ------------------------------------------------------------------------


class _Fallback(Exception):
    """The run cannot be converted column-wise; RowLayout.batch does it (or raises)."""


def _fast_kind(registry: TypeRegistry, oid: int, typmod: int, resolved: int, t: pa.DataType) -> str:
    """Which Arrow cast converts this column's text values exactly ("" when none does)."""
    if pa.types.is_string(t):
        if registry.native_converter(oid, typmod, KIND_TEXT) is _TEXT_DECODE:
            return "text"
        return "plain_decimal" if resolved == _NUMERIC_OID else ""
    if pa.types.is_integer(t):
        return "int" if resolved in _INT_OIDS else ""
    if pa.types.is_floating(t):
        return "float" if resolved in (700, 701) else ""
    if pa.types.is_boolean(t):
        return "bool" if resolved == 16 else ""
    if pa.types.is_decimal(t):
        return "decimal" if resolved == _NUMERIC_OID else ""
    if pa.types.is_date32(t):
        return "cast" if resolved == 1082 else ""
    if pa.types.is_timestamp(t):
        if resolved == 1184 and t.tz is not None:
            return "timestamptz"
        return "cast" if resolved == 1114 and t.tz is None else ""
    return ""


class _ColumnPlan:
    """One table column: its Arrow type and how to convert its raw values."""

    __slots__ = (
        "fast",
        "fits",
        "json_binary",
        "json_text",
        "name",
        "native_binary",
        "native_text",
        "none_may_hide",
        "type",
    )

    def __init__(
        self,
        registry: TypeRegistry,
        name: str,
        oid: int,
        typmod: int,
        resolved: int,
        t: pa.DataType,
        fits: Fits | None,
        none_may_hide: bool,
    ) -> None:
        self.name = name
        self.type = t
        self.fits = fits
        self.none_may_hide = none_may_hide
        self.fast = _fast_kind(registry, oid, typmod, resolved, t)
        self.native_text = registry.native_converter(oid, typmod, KIND_TEXT)
        self.native_binary = registry.native_converter(oid, typmod, KIND_BINARY)
        self.json_text = registry.json_converter(oid, typmod, KIND_TEXT)
        self.json_binary = registry.json_converter(oid, typmod, KIND_BINARY)

    def cast(self, raw: pa.Array) -> pa.Array | None:
        """The column (its raw values as a binary array) by an exact Arrow cast, or None when
        the values need the slow path."""
        fast = self.fast
        try:
            if fast == "bool":
                return pc.equal(raw, pa.scalar(b"t", pa.binary()))
            text = raw.cast(pa.string())  # validates UTF-8 as bytes.decode() does
            if fast == "text":
                return text
            if fast == "plain_decimal":
                ok = pc.all(pc.match_substring_regex(text, _PLAIN_DECIMAL)).as_py()
                return text if ok in (True, None) else None
            if fast == "float":
                wide = text.cast(pa.float64())
                return wide if self.type == pa.float64() else wide.cast(self.type)
            if fast == "timestamptz":
                ok = pc.all(pc.ends_with(text, "+00")).as_py()
                if ok not in (True, None):
                    return None
            return text.cast(self.type)  # int, decimal, date, timestamp(tz)
        except _CAST_ERRORS:
            return None

    def convert(
        self,
        which: str,
        kinds: Sequence[int],
        raw: Sequence[bytes | None],
        skip: Sequence[bool] | None,
        sidecar: dict[int, list[tuple[str, str]]],
    ) -> pa.Array:
        """Value by value, exactly as ``RowLayout._row``: the native value, or null and the
        JSON value in the sidecar when the native type cannot hold it."""
        fits, none_may_hide, as_string = self.fits, self.none_may_hide, self.fits is None
        native_text, native_binary = self.native_text, self.native_binary
        out: list[Any] = []
        append = out.append
        for row, (kind, b) in enumerate(zip(kinds, raw, strict=True)):
            try:
                if kind == KIND_TEXT:
                    v = native_text(b)  # type: ignore[arg-type]  # t and b carry bytes
                elif kind == KIND_BINARY:
                    v = native_binary(b)  # type: ignore[arg-type]
                else:
                    v = None
            except Exception as exc:  # the row path names the column and value
                raise _Fallback from exc
            bad = False
            if as_string:
                v = as_text(v)
            elif v is not None and not fits(v):  # type: ignore[misc]
                bad = True
            if (bad or (none_may_hide and has_none(v))) and not (skip and skip[row]):
                j = self._json(kind, b)
                if bad or lost(v, j):
                    entry = (f"{which}.{self.name}", orjson.dumps(j).decode())
                    sidecar.setdefault(row, []).append(entry)
                    v = None
            append(v)
        try:
            return pa.array(out, self.type)
        except _CAST_ERRORS as exc:
            raise _Fallback from exc

    def _json(self, kind: int, b: bytes | None) -> Any:
        if kind == KIND_TEXT:
            return self.json_text(b)  # type: ignore[arg-type]
        if kind == KIND_BINARY:
            return self.json_binary(b)  # type: ignore[arg-type]
        return UNCHANGED_TOAST if kind == KIND_UNCHANGED_TOAST else None


# --- the builder -----------------------------------------------------------------------------


_VALUES = operator.attrgetter("values")
_KINDS = operator.attrgetter("kinds")
_PRESENT = functools.partial(operator.is_not, None)  # t is not None


def _raw_parts(events: Sequence[ChangeEvent]) -> tuple[list[Any], ...]:
    """Per event: its transaction info, table info, before, after and TOAST fill images,
    truncate flags, snapshot marker, previous LSN, data-collection order, op, seq, LSN and
    processing time. The encoder's raw parts, before any conversion: the one place that reads
    ChangeEvent internals (one pass; compiled, each a field read)."""
    txns: list[Any] = []
    rels: list[Any] = []
    befores: list[Any] = []
    afters: list[Any] = []
    fills: list[Any] = []
    extras: list[Any] = []
    snapshots: list[Any] = []
    prevs: list[Any] = []
    dcos: list[Any] = []
    ops: list[Any] = []
    seqs: list[Any] = []
    lsns: list[Any] = []
    ts_ms: list[Any] = []
    for event in events:
        txns.append(event._txn)
        rels.append(event._rel)
        befores.append(event._before_tup)
        afters.append(event._after_tup)
        fills.append(event._fill_tup)
        extras.append(event._extra)
        snapshots.append(event._snapshot)
        prevs.append(event._prev_lsn)
        dcos.append(event._dco)
        ops.append(event.op)
        seqs.append(event.seq)
        lsns.append(event.lsn)
        ts_ms.append(event.ts_ms)
    return (
        txns,
        rels,
        befores,
        afters,
        fills,
        extras,
        snapshots,
        prevs,
        dcos,
        ops,
        seqs,
        lsns,
        ts_ms,
    )


def _distinct(*columns: list[Any]) -> tuple[list[tuple[Any, ...]], pa.Array | None]:
    """The distinct rows of the given columns (by ``==``, identity for most objects) in
    first-seen order, and each row's index into them (None: a single distinct row)."""
    n = len(columns[0])
    varying = [c for c in columns if c.count(c[0]) != n]
    if not varying:
        return [tuple(c[0] for c in columns)], None
    keys = varying[0] if len(varying) == 1 else list(zip(*varying, strict=True))
    # per row only C loops (dict(zip), map): the distinct keys in first-seen order, each with
    # the last row that has it (equal keys: equal values), and each row's key's number
    last = dict(zip(keys, range(n), strict=True))
    number = {k: i for i, k in enumerate(last)}
    index = list(map(number.__getitem__, keys))
    rows = list(last.values())
    picked = [[c[row] for row in rows] for c in columns]
    return list(zip(*picked, strict=True)), pa.array(index, pa.int32())


def _spread(values: list[Any], index: pa.Array | None, n: int, t: pa.DataType) -> pa.Array:
    """``values[index[i]]`` for each row; ``values[0]`` everywhere when index is None or all
    values are equal (a list of one value stands for a value shared by every row)."""
    if index is None or values.count(values[0]) == len(values):
        return pa.repeat(pa.scalar(values[0], t), n)
    return pa.array(values, t).take(index)


#: the ``source`` fields set per event, not shared by a transaction's events on a table
_PER_EVENT = frozenset({"lsn", "sequence", "xmin", "seq"})
_CONTEXT = operator.attrgetter("context")


def _shared_fields(keys: list[tuple[Any, Any, str]]) -> dict[str, list[Any]]:
    """For distinct (transaction, table, snapshot) keys: each shared ``source`` field's values,
    one per key, or a list of one value when every key has it. Built a field at a time from
    the ``TxnInfo`` and ``RelInfo`` attributes, so that a batch of a thousand small
    transactions builds no dict per transaction. What ``TxnInfo.source_base`` gives stays
    the reference: when the first key's dict has another field or another value, every key's
    dict is used instead."""
    txns = [k[0] for k in keys]
    rels = [k[1] for k in keys]
    contexts = list(map(_CONTEXT, txns))
    context_keys = contexts if contexts.count(contexts[0]) != len(contexts) else contexts[:1]
    rel_keys = rels if rels.count(rels[0]) != len(rels) else rels[:1]
    fields: dict[str, list[Any]] = {
        "version": [__version__],
        "connector": ["postgresql"],
        "name": [c.name for c in context_keys],
        "db": [c.database for c in context_keys],
        "schema": [None if r is None else r.schema for r in rel_keys],
        "table": [None if r is None else r.table for r in rel_keys],
        "ts_ms": [t.ts_ms for t in txns],
        "ts_us": [t.ts_us for t in txns],
        "snapshot": [k[2] for k in keys],
        "txId": [t.xid for t in txns],
        "commit_lsn": [t.commit_lsn for t in txns],
        "origin": [t.origin for t in txns],
    }
    # commit_lsn is the transaction's, set per event by the envelope (source_block): the base
    # leaves it out, as a streamed transaction's events are rendered before its commit
    reference = txns[0].source_base(rels[0], keys[0][2])
    if set(reference) - _PER_EVENT <= fields.keys() and all(
        reference.get(name) == values[0] for name, values in fields.items() if name != "commit_lsn"
    ):
        return fields
    bases = [txn.source_base(rel, snapshot) for txn, rel, snapshot in keys]
    shared = {name: [b.get(name) for b in bases] for name in reference if name not in _PER_EVENT}
    shared["commit_lsn"] = fields["commit_lsn"]
    return shared


class ColumnBuilder:
    """Events of one table → a record batch of ``layout.schema`` (see the module docstring)."""

    def __init__(self, layout: Layout, registry: TypeRegistry) -> None:
        self.layout = layout
        self.plans = tuple(
            _ColumnPlan(
                registry, c.name, c.oid, c.typmod, c.resolved, c.type, c.fits, c.none_may_hide
            )
            for c in layout.columns
        )
        self.names = tuple(p.name for p in self.plans)
        self.width = len(self.plans)
        self.null_values: tuple[None, ...] = (None,) * self.width
        self.null_kinds = bytes([KIND_NULL]) * self.width
        self.key_index = tuple(self.names.index(k) for k in layout.key_names)
        self.row_fields = list(layout.row_type)
        schema = layout.schema
        self.source_type = schema.field("source").type
        self.transaction_type = schema.field("transaction").type
        self.unrepresentable_type = schema.field("unrepresentable").type

    def batch(self, events: Sequence[ChangeEvent]) -> pa.RecordBatch:
        try:
            return self._batch(events)
        except _Fallback:
            return self.layout.batch(events)
        except AttributeError:  # ChangeEvent internals renamed (the tests catch this): slower,
            return self.layout.batch(events)  # but the same result

    def _batch(self, events: Sequence[ChangeEvent]) -> pa.RecordBatch:
        n = len(events)
        parts = _raw_parts(events)
        txns, rels, befores, afters, fills, extras, snapshots, prevs, dcos = parts[:9]
        ops, seqs, lsns, ts_ms = parts[9:]
        sidecar: dict[int, list[tuple[str, str]]] = {}

        unchanged: list[list[str] | None] = [None] * n
        skip: list[list[bool] | None] | None = None
        after_kinds = {t.kinds for t in afters if t is not None}
        toasted = (
            [i for i, t in enumerate(afters) if t is not None and KIND_UNCHANGED_TOAST in t.kinds]
            if any(KIND_UNCHANGED_TOAST in k for k in after_kinds)
            else []
        )
        for row in toasted:
            afters[row], names, flags = self._fill(afters[row], fills[row])
            if names:
                unchanged[row] = names
                if skip is None:
                    skip = [None] * n
                skip[row] = flags

        before, before_valid = self._image("before", befores, None, sidecar)
        after, after_valid = self._image("after", afters, skip, sidecar)

        seq_arr = pa.array(seqs, pa.int64())
        lsn_arr = pa.array(lsns, pa.int64())
        source, txid = self._source(
            txns, rels, snapshots, extras, prevs, ops, lsn_arr, seq_arr, unchanged
        )
        if self.layout.key_names:
            source = self._with_links(source, events, ops, extras)
        transaction = pa.StructArray.from_arrays(
            [txid, pc.add(seq_arr, 1), pa.array(dcos, pa.int64())],
            fields=list(self.transaction_type),
            mask=pc.is_null(txid) if txid.null_count else None,
        )
        columns: list[pa.Array] = [
            pa.array(ops, pa.string()),
            before,
            after,
            source,
            pa.array(ts_ms, pa.int64()),
            transaction,
        ]
        if self.key_index:
            columns.append(self._key(before, before_valid, after, after_valid))
        if sidecar:
            entries = [sidecar.get(i) for i in range(n)]
            columns.append(pa.array(entries, self.unrepresentable_type))
        else:
            columns.append(pa.nulls(n, self.unrepresentable_type))
        return pa.RecordBatch.from_arrays(columns, schema=self.layout.schema)

    def _fill(self, new: Any, fill: Any) -> tuple[Any, list[str], list[bool]]:
        """The new row with unchanged TOAST values taken from the fill image where it has them
        (``ChangeEvent._fill_unchanged`` on raw values), the names left unchanged, and a flag
        per column (True: unchanged, no sidecar entry)."""
        kinds = bytearray(new.kinds)
        values = list(new.values)
        old_kinds = fill.kinds if fill is not None else b""
        names: list[str] = []
        flags = [False] * len(kinds)
        for i, kind in enumerate(new.kinds):
            if kind != KIND_UNCHANGED_TOAST:
                continue
            if i < len(old_kinds) and old_kinds[i] != KIND_UNCHANGED_TOAST:
                kinds[i] = old_kinds[i]
                values[i] = fill.values[i]
            else:
                names.append(self.names[i])
                flags[i] = True
        return type(new)(bytes(kinds), tuple(values)), names, flags

    def _image(
        self,
        which: str,
        tuples: list[Any],
        skip: list[list[bool] | None] | None,
        sidecar: dict[int, list[tuple[str, str]]],
    ) -> tuple[pa.Array, pa.Array | None]:
        """The ``before``/``after`` struct column, and its validity (None: all rows valid)."""
        n = len(tuples)
        width = self.width
        null_values, null_kinds = self.null_values, self.null_kinds
        absent = [t is None for t in tuples]
        mask: pa.Array | None = None
        if True not in absent:
            values = list(map(_VALUES, tuples))
            distinct = set(map(_KINDS, tuples))
        elif False not in absent:
            return pa.nulls(n, self.layout.row_type), pa.array([False] * n, pa.bool_())
        else:
            values = [null_values if t is None else t.values for t in tuples]
            distinct = {null_kinds, *map(_KINDS, filter(_PRESENT, tuples))}
            mask = pa.array(absent, pa.bool_())
        if any(len(k) != width for k in distinct):  # the row path names the relation and
            raise _Fallback("a tuple of another width than the relation")  # the widths
        buffers = None if _c_arrow_columns is None else _c_arrow_columns(values, width)
        value_cols: list[tuple[bytes | None, ...]] | None = None
        if buffers is None:
            try:
                value_cols = list(zip(*values, strict=True))
            except ValueError as exc:
                raise _Fallback("a tuple of another width than the relation") from exc
        kinds: list[bytes] | None = None
        children: list[pa.Array] = []
        for i, plan in enumerate(self.plans):
            array = None
            if plan.fast and all(k[i] in _FAST_KINDS for k in distinct):
                if value_cols is not None:
                    array = plan.cast(pa.array(value_cols[i], pa.binary()))
                else:
                    assert buffers is not None
                    validity, offsets, data, null_count = buffers[i]
                    binary = pa.Array.from_buffers(
                        pa.binary(),
                        n,
                        [
                            validity and pa.py_buffer(validity),
                            pa.py_buffer(offsets),
                            pa.py_buffer(data),
                        ],
                        null_count,
                    )
                    array = plan.cast(binary)
            if array is None:
                raw = value_cols[i] if value_cols is not None else [v[i] for v in values]
                if kinds is None:
                    kinds = [null_kinds if t is None else t.kinds for t in tuples]
                col_skip = None
                if skip is not None:
                    col_skip = [s is not None and s[i] for s in skip]
                kind_col = [k[i] for k in kinds]
                array = plan.convert(which, kind_col, raw, col_skip, sidecar)
            children.append(array)
        struct = pa.StructArray.from_arrays(children, fields=self.row_fields, mask=mask)
        return struct, (pc.invert(mask) if mask is not None else None)

    def _source(
        self,
        txns: list[Any],
        rels: list[Any],
        snapshots: list[str],
        extras: list[Any],
        prevs: list[int | None],
        ops: list[str],
        lsn: pa.Array,
        seq: pa.Array,
        unchanged: list[list[str] | None],
    ) -> tuple[pa.Array, pa.Array]:
        """The ``source`` struct and the ``transaction.id`` column. The fields that a
        transaction's events on a table share are built once per distinct (transaction, table,
        snapshot): see :func:`_shared_fields`."""
        n = len(ops)
        keys, index = _distinct(txns, rels, snapshots)
        shared = _shared_fields(keys)
        prev = pa.array(prevs, pa.int64())
        lsn_text = lsn.cast(pa.string())
        sequence = pc.coalesce(
            pc.binary_join_element_wise('["', prev.cast(pa.string()), '","', lsn_text, '"]', ""),
            pc.binary_join_element_wise('[null,"', lsn_text, '"]', ""),
        )
        per_row: dict[str, pa.Array] = {
            "lsn": lsn,
            "sequence": sequence,
            "seq": seq,
            "xmin": pa.nulls(n, pa.int64()),
        }
        children: list[pa.Array] = []
        for field in self.source_type:
            name = field.name
            if name in per_row:
                children.append(per_row[name])
            elif name == "unchanged_toast":
                children.append(pa.array(unchanged, field.type))
            elif name == "old_key" or name == "new_key":
                children.append(pa.nulls(n, field.type))  # filled in by _with_links
            elif name == "truncate":
                flags = (
                    [
                        {"cascade": x[0], "restart_identity": x[1]} if op == "t" else None
                        for op, x in zip(ops, extras, strict=True)
                    ]
                    if "t" in ops
                    else None
                )
                children.append(
                    pa.nulls(n, field.type) if flags is None else pa.array(flags, field.type)
                )
            else:
                children.append(_spread(shared.get(name, [None]), index, n, field.type))
        source = pa.StructArray.from_arrays(children, fields=list(self.source_type))
        txid = _spread([txn.txid for txn, _, _ in keys], index, n, pa.string())
        return source, txid

    def _with_links(
        self,
        source: pa.StructArray,
        events: Sequence[ChangeEvent],
        ops: list[str],
        extras: list[Any],
    ) -> pa.StructArray:
        """``source`` with its ``old_key`` / ``new_key`` children filled in on the two events of
        each key change (:meth:`RowLayout.linked_key`; both null on every other event)."""
        layout = self.layout
        n = len(events)
        links: dict[str, list[Any]] = {"old_key": [None] * n, "new_key": [None] * n}
        found = False
        for row, (op, extra) in enumerate(zip(ops, extras, strict=True)):
            if extra is not None and (op == "c" or op == "d"):
                link = layout.linked_key(events[row])
                if link is not None:
                    links[link[0]][row] = link[1]
                    found = True
        if not found:
            return source
        children = [
            pa.array(links[f.name], f.type) if f.name in links else source.field(i)
            for i, f in enumerate(self.source_type)
        ]
        return pa.StructArray.from_arrays(children, fields=list(self.source_type))

    def _key(
        self,
        before: pa.Array,
        before_valid: pa.Array | None,
        after: pa.Array,
        after_valid: pa.Array | None,
    ) -> pa.Array:
        """The key columns of the new row, or of the old row where there is no new row; null
        when there is neither (truncates)."""
        if after_valid is None:  # every row has a new image
            children = [after.field(i) for i in self.key_index]
            mask = None
        else:
            children = [
                pc.if_else(after_valid, after.field(i), before.field(i)) for i in self.key_index
            ]
            mask = None
            if before_valid is not None:
                valid = pc.or_(after_valid, before_valid)
                mask = None if pc.all(valid).as_py() else pc.invert(valid)
        fields = [self.row_fields[i] for i in self.key_index]
        return pa.StructArray.from_arrays(children, fields=fields, mask=mask)
