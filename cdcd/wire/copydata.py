"""The CopyData messages of the streaming replication protocol, sans-I/O.

PostgreSQL docs, "Streaming Replication Protocol", START_REPLICATION (protocol section
55.4 / 54.4). Once START_REPLICATION has switched the connection to CopyBoth, every
CopyData (``d``) payload from the server starts with a sub-tag:

- ``w`` XLogData: ``Int64 wal_start, Int64 wal_end, Int64 send_time, Byten data`` where
  ``data`` is one logical decoding output message (for pgoutput: exactly one message);
- ``k`` Primary keepalive: ``Int64 wal_end, Int64 send_time, Byte1 reply_requested``.

The client answers with the Standby status update ``r``: ``Int64 write, Int64 flush,
Int64 apply, Int64 client_time, Byte1 reply_requested`` (see docs/protocol.md: report the end LSN of
what is durable, never more). Times are microseconds since 2000-01-01 (``cdcd.lsn``).

Invariants: any other sub-tag, a short header, or a keepalive of the wrong length is a
:class:`~cdcd.errors.RemoteProtocolError`. XLogData's ``data`` is a zero-copy memoryview
of the CopyData payload.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

from cdcd.errors import RemoteProtocolError

_XLOGDATA: Final = struct.Struct("!QQq")  # after the 'w' byte
_KEEPALIVE: Final = struct.Struct("!QqB")  # after the 'k' byte
_STATUS_UPDATE: Final = struct.Struct("!cQQQqB")

_XLOGDATA_HEADER: Final = 1 + _XLOGDATA.size  # 25
_KEEPALIVE_LEN: Final = 1 + _KEEPALIVE.size  # 18
_W: Final = ord("w")
_K: Final = ord("k")


@dataclass(frozen=True, slots=True)
class XLogData:
    """A ``w`` message. ``wal_start`` is the WAL position of the record sent (for pgoutput: a
    change's own LSN, a Begin's first LSN, a Commit's end); ``wal_end`` the server's WAL end;
    ``send_time`` microseconds since the PostgreSQL epoch; ``data`` the output plugin's bytes."""

    wal_start: int
    wal_end: int
    send_time: int
    data: bytes | memoryview


@dataclass(frozen=True, slots=True)
class PrimaryKeepalive:
    """A ``k`` message: the server's WAL end and clock; ``reply_requested`` asks for an
    immediate standby status update."""

    wal_end: int
    send_time: int
    reply_requested: bool


def parse_copy_data(payload: bytes | bytearray | memoryview) -> XLogData | PrimaryKeepalive:
    """Parse the payload of one CopyData (``d``) message sent during START_REPLICATION."""
    if not payload:
        raise RemoteProtocolError("empty CopyData in the replication stream", tag="d")
    sub = payload[0]
    if sub == _W:
        if len(payload) < _XLOGDATA_HEADER:
            raise RemoteProtocolError(
                f"XLogData of {len(payload)} bytes, shorter than its {_XLOGDATA_HEADER}-byte header",
                tag="w",
            )
        wal_start, wal_end, send_time = _XLOGDATA.unpack_from(payload, 1)
        return XLogData(wal_start, wal_end, send_time, memoryview(payload)[_XLOGDATA_HEADER:])
    if sub == _K:
        if len(payload) != _KEEPALIVE_LEN:
            raise RemoteProtocolError(
                f"primary keepalive of {len(payload)} bytes, expected {_KEEPALIVE_LEN}", tag="k"
            )
        wal_end, send_time, reply = _KEEPALIVE.unpack_from(payload, 1)
        if reply > 1:
            raise RemoteProtocolError(
                f"keepalive reply flag must be 0 or 1, not {reply}", tag="k", lsn=wal_end
            )
        return PrimaryKeepalive(wal_end, send_time, reply == 1)
    shown = chr(sub) if 0x20 < sub < 0x7F else f"\\x{sub:02x}"
    raise RemoteProtocolError(
        "unknown CopyData sub-message in the replication stream (expected 'w' or 'k')",
        tag=shown,
    )


def standby_status_update(
    write_lsn: int,
    flush_lsn: int,
    apply_lsn: int,
    client_time_pg_us: int,
    reply_requested: bool = False,
) -> bytes:
    """The CopyData payload of a Standby status update (``r``); frame it with
    ``frame(b"d", ...)``. LSNs are the positions written, flushed (durable) and applied;
    ``client_time_pg_us`` is microseconds since 2000-01-01 (``cdcd.lsn.unix_to_pg_us``)."""
    return _STATUS_UPDATE.pack(
        b"r", write_lsn, flush_lsn, apply_lsn, client_time_pg_us, 1 if reply_requested else 0
    )
