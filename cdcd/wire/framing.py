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

from cdcd.errors import RemoteProtocolError

_HEADER = struct.Struct("!cI")
_HEADER_SIZE = 5

#: PostgreSQL itself never sends a message near this; a larger length means corrupt framing.
DEFAULT_MAX_MESSAGE_SIZE = 1 << 30


class MessageReader:
    """Accumulates bytes and splits them into ``(tag, payload)`` backend messages."""

    __slots__ = ("_buf", "_max", "_pos")

    def __init__(self, max_message_size: int = DEFAULT_MAX_MESSAGE_SIZE) -> None:
        self._buf = bytearray()
        self._pos = 0
        self._max = max_message_size

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

    def next_run(self, tag: bytes, max_bytes: int = 256 * 1024) -> list[bytes]:
        """Payloads of the complete messages with ``tag`` at the head of the buffer, in order.

        The streaming fast path: one call for many messages. Stops before a message with
        another tag, an incomplete message, or once ``max_bytes`` of payload were taken (at
        least one message is taken when complete); ``[]`` when the next message is not a
        complete ``tag`` message (use :meth:`next` then)."""
        buf = self._buf
        pos = self._pos
        size = len(buf)
        header = _HEADER.unpack_from
        limit = self._max
        taken = 0
        payloads: list[bytes] = []
        append = payloads.append
        while size - pos >= _HEADER_SIZE and taken < max_bytes:
            kind, length = header(buf, pos)
            if kind != tag:
                break
            if length < 4 or length > limit:
                raise RemoteProtocolError(
                    f"impossible message length {length}", tag=kind.decode("latin-1")
                )
            end = pos + 1 + length
            if size < end:
                break
            append(bytes(buf[pos + _HEADER_SIZE : end]))
            taken += length
            pos = end
        self._pos = pos
        return payloads

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as messages."""
        return len(self._buf) - self._pos


def frame(tag: bytes, payload: bytes = b"") -> bytes:
    """Build one frontend (or, in tests, backend) message: tag, length, payload."""
    return tag + struct.pack("!I", len(payload) + 4) + payload
