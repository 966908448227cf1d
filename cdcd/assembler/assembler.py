"""Assembles decoded pgoutput messages into committed transactions, with bounded memory.

Sans-I/O apart from spill files: :meth:`Assembler.feed` takes one decoded message and the
XLogData ``wal_start`` it came with, and returns a :class:`Transaction` (or a part of one) when
one is released. No clocks, no logging, no asyncio. ``docs/assembler.md`` describes what is
released and when (regular, streamed, prepared transactions, messages, parts of a transaction
still arriving), how Relations are tracked, the invariants checked (an
:class:`~cdcd.errors.AssemblyError` naming the LSN), and how memory is accounted and bounded
(:mod:`cdcd.assembler.sizes`, compact form, spill files). This module checks the order of
the messages and routes each to the transaction it belongs to; a transaction being assembled is a
:class:`~cdcd.assembler.buffer.TxnBuffer`, whose memory :class:`~cdcd.assembler.memory.Memory`
accounts, compacts, spills and releases.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final

from cdcd.assembler.buffer import TxnBuffer
from cdcd.assembler.memory import Memory
from cdcd.assembler.policy import PartPolicy
from cdcd.assembler.sizes import COMPACT_BYTES, change_size, record_size
from cdcd.assembler.subxacts import abort_subxact
from cdcd.assembler.transaction import (
    ChangeRecord,
    RenderedJson,
    Transaction,
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


def _where(lsn: int) -> str:
    return f"at LSN {format_lsn(lsn)}"


class Assembler:
    """Turns a stream of pgoutput events into committed :class:`Transaction` objects.

    ``memory_limit``: accounted bytes of buffered changes beyond which transactions spill to
    ``spill_dir``; with ``spill_dir=None`` nothing spills (unbounded; for tests). Stale
    spill files in ``spill_dir`` are deleted at construction. ``compact_bytes``: accounted
    bytes of a transaction's decoded records beyond which it moves to the compact form.
    ``part_bytes``: accounted bytes of a regular transaction's changes beyond which they are
    released as a part while it still arrives (None: never; docs/assembler.md, "Parts");
    :attr:`part_policy` may refuse it per transaction. The assembler calls nothing of its
    caller's: Type messages are the caller's to observe, and a streamed change's row JSON is
    rendered by the caller before it is fed (:meth:`undecoded_relation`).
    """

    def __init__(
        self,
        *,
        memory_limit: int = DEFAULT_MEMORY_LIMIT,
        spill_dir: Path | None = None,
        compact_bytes: int = COMPACT_BYTES,
        part_bytes: int | None = None,
    ) -> None:
        self._memory = Memory(memory_limit, spill_dir, compact_bytes)
        self._parts = part_bytes is not None
        self._part_bytes = part_bytes or 0
        #: Read at each Begin with the transaction's commit LSN: may it be released in parts?
        self.part_policy = PartPolicy()
        #: Changes fed with their row JSON rendered on arrival since construction.
        self.rendered = 0
        self._relations: dict[int, Relation] = {}
        self._relations_view: Mapping[int, Relation] = MappingProxyType(self._relations)
        self._current: TxnBuffer | None = None  # Begin..Commit or Begin Prepare..Prepare
        self._block: TxnBuffer | None = None  # the streamed transaction of the open block
        self._streams: dict[int, TxnBuffer] = {}
        self._prepared: dict[str, TxnBuffer] = {}
        #: Commit / Rollback Prepared for a GID that was not held (no-ops).
        self.unknown_gid_resolutions = 0

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
        return self._memory.buffered

    @property
    def spill_count(self) -> int:
        """Spill events since construction."""
        return self._memory.spill_count

    @property
    def total_spilled_bytes(self) -> int:
        """The size of the spill files closed since construction (released or dropped)."""
        return self._memory.total_spilled_bytes

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
            self._memory.discard(buf)
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
                    return self._memory.release_part(buf)
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
                    self._block.spool_catalog(msg.xid)
            case Begin():
                self._check_outside("Begin", lsn)
                buf = self._current = TxnBuffer("regular", msg.xid, lsn, final_lsn=msg.final_lsn)
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
                return self._memory.release(
                    buf, "streamed", msg.commit_lsn, msg.end_lsn, msg.commit_time
                )
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
                self._current = TxnBuffer(
                    "prepare", msg.xid, lsn, final_lsn=msg.prepare_lsn, gid=msg.gid
                )
            case Prepare():
                self._on_prepare(msg, lsn)
            case CommitPrepared():
                held = self._resolve(msg.gid, "Commit Prepared", lsn)
                if held is not None:
                    return self._memory.release(
                        held, "prepared", msg.commit_lsn, msg.end_lsn, msg.commit_time
                    )
            case RollbackPrepared():
                held = self._resolve(msg.gid, "Rollback Prepared", lsn)
                if held is not None:
                    self._memory.discard(held)
        return None

    # --- message handlers ------------------------------------------------------------------

    def _on_relation(self, rel: Relation) -> None:
        block = self._block
        if block is None:
            self._relations[rel.oid] = rel
            return
        block.spool_catalog(rel.xid)
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
        return self._memory.release(buf, "regular", msg.commit_lsn, msg.end_lsn, msg.commit_time)

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
                self._memory.discard(buf)
            buf = self._streams[msg.xid] = TxnBuffer("stream", msg.xid, lsn)
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
            self._memory.discard(buf)
        else:
            self._memory.buffered -= abort_subxact(buf, msg.subxid)

    # --- helpers ----------------------------------------------------------------------------

    def _buffers(self) -> Iterator[TxnBuffer]:
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

    def _target(self, change: Change, lsn: int) -> TxnBuffer:
        buf = self._block or self._current
        if buf is None:
            raise AssemblyError(
                f"{type(change).__name__} outside any transaction or stream block {_where(lsn)}"
            )
        return buf

    def _relation(self, buf: TxnBuffer, oid: int, lsn: int) -> Relation:
        rel = buf.overlay.get(oid) if buf.overlay else None
        if rel is None:
            rel = self._relations.get(oid)
            if rel is None:
                raise AssemblyError(f"change of relation OID {oid} with no Relation {_where(lsn)}")
        return rel

    def _take_stream(self, xid: int, what: str, lsn: int) -> TxnBuffer:
        buf = self._streams.pop(xid, None)
        if buf is None:
            raise AssemblyError(f"{what} for xid {xid}, which was never streamed {_where(lsn)}")
        # The transaction's Relations become everyone's, as the apply worker applies them.
        for _, rel in buf.rel_log:
            self._relations[rel.oid] = rel
        buf.overlay, buf.rel_log = {}, []
        return buf

    def _hold(self, buf: TxnBuffer) -> None:
        self._hold_nothing(buf.gid)
        self._prepared[buf.gid] = buf

    def _hold_nothing(self, gid: str) -> None:
        if (old := self._prepared.pop(gid, None)) is not None:
            self._memory.discard(old)

    def _resolve(self, gid: str, what: str, lsn: int) -> TxnBuffer | None:
        """The prepared transaction ``gid`` a Commit / Rollback Prepared resolves, if held."""
        self._check_outside(what, lsn)
        held = self._prepared.pop(gid, None)
        if held is None:
            self.unknown_gid_resolutions += 1
        return held

    def _append(self, buf: TxnBuffer, record: ChangeRecord, xid: int | None) -> None:
        buf.count_change(xid)
        spill = buf.spill
        if spill is not None:
            size = spill.append(record)
            if spill.in_memory:
                self._grow(buf, size)
            return
        buf.records.append(record)
        buf.raws.append(None)
        self._grow(buf, change_size(record.change))

    def _grow(self, buf: TxnBuffer, size: int) -> None:
        """Account ``size`` more bytes to ``buf`` held in memory; compact, spill if needed."""
        if self._memory.grow(buf, size):
            self._memory.spill_until_under(self._buffers())

    def feed_undecoded(
        self, data: bytes, lsn: int, *, streamed: bool, rendered: RenderedJson | None = None
    ) -> bool:
        """Take an Insert, Update or Delete as pgoutput bytes, undecoded, if it belongs to a
        transaction in spill format (decoded when read back; docs/assembler.md, "Memory");
        return whether it was taken. False: decode ``data`` and :meth:`feed` it as usual.
        ``rendered``: the change's row JSON, which the caller rendered as it arrived (only
        for a streamed change; docs/assembler.md, "Rendering streamed changes"), kept with it.
        """
        if data[:1] not in _CHANGE_TAGS:
            return False
        return self._take_undecoded(data, lsn, streamed, rendered)

    def undecoded_relation(self, data: bytes, lsn: int, *, streamed: bool) -> Relation | None:
        """The Relation of the Insert, Update or Delete ``data`` if :meth:`feed_undecoded` would
        take it (its transaction is in spill format), else None: what a caller that renders a
        streamed change's row JSON before feeding it needs."""
        if data[:1] not in _CHANGE_TAGS:
            return None
        buf = self._block or self._current
        if buf is None or buf.spill is None or len(data) < (9 if streamed else 5):
            return None
        oid = _XID_OID.unpack_from(data, 1)[1] if streamed else _OID.unpack_from(data, 1)[0]
        return self._relation(buf, oid, lsn)

    def _take_undecoded(
        self, data: bytes, lsn: int, streamed: bool, rendered: RenderedJson | None
    ) -> bool:
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
        buf.count_change(xid)
        spill = buf.spill
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
        renders: bool = False,
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
        the decoder's state, which only Stream Start and Stop change, and those end a run.
        ``renders``: the caller renders streamed changes as they arrive, so the run also ends
        before a streamed change that would be taken undecoded (:meth:`undecoded_relation`)."""
        stop = renders and streamed
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
            block = self._block
            if stop and block is not None and block.spill is not None and tag in _CHANGE_TAGS:
                break  # left for the caller to render
            lsn: int = item[0]
            wal_end: int = item[1]
            taken += 1
            size += len(data)
            if wal_end > wal:
                wal = wal_end
            if tag in _CHANGE_TAGS and self._take_undecoded(data, lsn, streamed, None):
                continue
            txn = self.feed(decode(data, lsn), lsn, data)
            if txn is not None:
                return taken - start, size, wal, txn
        return taken - start, size, wal, None

    def _append_change(
        self, buf: TxnBuffer, lsn: int, change: Insert | Update | Delete, rel: Relation, data: bytes
    ) -> None:
        """_append for a change with its pgoutput bytes (the hot path of :meth:`feed`)."""
        buf.count_change(change.xid)
        spill = buf.spill
        if spill is not None:
            size = spill.append_raw(lsn, data, change.xid, (rel,))
            if spill.in_memory:
                self._grow(buf, size)
            return
        buf.records.append(ChangeRecord(lsn, change, (rel,)))
        buf.raws.append(data)
        self._grow(buf, record_size(change, data))
