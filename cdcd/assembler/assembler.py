"""Assembles decoded pgoutput messages into committed transactions, with bounded memory.

Sans-I/O apart from spill files: :meth:`Assembler.feed` takes one decoded message and the
XLogData ``wal_start`` it came with, and returns a :class:`Transaction` (or a part of one) when
one is released. No clocks, no logging, no asyncio. ``docs/assembler.md`` describes what is
released and when (regular, streamed, prepared transactions, messages, parts of a transaction
still arriving), how Relations are tracked, the invariants checked (an
:class:`~cdcd.errors.AssemblyError` naming the LSN), and how memory is accounted and bounded
(:mod:`cdcd.assembler.sizes`, compact form, spill files).
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final, Literal

from cdcd.assembler.sizes import COMPACT_BYTES, change_size, record_size
from cdcd.assembler.spill import SPILL_PREFIX, SPILL_SUFFIX, SpillFile, compact, remove_stale
from cdcd.assembler.subxacts import Subxact, abort_subxact
from cdcd.assembler.transaction import (
    ChangeRecord,
    RenderedJson,
    Transaction,
    TransactionKind,
    message_transaction,
)
from cdcd.decoder.events import (
    Begin,
    BeginPrepare,
    Change,
    Commit,
    CommitPrepared,
    Delete,
    Insert,
    Message,
    Origin,
    PgOutputMessage,
    Prepare,
    Relation,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
    Type,
    Update,
)
from cdcd.errors import AssemblyError
from cdcd.lsn import format_lsn

__all__ = [
    "COMPACT_BYTES",
    "DEFAULT_MEMORY_LIMIT",
    "Assembler",
    "PartPolicy",
    "change_size",
    "record_size",
]

DEFAULT_MEMORY_LIMIT: Final = 256 << 20

_OID: Final = struct.Struct("!I")  # pgoutput change header: relation OID
_XID_OID: Final = struct.Struct("!II")  # inside a stream block: xid, relation OID
_CHANGE_TAGS: Final = (b"I", b"U", b"D")  # pgoutput Insert, Update, Delete
_RUN_TAGS: Final = (b"I", b"U", b"D", b"B", b"C")  # those, Begin and Commit: feed_run's

_BufferKind = Literal["regular", "prepare", "stream"]


class PartPolicy:
    """Which regular transactions may be released in parts, by commit LSN, read at each Begin.
    Plain data that the pipeline keeps up to date (:mod:`cdcd.pipeline.stream`): none past
    ``until``, ``resume`` always, none committing before ``since``, none while ``hold``."""

    __slots__ = ("hold", "resume", "since", "until")

    def __init__(self) -> None:
        self.until: int | None = None  # --endpos: past it, never handed
        self.resume: int | None = None  # being handed in parts, resent after a reconnect
        self.since = 0  # the end of the last transaction queued: before it, a resend
        self.hold = False  # an incremental snapshot's watermark window is open

    def allows(self, commit_lsn: int) -> bool:
        if self.until is not None and commit_lsn > self.until:
            return False
        if commit_lsn == self.resume:
            return True
        return commit_lsn >= self.since and not self.hold


class _Buffer:
    """One transaction being assembled: as decoded records, or (once large) in spill format,
    in memory (compact) or in a spill file."""

    __slots__ = (
        "commit_time",
        "count",
        "final_lsn",
        "first_lsn",
        "gid",
        "kind",
        "mem_bytes",
        "origin",
        "origin_lsn",
        "overlay",
        "parted",
        "parting",
        "raws",
        "records",
        "rel_log",
        "seq",
        "spill",
        "subxact_ids",
        "subxacts",
        "xid",
    )

    def __init__(
        self, kind: _BufferKind, xid: int, first_lsn: int, *, final_lsn: int = 0, gid: str = ""
    ) -> None:
        self.kind = kind
        self.xid = xid
        self.first_lsn = first_lsn
        self.final_lsn = final_lsn  # Begin's final LSN, Begin Prepare's prepare LSN
        self.commit_time = 0  # Begin's (regular transactions)
        self.gid = gid
        # Regular transactions only: released in parts while they arrive (docs/assembler.md)
        self.parting = False
        self.parted = 0  # changes released in earlier parts
        self.records: list[ChangeRecord] = []
        # the pgoutput bytes of each record, when fed with them (None otherwise): a record
        # moved to a spill file is written as those bytes; dropped once released
        self.raws: list[bytes | None] = []
        self.count = 0
        self.mem_bytes = 0
        self.spill: SpillFile | None = None
        self.origin: str | None = None
        self.origin_lsn: int | None = None
        # Streamed transactions only: subtransactions, and the Relations streamed with them.
        self.seq = 0
        self.subxacts: list[Subxact] = []
        self.subxact_ids: set[int] = set()
        self.overlay: dict[int, Relation] = {}
        self.rel_log: list[tuple[int, Relation]] = []


def _where(lsn: int) -> str:
    return f"at LSN {format_lsn(lsn)}"


class Assembler:
    """Turns a stream of pgoutput events into committed :class:`Transaction` objects.

    ``memory_limit``: accounted bytes of buffered changes beyond which transactions spill to
    ``spill_dir``; with ``spill_dir=None`` nothing spills (unbounded; for tests). Stale
    spill files in ``spill_dir`` are deleted at construction. ``compact_bytes``: accounted
    bytes of a transaction's decoded records beyond which it moves to the compact form.
    ``on_type`` receives every Type message. ``part_bytes``: accounted bytes of a regular
    transaction's changes beyond which they are released as a part while it still arrives
    (None: never; docs/assembler.md, "Parts"); :attr:`part_policy` may refuse it per transaction.
    """

    def __init__(
        self,
        *,
        memory_limit: int = DEFAULT_MEMORY_LIMIT,
        spill_dir: Path | None = None,
        compact_bytes: int = COMPACT_BYTES,
        on_type: Callable[[Type], None] | None = None,
        part_bytes: int | None = None,
    ) -> None:
        self._memory_limit = memory_limit
        self._parts = part_bytes is not None
        self._part_bytes = part_bytes or 0
        #: Read at each Begin with the transaction's commit LSN: may it be released in parts?
        self.part_policy = PartPolicy()
        #: Renders the row JSON of a streamed transaction's change as it arrives (the pgoutput
        #: bytes, with the xid, and its Relation; None: left to the release), kept with it
        #: (docs/assembler.md, "Rendering streamed changes"). None: nothing is rendered.
        self.render: Callable[[bytes, Relation], RenderedJson | None] | None = None
        #: Changes rendered on arrival since construction.
        self.rendered = 0
        self._compact_bytes = compact_bytes
        self._spill_dir = spill_dir
        self._on_type = on_type
        self._relations: dict[int, Relation] = {}
        self._relations_view: Mapping[int, Relation] = MappingProxyType(self._relations)
        self._current: _Buffer | None = None  # Begin..Commit or Begin Prepare..Prepare
        self._block: _Buffer | None = None  # the streamed transaction of the open block
        self._streams: dict[int, _Buffer] = {}
        self._prepared: dict[str, _Buffer] = {}
        self._buffered = 0
        self._file_numbers = itertools.count(1)
        #: Commit / Rollback Prepared for a GID that was not held (no-ops).
        self.unknown_gid_resolutions = 0
        #: Spill events since construction, and the size of the spill files closed since
        #: construction (released or dropped transactions).
        self.spill_count = 0
        self.total_spilled_bytes = 0
        if spill_dir is not None:
            spill_dir.mkdir(parents=True, exist_ok=True)
            remove_stale(spill_dir)

    # --- state ----------------------------------------------------------------------------

    @property
    def relations(self) -> Mapping[int, Relation]:
        """The relation cache (read-only view), as of outside any streamed transaction."""
        return self._relations_view

    @property
    def idle(self) -> bool:
        """No open transaction, no buffered streamed xid, no held prepared transaction."""
        return self._current is None and not self._streams and not self._prepared

    @property
    def in_transaction(self) -> bool:
        """Inside Begin .. Commit, Begin Prepare .. Prepare or a Stream Start .. Stop block:
        the server is in the middle of sending something. Between them, buffered streamed
        xids and held prepared transactions may remain (see :attr:`idle`)."""
        return self._current is not None or self._block is not None

    def confirm_ceiling(self) -> int | None:
        """The highest LSN that may be confirmed without risking an in-flight transaction:
        the smallest first LSN among the open transaction, the buffered streamed ones and the
        held prepared ones; None when nothing is in flight."""
        firsts = [buf.first_lsn for buf in self._buffers()]
        return min(firsts) if firsts else None

    @property
    def buffered_bytes(self) -> int:
        """Accounted memory of the changes held in memory (see the module docstring)."""
        return self._buffered

    @property
    def spilled_bytes(self) -> int:
        """Bytes in the spill files of transactions not yet released."""
        return sum(
            buf.spill.size
            for buf in self._buffers()
            if buf.spill is not None and not buf.spill.in_memory
        )

    @property
    def open_streams(self) -> int:
        return len(self._streams)

    @property
    def held_prepared(self) -> int:
        return len(self._prepared)

    def reset(self) -> None:
        """Forget every unreleased transaction (after a reconnect the server resends them)."""
        for buf in list(self._buffers()):
            self._discard(buf)
        self._current = None
        self._block = None
        self._streams.clear()
        self._prepared.clear()

    # --- feeding ----------------------------------------------------------------------------

    def feed(self, msg: PgOutputMessage, lsn: int, data: bytes | None = None) -> Transaction | None:
        """Take one message (``lsn``: its XLogData ``wal_start``); return what it releases.

        ``data``: the pgoutput bytes ``msg`` was decoded from, when the caller has them. A
        transaction in spill format then stores an Insert, Update or Delete as those bytes,
        and its memory is accounted from their length (see the module docstring).
        """
        match msg:
            case Insert() | Update() | Delete():
                buf = self._target(msg, lsn)
                rel = self._relation(buf, msg.relation_oid, lsn)
                if data is None:
                    self._append(buf, ChangeRecord(lsn, msg, (rel,)), msg.xid)
                else:
                    self._append_change(buf, lsn, msg, rel, data)
                if buf.parting and buf.mem_bytes > self._part_bytes:
                    return self._release_part(buf)
            case Truncate():
                buf = self._target(msg, lsn)
                rels = tuple(self._relation(buf, oid, lsn) for oid in msg.relation_oids)
                self._append(buf, ChangeRecord(lsn, msg, rels), msg.xid)
            case Message():
                if not msg.transactional:
                    return message_transaction(msg, lsn)
                buf = self._target(msg, lsn)
                self._append(buf, ChangeRecord(lsn, msg, ()), msg.xid)
            case Relation():
                self._on_relation(msg)
            case Type():
                if self._block is not None:
                    self._spool_catalog(self._block, msg.xid)
                if self._on_type is not None:
                    self._on_type(msg)
            case Begin():
                self._check_outside("Begin", lsn)
                buf = self._current = _Buffer("regular", msg.xid, lsn, final_lsn=msg.final_lsn)
                buf.commit_time = msg.commit_time
                buf.parting = self._parts and self.part_policy.allows(msg.final_lsn)
            case Commit():
                return self._on_commit(msg, lsn)
            case Origin():
                self._on_origin(msg, lsn)
            case StreamStart():
                self._on_stream_start(msg, lsn)
            case StreamStop():
                if self._block is None:
                    raise AssemblyError(f"Stream Stop outside a stream block {_where(lsn)}")
                self._block = None
            case StreamCommit():
                self._check_outside("Stream Commit", lsn)
                buf = self._take_stream(msg.xid, "Stream Commit", lsn)
                return self._release(buf, "streamed", msg.commit_lsn, msg.end_lsn, msg.commit_time)
            case StreamAbort():
                self._check_outside("Stream Abort", lsn)
                self._on_stream_abort(msg)
            case StreamPrepare():
                self._check_outside("Stream Prepare", lsn)
                buf = self._take_stream(msg.xid, "Stream Prepare", lsn)
                buf.kind, buf.gid = "prepare", msg.gid
                self._hold(buf)
            case BeginPrepare():
                self._check_outside("Begin Prepare", lsn)
                self._hold_nothing(msg.gid)  # resent after a reconnect
                self._current = _Buffer(
                    "prepare", msg.xid, lsn, final_lsn=msg.prepare_lsn, gid=msg.gid
                )
            case Prepare():
                self._on_prepare(msg, lsn)
            case CommitPrepared():
                held = self._resolve(msg.gid, "Commit Prepared", lsn)
                if held is not None:
                    return self._release(
                        held, "prepared", msg.commit_lsn, msg.end_lsn, msg.commit_time
                    )
            case RollbackPrepared():
                held = self._resolve(msg.gid, "Rollback Prepared", lsn)
                if held is not None:
                    self._discard(held)
        return None

    # --- message handlers ------------------------------------------------------------------

    def _on_relation(self, rel: Relation) -> None:
        block = self._block
        if block is None:
            self._relations[rel.oid] = rel
            return
        self._spool_catalog(block, rel.xid)
        block.overlay[rel.oid] = rel
        block.rel_log.append((block.seq - 1, rel))

    def _on_origin(self, msg: Origin, lsn: int) -> None:
        buf = self._block or self._current
        if buf is None:
            raise AssemblyError(f"Origin outside a transaction {_where(lsn)}")
        buf.origin, buf.origin_lsn = msg.name, msg.origin_lsn

    def _on_commit(self, msg: Commit, lsn: int) -> Transaction:
        buf = self._current
        if self._block is not None or buf is None or buf.kind != "regular":
            raise AssemblyError(f"Commit without Begin {_where(lsn)}")
        if msg.commit_lsn != buf.final_lsn:
            raise AssemblyError(
                f"Commit of xid {buf.xid} at commit LSN {format_lsn(msg.commit_lsn)} but its "
                f"Begin announced final LSN {format_lsn(buf.final_lsn)} {_where(lsn)}"
            )
        self._current = None
        return self._release(buf, "regular", msg.commit_lsn, msg.end_lsn, msg.commit_time)

    def _on_prepare(self, msg: Prepare, lsn: int) -> None:
        buf = self._current
        if self._block is not None or buf is None or buf.kind != "prepare":
            raise AssemblyError(f"Prepare without Begin Prepare {_where(lsn)}")
        if (msg.gid, msg.xid, msg.prepare_lsn) != (buf.gid, buf.xid, buf.final_lsn):
            raise AssemblyError(
                f"Prepare of gid {msg.gid!r} xid {msg.xid} prepare LSN "
                f"{format_lsn(msg.prepare_lsn)} does not match Begin Prepare of gid "
                f"{buf.gid!r} xid {buf.xid} prepare LSN {format_lsn(buf.final_lsn)} {_where(lsn)}"
            )
        self._current = None
        self._hold(buf)

    def _on_stream_start(self, msg: StreamStart, lsn: int) -> None:
        self._check_outside("Stream Start", lsn)
        buf = self._streams.get(msg.xid)
        if msg.first_segment:
            if buf is not None:  # re-streamed from the start after a reconnect
                self._discard(buf)
            buf = self._streams[msg.xid] = _Buffer("stream", msg.xid, lsn)
        elif buf is None:
            raise AssemblyError(
                f"Stream Start continues xid {msg.xid}, whose first segment was not seen "
                f"{_where(lsn)}"
            )
        self._block = buf

    def _on_stream_abort(self, msg: StreamAbort) -> None:
        buf = self._streams.get(msg.xid)
        if buf is None:
            return
        if msg.subxid == msg.xid:
            del self._streams[msg.xid]
            self._discard(buf)
        else:
            self._buffered -= abort_subxact(buf, msg.subxid)

    # --- helpers ----------------------------------------------------------------------------

    def _buffers(self) -> Iterator[_Buffer]:
        if self._current is not None:
            yield self._current
        yield from self._streams.values()
        yield from self._prepared.values()

    def _check_outside(self, what: str, lsn: int) -> None:
        if self._current is not None:
            raise AssemblyError(
                f"{what} inside the open transaction xid {self._current.xid} {_where(lsn)}"
            )
        if self._block is not None:
            raise AssemblyError(
                f"{what} inside the stream block of xid {self._block.xid} {_where(lsn)}"
            )

    def _target(self, change: Change, lsn: int) -> _Buffer:
        buf = self._block or self._current
        if buf is None:
            raise AssemblyError(
                f"{type(change).__name__} outside any transaction or stream block {_where(lsn)}"
            )
        return buf

    def _relation(self, buf: _Buffer, oid: int, lsn: int) -> Relation:
        rel = buf.overlay.get(oid) if buf.overlay else None
        if rel is None:
            rel = self._relations.get(oid)
            if rel is None:
                raise AssemblyError(f"change of relation OID {oid} with no Relation {_where(lsn)}")
        return rel

    def _take_stream(self, xid: int, what: str, lsn: int) -> _Buffer:
        buf = self._streams.pop(xid, None)
        if buf is None:
            raise AssemblyError(f"{what} for xid {xid}, which was never streamed {_where(lsn)}")
        # The transaction's Relations become everyone's, as the apply worker applies them.
        for _, rel in buf.rel_log:
            self._relations[rel.oid] = rel
        buf.overlay, buf.rel_log = {}, []
        return buf

    def _hold(self, buf: _Buffer) -> None:
        self._hold_nothing(buf.gid)
        self._prepared[buf.gid] = buf

    def _hold_nothing(self, gid: str) -> None:
        if (old := self._prepared.pop(gid, None)) is not None:
            self._discard(old)

    def _resolve(self, gid: str, what: str, lsn: int) -> _Buffer | None:
        """The prepared transaction ``gid`` a Commit / Rollback Prepared resolves, if held."""
        self._check_outside(what, lsn)
        held = self._prepared.pop(gid, None)
        if held is None:
            self.unknown_gid_resolutions += 1
        return held

    def _spool_catalog(self, buf: _Buffer, xid: int | None) -> None:
        """A Relation or Type message inside a stream block: spooled, like a change."""
        self._note_subxact(buf, xid)
        buf.seq += 1

    def _note_subxact(self, buf: _Buffer, xid: int | None) -> None:
        if xid is None or xid == buf.xid or xid in buf.subxact_ids:
            return
        offset = buf.spill.tell() if buf.spill is not None else None
        buf.subxacts.append(Subxact(xid, buf.count, buf.seq, offset))
        buf.subxact_ids.add(xid)

    def _count_change(self, buf: _Buffer, xid: int | None) -> None:
        """One more change in ``buf`` (and, streamed, in the subtransaction ``xid``)."""
        if buf.kind == "stream":
            self._note_subxact(buf, xid)
            buf.seq += 1
        buf.count += 1

    def _append(self, buf: _Buffer, record: ChangeRecord, xid: int | None) -> None:
        self._count_change(buf, xid)
        spill = buf.spill
        if spill is not None:
            size = spill.append(record)
            if spill.in_memory:
                self._grow(buf, size)
            return
        buf.records.append(record)
        buf.raws.append(None)
        self._grow(buf, change_size(record.change))

    def _grow(self, buf: _Buffer, size: int) -> None:
        """Account ``size`` more bytes to ``buf`` held in memory; compact, spill if needed."""
        buf.mem_bytes += size
        self._buffered += size
        if buf.spill is None and buf.mem_bytes > self._compact_bytes and not buf.parting:
            self._compact(buf)
        if self._buffered > self._memory_limit and self._spill_dir is not None:
            self._spill_until_under(self._spill_dir)

    def feed_undecoded(self, data: bytes, lsn: int, *, streamed: bool) -> bool:
        """Take an Insert, Update or Delete as pgoutput bytes, undecoded, if it belongs to a
        transaction in spill format (decoded when read back; docs/assembler.md, "Memory");
        return whether it was taken. False: decode ``data`` and :meth:`feed` it as usual."""
        if data[:1] not in _CHANGE_TAGS:
            return False
        return self._take_undecoded(data, lsn, streamed)

    def _take_undecoded(self, data: bytes, lsn: int, streamed: bool) -> bool:
        """:meth:`feed_undecoded` for ``data`` known to be an Insert, Update or Delete."""
        buf = self._block or self._current
        if buf is None or buf.spill is None:
            return False
        if streamed:
            if len(data) < 9:
                return False
            xid, oid = _XID_OID.unpack_from(data, 1)
        else:
            if len(data) < 5:
                return False
            xid = None
            (oid,) = _OID.unpack_from(data, 1)
        rel = self._relation(buf, oid, lsn)
        self._count_change(buf, xid)
        spill = buf.spill
        rendered = None
        if streamed and self.render is not None:
            rendered = self.render(data, rel)
        if rendered is None:
            size = spill.append_raw(lsn, data, xid, (rel,))
        else:
            size = spill.append_rendered(lsn, data, xid, (rel,), rendered)
            self.rendered += 1
        if spill.in_memory:
            self._grow(buf, size)
        return True

    def feed_run(
        self,
        batch: list[Any],
        start: int,
        decode: Callable[[bytes, int], PgOutputMessage],
        streamed: bool,
    ) -> tuple[int, int, int, Transaction | None]:
        """Feed the Begins, Inserts, Updates, Deletes and Commits at ``batch[start:]``, as many
        as come in a row: the reader's per-message loop, run here in compiled code. ``batch``
        holds XLogData as ``(wal_start, wal_end, send_time, data)`` tuples (the replication
        client's batches); anything else ends the run, as does any other message (left for the
        caller: none of these needs the caller's attention before it is fed). Each change is
        taken undecoded (:meth:`feed_undecoded`) or decoded with ``decode`` and :meth:`feed`
        with its bytes, as are Begin and Commit; the run stops after a message whose feeding
        releases a transaction or a part of one. Returns how many items it took, their bytes,
        their highest ``wal_end`` (0 when none) and what was released (or None). ``streamed``:
        the decoder's state, which only Stream Start and Stop change, and those end a run."""
        taken = start
        size = 0
        wal = 0
        end = len(batch)
        while taken < end:
            item = batch[taken]
            if not isinstance(item, tuple):
                break
            data: bytes = item[3]
            tag = data[:1]
            if tag not in _RUN_TAGS:
                break
            lsn: int = item[0]
            wal_end: int = item[1]
            taken += 1
            size += len(data)
            if wal_end > wal:
                wal = wal_end
            if tag in _CHANGE_TAGS and self._take_undecoded(data, lsn, streamed):
                continue
            txn = self.feed(decode(data, lsn), lsn, data)
            if txn is not None:
                return taken - start, size, wal, txn
        return taken - start, size, wal, None

    def _append_change(
        self, buf: _Buffer, lsn: int, change: Insert | Update | Delete, rel: Relation, data: bytes
    ) -> None:
        """_append for a change with its pgoutput bytes (the hot path of :meth:`feed`)."""
        self._count_change(buf, change.xid)
        spill = buf.spill
        if spill is not None:
            size = spill.append_raw(lsn, data, change.xid, (rel,))
            if spill.in_memory:
                self._grow(buf, size)
            return
        buf.records.append(ChangeRecord(lsn, change, (rel,)))
        buf.raws.append(data)
        self._grow(buf, record_size(change, data))

    def _spill_until_under(self, spill_dir: Path) -> None:
        while self._buffered > self._memory_limit:
            largest = max(self._buffers(), key=lambda b: b.mem_bytes, default=None)
            if largest is None or largest.mem_bytes == 0:
                return
            self._spill(largest, spill_dir)

    def _spill(self, buf: _Buffer, spill_dir: Path) -> None:
        """Move ``buf`` to a new spill file; it holds no accounted memory afterwards."""
        if buf.spill is None:
            self._compact(buf)
        spill = buf.spill
        assert spill is not None and spill.in_memory
        spill.move_to(spill_dir / f"{SPILL_PREFIX}{next(self._file_numbers)}{SPILL_SUFFIX}")
        self._buffered -= buf.mem_bytes
        buf.mem_bytes = 0
        self.spill_count += 1

    def _compact(self, buf: _Buffer) -> None:
        """Move ``buf``'s decoded records into a spill stream held in memory."""
        pending = [sub for sub in buf.subxacts if sub.offset is None]
        spill, offsets = compact(buf.records, buf.raws, [sub.index for sub in pending])
        for sub, offset in zip(pending, offsets, strict=True):
            sub.offset = offset
        buf.spill = spill
        self._buffered += spill.tell() - buf.mem_bytes
        buf.mem_bytes = spill.tell()
        buf.records = []
        buf.raws = []

    def _discard(self, buf: _Buffer) -> None:
        self._buffered -= buf.mem_bytes
        buf.mem_bytes = 0
        buf.records = []
        buf.raws = []
        if buf.spill is not None:
            if not buf.spill.in_memory:
                self.total_spilled_bytes += buf.spill.size
            buf.spill.delete()
            buf.spill = None

    def _release(
        self, buf: _Buffer, kind: TransactionKind, commit_lsn: int, end_lsn: int, commit_time: int
    ) -> Transaction:
        self._buffered -= buf.mem_bytes
        # positional (kind, xid, commit_lsn, end_lsn, commit_time, size, origin, origin_lsn,
        # gid, mem_bytes, begins): keywords double what a compiled class's constructor costs
        txn = Transaction(
            kind,
            buf.xid,
            commit_lsn,
            end_lsn,
            commit_time,
            buf.count - buf.parted,
            buf.origin,
            buf.origin_lsn,
            buf.gid or None,
            0,
            buf.parted == 0,
        )
        spill = buf.spill
        if spill is None:
            txn.mem_bytes = buf.mem_bytes
            txn._records = buf.records
            buf.raws = []  # needed only while the transaction might still spill
        else:
            spill.finish()
            if spill.in_memory:
                txn.mem_bytes = buf.mem_bytes
            else:
                self.total_spilled_bytes += spill.size
            txn._reader = spill.reader()
            txn._drain = spill.draining_reader()
            txn._on_release = spill.delete
        return txn

    def _release_part(self, buf: _Buffer) -> Transaction:
        """The changes buffered so far of the regular transaction ``buf`` (decoded records: a
        parting buffer never compacts, and one that spilled holds no memory), as a part."""
        part = self._release(buf, "regular", buf.final_lsn, 0, buf.commit_time)
        part.ends = False
        buf.parted, buf.mem_bytes, buf.records, buf.raws = buf.count, 0, [], []
        return part
