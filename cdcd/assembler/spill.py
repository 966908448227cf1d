"""Spill format: a large buffered transaction's changes as one append-only byte stream.

The assembler (:mod:`cdcd.assembler.assembler`) keeps a small transaction as decoded
records. Once a transaction grows large, its changes move into a :class:`SpillFile`, which
first holds the stream in memory: the compact form, about the size of the pgoutput bytes,
against several times that for decoded objects, and with nothing decoded until release. When
the memory the assembler accounts for passes its limit, :meth:`SpillFile.move_to` writes the
stream to a file and later changes are appended there. The stream is read back, in order,
when the transaction is released, and dropped (the file deleted) when the transaction is
released, aborted or rolled back. Nothing here survives a restart: the server resends every
transaction that was not confirmed, so stale files are simply removed (:func:`remove_stale`).

Invariants:

- Records are written in the order they were appended; reading yields them in that order,
  as equal :class:`~cdcd.assembler.transaction.ChangeRecord` objects (the change events
  compare equal; the Relation objects are the very ones that were appended).
- :meth:`SpillFile.tell` is the offset the next record will start at. Truncating at an offset
  previously returned by ``tell`` drops exactly the records appended after it. The
  assembler uses this for Stream Abort of a subtransaction, as PostgreSQL's apply worker
  truncates its spool file (``src/backend/replication/logical/worker.c``,
  ``stream_abort_internal``).
- Relations are not written: each file keeps the few Relation objects its records refer to in
  a small in-memory table, and records carry an index into it.
- Inserts, Updates and Deletes are stored in pgoutput's own format (tag R) and read back by
  the decoder's fast path. A change appended with the bytes it was decoded from
  (:meth:`SpillFile.append_raw`) is stored as those very bytes; one moved from memory is
  re-encoded (:func:`cdcd.decoder.tuples.build_tuple`).
- In memory, the stream is kept in sealed chunks of about ``buffer_size`` bytes plus one
  open buffer: what it holds is :meth:`SpillFile.tell` bytes plus a small overhead per
  chunk. On disk, writes are buffered (``buffer_size``, 1 MiB by default): memory held by a
  spilled transaction is at most that buffer plus the relation table.
- I/O errors surface as :class:`OSError` (disk full, permission): the caller decides.

Record format (all integers little-endian)::

    u32 body length | body
    body   = u8 tag | u64 lsn | u8 has_xid | u32 xid | u32 nrel | nrel * u32 relation index | payload
    tag T  = u8 options | u32 n | n * u32 oid
    tag M  = u8 transactional | u64 message lsn | u32 len | prefix utf-8 | u32 len | content
    tag R  = an Insert, Update or Delete as a pgoutput message (has_xid: with the leading xid
             of a change inside a stream block), decoded again when read back
    tag J  = u32 len | the same pgoutput message | u32 len | before | u32 len | after
             | u32 len | key: the change with its row JSON rendered on arrival
             (ChangeRecord.rendered; key length 0xFFFFFFFF: no key)
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final

from cdcd.assembler.transaction import ChangeRecord, RenderedJson
from cdcd.decoder.events import (
    Change,
    Delete,
    Insert,
    Message,
    Relation,
    Truncate,
    TupleData,
    Update,
)
from cdcd.decoder.pgoutput import change_at
from cdcd.decoder.tuples import build_tuple
from cdcd.lsn import format_lsn

#: Spill files are named ``<SPILL_PREFIX><n><SPILL_SUFFIX>`` inside the spill directory.
SPILL_PREFIX: Final = "cdcd-txn-"
SPILL_SUFFIX: Final = ".spill"

DEFAULT_BUFFER_SIZE: Final = 1 << 20

_U32 = struct.Struct("<I")
_HEAD = struct.Struct("<BQBII")  # tag, lsn, has_xid, xid, nrel
# a tag J record's length, head, one relation index and the length of its pgoutput bytes
_RENDERED_HEAD = struct.Struct("<IBQBIIII")
_U16 = struct.Struct("<H")
_U8U32 = struct.Struct("<BI")
_MSG = struct.Struct("<BQ")

_TAG_TRUNCATE: Final = ord("T")
_TAG_MESSAGE: Final = ord("M")
_TAG_RAW: Final = ord("R")
_TAG_RENDERED: Final = ord("J")
_NO_KEY: Final = 0xFFFFFFFF
_NET_U32 = struct.Struct("!I")  # pgoutput (network order): relation oid
_NET_U32X2 = struct.Struct("!II")  # xid, relation oid


def remove_stale(spill_dir: Path) -> int:
    """Delete spill files left in ``spill_dir`` by an earlier process; return how many."""
    removed = 0
    for path in spill_dir.glob(f"{SPILL_PREFIX}*{SPILL_SUFFIX}"):
        path.unlink(missing_ok=True)
        removed += 1
    return removed


class SpillFile:
    """One transaction's change records in spill format: in memory, or (``path``) in a file."""

    __slots__ = (
        "_buffer_size",
        "_chunks",
        "_fd",
        "_flushed",
        "_pending",
        "_rel_index",
        "_rels",
        "in_memory",
        "path",
    )

    def __init__(self, path: Path | None, *, buffer_size: int = DEFAULT_BUFFER_SIZE) -> None:
        """A new, empty stream: in a file created at ``path``, or in memory when it is None."""
        self.path = path
        self._buffer_size = buffer_size
        self._fd: int | None = None
        self._chunks: list[bytes] = []  # in memory: the sealed part of the stream
        self.in_memory = path is None
        self._flushed = 0  # bytes before _pending: in _chunks (in memory) or in the file
        self._pending = bytearray()
        self._rels: list[Relation] = []
        self._rel_index: dict[int, int] = {}  # id(Relation) -> index in _rels
        if path is not None:
            self._fd = _create(path)

    def tell(self) -> int:
        """The offset the next appended record will start at (= the bytes appended so far)."""
        return self._flushed + len(self._pending)

    @property
    def size(self) -> int:
        return self.tell()

    def move_to(self, path: Path) -> None:
        """Write the stream held in memory to a file created at ``path``; later records are
        appended there."""
        if not self.in_memory:
            raise ValueError(f"spill stream is already in {self.path}")
        self._fd = _create(path)
        self.path = path
        self.in_memory = False
        for chunk in self._chunks:
            _write_all(self._fd, chunk)
        self._chunks = []

    def append(self, record: ChangeRecord) -> int:
        """Append one record (buffered); return the bytes it takes in the stream."""
        body = _encode(record, self._relation_ids(record.relations))
        pending = self._pending
        pending += _U32.pack(len(body))
        pending += body
        if len(pending) >= self._buffer_size:
            self._flush()
        return 4 + len(body)

    def append_raw(
        self, lsn: int, data: bytes, xid: int | None, relations: tuple[Relation, ...]
    ) -> int:
        """Append the Insert/Update/Delete decoded from ``data`` (an XLogData payload) at
        ``lsn``; ``xid`` is the change's xid (not None: received inside a stream block).
        Return the bytes it takes in the stream."""
        rel_ids = self._relation_ids(relations)
        head = _HEAD.pack(_TAG_RAW, lsn, xid is not None, xid or 0, len(rel_ids))
        length = len(head) + 4 * len(rel_ids) + len(data)
        pending = self._pending
        pending += _U32.pack(length)
        pending += head
        if len(rel_ids) == 1:
            pending += _U32.pack(rel_ids[0])
        else:
            pending += struct.pack(f"<{len(rel_ids)}I", *rel_ids)
        pending += data
        if len(pending) >= self._buffer_size:
            self._flush()
        return 4 + length

    def append_rendered(
        self,
        lsn: int,
        data: bytes,
        xid: int | None,
        relations: tuple[Relation, ...],
        rendered: RenderedJson,
    ) -> int:
        """:meth:`append_raw` of a one-table change with its row JSON, read back as
        ``ChangeRecord.rendered``. Return the bytes it takes in the stream."""
        (rel_id,) = self._relation_ids(relations)
        before, after, key = rendered
        tail = b"".join(
            (
                data,
                _U32.pack(len(before)),
                before,
                _U32.pack(len(after)),
                after,
                _U32.pack(_NO_KEY) if key is None else _U32.pack(len(key)) + key,
            )
        )
        length = _RENDERED_HEAD.size - 4 + len(tail)
        pending = self._pending
        pending += _RENDERED_HEAD.pack(
            length, _TAG_RENDERED, lsn, xid is not None, xid or 0, 1, rel_id, len(data)
        )
        pending += tail
        if len(pending) >= self._buffer_size:
            self._flush()
        return 4 + length

    def truncate(self, offset: int) -> None:
        """Drop every record appended at or after ``offset`` (a value of :meth:`tell`)."""
        if offset >= self._flushed:
            del self._pending[offset - self._flushed :]
            return
        self._pending.clear()
        if self.in_memory:
            kept: list[bytes] = []
            start = 0
            for chunk in self._chunks:
                if start + len(chunk) >= offset:
                    kept.append(chunk[: offset - start])
                    break
                kept.append(chunk)
                start += len(chunk)
            self._chunks = kept
        else:
            os.ftruncate(self._writer(), offset)
        self._flushed = offset

    def finish(self) -> None:
        """Flush and close for writing; the stream stays readable until :meth:`delete`."""
        if self.in_memory:
            self._flush()
        elif self._fd is not None:
            self._flush()
            os.close(self._fd)
            self._fd = None

    def reader(self) -> Callable[[], Iterator[ChangeRecord]]:
        """A function returning a fresh iterator over the records (after :meth:`finish`)."""
        rels = tuple(self._rels)
        if self.in_memory:
            chunks = self._chunks

            def read_memory() -> Iterator[ChangeRecord]:
                return _records(iter(chunks), rels, "in-memory spill stream")

            return read_memory
        path = self.path
        assert path is not None

        def read() -> Iterator[ChangeRecord]:
            return _read(path, rels)

        return read

    def draining_reader(self) -> Callable[[], Iterator[ChangeRecord]] | None:
        """For a stream held in memory (after :meth:`finish`): a function returning an
        iterator over the records that drops each chunk from the stream once it has been read,
        for the last reading (Transaction.take_changes); None for a file (nothing to free).
        The stream cannot be read again after it."""
        if not self.in_memory:
            return None
        rels = tuple(self._rels)
        chunks = self._chunks

        def drain() -> Iterator[ChangeRecord]:
            return _records(_taking(chunks), rels, "in-memory spill stream")

        return drain

    def delete(self) -> None:
        """Drop the stream (close and remove the file); safe to call more than once."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._pending = bytearray()
        self._chunks = []
        if self.path is not None:
            self.path.unlink(missing_ok=True)

    def _writer(self) -> int:
        if self._fd is None:
            raise ValueError(f"spill file {self.path} is closed for writing")
        return self._fd

    def _flush(self) -> None:
        pending = self._pending
        if not pending:
            return
        if self.in_memory:
            self._chunks.append(bytes(pending))
        else:
            _write_all(self._writer(), pending)
        self._flushed += len(pending)
        pending.clear()

    def _relation_ids(self, relations: tuple[Relation, ...]) -> list[int]:
        ids = []
        for rel in relations:
            index = self._rel_index.get(id(rel))
            if index is None:
                index = self._rel_index[id(rel)] = len(self._rels)
                self._rels.append(rel)
            ids.append(index)
        return ids


def compact(
    records: list[ChangeRecord], raws: list[bytes | None], firsts: list[int]
) -> tuple[SpillFile, list[int]]:
    """A stream in memory holding ``records`` in order, each as its pgoutput bytes in ``raws``
    when kept; and for each record index in ``firsts`` (ascending) the offset where that record
    starts (the end of the stream for an index past the last record)."""
    spill = SpillFile(None)
    offsets: list[int] = []
    for index, (record, raw) in enumerate(zip(records, raws, strict=True)):
        while len(offsets) < len(firsts) and firsts[len(offsets)] <= index:
            offsets.append(spill.tell())
        if raw is None:
            spill.append(record)
        else:
            spill.append_raw(record.lsn, raw, record.change.xid, record.relations)
    offsets += [spill.tell()] * (len(firsts) - len(offsets))
    return spill, offsets


def _create(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)


def _write_all(fd: int, data: bytes | bytearray) -> None:
    written = os.write(fd, data)
    while written < len(data):  # a partial write (a signal, a full disk): rare, so copying
        written += os.write(fd, data[written:])


# --- encoding ----------------------------------------------------------------------------------


def _encode(record: ChangeRecord, rel_ids: list[int]) -> bytes:
    change = record.change
    xid = change.xid
    out: list[bytes] = []
    tag = _TAG_RAW
    # Insert, Update and Delete in pgoutput's own format (tag R), as append_raw stores them.
    match change:
        case Insert():
            out += (b"I", _change_head(xid, change.relation_oid), b"N", _tuple(change.new))
        case Update():
            out += (b"U", _change_head(xid, change.relation_oid))
            if change.old is not None:
                out += (_old_part(change.old_kind), _tuple(change.old))
            out += (b"N", _tuple(change.new))
        case Delete():
            head = _change_head(xid, change.relation_oid)
            out += (b"D", head, _old_part(change.old_kind), _tuple(change.old))
        case Truncate():
            tag = _TAG_TRUNCATE
            oids = change.relation_oids
            out.append(_U8U32.pack(change.options, len(oids)))
            out.append(struct.pack(f"<{len(oids)}I", *oids))
        case Message():
            tag = _TAG_MESSAGE
            prefix = change.prefix.encode()
            out.append(_MSG.pack(change.transactional, change.lsn))
            out.append(_U32.pack(len(prefix)))
            out.append(prefix)
            out.append(_U32.pack(len(change.content)))
            out.append(change.content)
    head = _HEAD.pack(tag, record.lsn, xid is not None, xid or 0, len(rel_ids))
    return b"".join((head, struct.pack(f"<{len(rel_ids)}I", *rel_ids), *out))


def _change_head(xid: int | None, oid: int) -> bytes:
    """pgoutput's (xid,) relation OID of a change; the xid only inside a stream block."""
    return _NET_U32.pack(oid) if xid is None else _NET_U32X2.pack(xid, oid)


