"""The Kafka sink's own record batches against aiokafka's builder and reader (pure code)."""

from __future__ import annotations

import random

import pytest
from aiokafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder

from cdcd.sinks.kafka.recordbatch import (
    C_KAFKA_RECORD,
    CODECS,
    RecordBatch,
    encode_headers,
    header,
    header_name,
    record_size,
    write_record_python,
)

RECORDS = [
    # (timestamp, key, value, headers before seq, seq, headers after seq)
    (
        1_700_000_000_000,
        b'{"id":1}',
        b'{"op":"c"}' * 30,
        [("cdcd.commit_lsn", b"123")],
        0,
        [("cdcd.xid", b"77"), ("cdcd.op", b"c")],
    ),
    (1_700_000_000_005, b'{"id":2}', None, [("cdcd.commit_lsn", b"123")], 1, [("cdcd.op", b"d")]),
    (1_699_999_999_000, None, b"x" * 300, [("a", b""), ("\u00e9t\u00e9", b"\x00\xff")], -1, []),
    (1_700_000_000_001, b"k" * 200, b"v" * 70_000, [], 123_456_789, []),
]


#: how records are written: cdcd._kafkarec.kafka_record (C) and write_record_python
WRITERS = ["c", "python"]


def new_batch(max_size: int, writer: str = "c") -> RecordBatch:
    batch = RecordBatch(max_size)
    if writer == "python":
        batch.write_record = write_record_python
    elif C_KAFKA_RECORD is None:
        pytest.skip("cdcd._kafkarec is not compiled here")
    return batch


def _ours(codec: int, state: tuple[int, int, int] = (-1, -1, -1), writer: str = "c") -> bytes:
    batch = new_batch(1 << 20, writer)
    for ts, key, value, head, seq, tail in RECORDS:
        count = len(head) + len(tail) + (seq >= 0)
        assert batch.append(ts, key, value, encode_headers(head), seq, encode_headers(tail), count)
    return batch.build(codec, *state)


def _headers(head: list, seq: int, tail: list) -> list:
    return [*head, *([("cdcd.seq", b"%d" % seq)] if seq >= 0 else []), *tail]


def _aiokafka(codec: int) -> bytes:
    builder = DefaultRecordBatchBuilder(2, codec, 0, -1, -1, -1, 1 << 20)
    for offset, (ts, key, value, head, seq, tail) in enumerate(RECORDS):
        assert builder.append(offset, ts, key, value, _headers(head, seq, tail)) is not None
    return bytes(builder.build())


