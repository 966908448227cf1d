"""The pgoutput decoder against hand-built bytes, one builder per message of
"Logical Replication Message Formats" (PostgreSQL docs).
"""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdcd.decoder.events import (
    Begin,
    BeginPrepare,
    Column,
    Commit,
    CommitPrepared,
    Delete,
    Insert,
    Message,
    Origin,
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
from cdcd.decoder.pgoutput import PgOutputDecoder
from cdcd.errors import RemoteProtocolError

LSN = 0x16_B374D848
LSN_TEXT = "16/B374D848"
T0 = 785_000_000_123_456  # microseconds since 2000-01-01


# --- builders, straight from the formats doc -------------------------------------------------


def s(text: str) -> bytes:
    return text.encode() + b"\0"


def xid_part(xid: int | None) -> bytes:
    return b"" if xid is None else struct.pack("!I", xid)


def tuple_bytes(kinds: bytes, values: tuple[bytes | None, ...]) -> bytes:
    out = [struct.pack("!H", len(kinds))]
    for kind, value in zip(kinds, values, strict=True):
        out.append(bytes([kind]))
        if kind in b"tb":
            assert value is not None
            out.append(struct.pack("!i", len(value)) + value)
    return b"".join(out)


def begin(final_lsn: int, commit_time: int, xid: int) -> bytes:
    return b"B" + struct.pack("!QqI", final_lsn, commit_time, xid)


def commit(flags: int, commit_lsn: int, end_lsn: int, commit_time: int) -> bytes:
    return b"C" + struct.pack("!BQQq", flags, commit_lsn, end_lsn, commit_time)


def origin(origin_lsn: int, name: str) -> bytes:
    return b"O" + struct.pack("!Q", origin_lsn) + s(name)


def relation(
    oid: int,
    namespace: str,
    name: str,
    identity: bytes,
    columns: list[tuple[int, str, int, int]],
    xid: int | None = None,
) -> bytes:
    out = [b"R", xid_part(xid), struct.pack("!I", oid), s(namespace), s(name), identity]
    out.append(struct.pack("!H", len(columns)))
    for flags, col, type_oid, typmod in columns:
        out.append(bytes([flags]) + s(col) + struct.pack("!Ii", type_oid, typmod))
    return b"".join(out)


def type_msg(oid: int, namespace: str, name: str, xid: int | None = None) -> bytes:
    return b"Y" + xid_part(xid) + struct.pack("!I", oid) + s(namespace) + s(name)


def insert(oid: int, new: bytes, xid: int | None = None) -> bytes:
    return b"I" + xid_part(xid) + struct.pack("!I", oid) + b"N" + new


def update(
    oid: int, new: bytes, old: tuple[bytes, bytes] | None = None, xid: int | None = None
) -> bytes:
    old_part = b"" if old is None else old[0] + old[1]
    return b"U" + xid_part(xid) + struct.pack("!I", oid) + old_part + b"N" + new


def delete(oid: int, kind: bytes, old: bytes, xid: int | None = None) -> bytes:
    return b"D" + xid_part(xid) + struct.pack("!I", oid) + kind + old


def truncate(options: int, oids: list[int], xid: int | None = None) -> bytes:
    return (
        b"T"
        + xid_part(xid)
        + struct.pack("!iB", len(oids), options)
        + b"".join(struct.pack("!I", o) for o in oids)
    )


def message(flags: int, lsn: int, prefix: str, content: bytes, xid: int | None = None) -> bytes:
    return (
        b"M"
        + xid_part(xid)
        + struct.pack("!BQ", flags, lsn)
        + s(prefix)
        + struct.pack("!i", len(content))
        + content
    )


def stream_start(xid: int, first: int) -> bytes:
    return b"S" + struct.pack("!IB", xid, first)


STREAM_STOP = b"E"


def stream_commit(xid: int, flags: int, commit_lsn: int, end_lsn: int, t: int) -> bytes:
    return b"c" + struct.pack("!IBQQq", xid, flags, commit_lsn, end_lsn, t)


def stream_abort(xid: int, subxid: int, abort: tuple[int, int] | None = None) -> bytes:
    tail = b"" if abort is None else struct.pack("!Qq", *abort)
    return b"A" + struct.pack("!II", xid, subxid) + tail


def begin_prepare(prepare_lsn: int, end_lsn: int, t: int, xid: int, gid: str) -> bytes:
    return b"b" + struct.pack("!QQqI", prepare_lsn, end_lsn, t, xid) + s(gid)


def prepare_like(
    tag: bytes, flags: int, lsn: int, end_lsn: int, t: int, xid: int, gid: str
) -> bytes:
    return tag + struct.pack("!BQQqI", flags, lsn, end_lsn, t, xid) + s(gid)


def rollback_prepared(
    flags: int, prepare_end: int, rollback_end: int, pt: int, rt: int, xid: int, gid: str
) -> bytes:
    return b"r" + struct.pack("!BQQqqI", flags, prepare_end, rollback_end, pt, rt, xid) + s(gid)


ROW = TupleData(b"tnbu", (b"42", None, b"\x00\x01\xff", None))
ROW_BYTES = tuple_bytes(ROW.kinds, ROW.values)
KEY = TupleData(b"t", (b"7",))
KEY_BYTES = tuple_bytes(KEY.kinds, KEY.values)


def decode(data: bytes, proto: int = 4) -> object:
    return PgOutputDecoder(proto).decode(data, LSN)


# --- every message type ------------------------------------------------------------------------


@pytest.mark.parametrize("proto", [1, 2, 3, 4])
@pytest.mark.parametrize(
    ("data", "event"),
    [
        (begin(LSN, T0, 771), Begin(LSN, T0, 771)),
        (commit(0, LSN, LSN + 48, T0), Commit(0, LSN, LSN + 48, T0)),
        (origin(LSN - 1, "node_a"), Origin(LSN - 1, "node_a")),
        (
            relation(
                16384,
                "public",
                "orders",
                b"d",
                [(1, "id", 23, -1), (0, "naïve name", 1043, 68), (0, "price", 1700, 655366)],
            ),
            Relation(
                None,
                16384,
                "public",
                "orders",
                "d",
                (
                    Column(1, "id", 23, -1),
                    Column(0, "naïve name", 1043, 68),
                    Column(0, "price", 1700, 655366),
                ),
            ),
        ),
        (relation(1, "", "pg_thing", b"n", []), Relation(None, 1, "", "pg_thing", "n", ())),
        (type_msg(90001, "public", "mood"), Type(None, 90001, "public", "mood")),
        (insert(16384, ROW_BYTES), Insert(None, 16384, ROW)),
        (update(16384, ROW_BYTES), Update(None, 16384, None, None, ROW)),
        (update(16384, ROW_BYTES, (b"K", KEY_BYTES)), Update(None, 16384, "K", KEY, ROW)),
        (update(16384, ROW_BYTES, (b"O", ROW_BYTES)), Update(None, 16384, "O", ROW, ROW)),
        (delete(16384, b"K", KEY_BYTES), Delete(None, 16384, "K", KEY)),
        (delete(16384, b"O", ROW_BYTES), Delete(None, 16384, "O", ROW)),
        (truncate(0, [16384]), Truncate(None, 0, (16384,))),
        (truncate(3, [16384, 16390, 4294967295]), Truncate(None, 3, (16384, 16390, 4294967295))),
        (truncate(2, []), Truncate(None, 2, ())),
        (
            message(1, LSN, "audit", b"\x00bin\xff"),
            Message(None, True, LSN, "audit", b"\x00bin\xff"),
        ),
        (message(0, LSN, "", b""), Message(None, False, LSN, "", b"")),
    ],
)
def test_messages_without_stream_state(proto: int, data: bytes, event: object) -> None:
    assert decode(data, proto) == event


def test_truncate_option_bits() -> None:
    got = decode(truncate(3, [1, 2]))
    assert isinstance(got, Truncate)
    assert got.cascade and got.restart_identity
    got = decode(truncate(2, [1]))
    assert isinstance(got, Truncate)
    assert not got.cascade and got.restart_identity


def test_relation_identities_and_flags() -> None:
    for identity in "dnfi":
        got = decode(relation(5, "s", "t", identity.encode(), [(1, "a", 25, -1)]))
        assert isinstance(got, Relation)
        assert got.replica_identity == identity
        assert got.columns[0].is_identity


def test_tuple_kinds_all() -> None:
    kinds = b"nutb" * 3
    values = tuple(None if k in b"nu" else bytes([i]) * i for i, k in enumerate(kinds))
    got = decode(insert(9, tuple_bytes(kinds, values)))
    assert got == Insert(None, 9, TupleData(kinds, values))
    assert isinstance(got, Insert)
    assert all(type(v) is bytes for v in got.new.values if v is not None)


def test_empty_tuple_and_empty_values() -> None:
    assert decode(insert(9, tuple_bytes(b"", ()))) == Insert(None, 9, TupleData(b"", ()))
    assert decode(insert(9, tuple_bytes(b"tb", (b"", b"")))) == Insert(
        None, 9, TupleData(b"tb", (b"", b""))
    )


def test_memoryview_input() -> None:
    data = insert(9, ROW_BYTES)
    framed = memoryview(b"w" + bytes(24) + data)[25:]
    assert PgOutputDecoder(1).decode(framed, LSN) == Insert(None, 9, ROW)


@pytest.mark.parametrize("proto", [2, 3, 4])
def test_stream_messages(proto: int) -> None:
    d = PgOutputDecoder(proto)
    assert d.decode(stream_start(900, 1), LSN) == StreamStart(900, True)
    assert d.in_stream
    assert d.decode(STREAM_STOP, LSN) == StreamStop()
    assert not d.in_stream
    assert d.decode(stream_start(900, 0), LSN) == StreamStart(900, False)
    assert d.decode(STREAM_STOP, LSN) == StreamStop()
    assert d.decode(stream_commit(900, 0, LSN, LSN + 8, T0), LSN) == StreamCommit(
        900, 0, LSN, LSN + 8, T0
    )
    assert d.decode(stream_abort(900, 901), LSN) == StreamAbort(900, 901)


def test_stream_abort_parallel_form() -> None:
    data = stream_abort(900, 900, (LSN, T0))
    assert len(data) == 25
    assert len(stream_abort(900, 900)) == 9
    assert decode(data, 4) == StreamAbort(900, 900, LSN, T0)
    for proto in (2, 3):
        with pytest.raises(RemoteProtocolError, match="Stream Abort of 25 bytes") as exc:
            decode(data, proto)
        assert exc.value.tag == "A"
        assert exc.value.lsn == LSN


@pytest.mark.parametrize("size", [1, 5, 8, 10, 17, 24, 26, 33])
def test_stream_abort_other_lengths(size: int) -> None:
    data = stream_abort(1, 1, (2, 3)) + b"\0" * 8
    with pytest.raises(RemoteProtocolError, match=f"Stream Abort of {size} bytes") as exc:
        decode(data[:size], 4)
    assert exc.value.tag == "A"
    assert LSN_TEXT in str(exc.value)


@pytest.mark.parametrize("proto", [3, 4])
def test_two_phase_messages(proto: int) -> None:
    assert decode(begin_prepare(LSN, LSN + 9, T0, 5, "gid-1"), proto) == BeginPrepare(
        LSN, LSN + 9, T0, 5, "gid-1"
    )
    assert decode(prepare_like(b"P", 0, LSN, LSN + 9, T0, 5, "g"), proto) == Prepare(
        0, LSN, LSN + 9, T0, 5, "g"
    )
    assert decode(prepare_like(b"K", 0, LSN, LSN + 9, T0, 5, "g"), proto) == CommitPrepared(
        0, LSN, LSN + 9, T0, 5, "g"
    )
    assert decode(prepare_like(b"p", 0, LSN, LSN + 9, T0, 5, "g"), proto) == StreamPrepare(
        0, LSN, LSN + 9, T0, 5, "g"
    )
    assert decode(
        rollback_prepared(0, LSN, LSN + 99, T0, T0 + 5, 5, "g€"), proto
    ) == RollbackPrepared(0, LSN, LSN + 99, T0, T0 + 5, 5, "g€")


# --- stream state and the xid field -----------------------------------------------------------


STREAMED_CHANGES = [
    (relation(7, "s", "t", b"d", [(1, "a", 23, -1)], xid=901), Relation, 901),
    (type_msg(8, "s", "ty", xid=902), Type, 902),
    (insert(7, ROW_BYTES, xid=903), Insert, 903),
    (update(7, ROW_BYTES, (b"O", ROW_BYTES), xid=904), Update, 904),
    (delete(7, b"K", KEY_BYTES, xid=905), Delete, 905),
    (truncate(1, [7, 8], xid=906), Truncate, 906),
    (message(1, LSN, "p", b"c", xid=907), Message, 907),
]


@pytest.mark.parametrize("proto", [2, 3, 4])
@pytest.mark.parametrize(("data", "cls", "xid"), STREAMED_CHANGES)
def test_xid_inside_stream_block(proto: int, data: bytes, cls: type, xid: int) -> None:
    d = PgOutputDecoder(proto)
    d.decode(stream_start(900, 1), LSN)
    got = d.decode(data, LSN)
    assert isinstance(got, cls)
    assert isinstance(got, Relation | Type | Insert | Update | Delete | Truncate | Message)
    assert got.xid == xid
    d.decode(STREAM_STOP, LSN)
    # The same bytes outside the block are a different (here: malformed) message.
    with pytest.raises(RemoteProtocolError):
        d.decode(data, LSN)


def test_same_insert_bytes_decode_differently_in_a_block() -> None:
    # 'I' xid=16384 oid=... : outside a block the first Int32 is the relation OID.
    inner = insert(55, tuple_bytes(b"t", (b"x",)))  # I, oid 55, N, tuple
    as_streamed = b"I" + struct.pack("!I", 16384) + inner[1:]  # I, xid 16384, oid 55, ...
    d = PgOutputDecoder(2)
    d.decode(stream_start(16384, 1), LSN)
    assert d.decode(as_streamed, LSN) == Insert(16384, 55, TupleData(b"t", (b"x",)))
    d.decode(STREAM_STOP, LSN)
    with pytest.raises(RemoteProtocolError, match="expected 'N'"):
        d.decode(as_streamed, LSN)
    assert d.decode(inner, LSN) == Insert(None, 55, TupleData(b"t", (b"x",)))


def test_origin_inside_block_has_no_xid() -> None:
    d = PgOutputDecoder(2)
    d.decode(stream_start(1, 1), LSN)
    assert d.decode(origin(5, "o"), LSN) == Origin(5, "o")


def test_reset_leaves_the_block() -> None:
    d = PgOutputDecoder(2)
    d.decode(stream_start(1, 1), LSN)
    d.reset()
    assert not d.in_stream
    assert d.decode(insert(7, ROW_BYTES), LSN) == Insert(None, 7, ROW)
    assert d.decode(stream_start(1, 1), LSN) == StreamStart(1, True)


def test_proto_version_is_checked() -> None:
    with pytest.raises(ValueError, match="proto_version"):
        PgOutputDecoder(5)
    assert PgOutputDecoder(3).proto_version == 3


# --- errors ----------------------------------------------------------------------------------------


def assert_protocol_error(
    data: bytes, tag: str, match: str, proto: int = 4, decoder: PgOutputDecoder | None = None
) -> RemoteProtocolError:
    d = decoder or PgOutputDecoder(proto)
    with pytest.raises(RemoteProtocolError, match=match) as exc:
        d.decode(data, LSN)
    assert exc.value.tag == tag
    assert exc.value.lsn == LSN
    assert f"tag {tag!r}" in str(exc.value)
    assert LSN_TEXT in str(exc.value)
    return exc.value


@pytest.mark.parametrize("tag", [b"X", b"Z", b"\x00", b"\xff", b"w", b"k"])
def test_unknown_tag(tag: bytes) -> None:
    shown = tag.decode() if 0x20 < tag[0] < 0x7F else f"\\x{tag[0]:02x}"
    assert_protocol_error(tag + b"\0" * 20, shown, "not a pgoutput message")


def test_empty_message() -> None:
    with pytest.raises(RemoteProtocolError, match="empty") as exc:
        PgOutputDecoder(1).decode(b"", LSN)
    assert exc.value.lsn == LSN


@pytest.mark.parametrize(
    ("data", "proto", "need"),
    [
        (stream_start(1, 1), 1, ">= 2"),
        (STREAM_STOP, 1, ">= 2"),
        (stream_commit(1, 0, 1, 2, 3), 1, ">= 2"),
        (stream_abort(1, 1), 1, ">= 2"),
        (begin_prepare(1, 2, 3, 4, "g"), 2, ">= 3"),
        (prepare_like(b"P", 0, 1, 2, 3, 4, "g"), 2, ">= 3"),
        (prepare_like(b"K", 0, 1, 2, 3, 4, "g"), 1, ">= 3"),
        (rollback_prepared(0, 1, 2, 3, 4, 5, "g"), 2, ">= 3"),
        (prepare_like(b"p", 0, 1, 2, 3, 4, "g"), 2, ">= 3"),
    ],
)
def test_tag_needs_newer_proto(data: bytes, proto: int, need: str) -> None:
    err = assert_protocol_error(data, chr(data[0]), "needs proto_version", proto=proto)
    assert need in str(err)


def test_stream_start_inside_block() -> None:
    d = PgOutputDecoder(2)
    d.decode(stream_start(1, 1), LSN)
    assert_protocol_error(stream_start(2, 0), "S", "Stream Start inside", decoder=d)
    assert d.in_stream


def test_stream_stop_outside_block() -> None:
    assert_protocol_error(STREAM_STOP, "E", "Stream Stop outside", proto=2)


@pytest.mark.parametrize(
    "data",
    [
        begin(1, 2, 3),
        commit(0, 1, 2, 3),
        stream_commit(1, 0, 1, 2, 3),
        stream_abort(1, 1),
        begin_prepare(1, 2, 3, 4, "g"),
        prepare_like(b"P", 0, 1, 2, 3, 4, "g"),
        prepare_like(b"K", 0, 1, 2, 3, 4, "g"),
        prepare_like(b"p", 0, 1, 2, 3, 4, "g"),
        rollback_prepared(0, 1, 2, 3, 4, 5, "g"),
    ],
)
def test_transaction_boundary_inside_block(data: bytes) -> None:
    d = PgOutputDecoder(4)
    d.decode(stream_start(1, 1), LSN)
    assert_protocol_error(data, chr(data[0]), "inside a Stream Start", decoder=d)


VALID = [
    begin(LSN, T0, 1),
    commit(0, 1, 2, 3),
    origin(1, "o"),
    relation(7, "s", "t", b"d", [(1, "a", 23, -1), (0, "b", 25, -1)]),
    type_msg(8, "s", "ty"),
    insert(7, ROW_BYTES),
    update(7, ROW_BYTES),
    update(7, ROW_BYTES, (b"K", KEY_BYTES)),
    update(7, ROW_BYTES, (b"O", ROW_BYTES)),
    delete(7, b"K", KEY_BYTES),
    delete(7, b"O", ROW_BYTES),
    truncate(1, [7, 8]),
    message(1, 1, "p", b"content"),
    stream_start(1, 1),
    stream_commit(1, 0, 1, 2, 3),
    stream_abort(1, 2),
    stream_abort(1, 2, (3, 4)),
    begin_prepare(1, 2, 3, 4, "g"),
    prepare_like(b"P", 0, 1, 2, 3, 4, "g"),
    prepare_like(b"K", 0, 1, 2, 3, 4, "g"),
    prepare_like(b"p", 0, 1, 2, 3, 4, "g"),
    rollback_prepared(0, 1, 2, 3, 4, 5, "g"),
]


@pytest.mark.parametrize("data", VALID, ids=lambda d: chr(d[0]))
def test_trailing_garbage(data: bytes) -> None:
    PgOutputDecoder(4).decode(data, LSN)  # valid as it is
    tag = chr(data[0])
    match = "garbage|impossible|Stream Abort of"
    assert_protocol_error(data + b"\x01", tag, match)
    assert_protocol_error(data + b"\0" * 4, tag, match)


@pytest.mark.parametrize("data", VALID, ids=lambda d: chr(d[0]))
def test_every_truncation(data: bytes) -> None:
    tag = chr(data[0])
    for cut in range(1, len(data)):
        if cut == 9 and tag == "A":
            continue  # a parallel-form Stream Abort cut to 9 bytes is a valid short form
        assert_protocol_error(data[:cut], tag, "truncated|impossible|Stream Abort of|expected")


def test_stream_stop_with_payload() -> None:
    d = PgOutputDecoder(2)
    d.decode(stream_start(1, 1), LSN)
    assert_protocol_error(b"E\0", "E", "garbage", decoder=d)


def test_negative_and_oversized_value_lengths() -> None:
    head = b"I" + struct.pack("!I", 7) + b"N" + struct.pack("!H", 2) + b"t" + struct.pack("!i", 1)
    assert_protocol_error(
        head + b"x" + b"t" + struct.pack("!i", -1) + b"abc",
        "I",
        "column 2 of 2: impossible value length -1",
    )
    assert_protocol_error(
        head + b"x" + b"b" + struct.pack("!i", 4) + b"abc",
        "I",
        "column 2 of 2: impossible value length 4 with 3",
    )
    assert_protocol_error(
        head + b"x" + b"t" + struct.pack("!i", 2**31 - 1), "I", "impossible value length 2147483647"
    )


def test_negative_message_content_length() -> None:
    data = b"M" + struct.pack("!BQ", 1, 1) + s("p") + struct.pack("!i", -3) + b"abc"
    assert_protocol_error(data, "M", "impossible content length -3")


def test_truncate_impossible_count() -> None:
    assert_protocol_error(b"T" + struct.pack("!iB", -1, 0), "T", "impossible relation count -1")
    assert_protocol_error(b"T" + struct.pack("!iB", 3, 0) + b"\0" * 8, "T", "relation count 3")


def test_unknown_tuple_kind() -> None:
    data = insert(7, struct.pack("!H", 2) + b"n" + b"x")
    assert_protocol_error(data, "I", "column 2 of 2: unknown TupleData kind 'x'")


def test_bad_parts() -> None:
    assert_protocol_error(b"I" + struct.pack("!I", 7) + b"K" + KEY_BYTES, "I", "expected 'N'")
    assert_protocol_error(
        b"U" + struct.pack("!I", 7) + b"X" + ROW_BYTES, "U", "expected 'K', 'O' or 'N'"
    )
    assert_protocol_error(
        b"U" + struct.pack("!I", 7) + b"K" + KEY_BYTES + b"K" + ROW_BYTES,
        "U",
        "expected 'N' after the old tuple",
    )
    assert_protocol_error(
        b"D" + struct.pack("!I", 7) + b"N" + KEY_BYTES, "D", "expected 'K' or 'O'"
    )


def test_bad_flags_and_identity() -> None:
    assert_protocol_error(message(2, 1, "p", b""), "M", "flags 2")
    assert_protocol_error(relation(7, "s", "t", b"x", []), "R", "replica identity 'x'")
    assert_protocol_error(stream_start(1, 2), "S", "first-segment flag", proto=2)


def test_invalid_utf8_string() -> None:
    data = b"R" + struct.pack("!I", 7) + b"s\xff\xfe\0" + s("t") + b"d" + struct.pack("!H", 0)
    assert_protocol_error(data, "R", "not valid UTF-8")


def test_unterminated_string() -> None:
    assert_protocol_error(b"O" + struct.pack("!Q", 1) + b"name", "O", "terminating NUL")


# --- property tests ----------------------------------------------------------------------------

column = st.one_of(
    st.just((ord("n"), None)),
    st.just((ord("u"), None)),
    st.tuples(st.just(ord("t")), st.binary(max_size=40)),
    st.tuples(st.just(ord("b")), st.binary(max_size=40)),
)


@given(
    columns=st.lists(column, max_size=60),
    old=st.one_of(st.none(), st.sampled_from([b"K", b"O"])),
    xid=st.one_of(st.none(), st.integers(0, 2**32 - 1)),
    oid=st.integers(0, 2**32 - 1),
)
@settings(max_examples=300, deadline=None)
def test_tuple_round_trip(
    columns: list[tuple[int, bytes | None]], old: bytes | None, xid: int | None, oid: int
) -> None:
    kinds = bytes(k for k, _ in columns)
    values = tuple(v for _, v in columns)
    tup = TupleData(kinds, values)
    raw = tuple_bytes(kinds, values)
    d = PgOutputDecoder(2)
    if xid is not None:
        d.decode(stream_start(xid, 1), LSN)
    assert d.decode(insert(oid, raw, xid), LSN) == Insert(xid, oid, tup)
    if old is None:
        assert d.decode(update(oid, raw, None, xid), LSN) == Update(xid, oid, None, None, tup)
    else:
        assert d.decode(update(oid, raw, (old, raw), xid), LSN) == Update(
            xid, oid, old.decode(), tup, tup
        )
        assert d.decode(delete(oid, old, raw, xid), LSN) == Delete(xid, oid, old.decode(), tup)


@given(data=st.sampled_from(VALID), cut=st.integers(0, 200), in_block=st.booleans())
@settings(max_examples=500, deadline=None)
def test_random_truncation_raises_protocol_error(data: bytes, cut: int, in_block: bool) -> None:
    cut %= len(data)
    if data[0] == ord("A") and cut == 9:
        cut = 8  # a parallel-form Stream Abort cut to 9 bytes is a valid short form
    d = PgOutputDecoder(4)
    if in_block:
        d.decode(stream_start(1, 1), LSN)
    with pytest.raises(RemoteProtocolError):
        d.decode(data[:cut], LSN)


@given(garbage=st.binary(max_size=80), proto=st.integers(1, 4), in_block=st.booleans())
@settings(max_examples=1000, deadline=None)
def test_random_bytes_never_raise_anything_else(garbage: bytes, proto: int, in_block: bool) -> None:
    d = PgOutputDecoder(proto)
    if in_block and proto >= 2:
        d.decode(stream_start(1, 1), LSN)
    try:
        d.decode(garbage, LSN)
    except RemoteProtocolError as exc:
        assert exc.lsn == LSN


def test_decode_change_decodes_a_change_again_and_refuses_anything_else() -> None:
    """What spill files use to read back a change stored as its pgoutput bytes."""
    from cdcd.decoder.pgoutput import decode_change

    tup = struct.pack("!H", 1) + b"t" + struct.pack("!I", 1) + b"7"
    plain = b"I" + struct.pack("!I", 16384) + b"N" + tup
    streamed = b"I" + struct.pack("!II", 9, 16384) + b"N" + tup
    assert decode_change(plain, 0x10, streamed=False) == Insert(
        None, 16384, TupleData(b"t", (b"7",))
    )
    assert decode_change(streamed, 0x10, streamed=True) == Insert(
        9, 16384, TupleData(b"t", (b"7",))
    )
    with pytest.raises(RemoteProtocolError, match="expected an Insert, Update or Delete"):
        decode_change(b"B" + struct.pack("!QqI", 1, 2, 3), 0x10, streamed=False)


def test_plain_insert_reads_in_place_or_leaves_it_to_decode_change() -> None:
    """The spill reader's fast path: a well-formed Insert outside a stream block, read inside
    a larger buffer; anything else is None, and decode_change then explains what is wrong."""
    from cdcd.decoder.pgoutput import decode_change, plain_insert

    tup = struct.pack("!H", 2) + b"t" + struct.pack("!I", 1) + b"7" + b"n"
    plain = b"I" + struct.pack("!I", 16384) + b"N" + tup
    around = b"xyz" + plain + b"next record"
    start, stop = 3, 3 + len(plain)
    got = plain_insert(around, start, stop)
    assert got == decode_change(plain, 0x10, streamed=False)
    assert got == Insert(None, 16384, TupleData(b"tn", (b"7", None)))
    bad = {
        "trailing byte": plain + b"!",
        "truncated": plain[:-1],
        "a bad kind": plain.replace(b"n", b"?"),
        "no N": plain.replace(b"N", b"K", 1),
        "an update": b"U" + plain[1:],
        "too short": b"I\x00\x00",
    }
    for why, data in bad.items():
        assert plain_insert(data + b"more", 0, len(data)) is None, why
        if why != "an update":
            with pytest.raises(RemoteProtocolError):
                decode_change(data, 0x10, streamed=False)
    # inside a stream block: the xid follows the tag
    streamed = b"I" + struct.pack("!I", 9) + plain[1:]
    got = plain_insert(b"ab" + streamed, 2, 2 + len(streamed), True)
    assert got == decode_change(streamed, 0x10, streamed=True)
    assert got == Insert(9, 16384, TupleData(b"tn", (b"7", None)))
    assert plain_insert(streamed[:-1], 0, len(streamed) - 1, True) is None  # truncated


@settings(max_examples=300, deadline=None)
@given(
    oid=st.integers(min_value=0, max_value=2**32 - 1),
    columns=st.lists(
        st.one_of(
            st.just((b"n", None)),
            st.just((b"u", None)),
            st.tuples(st.sampled_from([b"t", b"b"]), st.binary(max_size=30)),
        ),
        max_size=12,
    ),
    before=st.binary(max_size=8),
    after=st.binary(max_size=8),
    xid=st.none() | st.integers(min_value=0, max_value=2**32 - 1),
)
def test_plain_insert_equals_decode_change_on_generated_inserts(
    oid: int,
    columns: list[tuple[bytes, bytes | None]],
    before: bytes,
    after: bytes,
    xid: int | None,
) -> None:
    """The fast path and the general one agree on any well-formed Insert, wherever it sits in
    a larger buffer (the spill read-back's case), from outside a stream block or inside one
    (``xid``: with the transaction's xid after the tag)."""
    from cdcd.decoder.pgoutput import decode_change, plain_insert

    body = struct.pack("!H", len(columns))
    for kind, value in columns:
        body += kind + (b"" if value is None else struct.pack("!I", len(value)) + value)
    streamed = xid is not None
    message = b"I" + (struct.pack("!I", xid) if streamed else b"") + struct.pack("!I", oid)
    message += b"N" + body
    buf = before + message + after
    fast = plain_insert(buf, len(before), len(before) + len(message), streamed)
    assert fast is not None
    assert fast == decode_change(message, 0x10, streamed=streamed)
    assert fast.xid == xid
