"""From committed transactions to change events: the one place that assigns ``seq``.

docs/events.md. Every sink receives the same :class:`ChangeEvent` objects, so positions
``(commit_lsn, seq)`` are identical in every sink. Values are converted lazily, once per event
and per representation (JSON-ready for JSON Lines and Kafka, native for Parquet), with
per-relation precomputed converters from :mod:`cdcd.values.types`.

``ChangeEvent`` attributes:
    op: str                 "c" "u" "d" "r" "t" "m"
    schema: str | None      None for logical messages
    table: str | None
    relation: Relation | None
    lsn: int                the change's own WAL position
    commit_lsn: int
    seq: int                0-based index within the transaction (after key-change splits)
    xid: int | None
    commit_time: int        PostgreSQL-epoch microseconds
    ts_ms: int              processing time (Unix ms): when the event was made (snapshot rows:
                            when their batch was)
    position -> (commit_lsn, seq)
methods:
    key() -> dict | None          replica-identity (primary key) columns, JSON-ready
    value() -> dict               the whole Debezium-compatible value of docs/events.md
    key_json() -> bytes | None    orjson of key()
    value_json() -> bytes         orjson of value()
    record_json() -> bytes        value plus top-level "key": one JSON Lines line (no newline)
    native_row(which) -> dict | None   "before"/"after" with native Python values (Parquet)
    source() -> dict              the value's ``source`` block
    transaction() -> dict | None  the value's ``transaction`` block (None: non-transactional)
    schema_info() -> dict | None  the table's columns and key, as in Encoder.schema_info
    unchanged_toast() -> list[str]  columns whose value PostgreSQL did not send
    key_link(native=False) -> (field, key) | None   ("new_key", ...) on the delete and
                                  ("old_key", ...) on the create of a key change, else None
    key_names -> tuple[str, ...] | None, catalog -> Catalog

``Encoder(context: SinkContext, catalog: Catalog, clock=time.time)``:
    events(txn: Transaction, cursor=None, last=False) -> Iterator[ChangeEvent]
    batches(txn, max_events=1000, cursor=None, last=False) -> Iterator[list[ChangeEvent]]
    (``cursor``: an :class:`EventCursor` carried from one part of a transaction to the next;
    ``last``: the writer's reading, after which nothing reads the changes again, which lets a
    transaction held in memory free them as they are read: Transaction.take_changes)
    take_counts() -> list[(table, op, n)]   events made since the last call, per "schema.table"
                                          ("_messages" for logical messages) and op
    snapshot_events(relation, rows, *, commit_lsn, commit_time, first_seq=0, xid=None,
                    last=False) -> Iterator[ChangeEvent]          (op "r")
    snapshot_run(relation, rows, ...) -> SnapshotRun   the same events, made when asked for
                                          (rows: a list, or a CopyBatch of COPY text)
    schema_info(relation) -> dict                                 (the file sink's _schema files)

Rules the encoder implements (docs/events.md):

- ``seq`` counts the events of a transaction from 0, after splitting. ``transaction.total_order``
  is ``seq + 1``; ``data_collection_order`` counts 1.. per table (logical messages count as one
  collection of their own).
- An Update whose key values differ between the old image (``K`` or ``O``) and the new row is
  a delete of the old key followed by a create of the new key. Key columns whose old value is
  unknown (``n`` in a ``K`` image: not part of the replica identity) or unchanged TOAST are
  not compared. The pair is linked: the delete's ``source.new_key`` is the create's ``key``,
  the create's ``source.old_key`` the delete's ``key`` (:meth:`ChangeEvent.key_link`); other
  events have neither field. A consumer fills the create's unchanged-TOAST columns from the
  row it held under ``old_key`` (PostgreSQL's own subscriber keeps the old values too).
- ``before`` is the old image when the server sent one: ``O`` the whole row, ``K`` the key
  columns with the other columns null (Debezium's shape); otherwise null.
- Unchanged TOAST (``u``) columns of the new row are filled from an ``O`` image when it carries
  them; otherwise they are ``"__debezium_unavailable_value"`` (None in native rows) and listed
  in ``source.unchanged_toast``.
- ``key()``: the catalog's key columns taken from the new row (the old row for deletes), null
  when the table has none. Truncates have no key; logical messages have ``{"prefix": ...}``
  (Debezium's message key).
- A Truncate of several tables is one op ``t`` event per table, consecutive, each with
  ``source.truncate = {"cascade", "restart_identity"}``. A transaction of kind ``"reset"`` (a
  recreated slot, :mod:`cdcd.pipeline.recreate`) is such truncates with
  ``source.snapshot = "reset"``.
- Logical messages are op ``m`` with ``message = {"prefix", "content": base64}`` and
  ``source.transactional``. A non-transactional one (a Transaction of kind ``"message"``) has
  position ``(its LSN - 1, 0)`` (the assembler's commit LSN for it: inside the message's own
  WAL record, where no transaction can commit), ``source.lsn`` the LSN as sent,
  ``source.txId`` null and ``transaction`` null.
- ``source.sequence`` is the JSON string ``["<previous lsn>","<lsn>"]`` like Debezium's, where
  the previous LSN is that of the previous event of the same transaction, and null for the
  first event (as Debezium writes when it knows no earlier position). It is a pure function of
  the transaction, so a resent transaction gets identical values.
- ``source.ts_ms``/``ts_us`` are the commit time; the top-level ``ts_ms`` is processing time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import orjson

from cdcd.assembler.transaction import ChangeRecord, RenderedJson, Transaction
from cdcd.decoder.events import (
    KIND_NULL,
    KIND_UNCHANGED_TOAST,
    Delete,
    Insert,
    Message,
    Relation,
    Truncate,
    TupleData,
    Update,
)
from cdcd.decoder.pgoutput import change_at
from cdcd.events.catalog import Catalog
from cdcd.events.change_event import ChangeEvent, KeyLink, RelInfo, TxnInfo
from cdcd.events.context import SinkContext
from cdcd.events.snapshot_run import SnapshotRun
from cdcd.values.types import RowDecoder

__all__ = ["Encoder"]

_RELATION_CACHE_LIMIT = 4096

#: what one change becomes, per event: (op, table, before, after, TOAST fill image, extra)
_Parts = tuple[str, RelInfo | None, TupleData | None, TupleData | None, TupleData | None, Any]


def _key_changed(key_idx: tuple[int, ...], old: TupleData, new: TupleData) -> bool:
    """Do the key values of the old image differ from the new row's? Columns whose old value
    is unknown (null in a K image) or unchanged TOAST on either side are not compared."""
    ok, ov, nk, nv = old.kinds, old.values, new.kinds, new.values
    for i in key_idx:
        if i >= len(ok) or i >= len(nk):
            continue
        if ok[i] in (KIND_NULL, KIND_UNCHANGED_TOAST) or nk[i] == KIND_UNCHANGED_TOAST:
            continue
        if ok[i] != nk[i] or ov[i] != nv[i]:
            return True
    return False


def _row_json(dec: RowDecoder, tup: TupleData) -> bytes:
    """A row's JSON as a change event writes it: from the column bytes where cdcd._rowjson
    can, else by serialising the decoded row (the same bytes)."""
    made = dec.row_json(tup)
    return orjson.dumps(dec.decode(tup)) if made is None else made


class EventCursor:
    """Where the events of a transaction handed over in parts (docs/assembler.md) go on: the
    next ``seq``, the ``data_collection_order`` counts per table, the previous event's LSN."""

    __slots__ = ("collections", "prev_lsn", "seq")

    def __init__(self) -> None:
        self.seq = 0
        self.collections: dict[int | None, int] = {}
        self.prev_lsn: int | None = None