@pytest.mark.parametrize("writer", WRITERS)
def test_uncompressed_batch_is_byte_identical_to_aiokafkas(writer: str) -> None:
    assert _ours(0, writer=writer) == _aiokafka(0)


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("codec", sorted(CODECS))
def test_aiokafka_reads_every_record_back(codec: str, writer: str) -> None:
    batch = DefaultRecordBatch(_ours(CODECS[codec], (4242, 3, 17), writer))
    assert batch.validate_crc()
    assert (batch.producer_id, batch.producer_epoch, batch.base_sequence) == (4242, 3, 17)
    if codec != "none":  # compression pays for these records
        assert batch.compression_type == CODECS[codec]
    got = [(r.offset, r.timestamp, r.key, r.value, list(r.headers)) for r in batch]
    want = [
        (offset, ts, key, value, _headers(head, seq, tail))
        for offset, (ts, key, value, head, seq, tail) in enumerate(RECORDS)
    ]
    assert got == want
    assert batch.first_timestamp == min(r[0] for r in RECORDS[:1])
    assert batch.max_timestamp == max(r[0] for r in RECORDS)


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("codec", sorted(CODECS))
def test_a_released_buffer_builds_the_same_batch_again(codec: str, writer: str) -> None:
    """A batch writing into the buffer an acknowledged one gave up (larger, full of its old
    records) builds the bytes a fresh one does, and a build leaves its records buildable."""
    old = new_batch(1 << 20, writer)
    while old.append(5, b"old", b"o" * 5000, b"", 1, b"", 1):
        pass
    old.build(CODECS[codec], 1, 0, 0)
    reused = RecordBatch(1 << 20, old.release())
    reused.write_record = old.write_record
    assert old.buffer == bytearray()
    for ts, key, value, head, seq, tail in RECORDS:
        count = len(head) + len(tail) + (seq >= 0)
        assert reused.append(ts, key, value, encode_headers(head), seq, encode_headers(tail), count)
    built = reused.build(CODECS[codec], 4242, 3, 17)
    assert built == _ours(CODECS[codec], (4242, 3, 17), writer)
    assert reused.build(CODECS[codec], 4242, 3, 17) == built  # a replay builds it again
    # a new producer's replay, the buffer gone to another batch meanwhile: its own header
    reused.release()
    again = new_batch(1 << 20, writer)
    for ts, key, value, head, seq, tail in RECORDS:
        count = len(head) + len(tail) + (seq >= 0)
        again.append(ts, key, value, encode_headers(head), seq, encode_headers(tail), count)
    fresh = again.build(CODECS[codec], 99, 4, 1234, True)
    assert reused.build(CODECS[codec], 99, 4, 1234, True) == fresh != built


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_a_sealed_batch_builds_without_its_buffer(codec: str) -> None:
    """Compressed as it closes (``seal``), a batch gives its buffer up and builds the bytes an
    unsealed one does; records that compression does not shrink keep their buffer."""
    sealed = new_batch(1 << 20, "python")
    for ts, key, value, head, seq, tail in RECORDS:
        count = len(head) + len(tail) + (seq >= 0)
        sealed.append(ts, key, value, encode_headers(head), seq, encode_headers(tail), count)
    assert sealed.seal(CODECS[codec], 1) == (codec != "none")
    if codec != "none":
        buffer = sealed.release()
        buffer[:] = b"\xff" * len(buffer)  # a next batch writes into it
    want = _ours(CODECS[codec], (4242, 3, 17), "python")
    assert sealed.build(CODECS[codec], 4242, 3, 17) == want
    tiny = new_batch(1 << 20, "python")
    assert tiny.append(1, b"k", b"v", b"", -1, b"", 0)
    assert not tiny.seal(CODECS["zstd"], 1)  # larger compressed: sent as it is


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_a_transactional_batch_is_aiokafkas_transactional_batch(codec: str) -> None:
    """In a Kafka transaction (exactly_once) a batch carries the transactional bit, as
    aiokafka's builder writes it, beside the codec."""
    batch = new_batch(1 << 20, "python")
    for ts, key, value, head, seq, tail in RECORDS:
        count = len(head) + len(tail) + (seq >= 0)
        batch.append(ts, key, value, encode_headers(head), seq, encode_headers(tail), count)
    ours = batch.build(CODECS[codec], 4242, 0, 5, True)
    builder = DefaultRecordBatchBuilder(2, CODECS[codec], 1, 4242, 0, 5, 1 << 20)
    for offset, (ts, key, value, head, seq, tail) in enumerate(RECORDS):
        builder.append(offset, ts, key, value, _headers(head, seq, tail))
    theirs = DefaultRecordBatch(bytes(builder.build()))
    read = DefaultRecordBatch(ours)
    assert read.validate_crc() and read.is_transactional and theirs.is_transactional
    assert read.compression_type == theirs.compression_type
    if codec == "none":
        assert ours == bytes(builder.build())


@pytest.mark.parametrize("writer", WRITERS)
def test_a_full_batch_refuses_the_next_record_but_takes_a_first_one_of_any_size(
    writer: str,
) -> None:
    batch = new_batch(1024, writer)
    assert batch.append(0, b"k", b"v" * 5000, b"", -1, b"", 0)  # alone: always fits
    size = batch.size()
    assert not batch.append(7, b"k", b"v", b"", -1, b"", 0)
    assert (batch.count, batch.size(), batch.max_ts) == (1, size, 0)  # nothing of it kept
    small = new_batch(1024, writer)
    while small.append(0, b"k", b"v" * 100, b"", 5, b"", 1):
        pass
    theirs = DefaultRecordBatchBuilder(2, 0, 0, -1, -1, -1, 1024)
    n = 0
    while theirs.append(n, 0, b"k", b"v" * 100, [("cdcd.seq", b"5")]) is not None:
        n += 1
    assert small.count == n > 1
    assert small.size() <= 1024
    assert len(list(DefaultRecordBatch(small.build(0, -1, -1, -1)))) == small.count


def test_record_size_bounds_aiokafkas_estimate() -> None:
    for _, key, value, head, seq, tail in RECORDS:
        headers = _headers(head, seq, tail)
        estimate = DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, headers)
        assert record_size(key, value, encode_headers(headers)) >= estimate


@pytest.mark.parametrize("value", [b"", b"1", b"x" * 63, b"x" * 64, b"x" * 300])
def test_one_header_encodes_as_the_list_does(value: bytes) -> None:
    assert header(header_name("cdcd.xid"), value) == encode_headers([("cdcd.xid", value)])