def _old_part(kind: str | None) -> bytes:
    if kind not in ("K", "O"):
        raise ValueError(f"old tuple of kind {kind!r}")
    return kind.encode()


def _tuple(tup: TupleData) -> bytes:
    return build_tuple(tup.kinds, tup.values)


# --- decoding ----------------------------------------------------------------------------------


def _taking(chunks: list[bytes]) -> Iterator[bytes]:
    """The chunks in order, each removed from ``chunks`` as it is handed out (so it is freed
    once the reader is past it)."""
    chunks.reverse()
    while chunks:
        yield chunks.pop()


def _read(path: Path, rels: tuple[Relation, ...]) -> Iterator[ChangeRecord]:
    """The records of ``path`` in order, reading ``DEFAULT_BUFFER_SIZE`` bytes at a time."""
    with path.open("rb", buffering=0) as f:
        chunks = iter(lambda: f.read(DEFAULT_BUFFER_SIZE), b"")
        yield from _records(chunks, rels, f"spill file {path}")


def _records(
    chunks: Iterator[bytes], rels: tuple[Relation, ...], where: str
) -> Iterator[ChangeRecord]:
    """The records of a stream given as consecutive chunks (a record may span chunks)."""
    singles = tuple((rel,) for rel in rels)  # the relations of a one-table record, shared
    chunk = b""
    pos = 0
    for more in chunks:
        chunk = chunk[pos:] + more if pos < len(chunk) else more
        pos = 0
        end = len(chunk)
        while pos + 4 <= end:
            length = _u32le(chunk, pos)
            stop = pos + 4 + length
            if stop > end:
                break
            yield _decode(chunk, pos + 4, stop, rels, singles)
            pos = stop
    if pos != len(chunk):
        raise ValueError(f"{where} is truncated")


