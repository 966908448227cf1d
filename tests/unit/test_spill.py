"""Spill file format: every change kind round-trips; truncation; cleanup."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdcd.assembler.spill import SPILL_PREFIX, SPILL_SUFFIX, SpillFile, remove_stale
from cdcd.assembler.transaction import ChangeRecord
from cdcd.decoder.events import (
    Column,
    Delete,
    Insert,
    Message,
    Relation,
    Truncate,
    TupleData,
    Update,
)

REL_A = Relation(None, 16384, "public", "a", "d", (Column(1, "id", 23, -1), Column(0, "v", 25, -1)))
REL_B = Relation(7, 16390, "", "b", "f", (Column(1, "k", 20, -1),))


def row(*values: bytes | None, kinds: bytes | None = None) -> TupleData:
    if kinds is None:
        kinds = bytes(ord("n") if v is None else ord("t") for v in values)
    return TupleData(kinds, values)


EVERY_KIND = [
    ChangeRecord(10, Insert(None, REL_A.oid, row(b"1", b"one")), (REL_A,)),
    ChangeRecord(11, Insert(7, REL_A.oid, row(b"2", None)), (REL_A,)),
    ChangeRecord(
        12,
        Update(None, REL_A.oid, None, None, row(b"1", None, kinds=b"tu")),
        (REL_A,),
    ),
    ChangeRecord(
        13,
        Update(9, REL_A.oid, "K", row(b"1", None), row(b"3", b"\x00\xff", kinds=b"tb")),
        (REL_A,),
    ),
    ChangeRecord(14, Update(None, REL_B.oid, "O", row(b"x"), row(b"")), (REL_B,)),
    ChangeRecord(15, Delete(None, REL_A.oid, "K", row(b"3", None)), (REL_A,)),
    ChangeRecord(16, Delete(2**32 - 1, REL_B.oid, "O", row(b"y")), (REL_B,)),
    ChangeRecord(17, Truncate(None, 3, (REL_A.oid, REL_B.oid)), (REL_A, REL_B)),
    ChangeRecord(18, Message(None, True, 18, "pfx/é", b"\x00content"), ()),
    ChangeRecord(2**64 - 1, Message(5, True, 2**64 - 1, "", b""), ()),
    ChangeRecord(19, Insert(None, REL_A.oid, row()), (REL_A,)),
]


def test_every_change_kind_round_trips_and_reads_twice(tmp_path: Path) -> None:
    spill = SpillFile(tmp_path / "t.spill", buffer_size=64)
    for record in EVERY_KIND:
        spill.append(record)
    spill.finish()
    read = spill.reader()
    assert list(read()) == EVERY_KIND
    again = list(read())
    assert again == EVERY_KIND
    # The very Relation objects come back, not copies.
    assert again[0].relations[0] is REL_A
    assert again[7].relations == (REL_A, REL_B)


@pytest.mark.parametrize("buffer_size", [1, 1 << 20])
def test_truncate_drops_records_after_offset(tmp_path: Path, buffer_size: int) -> None:
    spill = SpillFile(tmp_path / "t.spill", buffer_size=buffer_size)
    offsets = []
    for record in EVERY_KIND:
        offsets.append(spill.tell())
        spill.append(record)
    spill.truncate(offsets[5])
    spill.append(EVERY_KIND[0])
    spill.finish()
    assert list(spill.reader()()) == [*EVERY_KIND[:5], EVERY_KIND[0]]
    assert spill.size == (tmp_path / "t.spill").stat().st_size


def test_truncate_within_pending_after_partial_flush(tmp_path: Path) -> None:
    spill = SpillFile(tmp_path / "t.spill", buffer_size=200)
    offsets = []
    for record in EVERY_KIND * 3:
        offsets.append(spill.tell())
        spill.append(record)
    cut = len(offsets) - 2
    spill.truncate(offsets[cut])
    spill.finish()
    assert list(spill.reader()()) == (EVERY_KIND * 3)[:cut]


@pytest.mark.parametrize("buffer_size", [1, 64, 1 << 20])
@pytest.mark.parametrize("move_at", [None, 0, 4, len(EVERY_KIND)])
def test_in_memory_stream_truncates_and_moves_to_a_file(
    tmp_path: Path, buffer_size: int, move_at: int | None
) -> None:
    """The compact form: records in memory (sealed chunks of ``buffer_size``), truncated
    inside an earlier chunk, then (``move_at``) written to a file and continued there."""
    spill = SpillFile(None, buffer_size=buffer_size)
    assert spill.in_memory and spill.path is None
    offsets = []
    for record in EVERY_KIND * 2:
        offsets.append(spill.tell())
        assert spill.append(record) == spill.tell() - offsets[-1]
    cut = len(EVERY_KIND) + 3
    spill.truncate(offsets[cut])
    assert spill.tell() == offsets[cut]
    expected = (EVERY_KIND * 2)[:cut]
    path = tmp_path / "t.spill"
    for i, record in enumerate(EVERY_KIND):
        if i == move_at:
            spill.move_to(path)
            assert not spill.in_memory and path.stat().st_size <= spill.tell()
        spill.append(record)
        expected.append(record)
    if move_at == len(EVERY_KIND):
        spill.move_to(path)
    spill.finish()
    read = spill.reader()
    assert list(read()) == expected
    assert list(read()) == expected
    if move_at is None:
        assert not path.exists()
    else:
        assert path.stat().st_size == spill.size
        with pytest.raises(ValueError, match="already in"):
            spill.move_to(path)
    spill.delete()
    assert not path.exists()


def test_in_memory_raw_sizes_add_up() -> None:
    spill = SpillFile(None, buffer_size=100)
    data = b"I" + (16384).to_bytes(4, "big") + b"N\x00\x02t\x00\x00\x00\x011t\x00\x00\x00\x01x"
    sizes = [spill.append_raw(lsn, data, None, (REL_A,)) for lsn in range(1, 50)]
    assert sum(sizes) == spill.tell()
    spill.finish()
    records = list(spill.reader()())
    assert [r.lsn for r in records] == list(range(1, 50))
    assert records[0].change == Insert(None, REL_A.oid, row(b"1", b"x"))


def test_delete_removes_file_and_is_idempotent(tmp_path: Path) -> None:
    spill = SpillFile(tmp_path / "t.spill")
    spill.append(EVERY_KIND[0])
    spill.delete()
    spill.delete()
    assert not (tmp_path / "t.spill").exists()


def test_remove_stale_only_touches_spill_files(tmp_path: Path) -> None:
    (tmp_path / f"{SPILL_PREFIX}1{SPILL_SUFFIX}").write_bytes(b"x")
    (tmp_path / f"{SPILL_PREFIX}22{SPILL_SUFFIX}").write_bytes(b"x")
    (tmp_path / "keep.txt").write_bytes(b"x")
    assert remove_stale(tmp_path) == 2
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


values = st.one_of(st.none(), st.binary(max_size=40))


@st.composite
def tuples(draw: st.DrawFn) -> TupleData:
    vals = draw(st.lists(values, max_size=12))
    kinds = bytes(
        draw(st.sampled_from(b"nu")) if v is None else draw(st.sampled_from(b"tb")) for v in vals
    )
    return TupleData(kinds, tuple(vals))


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 2**64 - 1), st.one_of(st.none(), st.integers(0, 2**32 - 1)), tuples()
        ),
        max_size=20,
    )
)
def test_tuples_round_trip(tmp_path_factory: pytest.TempPathFactory, items: list) -> None:  # type: ignore[type-arg]
    path = tmp_path_factory.mktemp("spill") / "h.spill"
    records = [ChangeRecord(lsn, Insert(xid, REL_A.oid, t), (REL_A,)) for lsn, xid, t in items]
    spill = SpillFile(path, buffer_size=100)
    for record in records:
        spill.append(record)
    spill.finish()
    assert list(spill.reader()()) == records
    spill.delete()


def test_a_damaged_stream_is_an_error_not_a_wrong_record(tmp_path: Path) -> None:
    """The read-back takes the record head byte by byte: a record shorter than its head, or
    a stream cut inside a record, fails instead of yielding something."""
    import struct

    spill = SpillFile(tmp_path / "d.spill")
    for record in EVERY_KIND[:2]:
        spill.append(record)
    spill.finish()
    data = (tmp_path / "d.spill").read_bytes()
    (tmp_path / "d.spill").write_bytes(data[:-3])  # cut inside the last record
    with pytest.raises(ValueError, match="truncated"):
        list(spill.reader()())
    (tmp_path / "d.spill").write_bytes(struct.pack("<I", 5) + b"R" + bytes(4))  # a 5-byte body
    with pytest.raises(struct.error, match="spill record of 5 bytes"):
        list(spill.reader()())


def test_the_draining_reader_frees_each_chunk_once_read(tmp_path: Path) -> None:
    """The last reading of a stream held in memory (Transaction.take_changes) yields the same
    records as the reader and drops each sealed chunk from the stream as it goes, so the
    transaction's memory goes down while the sinks' buffers fill; a file has nothing to free."""
    spill = SpillFile(None, buffer_size=64)
    for record in EVERY_KIND * 3:
        spill.append(record)
    spill.finish()
    chunks = len(spill._chunks)
    assert chunks > 10
    held = []
    records = []
    for record in spill.draining_reader()():  # type: ignore[misc]
        records.append(record)
        held.append(len(spill._chunks))
    assert records == EVERY_KIND * 3
    assert held[0] < chunks and held[-1] == 0  # freed from the first record on
    assert held == sorted(held, reverse=True) and len(set(held)) > chunks // 2

    on_disk = SpillFile(tmp_path / "t.spill", buffer_size=64)
    on_disk.append(EVERY_KIND[0])
    on_disk.finish()
    assert on_disk.draining_reader() is None
    on_disk.delete()
