"""The reader's side of incremental snapshots: watermark windows in the replication stream.

An incremental snapshot (:mod:`cdcd.snapshot.incremental`, docs/snapshots.md)
reads a table in chunks, each between a low and a high watermark: transactional logical
messages with the prefix :data:`WATERMARK` that the snapshot connection writes with
``pg_logical_emit_message(true, 'cdcd-watermark', ...)``. They come back in the replication
stream in commit order. Between the two (the *window*), every change to a key of the chunk's
table is noted; at the high watermark the chunk's rows whose keys changed in the window are
dropped (the stream carries a newer image of them), and the rest are handed to the sinks as a
transaction of kind ``"snapshot"`` that takes the high watermark's place and position: its
``op: "r"`` events sort after every change they survived and before every later one.

A message with the prefix :data:`SIGNAL` (written by ``cdcd snapshot --table``) asks for
tables to be snapshotted; whether its sender may ask is checked by the receiver
(:mod:`cdcd.snapshot.signals`). Watermarks and signals are never published to the sinks.

Several chunks may be between their watermarks at once (``snapshot.workers``); each has its
own window, and a change is noted in every open window of its table.

Commit order in the WAL is not visibility order: a transaction becomes visible to new
snapshots a moment after its commit record is written, so one that commits just before the low
watermark may still be invisible to the chunk's read. The snapshot side therefore reads each
chunk in a transaction whose snapshot (``pg_current_snapshot()``) it hands over with the rows;
changes the stream carries between arming a chunk and its low watermark are kept aside, and
those of transactions that snapshot does not see are dropped from the chunk too.

This module holds no I/O: the reader calls :meth:`Watermarks.observe` for each committed
transaction it is about to queue.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, Final

from cdcd._purepy import c_module
from cdcd.assembler.transaction import ChangeRecord, Transaction
from cdcd.decoder.copy_batch import CopyBatch
from cdcd.decoder.copy_text import copy_rows
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
from cdcd.snapshot.signals import SIGNAL

WATERMARK = "cdcd-watermark"
PREFIXES = (WATERMARK, SIGNAL)

Key = tuple[bytes | None, ...]
#: cdcd._rowjson.copy_kept, the compiled :func:`kept_lines` (None where not in use)
_C_COPY_KEPT: Final[Callable[..., tuple[bytes, int] | None] | None] = getattr(
    c_module("cdcd._rowjson"), "copy_kept", None
)
#: a chunk's read snapshot: xmin, xmax and the transactions in progress (32-bit xids)
Snapshot = tuple[int, int, frozenset[int]]


@dataclass(frozen=True, slots=True)
class ChunkResult:
    """What became of a chunk at its high watermark. ``retry``: the window saw a change whose
    key could not be read (a TRUNCATE, a key column missing from the image), so the chunk must
    be read again; otherwise ``emitted`` rows were queued at ``end_lsn`` (0: none)."""

    retry: bool
    end_lsn: int = 0
    emitted: int = 0
    dropped: int = 0


@dataclass(eq=False)
class Chunk:
    """One chunk of a table between its watermarks. ``rows`` (in batches, COPY's text until
    something asks: :class:`~cdcd.decoder.copy_batch.CopyBatch`) and ``count`` are set by the
    snapshot before it writes the high watermark; ``key_names`` name the key columns in key
    order."""

    id: str
    relation: Relation
    key_names: tuple[str, ...]
    rows: list[Sequence[TupleData]] | None = None
    count: int = 0  # rows in ``rows``
    size: int = 0  # the rows' accounted bytes (cdcd.source.copy.accounted), set with them
    snapshot: Snapshot | None = None  # set with ``rows``; None: every early change counts
    opened: bool = False
    dirty: bool = False
    changed: set[Key] = field(default_factory=set)
    early: list[tuple[int, set[Key], bool]] = field(default_factory=list)  # before the window
    done: asyncio.Future[ChunkResult] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    #: the key columns' positions in the relation last seen (None: a key column is missing)
    _where: tuple[Relation, list[int] | None] | None = field(default=None, repr=False)

    def key_of(self, relation: Relation, row: TupleData) -> Key | None:
        """The key of ``row`` (an image of ``relation``), or None if a key column is missing."""
        positions = self.key_positions(relation)
        if positions is None:
            return None
        key: list[bytes | None] = []
        kinds = row.kinds
        for i in positions:
            if i >= len(kinds) or kinds[i] in (KIND_NULL, KIND_UNCHANGED_TOAST):
                return None
            key.append(row.values[i])
        return tuple(key)

    def key_positions(self, relation: Relation) -> list[int] | None:
        """The key columns' positions in ``relation`` (None: a key column is missing)."""
        where = self._where
        if where is None or where[0] is not relation:
            names = [c.name for c in relation.columns]
            where = self._where = (
                relation,
                None
                if any(n not in names for n in self.key_names)
                else [names.index(n) for n in self.key_names],
            )
        return where[1]


