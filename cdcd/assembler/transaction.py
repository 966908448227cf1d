"""What the assembler hands on: committed transactions with their ordered changes.

A :class:`Transaction` is released only once PostgreSQL has committed it (Commit, Stream
Commit or Commit Prepared). Its position is ``commit_lsn``; the LSN to acknowledge once every
sink holds it durably is ``end_lsn`` (see docs/protocol.md: acknowledge the end LSN, never the commit
LSN). A non-transactional logical decoding message is released on its own as a
``Transaction`` of kind ``"message"`` whose ``end_lsn`` is the message's LSN and whose
``commit_lsn`` is one less: pgoutput's Message LSN is the end of the message's WAL record, which
may be the commit LSN of the next transaction, while one byte before lies inside the message's
own record, where nothing commits (docs/events.md: positions are unique).

Each :class:`ChangeRecord` keeps the Relation (or Relations, for Truncate) as they were
described when the change was decoded, so DDL in the middle of a transaction changes only the
later changes. Changes of a large transaction may live in a spill file: ``changes()`` reads
them back in order, and may be called more than once until ``release()``.

A regular transaction (Begin .. Commit, not streamed) arrives only after it committed, and its
Begin carries its commit LSN, so its changes' positions are known from the first one: the
assembler releases it in *parts* while it arrives (docs/guarantees.md, docs/assembler.md).
A part is a ``Transaction`` too: ``begins`` on the first (the sinks' ``begin``), ``ends`` on the
last (their ``commit``, with the end LSN, which earlier parts do not know: 0 there). A whole
transaction is one part that begins and ends. ``size`` counts the changes of the part.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import islice
from typing import Literal

from cdcd.decoder.events import Change, Message, Relation, TupleData

TransactionKind = Literal["regular", "streamed", "prepared", "message", "snapshot", "reset"]

#: An Insert, Update or Delete's JSON made as its streamed transaction arrived (docs/assembler.md,
#: "Rendering streamed changes"): ``(before, after, key)`` exactly as its one change event writes
#: them (``b"null"`` for a missing row; key None: the table has no key).
RenderedJson = tuple[bytes, bytes, bytes | None]


@dataclass(frozen=True, slots=True, init=False)
class ChangeRecord:
    """One change inside a transaction.

    ``lsn``: the change's own WAL position (XLogData ``wal_start``; Debezium's ``source.lsn``).
    ``relations``: for Insert/Update/Delete one Relation; for Truncate one per truncated
    relation in message order; for a logical message none. ``rendered``: the change's row JSON
    made while its streamed transaction arrived (:data:`RenderedJson`), or None.
    """

    lsn: int
    change: Change
    relations: tuple[Relation, ...]
    rendered: RenderedJson | None

    # Spelled out, as in cdcd.decoder.events: compiled, a native constructor.
    def __init__(
        self,
        lsn: int,
        change: Change,
        relations: tuple[Relation, ...],
        rendered: RenderedJson | None = None,
    ) -> None:
        object.__setattr__(self, "lsn", lsn)
        object.__setattr__(self, "change", change)
        object.__setattr__(self, "relations", relations)
        object.__setattr__(self, "rendered", rendered)


@dataclass(slots=True)
class Transaction:
    """A committed transaction, ready for the sinks.

    ``commit_time`` is microseconds since the PostgreSQL epoch. ``origin`` is the name from an
    Origin message when the transaction was replicated from elsewhere. ``gid`` is set for a
    two-phase transaction (released at Commit Prepared, with that message's LSNs and time).
    ``size`` is the number of changes. ``mem_bytes`` is the memory its in-memory changes were
    accounted by the assembler (0 when they live in a spill file): what it holds until
    :meth:`release`. ``begins`` / ``ends``: this is the first / last part of the transaction
    (both for a whole one; see the module docstring); ``end_lsn`` is 0 until the last part.
    ``rows``: a chunk of an incremental snapshot (kind ``"snapshot"``), its rows of one table
    in batches, from which the writer makes the events a batch at a time without a record
    per row (``changes()`` gives the same rows as Inserts).
    """

    kind: TransactionKind
    xid: int
    commit_lsn: int
    end_lsn: int
    commit_time: int
    size: int
    origin: str | None = None
    origin_lsn: int | None = None
    gid: str | None = None
    mem_bytes: int = 0
    begins: bool = True
    ends: bool = True
    _reader: Callable[[], Iterator[ChangeRecord]] | None = field(default=None, repr=False)
    _records: list[ChangeRecord] | None = field(default=None, repr=False)
    _on_release: Callable[[], None] | None = field(default=None, repr=False)
    #: for a stream held in memory: the last reading, which frees it as it goes (take_changes)
    _drain: Callable[[], Iterator[ChangeRecord]] | None = field(default=None, repr=False)
    rows: tuple[Relation, list[Sequence[TupleData]]] | None = field(default=None, repr=False)

    def changes(self) -> Iterator[ChangeRecord]:
        """The changes in commit order; for a spilled transaction, read back from disk."""
        if self._records is not None:
            return iter(self._records)
        if self._reader is not None:
            return self._reader()
        return iter(())

    def take_changes(self) -> Iterator[ChangeRecord]:
        """The changes, read for the last time (the writer's reading, once whatever else
        reads them has done so): a transaction held in memory in the compact form gives each
        chunk back as soon as it has been read, so its memory goes down while the sinks' buffers
        fill (docs/guarantees.md). Reading its changes again after this is an error."""
        drain = self._drain
        if drain is None or self._records is not None:
            return self.changes()
        self._drain = None
        self._reader = _taken
        return drain()

    def drop_first(self, count: int) -> None:
        """Leave out the first ``count`` changes (handed over before a reconnect)."""
        if count <= 0:
            return
        count = min(count, self.size)
        self.size -= count
        self.rows = None  # the changes left: changes() skips the first ones
        if self._records is not None:
            self._records = self._records[count:]
        elif self._reader is not None:
            self._reader = partial(_skipping, self._reader, count)
            if self._drain is not None:
                self._drain = partial(_skipping, self._drain, count)

    def release(self) -> None:
        """Free what the transaction holds (memory, spill files). Call once all sinks are done."""
        self._records = None
        self._reader = None
        self._drain = None
        self.rows = None
        if self._on_release is not None:
            callback, self._on_release = self._on_release, None
            callback()


def message_transaction(msg: Message, lsn: int) -> Transaction:
    """A non-transactional message as a Transaction of its own. Its position is ``msg.lsn - 1``:
    pgoutput's Message LSN is the *end* of the message's WAL record, which is where the next
    record begins, so it can be the commit LSN of the transaction committed right after it;
    one byte before is inside the message's own record, where no transaction commits. It is
    acknowledged with ``msg.lsn``, as before (end LSNs stay strictly increasing)."""
    return Transaction(
        kind="message",
        xid=msg.xid or 0,
        commit_lsn=msg.lsn - 1,
        end_lsn=msg.lsn,
        commit_time=0,
        size=1,
        _records=[ChangeRecord(lsn, msg, ())],
    )


def _taken() -> Iterator[ChangeRecord]:
    raise RuntimeError("the changes of this transaction were taken (Transaction.take_changes)")


def _skipping(reader: Callable[[], Iterator[ChangeRecord]], count: int) -> Iterator[ChangeRecord]:
    return islice(reader(), count, None)
