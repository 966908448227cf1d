"""Real pgoutput streams (``tests/corpus``, captured from PostgreSQL 15, 16 and 18 under every
option set) decoded and assembled: the released transactions must be what each scenario's
SQL (in the file header) committed — rows per table, which savepoint's rows survived,
column sets around DDL, message order, prepared transactions, truncated tables, origins.

Every file is also assembled with spilling forced (memory limit 0) and must give the same
transactions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cdcd.assembler.assembler import Assembler, record_size
from cdcd.assembler.transaction import ChangeRecord, Transaction
from cdcd.decoder.events import (
    KIND_BINARY,
    KIND_NULL,
    Delete,
    Insert,
    Message,
    PgOutputMessage,
    StreamAbort,
    Truncate,
    TupleData,
    Update,
)
from cdcd.decoder.pgoutput import PgOutputDecoder
from tests.corpusutil import all_corpus_files, corpus_files, load_corpus

INT_OIDS = {20, 21, 23}


def decoded(path: Path) -> tuple[dict[str, Any], list[tuple[int, PgOutputMessage]]]:
    header, rows = load_corpus(path)
    assert header["scenario"] == path.stem
    decoder = PgOutputDecoder(int(header["options"]["proto_version"]))
    return header, [(lsn, decoder.decode(data, lsn)) for lsn, _xid, data in rows]


def assemble(
    msgs: list[tuple[int, PgOutputMessage]],
    asm: Assembler | None = None,
    raw: list[bytes] | None = None,
) -> list[Transaction]:
    """Feed ``msgs``; with ``raw`` (the bytes of each message) as the daemon feeds them."""
    asm = asm or Assembler()
    out = []
    for i, (lsn, msg) in enumerate(msgs):
        txn = asm.feed(msg, lsn, None if raw is None else raw[i])
        if raw is not None:  # the accounting follows every append, drop and release
            held = list(asm._buffers())
            for buf in held:
                if buf.spill is None:
                    sizes = [
                        record_size(r.change, b) for r, b in zip(buf.records, buf.raws, strict=True)
                    ]
                    assert buf.mem_bytes == sum(sizes)
                elif buf.spill.in_memory:
                    assert buf.mem_bytes == buf.spill.tell()
                else:
                    assert buf.mem_bytes == 0
            assert asm.buffered_bytes == sum(buf.mem_bytes for buf in held)
        if txn is not None:
            out.append(txn)
    assert asm.idle, "every corpus scenario ends with nothing in flight"
    assert asm.buffered_bytes == 0
    return out


def files(scenario: str) -> list[Any]:
    found = corpus_files(scenario=scenario)
    if not found:
        return [pytest.param(None, marks=pytest.mark.skip(reason="corpus not captured"))]
    return [pytest.param(p, id="/".join(p.parts[-3:-1])) for p in found]


def is_streaming(header: dict[str, Any]) -> bool:
    return header["options"].get("streaming", "off") not in ("off", "false")


def is_two_phase(header: dict[str, Any]) -> bool:
    return bool(header.get("slot_two_phase")) and header["options"].get("two_phase") in (
        "true",
        "on",
    )


def value(record: ChangeRecord, tup: TupleData, name: str) -> int | str | None:
    """A column of a row image, by name, as int (integer types) or str."""
    rel = record.relations[0]
    assert len(tup) == len(rel.columns), "row image matches its Relation"
    idx = [c.name for c in rel.columns].index(name)
    kind, raw = tup.kinds[idx], tup.values[idx]
    if kind == KIND_NULL:
        return None
    assert raw is not None
    if rel.columns[idx].type_oid in INT_OIDS:
        if kind == KIND_BINARY:
            return int.from_bytes(raw, "big", signed=True)
        return int(raw)
    return raw.decode()


def ids(txn: Transaction, table: str = "big") -> list[int | str | None]:
    return [
        value(r, r.change.new, "id")
        for r in txn.changes()
        if isinstance(r.change, Insert) and r.relations[0].name == table
    ]


def shape(txn: Transaction) -> list[tuple[str, tuple[str, ...]]]:
    """Per change: its kind letter and table names (Truncate: sorted)."""
    out: list[tuple[str, tuple[str, ...]]] = []
    for r in txn.changes():
        match r.change:
            case Insert():
                out.append(("I", (r.relations[0].name,)))
            case Update():
                out.append(("U", (r.relations[0].name,)))
            case Delete():
                out.append(("D", (r.relations[0].name,)))
            case Truncate():
                out.append(("T", tuple(sorted(rel.name for rel in r.relations))))
            case Message():
                out.append(("M", ()))
    return out


# --- every file ---------------------------------------------------------------------------


def assemble_as_the_daemon(path: Path, asm: Assembler) -> list[Transaction]:
    """As cdcd.app's reader: a change of a spilled transaction is handed over undecoded."""
    header, rows = load_corpus(path)
    decoder = PgOutputDecoder(int(header["options"]["proto_version"]))
    out = []
    undecoded = 0
    for lsn, _xid, data in rows:
        if asm.feed_undecoded(data, lsn, streamed=decoder.in_stream):
            undecoded += 1
            continue
        txn = asm.feed(decoder.decode(data, lsn), lsn, data)
        if txn is not None:
            out.append(txn)
    assert asm.idle and asm.buffered_bytes == 0
    return out