def marker(txn: Transaction) -> Message | None:
    """The watermark or signal message ``txn`` consists of, if it is one."""
    if txn.size != 1:
        return None
    record = next(txn.changes(), None)
    if record is None:
        return None
    change = record.change
    if type(change) is Message and change.prefix in PREFIXES:
        return change
    return None


class Watermarks:
    """See the module docstring. ``on_signal`` receives a signal's content, unchecked, and its
    end LSN (a signal is sent again after a reconnect or restart until confirmed)."""

    def __init__(self, on_signal: Callable[[bytes, int], None]) -> None:
        self._chunks: dict[str, Chunk] = {}
        self._on_signal = on_signal

    @property
    def window_open(self) -> bool:
        """Whether transactions must be observed: a chunk is armed (its early changes are kept
        aside) or between its watermarks."""
        return bool(self._chunks)

    def arm(self, chunk: Chunk) -> None:
        """``chunk``'s low watermark is about to be written."""
        self._chunks[chunk.id] = chunk

    def disarm(self, chunk: Chunk) -> None:
        if self._chunks.get(chunk.id) is chunk:
            del self._chunks[chunk.id]

    def abandon(self) -> None:
        """Give up the chunks in flight (the slot was recreated: their watermarks may never come
        back); the snapshot reads them again."""
        chunks, self._chunks = self._chunks, {}
        for chunk in chunks.values():
            if not chunk.done.done():
                chunk.done.set_result(ChunkResult(retry=True))

    def observe(self, txn: Transaction, mark: Message | None) -> Transaction | None:
        """The transaction to queue in place of ``txn`` (``txn`` itself, a snapshot chunk at
        a high watermark) or None to drop it (a watermark or signal). ``mark``: :func:`marker`
        of ``txn``, computed by the caller when the stream carried such a message."""
        if mark is not None:
            self._on_mark(mark, txn.end_lsn)
            return self._at_watermark(txn, mark) if self._chunks else None
        for chunk in self._chunks.values():
            keys, dirty = _changes(chunk, txn)
            if chunk.opened:
                chunk.changed |= keys
                chunk.dirty |= dirty
            elif keys or dirty:
                chunk.early.append((txn.xid, keys, dirty))
        return txn

    def _on_mark(self, mark: Message, end_lsn: int) -> None:
        if mark.prefix == SIGNAL:  # checked by the receiver (cdcd.snapshot.signals)
            self._on_signal(mark.content, end_lsn)

    def _at_watermark(self, txn: Transaction, mark: Message) -> Transaction | None:
        payload = _payload(mark)
        chunk = self._chunks.get(payload.get("id")) if payload is not None else None  # type: ignore[arg-type]
        if mark.prefix != WATERMARK or payload is None or chunk is None:
            return None  # a signal, or a watermark of an earlier run or chunk
        if payload.get("mark") == "low":
            chunk.opened = True
            return None
        if not chunk.opened or chunk.rows is None:
            return None
        del self._chunks[chunk.id]
        for xid, keys, dirty in chunk.early:  # committed before the window, not read
            if chunk.snapshot is None or not visible(chunk.snapshot, xid):
                chunk.changed |= keys
                chunk.dirty |= dirty
        if chunk.dirty:
            chunk.done.set_result(ChunkResult(retry=True))
            return None
        rel = chunk.relation
        changed = chunk.changed
        kept = chunk.rows
        emitted = chunk.count
        if changed:  # else no change in the window: every row is kept, none looked at
            kept = [rows for batch in chunk.rows if (rows := _kept(chunk, batch, changed))]
            emitted = sum(len(rows) for rows in kept)
        dropped = chunk.count - emitted
        if not emitted:
            chunk.done.set_result(ChunkResult(retry=False, dropped=dropped))
            return None
        chunk.done.set_result(
            ChunkResult(retry=False, end_lsn=txn.end_lsn, emitted=emitted, dropped=dropped)
        )
        return snapshot_transaction(
            rel,
            kept,
            emitted,
            commit_lsn=txn.commit_lsn,
            end_lsn=txn.end_lsn,
            commit_time=txn.commit_time,
            mem_bytes=chunk.size * emitted // max(chunk.count, 1),
        )


def snapshot_transaction(
    rel: Relation,
    batches: list[Sequence[TupleData]],
    count: int,
    *,
    commit_lsn: int,
    end_lsn: int,
    commit_time: int,
    mem_bytes: int,
) -> Transaction:
    """A chunk's ``count`` rows (of ``rel``, in ``batches``) as a transaction of kind
    ``"snapshot"`` at the high watermark's place: the writer makes their events from
    ``Transaction.rows`` a batch at a time; ``changes()`` makes them Inserts, one record per
    row, only for whatever asks for records."""

    def inserts() -> Iterator[ChangeRecord]:
        relations = (rel,)
        oid = rel.oid
        for batch in batches:
            for row in batch:
                yield ChangeRecord(commit_lsn, Insert(None, oid, row), relations)

    return Transaction(
        kind="snapshot",
        xid=0,
        commit_lsn=commit_lsn,
        end_lsn=end_lsn,
        commit_time=commit_time,
        size=count,
        mem_bytes=mem_bytes,
        _reader=inserts,
        rows=(rel, batches),
    )