def test_c_and_python_writers_write_the_same_bytes() -> None:
    """Random records (null and empty keys and values, values past one-byte varints, negative
    timestamp deltas, large sequence numbers, a buffer that grows): the same batches."""
    if C_KAFKA_RECORD is None:
        pytest.skip("cdcd._kafkarec is not compiled here")
    rng = random.Random(7)
    head = encode_headers([("cdcd.commit_lsn", b"123456789")])
    for _ in range(40):
        limit = rng.choice([300, 5000, 1 << 16])
        batches = [new_batch(limit, "c"), new_batch(limit, "python")]
        for _ in range(rng.randrange(1, 200)):
            key = rng.choice([None, b"", b"k" * rng.randrange(1, 200)])
            value = rng.choice(
                [None, b"", bytes(rng.randrange(256) for _ in range(rng.randrange(1, 3000)))]
            )
            seq = rng.choice([-1, 0, rng.randrange(10**12)])
            tail = encode_headers([("cdcd.op", rng.choice([b"c", b"d"]))] * rng.randrange(3))
            ts = 1_700_000_000_000 + rng.randrange(-(10**6), 10**6)
            count = 1 + (seq >= 0) + rng.randrange(3)
            taken = [b.append(ts, key, value, head, seq, tail, count) for b in batches]
            assert taken[0] == taken[1]
            if not taken[0]:
                break
        c, python = batches
        assert (c.count, c.first_ts, c.max_ts) == (python.count, python.first_ts, python.max_ts)
        assert c.build(0, -1, -1, -1) == python.build(0, -1, -1, -1)


def test_c_writer_refuses_what_it_cannot_write() -> None:
    if C_KAFKA_RECORD is None:
        pytest.skip("cdcd._kafkarec is not compiled here")
    with pytest.raises(TypeError, match="key must be bytes or None"):
        C_KAFKA_RECORD(bytearray(100), 61, -1, 0, 0, "text", None, b"", -1, b"", 0)
    with pytest.raises(TypeError, match="bytearray"):
        C_KAFKA_RECORD(b"x" * 100, 61, -1, 0, 0, None, None, b"", -1, b"", 0)
    with pytest.raises(ValueError, match="pos outside"):
        C_KAFKA_RECORD(bytearray(10), 61, -1, 0, 0, None, None, b"", -1, b"", 0)


@pytest.mark.parametrize(("codec", "levels"), [("zstd", (-5, 1, 3, 19)), ("gzip", (1, 9))])
def test_every_compression_level_reads_back(codec: str, levels: tuple[int, ...]) -> None:
    """``compression_level`` reaches the codec: the levels write other bytes, all of which
    aiokafka reads back as the same records."""
    built = set()
    for level in levels:
        batch = new_batch(1 << 20, "python")
        for g in range(300):  # records that compress, so that the level shows
            value = b'{"id":%d,"name":"name-%d","score":%d.5}' % (g, g, g // 3)
            assert batch.append(g, b'{"id":%d}' % g, value, b"", g, b"", 1)
        raw = batch.build(CODECS[codec], 7, 0, 0, False, level)
        read = DefaultRecordBatch(raw)
        assert read.validate_crc() and read.compression_type == CODECS[codec]
        assert [r.key for r in read] == [b'{"id":%d}' % g for g in range(300)]
        built.add(raw)
    assert len(built) == len(levels)


def test_a_level_that_does_not_fit_the_codec_is_refused() -> None:
    from pydantic import ValidationError

    from cdcd.sinks.kafka.client import KafkaSinkConfig

    assert KafkaSinkConfig(bootstrap_servers="b:9092").level() == 1  # zstd's default here
    assert KafkaSinkConfig(bootstrap_servers="b:9092", compression_level=-3).level() == -3
    for codec, level in (("zstd", 23), ("gzip", 0), ("snappy", 1), ("none", 1)):
        with pytest.raises(ValidationError, match=f"compression_level {level} does not fit"):
            KafkaSinkConfig(bootstrap_servers="b:9092", compression=codec, compression_level=level)


@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_a_split_batch_holds_the_same_records_in_two(codec: str, writer: str) -> None:
    batch = new_batch(1 << 20, writer)
    for ts, key, value, head, seq, tail in RECORDS * 3:
        count = len(head) + len(tail) + (seq >= 0)
        assert batch.append(ts, key, value, encode_headers(head), seq, encode_headers(tail), count)
    first, second = batch.split()
    assert (first.count, second.count) == (6, 6)
    got = []
    for part, sequence in ((first, 0), (second, 6)):
        built = DefaultRecordBatch(part.build(CODECS[codec], 7, 0, sequence))
        assert built.validate_crc() and built.base_sequence == sequence
        records = list(built)
        assert [r.offset for r in records] == list(range(6))
        assert built.first_timestamp == records[0].timestamp
        assert built.max_timestamp == max(r.timestamp for r in records)
        got += [(r.timestamp, r.key, r.value, list(r.headers)) for r in records]
    want = [
        (ts, key, value, _headers(head, seq, tail))
        for ts, key, value, head, seq, tail in RECORDS * 3
    ]
    assert got == want
