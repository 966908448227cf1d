"""pgoutput bytes to events, sans-I/O: one XLogData payload in, one event out.

Implements PostgreSQL docs "Logical Replication Message Formats" (protocol section 55.9 /
54.9) for protocol versions 1 to 4. The walsender sends exactly one pgoutput message per XLogData (``w``) CopyData, so
:meth:`PgOutputDecoder.decode` takes a whole message and returns one event of
:mod:`cdcd.decoder.events`.

Invariants:

- Every byte is accounted for. An unknown tag, a truncated message, a length that is negative
  or runs past the end, bytes left over after a complete message, a string that is not
  NUL-terminated UTF-8, or an unknown kind/flag byte raises
  :class:`~cdcd.errors.RemoteProtocolError` naming the tag and the XLogData LSN. Nothing is
  skipped.
- A tag newer than the negotiated ``proto_version`` is an error: streaming tags
  (S E c A) need >= 2, two-phase tags (b P K r p) need >= 3, Stream Abort's abort LSN/time
  (``streaming = parallel``) needs >= 4.
- Stream state: Stream Start enters a block, Stream Stop leaves it. Inside a block (which only
  exists with protocol >= 2) Relation, Type, Insert, Update, Delete, Truncate and Message
  carry a leading xid; outside, they do not and the event's ``xid`` is None. Stream Start
  inside a block, Stream Stop outside one, and a transaction boundary (B C b P K r c A p)
  inside one are errors: the server sends Stream Commit/Abort/Prepare outside blocks.
  Origin may appear inside a block (pgoutput sends it right after Stream Start).
- :meth:`PgOutputDecoder.reset` after a reconnect leaves any block: the new walsender starts
  outside one.

The decoder keeps values raw (``TupleData``): type conversion happens later, per relation.
It is on the hot path (hundreds of thousands of rows per second in pure Python), so it
dispatches on the tag byte through a 256-entry table, unpacks with precompiled structs and
copies each column value exactly once (one ``bytes`` slice).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Final

from cdcd.decoder.events import (
    KIND_BINARY,
    KIND_NULL,
    KIND_TEXT,
    KIND_UNCHANGED_TOAST,
    Begin,
    BeginPrepare,
    Column,
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
    TupleData,
    Type,
    Update,
)
from cdcd.decoder.tuples import BadKind, parse_tuple
from cdcd.errors import RemoteProtocolError

# Field layouts after the tag byte (network byte order). XLogRecPtr, TransactionId and Oid
# are unsigned; TimestampTz, counts and typmod are signed. (TupleData value lengths are read
# unsigned on the fast path and signed when describing an error: see _tuple.)
_BEGIN: Final = struct.Struct("!QqI")  # final_lsn, commit_time, xid
_COMMIT: Final = struct.Struct("!BQQq")  # flags, commit_lsn, end_lsn, commit_time
_ORIGIN: Final = struct.Struct("!Q")
_U32: Final = struct.Struct("!I")
_I32: Final = struct.Struct("!i")
_U16: Final = struct.Struct("!H")
_COLUMN_TAIL: Final = struct.Struct("!Ii")  # type oid, typmod
_TRUNCATE: Final = struct.Struct("!iB")  # number of relations, option bits
_MESSAGE: Final = struct.Struct("!BQ")  # flags, lsn
_STREAM_START: Final = struct.Struct("!IB")
_STREAM_COMMIT: Final = struct.Struct("!IBQQq")
_U32X2: Final = struct.Struct("!II")
_STREAM_ABORT: Final = _U32X2  # xid, subxid
_STREAM_ABORT_V4: Final = struct.Struct("!IIQq")
_PREPARE_HEAD: Final = struct.Struct("!BQQqI")  # P, K, p: flags, lsn, end_lsn, time, xid
_BEGIN_PREPARE_HEAD: Final = struct.Struct("!QQqI")
_ROLLBACK_PREPARED_HEAD: Final = struct.Struct("!BQQqqI")

_STREAM_ABORT_LEN: Final = 1 + _STREAM_ABORT.size  # 9 bytes, tag included
_STREAM_ABORT_V4_LEN: Final = 1 + _STREAM_ABORT_V4.size  # 25 bytes, tag included

_HAS_VALUE: Final = (KIND_TEXT, KIND_BINARY)
_NO_VALUE: Final = (KIND_NULL, KIND_UNCHANGED_TOAST)
_PART_N: Final = ord("N")
_INSERT: Final = ord("I")
_PART_K: Final = ord("K")
_PART_O: Final = ord("O")
_OLD_PARTS: Final = (_PART_K, _PART_O)
_REPLICA_IDENTITIES: Final = frozenset("dnfi")

_STREAMING_TAGS: Final = b"SEcA"
_TWO_PHASE_TAGS: Final = b"bPKrp"

_Handler = Callable[[bytes, int], PgOutputMessage]


class _Malformed(Exception):
    """Internal: a byte that cannot be right here (unknown kind, flag, part)."""


class _Truncated(_Malformed):
    """Internal: a length or string ran past the end of the message."""


def _tag_name(tag: int) -> str:
    return chr(tag) if 0x20 < tag < 0x7F else f"\\x{tag:02x}"


def _string(buf: bytes, pos: int) -> tuple[str, int]:
    """A NUL-terminated UTF-8 string at ``pos``; returns it and the position after the NUL."""
    nul = buf.find(b"\0", pos)
    if nul < 0:
        raise _Truncated("string without a terminating NUL")
    return buf[pos:nul].decode("utf-8"), nul + 1


def _tuple(buf: bytes, pos: int) -> tuple[TupleData, int]:
    """A TupleData part at ``pos``; returns it and the position after it.

    The hot loop of the decoder, in :mod:`cdcd.decoder.tuples` (compiled when built). Lengths
    are read unsigned, so ``pos`` only moves forward; a length running past the end shows up
    as an IndexError or as ``pos > len(buf)`` afterwards, and :func:`_tuple_error` then rescans
    to say which column was wrong.
    """
    try:
        kinds, values, end = parse_tuple(buf, pos)
    except IndexError:
        raise _tuple_error(buf, pos) from None
    except BadKind as exc:
        raise _Malformed(
            f"column {exc.column + 1} of {exc.ncols}: unknown TupleData kind "
            f"{_tag_name(exc.kind)!r}"
        ) from None
    if end > len(buf):
        raise _tuple_error(buf, pos)
    return TupleData(kinds, values), end


def _tuple_error(buf: bytes, pos: int) -> _Truncated:
    """Describe where the TupleData at ``pos`` runs past the end (slow path, errors only)."""
    end = len(buf)
    ncols = _U16.unpack_from(buf, pos)[0]
    pos += 2
    for i in range(ncols):
        where = f"column {i + 1} of {ncols}"
        if pos >= end:
            return _Truncated(f"{where}: message ends before its kind byte")
        if buf[pos] in _HAS_VALUE:
            if pos + 5 > end:
                return _Truncated(f"{where}: message ends inside the value length")
            length = _I32.unpack_from(buf, pos + 1)[0]
            if length < 0 or length > end - pos - 5:
                return _Truncated(
                    f"{where}: impossible value length {length} with {end - pos - 5} bytes left"
                )
            pos += 5 + length
        else:
            pos += 1
    return _Truncated("TupleData runs past the end of the message")  # pragma: no cover


class PgOutputDecoder:
    """Decodes pgoutput messages of one replication session with a fixed ``proto_version``.

    ``decode(data, lsn)`` takes one XLogData payload (exactly one message); ``lsn`` is that
    XLogData's ``wal_start`` and only appears in error messages.
    """

    __slots__ = ("_handlers", "_in_stream", "_proto")

    def __init__(self, proto_version: int) -> None:
        if not 1 <= proto_version <= 4:
            raise ValueError(f"pgoutput proto_version must be 1..4, not {proto_version}")
        self._proto = proto_version
        self._in_stream = False
        handlers: list[_Handler | None] = [None] * 256
        by_tag: dict[bytes, _Handler] = {
            b"B": self._begin,
            b"C": self._commit,
            b"O": self._origin,
            b"R": self._relation,
            b"Y": self._type,
            b"I": self._insert,
            b"U": self._update,
            b"D": self._delete,
            b"T": self._truncate,
            b"M": self._message,
            b"S": self._stream_start,
            b"E": self._stream_stop,
            b"c": self._stream_commit,
            b"A": self._stream_abort,
            b"b": self._begin_prepare,
            b"P": self._prepare,
            b"K": self._commit_prepared,
            b"r": self._rollback_prepared,
            b"p": self._stream_prepare,
        }
        for tag, handler in by_tag.items():
            if tag in _STREAMING_TAGS and proto_version < 2:
                continue
            if tag in _TWO_PHASE_TAGS and proto_version < 3:
                continue
            handlers[tag[0]] = handler
        self._handlers = handlers

    @property
    def proto_version(self) -> int:
        return self._proto

    @property
    def in_stream(self) -> bool:
        """Whether a Stream Start .. Stream Stop block is open."""
        return self._in_stream

    def reset(self) -> None:
        """Forget the stream state, as after a reconnect: the next message is outside a block."""
        self._in_stream = False

    def decode(self, data: bytes | bytearray | memoryview, lsn: int) -> PgOutputMessage:
        """Decode one pgoutput message; raise RemoteProtocolError if it is not exactly one."""
        buf = data if type(data) is bytes else bytes(data)
        if not buf:
            raise RemoteProtocolError("empty pgoutput message", lsn=lsn)
        tag = buf[0]
        handler = self._handlers[tag]
        if handler is None:
            raise self._unknown(tag, lsn)
        try:
            return handler(buf, lsn)
        except (_Truncated, IndexError, struct.error) as exc:
            detail = f": {exc}" if isinstance(exc, _Truncated) else ""
            why = f"truncated pgoutput message ({len(buf)} bytes){detail}"
        except UnicodeDecodeError as exc:
            why = f"string is not valid UTF-8: {exc.reason} at byte {exc.start} of {exc.object!r}"
        except _Malformed as exc:
            why = str(exc)
        raise RemoteProtocolError(why, tag=_tag_name(tag), lsn=lsn)

    # --- helpers -------------------------------------------------------------------------

    def _unknown(self, tag: int, lsn: int) -> RemoteProtocolError:
        if tag in _STREAMING_TAGS:
            why = (
                f"a streaming message, which needs proto_version >= 2 (session uses {self._proto})"
            )
        elif tag in _TWO_PHASE_TAGS:
            why = (
                f"a two-phase message, which needs proto_version >= 3 (session uses {self._proto})"
            )
        else:
            why = "not a pgoutput message"
        return RemoteProtocolError(f"unexpected tag: {why}", tag=_tag_name(tag), lsn=lsn)

    @staticmethod
    def _done(buf: bytes, pos: int, lsn: int) -> None:
        """Raise unless ``pos`` is exactly the end of the message."""
        if pos != len(buf):
            raise RemoteProtocolError(
                f"{len(buf) - pos} bytes of trailing garbage after a complete message "
                f"of {pos} bytes",
                tag=_tag_name(buf[0]),
                lsn=lsn,
            )

    def _outside_block(self, buf: bytes, lsn: int) -> None:
        if self._in_stream:
            raise RemoteProtocolError(
                "transaction boundary inside a Stream Start .. Stream Stop block",
                tag=_tag_name(buf[0]),
                lsn=lsn,
            )

    def _xid(self, buf: bytes) -> tuple[int | None, int]:
        """The streamed-transaction xid after the tag, if inside a block, and the next position."""
        if self._in_stream:
            return _U32.unpack_from(buf, 1)[0], 5
        return None, 1

    # --- transaction framing ---------------------------------------------------------------

    def _begin(self, buf: bytes, lsn: int) -> Begin:
        self._outside_block(buf, lsn)
        final_lsn, commit_time, xid = _BEGIN.unpack_from(buf, 1)
        self._done(buf, 1 + _BEGIN.size, lsn)
        return Begin(final_lsn, commit_time, xid)

    def _commit(self, buf: bytes, lsn: int) -> Commit:
        self._outside_block(buf, lsn)
        flags, commit_lsn, end_lsn, commit_time = _COMMIT.unpack_from(buf, 1)
        self._done(buf, 1 + _COMMIT.size, lsn)
        return Commit(flags, commit_lsn, end_lsn, commit_time)

    def _origin(self, buf: bytes, lsn: int) -> Origin:
        (origin_lsn,) = _ORIGIN.unpack_from(buf, 1)
        name, pos = _string(buf, 1 + _ORIGIN.size)
        self._done(buf, pos, lsn)
        return Origin(origin_lsn, name)

    # --- catalog -------------------------------------------------------------------------

    def _relation(self, buf: bytes, lsn: int) -> Relation:
        xid, pos = self._xid(buf)
        (oid,) = _U32.unpack_from(buf, pos)
        namespace, pos = _string(buf, pos + 4)
        name, pos = _string(buf, pos)
        identity = chr(buf[pos])
        if identity not in _REPLICA_IDENTITIES:
            raise _Malformed(f"relation {oid}: unknown replica identity {identity!r}")
        (ncols,) = _U16.unpack_from(buf, pos + 1)
        pos += 3
        columns = []
        for _ in range(ncols):
            flags = buf[pos]
            col_name, pos = _string(buf, pos + 1)
            type_oid, typmod = _COLUMN_TAIL.unpack_from(buf, pos)
            pos += _COLUMN_TAIL.size
            columns.append(Column(flags, col_name, type_oid, typmod))
        self._done(buf, pos, lsn)
        return Relation(xid, oid, namespace, name, identity, tuple(columns))

    def _type(self, buf: bytes, lsn: int) -> Type:
        xid, pos = self._xid(buf)
        (oid,) = _U32.unpack_from(buf, pos)
        namespace, pos = _string(buf, pos + 4)
        name, pos = _string(buf, pos)
        self._done(buf, pos, lsn)
        return Type(xid, oid, namespace, name)

    # --- changes -------------------------------------------------------------------------

    def _insert(self, buf: bytes, lsn: int) -> Insert:
        if self._in_stream:
            xid, oid = _U32X2.unpack_from(buf, 1)
            pos = 9
        else:
            xid = None
            (oid,) = _U32.unpack_from(buf, 1)
            pos = 5
        if buf[pos] != _PART_N:
            raise _Malformed(f"expected 'N' before the new tuple, got {_tag_name(buf[pos])!r}")
        new, pos = _tuple(buf, pos + 1)
        if pos != len(buf):
            self._done(buf, pos, lsn)
        return Insert(xid, oid, new)

    def _update(self, buf: bytes, lsn: int) -> Update:
        xid, pos = self._xid(buf)
        (oid,) = _U32.unpack_from(buf, pos)
        pos += 4
        part = buf[pos]
        old_kind: str | None = None
        old: TupleData | None = None
        if part in _OLD_PARTS:
            old_kind = chr(part)
            old, pos = _tuple(buf, pos + 1)
            part = buf[pos]
        if part != _PART_N:
            raise _Malformed(
                f"expected 'K', 'O' or 'N' in an update, got {_tag_name(part)!r}"
                if old_kind is None
                else f"expected 'N' after the old tuple, got {_tag_name(part)!r}"
            )
        new, pos = _tuple(buf, pos + 1)
        self._done(buf, pos, lsn)
        return Update(xid, oid, old_kind, old, new)

    def _delete(self, buf: bytes, lsn: int) -> Delete:
        xid, pos = self._xid(buf)
        (oid,) = _U32.unpack_from(buf, pos)
        pos += 4
        part = buf[pos]
        if part not in _OLD_PARTS:
            raise _Malformed(f"expected 'K' or 'O' in a delete, got {_tag_name(part)!r}")
        old, pos = _tuple(buf, pos + 1)
        self._done(buf, pos, lsn)
        return Delete(xid, oid, chr(part), old)

    def _truncate(self, buf: bytes, lsn: int) -> Truncate:
        xid, pos = self._xid(buf)
        nrels, options = _TRUNCATE.unpack_from(buf, pos)
        pos += _TRUNCATE.size
        if nrels < 0 or nrels * 4 != len(buf) - pos:
            raise RemoteProtocolError(
                f"impossible relation count {nrels} for {len(buf) - pos} bytes of OIDs",
                tag="T",
                lsn=lsn,
            )
        oids = struct.unpack_from(f"!{nrels}I", buf, pos)
        return Truncate(xid, options, oids)

    def _message(self, buf: bytes, lsn: int) -> Message:
        xid, pos = self._xid(buf)
        flags, message_lsn = _MESSAGE.unpack_from(buf, pos)
        if flags > 1:
            raise _Malformed(f"unknown logical message flags {flags}")
        prefix, pos = _string(buf, pos + _MESSAGE.size)
        (length,) = _I32.unpack_from(buf, pos)
        pos += 4
        if length < 0 or length > len(buf) - pos:
            raise RemoteProtocolError(
                f"impossible content length {length} with {len(buf) - pos} bytes left",
                tag="M",
                lsn=lsn,
            )
        content = buf[pos : pos + length]
        self._done(buf, pos + length, lsn)
        return Message(xid, flags == 1, message_lsn, prefix, content)

    # --- streaming (protocol >= 2) -----------------------------------------------------------

    def _stream_start(self, buf: bytes, lsn: int) -> StreamStart:
        if self._in_stream:
            raise RemoteProtocolError(
                "Stream Start inside a Stream Start .. Stream Stop block", tag="S", lsn=lsn
            )
        xid, first = _STREAM_START.unpack_from(buf, 1)
        if first > 1:
            raise _Malformed(f"first-segment flag must be 0 or 1, not {first}")
        self._done(buf, 1 + _STREAM_START.size, lsn)
        self._in_stream = True
        return StreamStart(xid, first == 1)

    def _stream_stop(self, buf: bytes, lsn: int) -> StreamStop:
        if not self._in_stream:
            raise RemoteProtocolError("Stream Stop outside a stream block", tag="E", lsn=lsn)
        self._done(buf, 1, lsn)
        self._in_stream = False
        return StreamStop()

    def _stream_commit(self, buf: bytes, lsn: int) -> StreamCommit:
        self._outside_block(buf, lsn)
        xid, flags, commit_lsn, end_lsn, commit_time = _STREAM_COMMIT.unpack_from(buf, 1)
        self._done(buf, 1 + _STREAM_COMMIT.size, lsn)
        return StreamCommit(xid, flags, commit_lsn, end_lsn, commit_time)

    def _stream_abort(self, buf: bytes, lsn: int) -> StreamAbort:
        # The v4 abort LSN/time are sent only with streaming = parallel, and nothing on the
        # wire says which: the length does (9 or 25 bytes, tag included).
        self._outside_block(buf, lsn)
        if len(buf) == _STREAM_ABORT_LEN:
            xid, subxid = _STREAM_ABORT.unpack_from(buf, 1)
            return StreamAbort(xid, subxid)
        if len(buf) == _STREAM_ABORT_V4_LEN and self._proto >= 4:
            xid, subxid, abort_lsn, abort_time = _STREAM_ABORT_V4.unpack_from(buf, 1)
            return StreamAbort(xid, subxid, abort_lsn, abort_time)
        expected = (
            f"{_STREAM_ABORT_LEN} or {_STREAM_ABORT_V4_LEN}"
            if self._proto >= 4
            else f"{_STREAM_ABORT_LEN} (abort LSN/time need proto_version 4)"
        )
        raise RemoteProtocolError(
            f"Stream Abort of {len(buf)} bytes, expected {expected}", tag="A", lsn=lsn
        )

    # --- two-phase (protocol >= 3) -----------------------------------------------------------

    def _begin_prepare(self, buf: bytes, lsn: int) -> BeginPrepare:
        self._outside_block(buf, lsn)
        prepare_lsn, end_lsn, prepare_time, xid = _BEGIN_PREPARE_HEAD.unpack_from(buf, 1)
        gid, pos = _string(buf, 1 + _BEGIN_PREPARE_HEAD.size)
        self._done(buf, pos, lsn)
        return BeginPrepare(prepare_lsn, end_lsn, prepare_time, xid, gid)

    def _prepare_fields(self, buf: bytes, lsn: int) -> tuple[int, int, int, int, int, str]:
        """The common layout of Prepare, Commit Prepared and Stream Prepare."""
        self._outside_block(buf, lsn)
        flags, first_lsn, end_lsn, time, xid = _PREPARE_HEAD.unpack_from(buf, 1)
        gid, pos = _string(buf, 1 + _PREPARE_HEAD.size)
        self._done(buf, pos, lsn)
        return flags, first_lsn, end_lsn, time, xid, gid

    def _prepare(self, buf: bytes, lsn: int) -> Prepare:
        return Prepare(*self._prepare_fields(buf, lsn))

    def _commit_prepared(self, buf: bytes, lsn: int) -> CommitPrepared:
        return CommitPrepared(*self._prepare_fields(buf, lsn))

    def _stream_prepare(self, buf: bytes, lsn: int) -> StreamPrepare:
        return StreamPrepare(*self._prepare_fields(buf, lsn))

    def _rollback_prepared(self, buf: bytes, lsn: int) -> RollbackPrepared:
        self._outside_block(buf, lsn)
        flags, prepare_end, rollback_end, prepare_time, rollback_time, xid = (
            _ROLLBACK_PREPARED_HEAD.unpack_from(buf, 1)
        )
        gid, pos = _string(buf, 1 + _ROLLBACK_PREPARED_HEAD.size)
        self._done(buf, pos, lsn)
        return RollbackPrepared(
            flags, prepare_end, rollback_end, prepare_time, rollback_time, xid, gid
        )


_REDECODERS: Final = (PgOutputDecoder(1), PgOutputDecoder(2))
_REDECODERS[1]._in_stream = True  # inside a stream block: changes carry their xid


def plain_insert(buf: bytes, start: int, stop: int, streamed: bool = False) -> Insert | None:
    """The Insert in ``buf[start:stop]`` if it is a well-formed one, else None (then
    :func:`decode_change` decodes it, or says what is wrong). ``streamed``: received inside a
    stream block, so with the transaction's xid after the tag.

    The fast path of reading spilled changes back: no copy of the message, no dispatch.
    """
    head = 5 if streamed else 1  # the relation OID's offset
    if stop - start < head + 7 or buf[start] != _INSERT or buf[start + head + 4] != _PART_N:
        return None
    try:
        kinds, values, end = parse_tuple(buf, start + head + 5)
    except (IndexError, BadKind):
        return None
    if end != stop:
        return None
    at = start + head  # the OID and xid, network order, read byte by byte (no struct call)
    oid: int = (buf[at] << 24) | (buf[at + 1] << 16) | (buf[at + 2] << 8) | buf[at + 3]
    xid: int | None = None
    if streamed:
        xid = (
            (buf[start + 1] << 24) | (buf[start + 2] << 16) | (buf[start + 3] << 8) | buf[start + 4]
        )
    return Insert(xid, oid, TupleData(kinds, values))


def decode_change(data: bytes, lsn: int, *, streamed: bool) -> Insert | Update | Delete:
    """Decode an Insert, Update or Delete message again, outside a session.

    Spill files keep a change's pgoutput bytes as received (:mod:`cdcd.assembler.spill`);
    ``streamed`` says whether it was received inside a stream block (with a leading xid).
    """
    msg = _REDECODERS[streamed].decode(data, lsn)
    if type(msg) not in (Insert, Update, Delete):
        raise RemoteProtocolError(
            f"expected an Insert, Update or Delete, not {type(msg).__name__}",
            tag=_tag_name(data[0]),
            lsn=lsn,
        )
    return msg  # type: ignore[return-value]


def change_at(
    buf: bytes, start: int, stop: int, lsn: int, streamed: bool
) -> Insert | Update | Delete:
    """The Insert, Update or Delete whose pgoutput bytes are ``buf[start:stop]``, decoded
    outside a session: :func:`plain_insert` where it can, else :func:`decode_change` (which
    says what is wrong)."""
    change = plain_insert(buf, start, stop, streamed)
    if change is not None:
        return change
    data = buf if start == 0 and stop == len(buf) else buf[start:stop]
    return decode_change(data, lsn, streamed=streamed)