@pytest.mark.parametrize(
    "path", [pytest.param(p, id="/".join(p.parts[-3:])) for p in all_corpus_files()]
)
@pytest.mark.parametrize(
    "variant",
    [
        "records",
        "raw",
        "raw-some-in-memory",
        "raw-in-memory",
        "daemon",
        "daemon-some-in-memory",
        "compact",
        "daemon-compact",
        "daemon-compact-then-spill",
    ],
)
def test_every_file_assembles_and_spilling_changes_nothing(
    path: Path, variant: str, tmp_path: Path
) -> None:
    """Spilling gives the very same transactions: changes encoded field by field ("records"),
    kept as the pgoutput bytes they came as ("raw"), and both in one file (the changes in
    memory when the transaction spills are encoded, the later ones raw), and as the daemon
    feeds them (the changes of a spilled transaction undecoded). So does the compact form in
    memory (every transaction with a change goes compact at once), alone and then spilled."""
    _header, msgs = decoded(path)
    raw = [data for _lsn, _xid, data in load_corpus(path)[1]]
    plain = assemble(msgs)
    if variant == "records":
        spilled = assemble(msgs, Assembler(memory_limit=0, spill_dir=tmp_path))
    elif variant == "compact":
        spilled = assemble(msgs, Assembler(memory_limit=1 << 40, compact_bytes=0), raw)
    elif variant.startswith("daemon-compact"):
        limit = 1 << 40 if variant == "daemon-compact" else 2000
        asm = Assembler(memory_limit=limit, spill_dir=tmp_path, compact_bytes=0)
        spilled = assemble_as_the_daemon(path, asm)
    elif variant.startswith("daemon"):
        limit = 0 if variant == "daemon" else 2000
        spilled = assemble_as_the_daemon(path, Assembler(memory_limit=limit, spill_dir=tmp_path))
    else:
        limit = {"raw": 0, "raw-some-in-memory": 2000, "raw-in-memory": 1 << 40}[variant]
        spilled = assemble(msgs, Assembler(memory_limit=limit, spill_dir=tmp_path), raw)
    assert [(t.kind, t.xid, t.gid, t.commit_lsn, t.end_lsn, t.size) for t in spilled] == [
        (t.kind, t.xid, t.gid, t.commit_lsn, t.end_lsn, t.size) for t in plain
    ]
    for a, b in zip(plain, spilled, strict=True):
        records = list(b.changes())
        assert records == list(a.changes())
        assert len(records) == a.size
        lsns = [r.lsn for r in records]
        assert lsns == sorted(lsns), "changes in WAL order"
        for r in records:
            if isinstance(r.change, Insert | Update | Delete):
                assert r.relations[0].oid == r.change.relation_oid
            elif isinstance(r.change, Truncate):
                assert tuple(rel.oid for rel in r.relations) == r.change.relation_oids
        b.release()
    assert list(tmp_path.iterdir()) == []


if not all_corpus_files():  # pragma: no cover - only before the corpus is captured
    pytestmark = pytest.mark.skip(reason="tests/corpus holds no captured files")


# --- scenarios --------------------------------------------------------------------------------


@pytest.mark.parametrize("path", files("stream_commit"))
def test_stream_commit(path: Path) -> None:
    header, msgs = decoded(path)
    (txn,) = assemble(msgs)
    assert txn.kind == ("streamed" if is_streaming(header) else "regular")
    assert ids(txn) == [1, 2, 3, 101, 102, 103, 201, 202, 203]


@pytest.mark.parametrize("path", files("stream_abort"))
def test_stream_abort_commits_only_the_later_transaction(path: Path) -> None:
    _header, msgs = decoded(path)
    (txn,) = assemble(msgs)
    assert shape(txn) == [("I", ("after",))]
    assert ids(txn, "after") == [1]


@pytest.mark.parametrize("path", files("stream_savepoints"))
def test_stream_savepoints_inner_rollback_only(path: Path) -> None:
    header, msgs = decoded(path)
    if is_streaming(header):
        sub_aborts = [m for _, m in msgs if isinstance(m, StreamAbort) and m.subxid != m.xid]
        assert sub_aborts, "the corpus holds a streamed subtransaction abort"
    big, small = assemble(msgs)
    assert big.kind == ("streamed" if is_streaming(header) else "regular")
    # SAVEPOINT b's rows (201-203) were rolled back; a's (101-103) released with the top.
    assert ids(big) == [1, 2, 3, 101, 102, 103, 301, 302, 303]
    assert ids(small) == [-1, -3]


