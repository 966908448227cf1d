"""``Encoder.render``: a streamed change's row JSON made as it arrives (docs/assembler.md,
"Rendering streamed changes"), and what it leaves to the release. The corpus test
(tests/integration/test_rendered_streams.py) compares every event of real streams; here the
cases real streams rarely carry: an Update of the key, unchanged TOAST, a K image, a table
without a key, a subtransaction aborted after rendering, a bad value, a bad message."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest

from cdcd.assembler.assembler import Assembler
from cdcd.assembler.spill import SpillFile
from cdcd.assembler.transaction import ChangeRecord, Transaction
from cdcd.decoder.events import (
    Column,
    PgOutputMessage,
    Relation,
    StreamAbort,
    StreamCommit,
    StreamStart,
    StreamStop,
)
from cdcd.decoder.pgoutput import decode_change
from cdcd.decoder.tuples import build_tuple
from cdcd.errors import RemoteProtocolError
from cdcd.events.catalog import StaticCatalog
from cdcd.events.encoder import Encoder
from cdcd.pipeline.feeding import feed_rendering
from tests.unit.sink_fixtures import CONTEXT

XID = 900
KEYED = Relation(
    None,
    16400,
    "public",
    "items",
    "d",
    (Column(1, "id", 23, -1), Column(0, "qty", 23, -1), Column(0, "body", 25, -1)),
)
KEYLESS = Relation(None, 16401, "public", "log", "n", (Column(0, "line", 25, -1),))


def _tuple(*values: bytes | str | None) -> bytes:
    """TupleData of text values; None is a null, "u" unchanged TOAST."""
    kinds = bytes(b"n"[0] if v is None else b"u"[0] if v == "u" else b"t"[0] for v in values)
    return build_tuple(kinds, tuple(v if isinstance(v, bytes) else None for v in values))


def _head(tag: bytes, rel: Relation, xid: int = XID) -> bytes:
    return tag + struct.pack("!II", xid, rel.oid)


def insert(rel: Relation, *values: bytes | str | None, xid: int = XID) -> bytes:
    return _head(b"I", rel, xid) + b"N" + _tuple(*values)


def update(rel: Relation, old: tuple[bytes | None, ...] | None, *new: bytes | str | None) -> bytes:
    old_part = b"" if old is None else b"K" + _tuple(*old)
    return _head(b"U", rel) + old_part + b"N" + _tuple(*new)


def delete(rel: Relation, *old: bytes | None, kind: bytes = b"K") -> bytes:
    return _head(b"D", rel) + kind + _tuple(*old)


def encoder() -> Encoder:
    return Encoder(CONTEXT, StaticCatalog(), clock=lambda: 1.0)


def stream(
    changes: list[bytes], enc: Encoder | None, *, abort_subxid: int | None = None
) -> tuple[Transaction, Assembler]:
    """One streamed transaction of ``changes`` (fed as the daemon feeds them, everything in
    spill format), optionally with Stream Abort of a subtransaction before its commit."""
    asm = Assembler(compact_bytes=0)
    lsn = 0x1000
    for rel in (KEYED, KEYLESS):
        asm.feed(rel, lsn)
    asm.feed(StreamStart(XID, True), lsn)
    for data in changes:
        lsn += 0x10
        rel = asm.undecoded_relation(data, lsn, streamed=True)
        rendered = None if enc is None or rel is None else enc.render(data, rel)
        if not asm.feed_undecoded(data, lsn, streamed=True, rendered=rendered):
            asm.feed(decode_change(data, lsn, streamed=True), lsn, data)
    asm.feed(StreamStop(), lsn)
    if abort_subxid is not None:
        asm.feed(StreamAbort(XID, abort_subxid), lsn)
    txn = asm.feed(StreamCommit(XID, 0, lsn + 0x10, lsn + 0x18, 1_000_000), lsn + 0x10)
    assert txn is not None
    return txn, asm


def events_seen(enc: Encoder, txn: Transaction) -> list[str]:
    return [
        repr(
            (
                e.position,
                e.record_json(),
                e.key_json(),
                e.value_json(),
                e.value(),
                e.key(),
                e.native_row("after"),
            )
        )
        for e in enc.events(txn)
    ]


FIRST = insert(KEYED, b"0", b"0", b"first: decoded, then compacted")
CASES = {
    "insert": (insert(KEYED, b"1", b"10", b"x"), True),
    "insert, a null": (insert(KEYED, b"2", None, b"y"), True),
    "insert without a key": (insert(KEYLESS, b"line"), True),
    "update, no old image": (update(KEYED, None, b"1", b"11", b"x"), True),
    "update, same key": (update(KEYED, (b"1", None, None), b"1", b"12", b"x"), True),
    "update of the key": (update(KEYED, (b"1", None, None), b"9", b"12", b"x"), False),
    "update, unchanged TOAST": (update(KEYED, None, b"1", b"13", "u"), False),
    "delete, K image": (delete(KEYED, b"1", None, None), True),
    "delete without a key": (delete(KEYLESS, b"line", kind=b"O"), True),
    "malformed": (_head(b"I", KEYED) + b"N" + b"\x00\x07t", False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_render_or_leave_to_the_release(name: str) -> None:
    data, renders = CASES[name]
    early = encoder()
    got, asm = stream([FIRST, data], early)
    assert asm.rendered == int(renders)
    if name == "malformed":  # the release says what is wrong, as without rendering
        with pytest.raises(RemoteProtocolError, match="truncated pgoutput message"):
            list(got.changes())
        return
    assert [r.rendered is not None for r in got.changes()] == [False, renders]
    plain = encoder()
    expected, _ = stream([FIRST, data], None)
    assert events_seen(early, got) == events_seen(plain, expected)


def test_rendered_json_is_what_the_event_writes() -> None:
    txn, _ = stream([FIRST, insert(KEYED, b"7", b"70", b"seven")], encoder())
    record = list(txn.changes())[1]
    assert record.rendered == (
        b"null",
        b'{"id":7,"qty":70,"body":"seven"}',
        b'{"id":7}',
    )
    event = list(encoder().events(txn))[1]
    assert event.key_json() == b'{"id":7}'
    assert event.record_json().startswith(b'{"before":null,"after":{"id":7,"qty":70,"body":"sev')


def test_a_bad_value_fails_at_the_release_as_before() -> None:
    """A value that does not convert is not rendered; the release raises the same error."""
    bad = insert(KEYED, b"not a number", b"1", b"x")
    early, plain = encoder(), encoder()
    got, asm = stream([FIRST, bad], early)
    assert asm.rendered == 0
    expected, _ = stream([FIRST, bad], None)
    with pytest.raises(RemoteProtocolError) as with_render:
        events_seen(early, got)
    with pytest.raises(RemoteProtocolError) as without:
        events_seen(plain, expected)
    assert str(with_render.value) == str(without.value)


def test_aborted_subtransaction_drops_its_rendered_changes() -> None:
    sub = 901
    kept = insert(KEYED, b"1", b"1", b"kept")
    dropped = [insert(KEYED, b"%d" % i, b"2", b"gone", xid=sub) for i in range(2, 5)]
    early = encoder()
    txn, asm = stream([FIRST, kept, *dropped], early, abort_subxid=sub)
    assert asm.rendered == 4
    assert [r.rendered is not None for r in txn.changes()] == [False, True]
    events = list(early.events(txn))
    assert [e.key() for e in events] == [{"id": 0}, {"id": 1}]
    assert [e.position[1] for e in events] == [0, 1]


def test_spill_record_round_trip(tmp_path: Path) -> None:
    data = insert(KEYED, b"3", b"30", b"z")
    change = decode_change(data, 0x20, streamed=True)
    rendered = (b"null", b'{"id":3,"qty":30,"body":"z"}', None)
    for path in (None, tmp_path / "s.spill"):
        spill = SpillFile(path)
        size = spill.append_rendered(0x20, data, XID, (KEYED,), rendered)
        assert size == spill.tell()
        spill.append_raw(0x30, data, XID, (KEYED,))
        spill.finish()
        back = list(spill.reader()())
        assert back == [
            ChangeRecord(0x20, change, (KEYED,), rendered),
            ChangeRecord(0x30, change, (KEYED,)),
        ]
        spill.delete()


def test_a_damaged_rendered_record_is_an_error_naming_its_lsn() -> None:
    data = insert(KEYED, b"3", b"30", b"z")
    spill = SpillFile(None)
    spill.append_rendered(0x1234, data, XID, (KEYED,), (b"null", b"{}", b'{"id":3}'))
    spill.finish()
    (chunk,) = spill._chunks
    # the record's length grows by one byte it does not account for: the JSON no longer
    # ends where the record does
    damaged = (int.from_bytes(chunk[:4], "little") + 1).to_bytes(4, "little") + chunk[4:] + b"x"
    spill._chunks = [damaged]
    with pytest.raises(ValueError, match=r"0/1234.*rendered JSON"):
        list(spill.reader()())


@pytest.mark.parametrize("renders", [False, True])
def test_feed_run_leaves_changes_to_render_to_the_caller(renders: bool) -> None:
    """With ``renders``, a run stops before a streamed change that would be taken undecoded
    (the reader renders it, then feeds it); the change before it, decoded, is taken."""
    asm = Assembler(compact_bytes=0)
    for rel in (KEYED, KEYLESS):
        asm.feed(rel, 0x1000)
    asm.feed(StreamStart(XID, True), 0x1000)
    second = insert(KEYED, b"1", b"1", b"x")
    batch: list[Any] = [(0x1010, 0x1010, 0, FIRST), (0x1020, 0x1020, 0, second)]

    def decode(data: bytes, lsn: int) -> PgOutputMessage:
        return decode_change(data, lsn, streamed=True)

    taken, _, _, txn = asm.feed_run(batch, 0, decode, True, renders)
    assert (taken, txn) == ((1, None) if renders else (2, None))
    if renders:
        rel = asm.undecoded_relation(second, 0x1020, streamed=True)
        assert rel is KEYED
        assert asm.feed_undecoded(
            second, 0x1020, streamed=True, rendered=encoder().render(second, rel)
        )
        assert asm.rendered == 1


def test_feed_rendering_renders_the_run_as_the_reader_feeds_it() -> None:
    """cdcd.pipeline.feeding.feed_rendering: one call takes the whole run, every change after
    the first (the transaction is then in spill format) rendered; the events are the same."""
    changes = [FIRST] + [data for data, renders in CASES.values() if renders]
    batch: list[Any] = [(0x1010 + i, 0x1010 + i, 0, data) for i, data in enumerate(changes)]

    def decode(data: bytes, lsn: int) -> PgOutputMessage:
        return decode_change(data, lsn, streamed=True)

    def released(enc: Encoder | None) -> list[bytes]:
        asm = Assembler(compact_bytes=0)
        for rel in (KEYED, KEYLESS):
            asm.feed(rel, 0x1000)
        asm.feed(StreamStart(XID, True), 0x1000)
        if enc is None:
            run = asm.feed_run(batch, 0, decode, True)
        else:
            run = feed_rendering(asm, enc, batch, 0, decode, True)
        assert run == (len(batch), sum(map(len, changes)), batch[-1][1], None)
        assert asm.rendered == (0 if enc is None else len(changes) - 1)
        asm.feed(StreamStop(), 0x2000)
        txn = asm.feed(StreamCommit(XID, 0, 0x2010, 0x2018, 1_000_000), 0x2010)
        assert txn is not None
        return [e.record_json() for e in (enc or encoder()).events(txn)]

    assert released(encoder()) == released(None)
