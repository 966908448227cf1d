"""The change event every sink receives: :class:`ChangeEvent` (its API: ``docs/sinks.md``).

Every sink receives the same event objects, so positions ``(commit_lsn, seq)`` are identical in
every sink. Values are converted lazily, once per event and per representation (JSON-ready for
JSON Lines and Kafka, native for Parquet), with per-relation precomputed converters from
:mod:`cdcd.values.types`. The JSON form is docs/events.md; the rules
that make events out of changes are :mod:`cdcd.events.encoder`'s.
"""

from __future__ import annotations

import base64
from typing import Any, Literal, cast

import orjson

from cdcd.assembler.transaction import RenderedJson
from cdcd.decoder.events import (
    KIND_UNCHANGED_TOAST,
    Message,
    Relation,
    TupleData,
)
from cdcd.events.catalog import Catalog, schema_name
from cdcd.events.context import SinkContext
from cdcd.events.envelope import (
    HEAD_TAIL,
    ROW,
    fields_json,
    message_value,
    row_body,
    row_value,
    sequence,
    source_block,
    source_extra,
    source_fixed,
    source_head,
    source_origin,
    transaction_block,
)
from cdcd.lsn import pg_to_unix_us
from cdcd.values.types import C_EVENT_BODY, UNCHANGED_TOAST, RowDecoder, json_prefixes

__all__ = ["UNCHANGED_TOAST", "ChangeEvent", "Row"]

Row = dict[str, Any]


class RelInfo:
    """Per-relation precomputation: names, key columns and lazily built row decoders."""

    __slots__ = (
        "_json",
        "_native",
        "_schema_info",
        "_source_prefix",
        "catalog",
        "key_idx",
        "key_names",
        "key_prefixes",
        "relation",
        "schema",
        "table",
    )

    def __init__(self, relation: Relation, catalog: Catalog) -> None:
        self.relation = relation
        self.catalog = catalog
        self.schema = schema_name(relation)
        self.table = relation.name
        names = [c.name for c in relation.columns]
        keys = catalog.key_columns(relation)
        # A key column left out of a publication's column list cannot be part of the key.
        present = tuple(k for k in keys or () if k in names)
        self.key_names: tuple[str, ...] | None = present or None
        self.key_idx: tuple[int, ...] = tuple(names.index(k) for k in present)
        self.key_prefixes = json_prefixes(present)  # for RowDecoder.columns_json
        self._json: RowDecoder | None = None
        self._native: RowDecoder | None = None
        self._schema_info: dict[str, Any] | None = None
        self._source_prefix: tuple[SinkContext, bytes] | None = None

    def decoder(self, native: bool) -> RowDecoder:
        if native:
            if self._native is None:
                self._native = RowDecoder(self.relation, self.catalog.types, "native")
            return self._native
        if self._json is None:
            self._json = RowDecoder(self.relation, self.catalog.types, "json")
        return self._json

    def source_prefix(self, context: SinkContext) -> bytes:
        """``{"version":...,"connector":...,"name":...,"db":...,"schema":...,"table":...``: the
        start of every source block of this table (no closing brace), as orjson writes it."""
        cached = self._source_prefix
        if cached is None or cached[0] is not context:
            fields = source_fixed(context.name, context.database, self.schema, self.table)
            cached = self._source_prefix = (context, orjson.dumps(fields)[:-1])
        return cached[1]

    def schema_info(self) -> dict[str, Any]:
        if self._schema_info is None:
            rel = self.relation
            keys = set(self.key_names or ())
            types = self.catalog.types
            self._schema_info = {
                "schema": self.schema,
                "table": self.table,
                "relation_oid": rel.oid,
                "replica_identity": rel.replica_identity,
                "key": list(self.key_names) if self.key_names else None,
                "columns": [
                    {
                        "name": c.name,
                        "type": types.type_name(c.type_oid),
                        "type_oid": c.type_oid,
                        "typmod": c.typmod,
                        "key": c.name in keys,
                    }
                    for c in rel.columns
                ],
            }
        return self._schema_info