class Encoder:
    """Turns transactions into change events for every sink (see the module docstring)."""

    def __init__(
        self,
        context: SinkContext,
        catalog: Catalog,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.context = context
        self.catalog = catalog
        self._clock = clock
        self._rels: dict[int, RelInfo] = {}
        self._counts: dict[tuple[RelInfo | None, str], int] = {}

    def take_counts(self) -> list[tuple[str, str, int]]:
        """The events made since the last call, per table and op: counted here, in compiled
        code, rather than by going over the events again."""
        counts = [
            ("_messages" if rel is None else f"{rel.schema}.{rel.table}", op, n)
            for (rel, op), n in self._counts.items()
        ]
        self._counts.clear()
        return counts

    def _rel(self, relation: Relation) -> RelInfo:
        info = self._rels.get(id(relation))
        if info is None or info.relation is not relation:
            if len(self._rels) >= _RELATION_CACHE_LIMIT:
                self._rels.clear()
            info = RelInfo(relation, self.catalog)
            self._rels[id(relation)] = info
        return info

    def schema_info(self, relation: Relation) -> dict[str, Any]:
        """The table's columns (name, type name, type oid, typmod, key flag) and key."""
        return self._rel(relation).schema_info()

    def events(
        self, txn: Transaction, cursor: EventCursor | None = None, last: bool = False
    ) -> Iterator[ChangeEvent]:
        """The events of ``txn`` in ``seq`` order; ``cursor``: continue a transaction's events
        from its earlier parts (and record where they stop, once all are taken); ``last``: the
        last reading of its changes (:meth:`Transaction.take_changes`)."""
        if txn.kind == "snapshot":  # a chunk of an incremental snapshot: rows of one table
            rows = [record.change.new for record in txn.changes()]  # type: ignore[union-attr]
            if rows:
                relation = next(txn.changes()).relations[0]
                yield from self.snapshot_events(
                    relation, rows, commit_lsn=txn.commit_lsn, commit_time=txn.commit_time
                )
            return
        transactional = txn.kind != "message"
        info = TxnInfo(
            self.context,
            txn.xid if transactional else None,
            txn.commit_lsn,
            txn.commit_time,
            txn.origin,
            transactional,
        )
        clock = self._clock
        # the reset of a recreated slot: truncates marked as such (cdcd.pipeline.recreate)
        marked = "reset" if txn.kind == "reset" else "false"
        if cursor is None:
            cursor = EventCursor()
        collections = cursor.collections
        seq = cursor.seq
        prev_lsn = cursor.prev_lsn
        counts = self._counts

        for record in txn.take_changes() if last else txn.changes():
            lsn = record.lsn
            ts_ms = int(clock() * 1000)
            change = record.change
            if type(change) is Insert:  # the common case, without _split's tuples
                table = self._rel(record.relations[0])
                table_oid: int | None = table.relation.oid
                dco = collections.get(table_oid, 0) + 1
                collections[table_oid] = dco
                inserted: tuple[RelInfo | None, str] = (table, "c")
                counts[inserted] = counts.get(inserted, 0) + 1
                rendered = record.rendered
                if rendered is None:
                    yield ChangeEvent(
                        "c", table, info, lsn, seq, dco, prev_lsn, ts_ms, None, change.new
                    )
                else:
                    yield ChangeEvent(
                        "c", table, info, lsn, seq, dco, prev_lsn, ts_ms, None, change.new,
                        None, None, "false", rendered,
                    )  # fmt: skip
                seq += 1
                prev_lsn = lsn
                continue
            parts = self._split(record, txn)
            # rendered on arrival only where the change is one row event (Encoder.render)
            rendered = record.rendered if len(parts) == 1 else None
            for op, rel, before, after, fill, extra in parts:
                # data_collection_order: per table (by OID); logical messages count under None
                oid = rel.relation.oid if rel is not None else None
                dco = collections.get(oid, 0) + 1
                collections[oid] = dco
                counted = (rel, op)
                counts[counted] = counts.get(counted, 0) + 1
                yield ChangeEvent(
                    op,
                    rel,
                    info,
                    lsn,
                    seq,
                    dco,
                    prev_lsn,
                    ts_ms,
                    before,
                    after,
                    fill,
                    extra,
                    marked,
                    rendered,
                )
                seq += 1
                prev_lsn = lsn
        cursor.seq = seq
        cursor.prev_lsn = prev_lsn

    def render(self, data: bytes, relation: Relation) -> RenderedJson | None:
        """The row JSON of a streamed transaction's Insert, Update or Delete as its one change
        event will write it, made as the change arrives (``data``: its pgoutput bytes, with
        the xid; docs/assembler.md, "Rendering streamed changes"): ``(before, after, key)``,
        the bytes :meth:`ChangeEvent.record_json` and ``key_json`` would otherwise make at the
        commit. None where those bytes come from more than the change (an Update of the key,
        which becomes two linked events, or unchanged TOAST to fill) and where the change does
        not decode or convert: the release then does what it always did, errors included."""
        try:
            change = change_at(data, 0, len(data), 0, True)
            rel = self._rel(relation)
            before: TupleData | None = None
            after: TupleData | None = None
            if type(change) is Insert:
                after = change.new
            elif type(change) is Delete:
                before = change.old
            else:
                update: Update = change  # type: ignore[assignment]
                before, after = update.old, update.new
                if before is not None and rel.key_idx and _key_changed(rel.key_idx, before, after):
                    return None
            if after is not None and KIND_UNCHANGED_TOAST in after.kinds:
                return None
            dec = rel.decoder(False)
            before_json = b"null" if before is None else _row_json(dec, before)
            after_json = b"null" if after is None else _row_json(dec, after)
            key_json: bytes | None = None
            names = rel.key_names
            if names is not None:
                key_row = after if after is not None else before
                assert key_row is not None
                key_json = dec.columns_json(key_row, rel.key_idx, rel.key_prefixes)
                if key_json is None:  # as ChangeEvent.key() makes it
                    row = dec.decode(key_row)
                    key_json = orjson.dumps({name: row[name] for name in names})
            return (before_json, after_json, key_json)
        except Exception:  # the release decodes it again and says what is wrong
            return None

    def _split(self, record: ChangeRecord, txn: Transaction) -> tuple[_Parts, ...]:
        """The events one change becomes: (op, table, before, after, TOAST fill, extra)."""
        change = record.change
        if isinstance(change, Insert):
            return (("c", self._rel(record.relations[0]), None, change.new, None, None),)
        if isinstance(change, Update):
            rel = self._rel(record.relations[0])
            old = change.old
            fill = old if change.old_kind == "O" else None
            if old is not None and rel.key_idx and _key_changed(rel.key_idx, old, change.new):
                link = KeyLink(old, change.new, fill)
                return (
                    ("d", rel, old, None, None, link),
                    ("c", rel, None, change.new, fill, link),
                )
            return (("u", rel, old, change.new, fill, None),)
        if isinstance(change, Delete):
            return (("d", self._rel(record.relations[0]), change.old, None, None, None),)
        if isinstance(change, Truncate):
            flags = (change.cascade, change.restart_identity)
            return tuple(("t", self._rel(r), None, None, None, flags) for r in record.relations)
        if isinstance(change, Message):
            return (("m", None, None, None, None, change),)
        raise TypeError(  # pragma: no cover - Change is a closed union
            f"unexpected change {change!r} in transaction {txn.xid}"
        )

    def batches(
        self,
        txn: Transaction,
        max_events: int = 1000,
        cursor: EventCursor | None = None,
        last: bool = False,
    ) -> Iterator[list[ChangeEvent]]:
        """The events of ``txn`` in lists of at most ``max_events`` (never empty)."""
        batch: list[ChangeEvent] = []
        append = batch.append
        for event in self.events(txn, cursor, last):
            append(event)
            if len(batch) >= max_events:
                yield batch
                batch = []
                append = batch.append
        if batch:
            yield batch

    def snapshot_events(
        self,
        relation: Relation,
        rows: Iterable[TupleData],
        *,
        commit_lsn: int,
        commit_time: int,
        first_seq: int = 0,
        xid: int | None = None,
        last: bool = False,
    ) -> Iterator[ChangeEvent]:
        """Op ``r`` events for rows read by an initial snapshot: :meth:`snapshot_run`'s."""
        batch = rows if isinstance(rows, list) else list(rows)
        run = self.snapshot_run(
            relation,
            batch,
            commit_lsn=commit_lsn,
            commit_time=commit_time,
            first_seq=first_seq,
            xid=xid,
            last=last,
        )
        yield from run.events()

    def snapshot_run(
        self,
        relation: Relation,
        rows: Sequence[TupleData],
        *,
        commit_lsn: int,
        commit_time: int,
        first_seq: int = 0,
        xid: int | None = None,
        last: bool = False,
    ) -> SnapshotRun:
        """Op ``r`` events for rows read by an initial snapshot, made when a sink asks for them
        (:class:`~cdcd.events.snapshot_run.SnapshotRun`; the JSON Lines writer takes their
        records without making them).

        The snapshot feature chooses the position: ``commit_lsn`` = the slot's consistent
        point - 1 (a transaction can commit at the point itself, see :mod:`cdcd.source.snapshot`) and
        ``seq`` counting every row of the snapshot from ``first_seq``.
        Events have ``source.snapshot = "true"``; with ``last=True`` the final row is marked
        ``"last"``. They have no ``transaction`` block; ``lsn`` equals ``commit_lsn``.
        """
        info = TxnInfo(self.context, xid, commit_lsn, commit_time, None, False)
        rel = self._rel(relation)
        ts_ms = int(self._clock() * 1000)  # processing time: once per batch of rows
        read: tuple[RelInfo | None, str] = (rel, "r")
        self._counts[read] = self._counts.get(read, 0) + len(rows)
        final = len(rows) - 1 if last else -1
        return SnapshotRun(rel, info, rows, commit_lsn, first_seq, ts_ms, final)
