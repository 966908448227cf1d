"""Streaming replication CopyData messages (XLogData, keepalive, status update) and their
framing at every chunk boundary."""

from __future__ import annotations

import itertools
import random
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdcd.errors import RemoteProtocolError
from cdcd.wire.copydata import (
    PrimaryKeepalive,
    XLogData,
    parse_copy_data,
    standby_status_update,
)
from cdcd.wire.framing import MessageReader, frame

LSN = 0x1_6B37_48A0
T0 = 785_000_000_123_456


def w(start: int, end: int, t: int, data: bytes) -> bytes:
    return b"w" + struct.pack("!QQq", start, end, t) + data


def k(end: int, t: int, reply: int) -> bytes:
    return b"k" + struct.pack("!QqB", end, t, reply)


def test_xlogdata() -> None:
    msg = parse_copy_data(w(LSN, LSN + 100, T0, b"B\x01\x02"))
    assert isinstance(msg, XLogData)
    assert (msg.wal_start, msg.wal_end, msg.send_time) == (LSN, LSN + 100, T0)
    assert bytes(msg.data) == b"B\x01\x02"


def test_xlogdata_data_is_not_copied() -> None:
    payload = w(1, 2, 3, b"I" * 1000)
    msg = parse_copy_data(payload)
    assert isinstance(msg, XLogData)
    assert isinstance(msg.data, memoryview)
    assert msg.data.obj is payload


def test_xlogdata_empty_data_and_max_values() -> None:
    msg = parse_copy_data(w(2**64 - 1, 0, -1, b""))
    assert msg == XLogData(2**64 - 1, 0, -1, msg.data)  # type: ignore[union-attr]
    assert isinstance(msg, XLogData)
    assert bytes(msg.data) == b""


@pytest.mark.parametrize("reply", [0, 1])
def test_keepalive(reply: int) -> None:
    assert parse_copy_data(k(LSN, T0, reply)) == PrimaryKeepalive(LSN, T0, bool(reply))


def test_keepalive_from_memoryview_and_bytearray() -> None:
    assert parse_copy_data(memoryview(k(LSN, T0, 1))) == PrimaryKeepalive(LSN, T0, True)
    assert parse_copy_data(bytearray(k(LSN, T0, 0))) == PrimaryKeepalive(LSN, T0, False)


@pytest.mark.parametrize(
    ("payload", "tag", "match"),
    [
        (b"", "d", "empty CopyData"),
        (b"w" + bytes(23), "w", "XLogData of 24 bytes, shorter than its 25-byte header"),
        (b"w", "w", "XLogData of 1 bytes"),
        (k(1, 2, 0)[:-1], "k", "keepalive of 17 bytes, expected 18"),
        (k(1, 2, 0) + b"\0", "k", "keepalive of 19 bytes"),
        (k(1, 2, 2), "k", "reply flag must be 0 or 1"),
        (b"r" + bytes(33), "r", "unknown CopyData sub-message"),
        (b"\x00abc", "\\x00", "unknown CopyData sub-message"),
    ],
)
def test_parse_errors(payload: bytes, tag: str, match: str) -> None:
    with pytest.raises(RemoteProtocolError, match=match) as exc:
        parse_copy_data(payload)
    assert exc.value.tag == tag


def test_standby_status_update_layout() -> None:
    got = standby_status_update(LSN + 3, LSN + 2, LSN + 1, T0)
    assert got == b"r" + struct.pack("!QQQqB", LSN + 3, LSN + 2, LSN + 1, T0, 0)
    assert len(got) == 34
    assert standby_status_update(1, 2, 3, 4, reply_requested=True)[-1] == 1
    framed = frame(b"d", got)
    assert framed[:5] == b"d" + struct.pack("!I", 38)


# --- framing: the same messages at every chunk boundary ----------------------------------------


def stream() -> tuple[bytes, list[tuple[bytes, bytes]]]:
    msgs: list[tuple[bytes, bytes]] = []
    rnd = random.Random(7)
    for i in range(60):
        if i % 7 == 3:
            payload = k(LSN + i, T0 + i, i % 2)
        else:
            payload = w(LSN + i, LSN + i + 1, T0 + i, rnd.randbytes(rnd.choice([0, 1, 30, 700])))
        msgs.append((b"d", payload))
    msgs.insert(0, (b"W", b"\x00\x00\x00"))  # CopyBothResponse
    msgs.append((b"c", b""))  # CopyDone
    return b"".join(frame(t, p) for t, p in msgs), msgs


def read_all(chunks: list[bytes]) -> tuple[list[tuple[bytes, bytes]], int]:
    reader = MessageReader()
    out: list[tuple[bytes, bytes]] = []
    for chunk in chunks:
        reader.feed(chunk)
        while (msg := reader.next()) is not None:
            out.append(msg)
    return out, reader.buffered


def parsed(msgs: list[tuple[bytes, bytes]]) -> list[object]:
    out: list[object] = []
    for tag, payload in msgs:
        if tag == b"d":
            m = parse_copy_data(payload)
            out.append(
                (m.wal_start, m.wal_end, m.send_time, bytes(m.data))
                if isinstance(m, XLogData)
                else m
            )
        else:
            out.append((tag, payload))
    return out


def test_framing_whole_bytewise_and_chunked() -> None:
    data, expected = stream()
    whole, left = read_all([data])
    assert whole == expected and left == 0
    bytewise, left = read_all([data[i : i + 1] for i in range(len(data))])
    assert bytewise == expected and left == 0
    assert parsed(bytewise) == parsed(expected)


@given(cuts=st.lists(st.integers(0, 20_000), max_size=40), tail=st.integers(1, 40))
@settings(max_examples=100, deadline=None)
def test_framing_random_chunks_with_trailing_partial(cuts: list[int], tail: int) -> None:
    data, expected = stream()
    partial = frame(b"d", w(9, 9, 9, b"next message"))[:tail]
    full = data + partial
    points = sorted({c % len(full) for c in cuts} | {0, len(full)})
    chunks = [full[a:b] for a, b in itertools.pairwise(points)]
    got, left = read_all(chunks)
    assert got == expected
    assert left == len(partial)
    assert parsed(got) == parsed(expected)