class TxnInfo:
    """What the events of one transaction share, and the source blocks built from it."""

    __slots__ = (
        "_heads",
        "_sources",
        "commit_lsn",
        "commit_time",
        "context",
        "origin",
        "origin_json",
        "transactional",
        "ts_ms",
        "ts_us",
        "txid",
        "xid",
    )

    def __init__(
        self,
        context: SinkContext,
        xid: int | None,
        commit_lsn: int,
        commit_time: int,
        origin: str | None,
        transactional: bool,
    ) -> None:
        self.context = context
        self.xid = xid
        self.commit_lsn = commit_lsn
        self.commit_time = commit_time
        self.origin = origin
        self.transactional = transactional
        self.ts_us = pg_to_unix_us(commit_time)
        self.ts_ms = self.ts_us // 1000
        self.txid = f"{xid}:{commit_lsn}" if transactional else None
        self._sources: dict[tuple[int, str], Row] = {}
        self._heads: dict[tuple[int, str], bytes] = {}
        self.origin_json = fields_json(source_origin(origin)) if origin is not None else b""

    def source_base(self, rel: RelInfo | None, snapshot: str) -> Row:
        """The source fields shared by this transaction's events on one table (cached)."""
        cache_key = (id(rel), snapshot)
        base = self._sources.get(cache_key)
        if base is None:
            context = self.context
            fixed = source_fixed(
                context.name,
                context.database,
                rel.schema if rel is not None else None,
                rel.table if rel is not None else None,
            )
            base = source_head(fixed, self.ts_ms, self.ts_us, snapshot, self.xid, self.origin)
            self._sources[cache_key] = base
        return base

    def source_head(self, rel: RelInfo | None, snapshot: str) -> bytes:
        """The JSON of the source fields before ``lsn`` (``{"version":...,"txId":...,``),
        serialised once per table: the per-event fields are formatted onto it."""
        cache_key = (id(rel), snapshot)
        head = self._heads.get(cache_key)
        if head is None:
            # The fields up to "table" are the same for every transaction: serialised once per
            # table (see RelInfo.source_prefix); the rest is formatted here.
            prefix = rel.source_prefix(self.context) if rel is not None else None
            if prefix is None:
                base = self.source_base(rel, snapshot)
                fixed = {k: base[k] for k in list(base)[: list(base).index("lsn")]}
                head = orjson.dumps(fixed)[:-1] + b","
            else:
                txid = b"null" if self.xid is None else b"%d" % self.xid
                head = prefix + HEAD_TAIL % (
                    self.ts_ms,
                    self.ts_us,
                    orjson.dumps(snapshot),
                    txid,
                )
            self._heads[cache_key] = head
        return head


_UNSET: Any = object()


class KeyLink:
    """What the delete and the create of a key change share (their ``extra``): the old image
    (the delete's ``before``), the new row and its TOAST fill image (the create's ``after``)."""

    __slots__ = ("fill", "new", "old")

    def __init__(self, old: TupleData, new: TupleData, fill: TupleData | None) -> None:
        self.old = old
        self.new = new
        self.fill = fill


def _image_key(rel: RelInfo, native: bool, tup: TupleData, fill: TupleData | None) -> Row:
    """The key columns of ``tup`` as :meth:`ChangeEvent.key` gives them for an event whose row
    it is: unchanged TOAST key columns filled from ``fill`` where it has them."""
    dec = rel.decoder(native)
    row = dec.decode(tup)
    kinds = tup.kinds
    if fill is not None and KIND_UNCHANGED_TOAST in kinds:
        old = dec.decode(fill)
        names = dec.names
        for i in rel.key_idx:
            if (
                kinds[i] == KIND_UNCHANGED_TOAST
                and i < len(fill.kinds)
                and fill.kinds[i] != KIND_UNCHANGED_TOAST
            ):
                row[names[i]] = old[names[i]]
    return {name: row[name] for name in rel.key_names or ()}