def _kept(chunk: Chunk, batch: Sequence[TupleData], changed: set[Key]) -> Sequence[TupleData]:
    """The rows of ``batch`` whose keys ``changed`` does not hold. Rows still in COPY's text
    stay so: only their key columns are looked at (:func:`kept_lines`, in C where compiled)."""
    rel = chunk.relation
    if not isinstance(batch, CopyBatch) or batch.parsed:
        return [r for r in batch if chunk.key_of(rel, r) not in changed]
    positions = chunk.key_positions(rel)
    if positions is None:  # no key to compare (as key_of says for each row): all kept
        return batch
    where = tuple(positions)
    found = None if _C_COPY_KEPT is None else _C_COPY_KEPT(batch.text, batch.width, where, changed)
    text, count = kept_lines(batch.text, batch.width, where, changed) if found is None else found
    if text is batch.text:
        return batch
    return CopyBatch(text, count, batch.width) if count else []


def kept_lines(
    text: bytes, width: int, positions: tuple[int, ...], changed: AbstractSet[Key]
) -> tuple[bytes, int]:
    """The lines of ``text`` (COPY's text of rows of ``width`` columns, separated by newlines)
    whose key, the fields at ``positions``, ``changed`` does not hold, joined by newlines
    (``text`` itself when all are kept), and how many. A key field with a backslash, COPY's
    escape, is parsed to compare its value; a key with a null field is no key, never held.
    The reference for ``cdcd._rowjson.copy_kept`` (tests/unit/test_watermarks.py)."""
    need = max(positions) + 1
    lines = text.split(b"\n")
    kept: list[bytes] = []
    for line in lines:
        fields = line.split(b"\t", need)
        if len(fields) < need:
            raise ValueError(f"COPY row with {len(fields)} fields, expected {width}")
        values = [fields[i] for i in positions]
        key: Key | None = tuple(values)
        if any(b"\\" in value for value in values):
            row = copy_rows([line], width)[0].values
            key = (
                None if any(row[i] is None for i in positions) else tuple(row[i] for i in positions)
            )
        if key not in changed:
            kept.append(line)
    if len(kept) == len(lines):
        return text, len(kept)
    return b"\n".join(kept), len(kept)


def _changes(chunk: Chunk, txn: Transaction) -> tuple[set[Key], bool]:
    """The keys of ``chunk``'s table that ``txn`` changes, and whether it changes some in a way
    keys cannot show (a TRUNCATE, a key column missing from an image)."""
    oid = chunk.relation.oid
    keys: set[Key] = set()
    dirty = False
    for record in txn.changes():
        change = record.change
        kind = type(change)
        if kind is Truncate:
            if oid in change.relation_oids:  # type: ignore[union-attr]
                dirty = True
            continue
        if kind is Message or record.relations[0].oid != oid:
            continue
        rel = record.relations[0]
        images: list[TupleData] = []
        if kind is Insert or kind is Update:
            images.append(change.new)  # type: ignore[union-attr]
        if kind is Delete or (kind is Update and change.old is not None):  # type: ignore[union-attr]
            images.append(change.old)  # type: ignore[union-attr,arg-type]
        for image in images:
            key = chunk.key_of(rel, image)
            if key is None:
                dirty = True
            else:
                keys.add(key)
    return keys, dirty


def parse_snapshot(text: str) -> Snapshot:
    """``pg_current_snapshot()`` (``xmin:xmax:xip,...``, 64-bit xids) as 32-bit xids, the
    stream's."""
    xmin, xmax, xip = text.split(":")
    mask = 0xFFFFFFFF
    return int(xmin) & mask, int(xmax) & mask, frozenset(int(x) & mask for x in xip.split(",") if x)


def _precedes(a: int, b: int) -> bool:
    """``a`` before ``b`` in 32-bit xid order (modulo 2^32, as PostgreSQL compares them)."""
    return ((a - b) & 0xFFFFFFFF) >= 0x80000000


def visible(snapshot: Snapshot, xid: int) -> bool:
    """Whether the committed transaction ``xid`` is visible to ``snapshot``."""
    xmin, xmax, xip = snapshot
    if _precedes(xid, xmin):
        return True
    return _precedes(xid, xmax) and xid not in xip


def _payload(mark: Message) -> dict[str, Any] | None:
    try:
        payload = json.loads(mark.content)
    except ValueError:
        return None
    return payload if isinstance(payload, dict) else None
