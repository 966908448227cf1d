"""Framing of PostgreSQL frontend/backend protocol messages, sans-I/O.

PostgreSQL docs, "Message Formats" (protocol section 55.7): after startup every message is
``Byte1(tag) Int32(length including itself) Byte(length-4)``. :class:`MessageReader` is fed
whatever bytes arrive, in chunks of any size, and hands back complete messages::

    reader.feed(chunk)
    while (msg := reader.next()) is not None:
        tag, payload = msg

It never blocks and never reads a socket; the asyncio layer in ``cdcd.replication`` feeds it.
A length below 4 or above ``max_message_size`` is a :class:`RemoteProtocolError`.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Final

from cdcd._purepy import c_module
from cdcd.errors import RemoteProtocolError

_HEADER = struct.Struct("!cI")
_HEADER_SIZE = 5
_XLOG = struct.Struct("!cQQq")  # XLogData: 'w', wal_start, wal_end, send_time
_XLOG_SIZE = 25
_W = ord("w")

#: PostgreSQL itself never sends a message near this; a larger length means corrupt framing.
DEFAULT_MAX_MESSAGE_SIZE = 1 << 30

XlogRun = Callable[[bytearray, int, int, int], tuple[list[object], list[int], int]]
_XLOG_C: Final = c_module("cdcd._xlog")
#: cdcd._xlog.xlog_run (hand-written C), or None where it is not in use: then
#: :meth:`MessageReader.next_xlog_run` takes the messages in Python, with the same result
C_XLOG_RUN: Final[XlogRun | None] = None if _XLOG_C is None else _XLOG_C.xlog_run


class MessageReader:
    """Accumulates bytes and splits them into ``(tag, payload)`` backend messages."""

    __slots__ = ("_buf", "_max", "_pos", "xlog_run_c")

    def __init__(self, max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE) -> None:
        self._buf = bytearray()
        self._pos = 0
        self._max = max_message_size
        #: :data:`C_XLOG_RUN`, or None for the Python loop (the tests compare the two)
        self.xlog_run_c: XlogRun | None = C_XLOG_RUN

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Append received bytes."""
        if self._pos and self._pos >= len(self._buf) // 2:
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    def next(self) -> tuple[bytes, bytes] | None:
        """The next complete message as ``(tag, payload)``, or None until more bytes arrive."""
        buf = self._buf
        pos = self._pos
        if len(buf) - pos < _HEADER_SIZE:
            return None
        tag, length = _HEADER.unpack_from(buf, pos)
        if length < 4 or length > self._max:
            raise RemoteProtocolError(
                f"impossible message length {length}", tag=tag.decode("latin-1")
            )
        end = pos + 1 + length
        if len(buf) < end:
            return None
        payload = bytes(buf[pos + _HEADER_SIZE : end])
        self._pos = end
        return tag, payload

    def _end_of(self, pos: int, size: int, tag: bytes) -> int:
        """Where the message at ``pos`` (a whole header is there) ends when it is a complete
        ``tag`` message; -1 when it has another tag or is incomplete."""
        kind, length = _HEADER.unpack_from(self._buf, pos)
        if kind != tag:
            return -1
        if length < 4 or length > self._max:
            raise RemoteProtocolError(
                f"impossible message length {length}", tag=kind.decode("latin-1")
            )
        end = pos + 1 + length
        return end if end <= size else -1

    def next_run(self, tag: bytes, max_bytes: int = 256 * 1024) -> list[bytes]:
        """Payloads of the complete messages with ``tag`` at the head of the buffer, in order.

        The streaming fast path: one call for many messages. Stops before a message with
        another tag, an incomplete message, or once ``max_bytes`` of payload were taken (at
        least one message is taken when complete); ``[]`` when the next message is not a
        complete ``tag`` message (use :meth:`next` then)."""
        buf = self._buf
        pos = self._pos
        size = len(buf)
        taken = 0
        payloads: list[bytes] = []
        append = payloads.append
        while size - pos >= _HEADER_SIZE and taken < max_bytes:
            end = self._end_of(pos, size, tag)
            if end < 0:
                break
            append(bytes(buf[pos + _HEADER_SIZE : end]))
            taken += end - pos - 1
            pos = end
        self._pos = pos
        return payloads

    def next_xlog_run(self, max_bytes: int = 256 * 1024) -> tuple[list[object], list[int]]:
        """:meth:`next_run` of CopyData (``d``) messages for a replication stream, each XLogData
        (``w``: PostgreSQL docs, "Streaming Replication Protocol") already split into a
        ``(wal_start, wal_end, send_time, data)`` tuple, its data copied once; any other
        CopyData payload (a keepalive) as its bytes, its index in the second list. Compiled
        (``cdcd/_purepy.py``), or in C (:data:`C_XLOG_RUN`): the per-message loop of
        streaming. The C function stops where the Python loop would; when it took nothing, the
        Python loop looks at the message again (and raises for an impossible length)."""
        fast = self.xlog_run_c
        if fast is not None:
            run, run_others, end = fast(self._buf, self._pos, max_bytes, self._max)
            if run:
                self._pos = end
                return run, run_others
        buf = self._buf
        pos = self._pos
        size = len(buf)
        xlog = _XLOG.unpack_from
        taken = 0
        items: list[object] = []
        others: list[int] = []
        append = items.append
        while size - pos >= _HEADER_SIZE and taken < max_bytes:
            end = self._end_of(pos, size, b"d")
            if end < 0:
                break
            start = pos + _HEADER_SIZE
            if end - start >= _XLOG_SIZE and buf[start] == _W:
                _, wal_start, wal_end, sent = xlog(buf, start)
                append((wal_start, wal_end, sent, bytes(buf[start + _XLOG_SIZE : end])))
            else:
                others.append(len(items))
                append(bytes(buf[start:end]))
            taken += end - pos - 1
            pos = end
        self._pos = pos
        return items, others

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as messages."""
        return len(self._buf) - self._pos


def frame(tag: bytes, payload: bytes = b"") -> bytes:
    """Build one frontend (or, in tests, backend) message: tag, length, payload."""
    return tag + struct.pack("!I", len(payload) + 4) + payload