class ChangeEvent:
    """One change event (docs/events.md). Cheap to make; values are built on first request and
    cached, so every sink sees the same bytes."""

    __slots__ = (
        "_after_tup",
        "_before_tup",
        "_dco",
        "_extra",
        "_fill_tup",
        "_json_body",
        "_json_rows",
        "_key",
        "_native_rows",
        "_prev_lsn",
        "_rel",
        "_rendered",
        "_snapshot",
        "_source",
        "_txn",
        "_value",
        "commit_lsn",
        "commit_time",
        "lsn",
        "op",
        "relation",
        "schema",
        "seq",
        "table",
        "ts_ms",
        "xid",
    )

    def __init__(
        self,
        op: str,
        rel: RelInfo | None,
        txn: TxnInfo,
        lsn: int,
        seq: int,
        dco: int,
        prev_lsn: int | None,
        ts_ms: int,
        before: TupleData | None = None,
        after: TupleData | None = None,
        fill: TupleData | None = None,
        extra: Any = None,
        snapshot: str = "false",
        rendered: RenderedJson | None = None,
    ) -> None:
        self.op = op
        self._rel = rel
        self._txn = txn
        if rel is not None:
            self.relation: Relation | None = rel.relation
            self.schema: str | None = rel.schema
            self.table: str | None = rel.table
        else:
            self.relation = self.schema = self.table = None
        self.lsn = lsn
        self.commit_lsn = txn.commit_lsn
        self.seq = seq
        self.xid = txn.xid
        self.commit_time = txn.commit_time
        self.ts_ms = ts_ms
        self._dco = dco
        self._prev_lsn = prev_lsn
        self._before_tup = before
        self._after_tup = after
        self._fill_tup = fill
        self._extra = extra  # Truncate flags, the Message, or the KeyLink of a key change
        self._snapshot = snapshot
        # (before, after, key) JSON made on arrival (a streamed transaction's change whose
        # one event this is; docs/assembler.md): the bytes the methods below would make
        self._rendered = rendered
        self._json_rows: tuple[Row | None, Row | None, list[str]] | None = None
        self._native_rows: tuple[Row | None, Row | None, list[str]] | None = None
        self._key: Any = _UNSET  # Row | None once built (Any: the sentinel is neither)
        self._source: Row | None = None
        self._value: Row | None = None
        self._json_body: bytes | None = None

    def __repr__(self) -> str:
        where = f"{self.schema}.{self.table}" if self.table is not None else "message"
        return f"<ChangeEvent {self.op} {where} at ({self.commit_lsn:X}, {self.seq})>"

    @property
    def position(self) -> tuple[int, int]:
        return (self.commit_lsn, self.seq)

    @property
    def key_names(self) -> tuple[str, ...] | None:
        return self._rel.key_names if self._rel is not None else None

    @property
    def catalog(self) -> Catalog | None:
        return self._rel.catalog if self._rel is not None else None

    @property
    def transactional(self) -> bool:
        return self._txn.transactional

    def schema_info(self) -> dict[str, Any] | None:
        """The table's columns and key (see :meth:`Encoder.schema_info`); None for messages."""
        return self._rel.schema_info() if self._rel is not None else None

    # --- rows -------------------------------------------------------------------------------

    def _rows(self, native: bool) -> tuple[Row | None, Row | None, list[str]]:
        """(before, after, unchanged TOAST columns) in one representation, cached."""
        rows = self._native_rows if native else self._json_rows
        if rows is not None:
            return rows
        rel = self._rel
        before = after = None
        unchanged: list[str] = []
        if rel is not None:
            dec = rel.decoder(native)
            if self._before_tup is not None:
                before = dec.decode(self._before_tup)
            new = self._after_tup
            if new is not None:
                after = dec.decode(new)
                if KIND_UNCHANGED_TOAST in new.kinds:
                    unchanged = self._fill_unchanged(dec, after, new, before)
        rows = (before, after, unchanged)
        if native:
            self._native_rows = rows
        else:
            self._json_rows = rows
        return rows

    def _fill_unchanged(
        self, dec: RowDecoder, after: Row, new: TupleData, before: Row | None
    ) -> list[str]:
        fill = self._fill_tup
        old: Row | None = None
        old_kinds = b""
        if fill is not None:
            old = before if fill is self._before_tup and before is not None else dec.decode(fill)
            old_kinds = fill.kinds
        names = dec.names
        unchanged = []
        for i, kind in enumerate(new.kinds):
            if kind != KIND_UNCHANGED_TOAST:
                continue
            name = names[i]
            if old is not None and i < len(old_kinds) and old_kinds[i] != KIND_UNCHANGED_TOAST:
                after[name] = old[name]
            else:
                unchanged.append(name)
        return unchanged

    def native_row(self, which: Literal["before", "after"]) -> Row | None:
        """The old or new row with native Python values (Parquet); unchanged TOAST is None."""
        before, after, _ = self._rows(True)
        return before if which == "before" else after

    def unchanged_toast(self) -> list[str]:
        """Columns of the new row whose value PostgreSQL did not send (and no old image had).

        The same in both representations: taken from whichever is built, and without
        converting any value when the row has no unchanged-TOAST column (Parquet asks for
        this on every event)."""
        rows = self._json_rows or self._native_rows
        if rows is not None:
            return rows[2]
        new = self._after_tup
        if new is None or self._rel is None or KIND_UNCHANGED_TOAST not in new.kinds:
            return []
        return self._rows(False)[2]

    # --- key and value ---------------------------------------------------------------------

    def key_link(self, native: bool = False) -> tuple[str, Row] | None:
        """For the two events of a key change, the field that links them and its value:
        ``("new_key", <the create's key>)`` on the delete, ``("old_key", <the delete's key>)``
        on the create (JSON-ready, or native values for Parquet). None for any other event."""
        link = self._extra
        rel = self._rel
        if not isinstance(link, KeyLink) or rel is None:
            return None
        if self.op == "d":
            return ("new_key", _image_key(rel, native, link.new, link.fill))
        return ("old_key", _image_key(rel, native, link.old, None))

    def key(self) -> Row | None:
        cached = self._key
        if cached is not _UNSET:
            return cast("Row | None", cached)
        key: Row | None = None
        if self.op == "m":
            key = {"prefix": self._extra.prefix}
        elif self._rel is not None and self._rel.key_names is not None and self.op != "t":
            before, after, _ = self._rows(False)
            row = after if after is not None else before
            if row is not None:
                key = {name: row[name] for name in self._rel.key_names}
        self._key = key
        return key

    def source(self) -> Row:
        src = self._source
        if src is None:
            prev = self._prev_lsn
            base = self._txn.source_base(self._rel, self._snapshot)
            lsn = self.lsn
            src = source_block(base, lsn, sequence(prev, lsn), self.commit_lsn, self.seq)
            op = self.op
            if op == "t":
                cascade, restart = self._extra
                src["truncate"] = {"cascade": cascade, "restart_identity": restart}
            elif op == "m":
                src["transactional"] = self._txn.transactional
            else:
                src.update(source_extra(self._rows(False)[2], self.key_link()))
            self._source = src
        return src

    def transaction(self) -> Row | None:
        """The value's ``transaction`` block (``id``, ``total_order``, ``data_collection_order``),
        or None for a non-transactional logical message; built without building :meth:`value`."""
        txid = self._txn.txid
        if txid is None:
            return None
        return transaction_block(txid, self.seq + 1, self._dco)

    def value(self) -> Row:
        value = self._value
        if value is None:
            if self.op == "m":
                msg: Message = self._extra
                message = {
                    "prefix": msg.prefix,
                    "content": base64.b64encode(msg.content).decode("ascii"),
                }
                value = message_value(self.ts_ms, self.source(), message, self.transaction())
            else:
                before, after, _ = self._rows(False)
                value = row_value(
                    before, after, self.source(), self.op, self.ts_ms, self.transaction()
                )
            self._value = value
        return value

    def key_json(self) -> bytes | None:
        """``orjson.dumps(self.key())``: for a row event, written from the key columns' bytes
        where RowDecoder.columns_json can (no dict, no value of the other columns)."""
        rendered = self._rendered
        if rendered is not None:
            return rendered[2]
        key = self._key
        if key is _UNSET:
            rel = self._rel
            op = self.op
            if rel is not None and rel.key_names is not None and op != "m" and op != "t":
                tup = self._after_tup if self._after_tup is not None else self._before_tup
                if tup is not None and self._json_rows is None:
                    made = rel.decoder(False).columns_json(tup, rel.key_idx, rel.key_prefixes)
                    if made is not None:
                        return made
            key = self.key()
        return None if key is None else orjson.dumps(key)

    def value_json(self) -> bytes:
        return self._body() + ROW.end

    def record_json(self) -> bytes:
        """One JSON Lines line (without the newline): the value plus a top-level ``key``."""
        key = self.key_json()
        key_json = b"null" if key is None else key
        if self._json_body is None and C_EVENT_BODY is not None:
            made = self._make_body(key_json)  # the whole record in one piece
            if made is not None:
                return made
        return b"".join((self._body(), ROW.key, key_json, ROW.end))

    def _body(self) -> bytes:
        """The value's JSON without its closing brace, cached.

        The hot path: row events are assembled from the rows' JSON, the source fields
        serialised once per transaction and table, and the per-event numbers, rather than by
        serialising the whole :meth:`value` dict (same JSON, about twice as fast). The rows'
        JSON comes straight from the column bytes (RowDecoder.row_json) unless a row has
        unchanged TOAST to fill in, the event is half of a key change, or the rows are built
        already. Messages and truncates serialise :meth:`value`."""
        body = self._json_body
        if body is None:
            body = self._make_body(None)
            assert body is not None
            self._json_body = body
        return body

    def _make_body(self, key: bytes | None) -> bytes | None:
        """:meth:`_body`, not cached; with ``key`` (cdcd._rowjson in use), the whole JSON Lines
        record with that key instead, or None for a message or a truncate."""
        op = self.op
        if op == "m" or op == "t":
            return None if key is not None else orjson.dumps(self.value())[:-1]
        rel = self._rel
        before_json = after_json = None
        unchanged: list[str] = []
        rendered = self._rendered
        if rendered is not None:
            before_json, after_json = rendered[0], rendered[1]
        elif rel is not None and self._extra is None and self._json_rows is None:
            dec = rel.decoder(False)
            old, new = self._before_tup, self._after_tup
            after_json = b"null" if new is None else dec.row_json(new)
            if after_json is not None:
                before_json = b"null" if old is None else dec.row_json(old)
        if before_json is None or after_json is None:
            before, after, unchanged = self._rows(False)
            before_json = b"null" if before is None else orjson.dumps(before)
            after_json = b"null" if after is None else orjson.dumps(after)
        txn = self._txn
        lsn = self.lsn
        seq = self.seq
        prev = self._prev_lsn
        txid = txn.txid
        link = self.key_link() if self._extra is not None else None
        extra = txn.origin_json  # what the source block has after "seq"
        if unchanged or link is not None:
            extra += fields_json(source_extra(unchanged, link))
        head = txn.source_head(self._rel, self._snapshot)
        if C_EVENT_BODY is not None:  # the same bytes as below, from cdcd/_rowjson.c
            return C_EVENT_BODY(
                before_json, after_json, head, lsn, prev, self.commit_lsn, seq, extra, op,
                self.ts_ms, txid, self._dco, key, ROW,
            )  # fmt: skip
        if key is not None:
            return None  # the caller joins the record
        return row_body(
            before_json, after_json, head, lsn, prev, self.commit_lsn, seq, extra, op,
            self.ts_ms, txid, self._dco, None,
        )  # fmt: skip