def _u32le(buf: bytes, pos: int) -> int:
    """The little-endian u32 at ``pos`` (byte by byte: no struct call)."""
    return buf[pos] | (buf[pos + 1] << 8) | (buf[pos + 2] << 16) | (buf[pos + 3] << 24)


def _decode(
    buf: bytes,
    start: int,
    stop: int,
    rels: tuple[Relation, ...],
    singles: tuple[tuple[Relation, ...], ...],
) -> ChangeRecord:
    """The record whose body is ``buf[start:stop]`` (``singles``: ``(rel,)`` for each of
    ``rels``, shared by the one-table records)."""
    if stop - start < _HEAD.size:
        raise struct.error(f"spill record of {stop - start} bytes")
    # the head (_HEAD: tag, lsn, has_xid, xid, nrel), read byte by byte (no struct call)
    tag: int = buf[start]
    lsn = _u32le(buf, start + 1) | (_u32le(buf, start + 5) << 32)
    has_xid: int = buf[start + 9]
    raw_xid = _u32le(buf, start + 10)
    nrel = _u32le(buf, start + 14)
    pos = start + _HEAD.size
    if nrel == 1:
        index = _u32le(buf, pos)
        relations: tuple[Relation, ...] = singles[index]
    else:
        relations = tuple(rels[i] for i in struct.unpack_from(f"<{nrel}I", buf, pos))
    pos += 4 * nrel
    xid = raw_xid if has_xid else None
    change: Change | None
    if tag == _TAG_RAW:
        change = change_at(buf, pos, stop, lsn, bool(has_xid))
    elif tag == _TAG_RENDERED:
        return _decode_rendered(buf, pos, stop, lsn, bool(has_xid), relations)
    elif tag == _TAG_TRUNCATE:
        options, n = _U8U32.unpack_from(buf, pos)
        pos += _U8U32.size
        change = Truncate(xid, options, struct.unpack_from(f"<{n}I", buf, pos))
    elif tag == _TAG_MESSAGE:
        transactional, msg_lsn = _MSG.unpack_from(buf, pos)
        pos += _MSG.size
        (plen,) = _U32.unpack_from(buf, pos)
        prefix = buf[pos + 4 : pos + 4 + plen].decode()
        pos += 4 + plen
        (clen,) = _U32.unpack_from(buf, pos)
        content = buf[pos + 4 : pos + 4 + clen]
        change = Message(xid, bool(transactional), msg_lsn, prefix, content)
    else:
        raise ValueError(f"spill record with unknown tag {tag}")
    return ChangeRecord(lsn, change, relations)


def _decode_rendered(
    buf: bytes, pos: int, stop: int, lsn: int, streamed: bool, relations: tuple[Relation, ...]
) -> ChangeRecord:
    """The tag J record whose payload is ``buf[pos:stop]``."""
    end = pos + 4 + _u32le(buf, pos)
    change = change_at(buf, pos + 4, end, lsn, streamed)
    pos = end
    end = pos + 4 + _u32le(buf, pos)
    before = buf[pos + 4 : end]
    pos = end
    end = pos + 4 + _u32le(buf, pos)
    after = buf[pos + 4 : end]
    pos = end
    size = _u32le(buf, pos)
    key = None if size == _NO_KEY else buf[pos + 4 : pos + 4 + size]
    if (pos + 4 if key is None else pos + 4 + size) != stop:
        raise ValueError(
            f"spill record at LSN {format_lsn(lsn)}: its rendered JSON does not fill it"
        )
    return ChangeRecord(lsn, change, relations, (before, after, key))