@pytest.mark.parametrize("path", files("stream_interleaved"))
def test_stream_interleaved(path: Path) -> None:
    header, msgs = decoded(path)
    c1, c2 = assemble(msgs)
    if is_streaming(header):
        assert (c1.kind, c2.kind) == ("streamed", "streamed")
    assert ids(c1) == [1000, 1001, 1002, 1100, 1101, 1102, 1900, 1901, 1902]
    assert ids(c2) == [2000, 2001, 2002, 2100, 2101, 2102, 2900, 2901, 2902]
    assert c1.commit_lsn < c2.commit_lsn


@pytest.mark.parametrize("path", files("stream_ddl"))
def test_stream_ddl_column_sets(path: Path) -> None:
    header, msgs = decoded(path)
    (txn,) = assemble(msgs)
    assert txn.kind == ("streamed" if is_streaming(header) else "regular")
    rows = []
    for r in txn.changes():
        assert isinstance(r.change, Insert)
        cols = tuple(c.name for c in r.relations[0].columns)
        extra = value(r, r.change.new, "extra") if "extra" in cols else None
        note = value(r, r.change.new, "note") if "note" in cols else None
        rows.append((value(r, r.change.new, "id"), cols, note, extra))
    assert rows == [
        *((i, ("id", "note"), None, None) for i in (1, 2, 3)),
        *((i, ("id", "note", "extra"), "n", i) for i in (101, 102, 103)),
        *((i, ("id", "extra"), None, 7) for i in (201, 202, 203)),
    ]


@pytest.mark.parametrize("path", files("prepared"))
def test_prepared(path: Path) -> None:
    header, msgs = decoded(path)
    small, large = assemble(msgs)
    assert ids(small) == [1]
    assert ids(large) == [10, 11, 12, 20, 21, 22]
    if is_two_phase(header):
        assert [(t.kind, t.gid) for t in (small, large)] == [
            ("prepared", "small_commit"),
            ("prepared", "large_commit"),
        ]
    else:  # decoded at COMMIT PREPARED as an ordinary transaction
        assert small.kind == "regular" and small.gid is None
        assert large.kind == ("streamed" if is_streaming(header) else "regular")


@pytest.mark.parametrize("path", files("messages"))
def test_messages_in_order(path: Path) -> None:
    header, msgs = decoded(path)
    released = assemble(msgs)
    got = []
    for txn in released:
        items: list[tuple[object, ...]] = []
        for r in txn.changes():
            if isinstance(r.change, Message):
                items.append((r.change.transactional, r.change.prefix, r.change.content))
            else:
                assert isinstance(r.change, Insert)
                items.append(("row", value(r, r.change.new, "id")))
        got.append((txn.kind, items))
    last_kind = "streamed" if is_streaming(header) else "regular"
    assert got == [
        ("message", [(False, "cdcd", b"non-transactional text")]),
        ("message", [(False, "cdcd.bin", b"\x00\xff\x10")]),
        (
            "regular",
            [
                (True, "cdcd", b"transactional text"),
                ("row", 1),
                (True, "cdcd.bin", b"\x00\x01\xfe\xff"),
            ],
        ),
        ("regular", [(True, "cdcd", b"only a message")]),
        (
            last_kind,
            [
                (True, "cdcd", b"streamed start"),
                ("row", 1),
                ("row", 2),
                ("row", 3),
                (True, "cdcd", b"streamed end"),
            ],
        ),
    ]
    # a non-transactional message: position its LSN - 1, acknowledged with its LSN
    assert released[0].commit_lsn == released[0].end_lsn - 1
    assert released[0].end_lsn <= released[1].commit_lsn


@pytest.mark.parametrize("path", files("truncate"))
def test_truncate_several_tables(path: Path) -> None:
    _header, msgs = decoded(path)
    released = assemble(msgs)
    assert [shape(t) for t in released] == [
        [("I", ("parent",))],
        [("I", ("child",))],
        [("I", ("other",))],
        [("T", ("child", "other", "parent"))],
        [("I", ("lone",))],
        [("T", ("lone",))],
        [("I", ("lone",)), ("T", ("lone",)), ("I", ("lone",))],
    ]
    (cascade,) = released[3].changes()
    assert isinstance(cascade.change, Truncate)
    assert cascade.change.cascade and cascade.change.restart_identity
    (plain,) = released[5].changes()
    assert isinstance(plain.change, Truncate) and plain.change.options == 0
    assert ids(released[6], "lone") == [2, 3]


@pytest.mark.parametrize("path", files("origin"))
def test_origin(path: Path) -> None:
    _header, msgs = decoded(path)
    replayed, local = assemble(msgs)
    assert (replayed.origin, replayed.origin_lsn) == ("cdcd_corpus_origin", 0x1234ABCD)
    assert (local.origin, local.origin_lsn) == (None, None)
    assert ids(replayed, "t") == [1] and ids(local, "t") == [2]
