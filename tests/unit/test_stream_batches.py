"""The streaming fast path: MessageReader.next_run and Session.copy_data_run (pure code).

They must return exactly what ``next()`` / ``next_event()`` would, message by message, in any
chunking, and stop at other tags, incomplete messages and the byte budget.
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdcd.errors import RemoteProtocolError
from cdcd.wire.framing import C_XLOG_RUN, MessageReader, frame
from cdcd.wire.session import CopyData, NoticeResponse, Session, State


def _drain_one_by_one(stream: bytes) -> list[tuple[bytes, bytes]]:
    reader = MessageReader()
    reader.feed(stream)
    out = []
    while (msg := reader.next()) is not None:
        out.append(msg)
    return out


@settings(max_examples=200, deadline=None)
@given(
    payloads=st.lists(st.binary(max_size=40), max_size=30),
    other_at=st.lists(st.integers(min_value=0, max_value=30), max_size=3),
    chunk=st.integers(min_value=1, max_value=64),
    budget=st.integers(min_value=1, max_value=100),
)
def test_next_run_equals_next(
    payloads: list[bytes], other_at: list[int], chunk: int, budget: int
) -> None:
    messages = [(b"d", p) for p in payloads]
    for i in sorted(other_at, reverse=True):
        messages.insert(min(i, len(messages)), (b"N", b"x"))
    stream = b"".join(frame(t, p) for t, p in messages)
    reader = MessageReader()
    got: list[tuple[bytes, bytes]] = []
    for start in range(0, len(stream), chunk):
        reader.feed(stream[start : start + chunk])
        while True:
            run = reader.next_run(b"d", max_bytes=budget)
            if run:
                got.extend((b"d", p) for p in run)
                continue
            msg = reader.next()
            if msg is None:
                break
            got.append(msg)
    assert got == _drain_one_by_one(stream) == messages
    assert reader.buffered == 0


def test_next_run_stops_at_other_tag_and_partial_message() -> None:
    reader = MessageReader()
    reader.feed(frame(b"d", b"a") + frame(b"d", b"b") + frame(b"N", b"n") + frame(b"d", b"c"))
    assert reader.next_run(b"d") == [b"a", b"b"]
    assert reader.next_run(b"d") == []
    assert reader.next() == (b"N", b"n")
    partial = frame(b"d", b"dddd")
    reader.feed(partial[:-1])
    assert reader.next_run(b"d") == [b"c"]
    assert reader.next_run(b"d") == []
    reader.feed(partial[-1:])
    assert reader.next_run(b"d") == [b"dddd"]


def test_next_run_byte_budget_takes_at_least_one() -> None:
    reader = MessageReader()
    reader.feed(frame(b"d", b"x" * 100) + frame(b"d", b"y"))
    assert reader.next_run(b"d", max_bytes=10) == [b"x" * 100]
    assert reader.next_run(b"d", max_bytes=10) == [b"y"]


def test_next_run_impossible_length() -> None:
    reader = MessageReader()
    reader.feed(b"d\x00\x00\x00\x02")
    with pytest.raises(RemoteProtocolError, match="impossible message length"):
        reader.next_run(b"d")


def test_copy_data_run_only_while_streaming() -> None:
    session = Session(user="u", database="d")
    session.receive_data(frame(b"d", b"w1") + frame(b"N", b"SNOTICE\x00Mhi\x00\x00"))
    assert session.copy_data_run() == []  # not in COPY: next_event decides (and refuses 'd')
    session._state = State.COPY_BOTH
    assert session.copy_data_run() == [b"w1"]
    assert session.copy_data_run() == []
    assert isinstance(session.next_event(), NoticeResponse)
    session.receive_data(frame(b"d", b"w2"))
    session._state = State.COPY_CLIENT_DONE
    assert session.copy_data_run() == [b"w2"]
    session.receive_data(frame(b"d", b"w3"))
    session._state = State.COPY_BOTH
    assert session.next_event() == CopyData(b"w3")


def _xlog(wal_start: int, wal_end: int, sent: int, data: bytes) -> bytes:
    return frame(b"d", b"w" + struct.pack("!QQq", wal_start, wal_end, sent) + data)


@pytest.fixture(params=["c", "python"])
def xlog_path(request: pytest.FixtureRequest) -> str:
    """Which loop ``next_xlog_run`` takes: the C function or the Python one."""
    if request.param == "c" and C_XLOG_RUN is None:
        pytest.skip("cdcd._xlog is not in use here")
    return str(request.param)


def _reader(path: str, **kwargs: int) -> MessageReader:
    reader = MessageReader(**kwargs)
    if path == "python":
        reader.xlog_run_c = None
    return reader


def test_next_xlog_run_splits_xlogdata_and_leaves_other_payloads(xlog_path: str) -> None:
    keepalive = b"k" + struct.pack("!QqB", 0x500, 7, 1)
    reader = _reader(xlog_path)
    reader.feed(
        _xlog(0x10, 0x20, 5, b"I-one")
        + frame(b"d", keepalive)
        + _xlog(0x30, 0x40, 6, b"")
        + frame(b"Z", b"I")
        + _xlog(0x50, 0x60, 7, b"after")
    )
    items, others = reader.next_xlog_run()
    assert items == [(0x10, 0x20, 5, b"I-one"), keepalive, (0x30, 0x40, 6, b"")]
    assert others == [1]
    assert all(type(item[3]) is bytes for item in items if type(item) is tuple)
    assert reader.next() == (b"Z", b"I")  # another tag ends the run
    partial = _xlog(0x70, 0x80, 8, b"partial")
    reader.feed(partial[:-1])
    items, others = reader.next_xlog_run()
    assert items == [(0x50, 0x60, 7, b"after")]  # the incomplete message waits
    reader.feed(partial[-1:])
    assert reader.next_xlog_run() == ([(0x70, 0x80, 8, b"partial")], [])


def test_next_xlog_run_impossible_length(xlog_path: str) -> None:
    reader = _reader(xlog_path, max_message_size=100)
    reader.feed(_xlog(1, 2, 3, b"ok") + b"d" + struct.pack("!I", 101) + b"x" * 97)
    taken: list[object] = []
    with pytest.raises(RemoteProtocolError, match="impossible message length 101"):
        for _ in range(3):  # C hands over what comes before it first; Python raises at once
            taken += reader.next_xlog_run()[0]
    assert taken in ([], [(1, 2, 3, b"ok")])
    reader = _reader(xlog_path)
    reader.feed(b"d" + struct.pack("!I", 3))
    with pytest.raises(RemoteProtocolError, match="impossible message length 3"):
        reader.next_xlog_run()


@settings(max_examples=300, deadline=None)
@given(
    messages=st.lists(
        st.one_of(
            st.tuples(
                st.integers(0, 2**64 - 1),
                st.integers(0, 2**64 - 1),
                st.integers(-(2**63), 2**63 - 1),
                st.binary(max_size=40),
            ).map(lambda t: _xlog(*t)),
            st.binary(max_size=30).map(lambda b: frame(b"d", b)),  # keepalives, short payloads
            st.binary(max_size=10).map(lambda b: frame(b"N", b)),  # another tag
        ),
        max_size=25,
    ),
    cut=st.integers(0, 2000),
    budget=st.integers(1, 300),
)
def test_next_xlog_run_c_and_python_take_the_same(
    messages: list[bytes], cut: int, budget: int
) -> None:
    """Both loops, on any stream cut anywhere and any byte budget, return the same items and
    leave the reader at the same place."""
    if C_XLOG_RUN is None:
        pytest.skip("cdcd._xlog is not in use here")
    stream = b"".join(messages)
    cut = min(cut, len(stream))
    readers = [_reader("c"), _reader("python")]
    outputs: list[list[object]] = [[], []]
    for reader, out in zip(readers, outputs, strict=True):
        reader.feed(stream[:cut])
        for piece in (None, stream[cut:]):
            if piece is not None:
                reader.feed(piece)
            while True:
                items, others = reader.next_xlog_run(budget)
                if items:
                    out.append((items, others))
                    continue
                msg = reader.next()  # another tag, or nothing complete
                if msg is None:
                    break
                out.append(msg)
        assert reader.buffered == 0
    assert outputs[0] == outputs[1]


def test_xlog_run_only_while_streaming() -> None:
    session = Session(user="u", database="d")
    session.receive_data(_xlog(1, 2, 3, b"B"))
    assert session.xlog_run() == ([], [])  # not in COPY BOTH yet
    session._state = State.COPY_BOTH
    assert session.xlog_run() == ([(1, 2, 3, b"B")], [])
