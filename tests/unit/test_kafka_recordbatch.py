"""The Kafka sink's own record batches against aiokafka's builder and reader (pure code)."""

from __future__ import annotations

import pytest
from aiokafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder

from cdcd.sinks.kafka_recordbatch import (
    CODECS,
    RecordBatch,
    encode_headers,
    header,
    header_name,
    record_size,
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


def _ours(codec: int, state: tuple[int, int, int] = (-1, -1, -1)) -> bytes:
    batch = RecordBatch(1 << 20)
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


def test_uncompressed_batch_is_byte_identical_to_aiokafkas() -> None:
    assert _ours(0) == _aiokafka(0)


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_aiokafka_reads_every_record_back(codec: str) -> None:
    batch = DefaultRecordBatch(_ours(CODECS[codec], (4242, 3, 17)))
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


def test_a_full_batch_refuses_the_next_record_but_takes_a_first_one_of_any_size() -> None:
    batch = RecordBatch(1024)
    assert batch.append(0, b"k", b"v" * 5000, b"", -1, b"", 0)  # alone: always fits
    assert not batch.append(0, b"k", b"v", b"", -1, b"", 0)
    assert batch.count == 1
    small = RecordBatch(1024)
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
