"""The Kafka sink's batches cut by their compressed size (cdcd.sinks.kafka.batches, pure code):
batches over ``max_request_size`` uncompressed when they compress, and never a batch the broker
would refuse for its size, however the records compress."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from aiokafka.record.default_records import DefaultRecordBatch

from cdcd.sinks.kafka.batches import Batch, Batches
from cdcd.sinks.kafka.recordbatch import CODECS, encode_headers

TOPIC = "t"
LIMIT = 64 * 1024  # max_request_size


def _batches(max_batch_size: int) -> Batches:
    def check_size(*args: Any) -> None:
        raise AssertionError("no record here is too large")

    batches = Batches(
        prefix="p",
        message_topic="p.message",
        routing={},
        tombstones=True,
        count_tables=False,
        max_batch_size=max_batch_size,
        max_request_size=LIMIT,
        check_size=check_size,
        codec=CODECS["zstd"],
        level=1,
    )
    batches.partitions[TOPIC] = [0]
    batches.record_limit = batches.byte_limit = 1 << 40
    return batches


def _value(i: int, compressible: bool) -> bytes:
    if compressible:
        return b'{"id": %d, "name": "name-%d", "pad": "%s"}' % (i, i, b"x" * 300)
    return os.urandom(340)


def _drain(batches: Batches, values: list[bytes]) -> list[bytes]:
    """Add the records, handing closed batches over (built, as the producer would) as they
    close; every built batch."""
    built: list[bytes] = []
    head = encode_headers([("cdcd.commit_lsn", b"1")])

    def hand_over() -> None:
        while batches.ready:
            batch = batches.ready.popleft()
            built.append(batch.records.build(batches.codec, 1, 0, 0, level=batches.level))
            batches.recycle(batch)

    async def run() -> None:
        for i, value in enumerate(values):
            batches.add(TOPIC, 1000 + i, b"%d" % i, value, head, i, b"", 2, "test")
            hand_over()
        batches.close_open()
        hand_over()

    asyncio.run(run())
    return built


def _uncompressed(built: bytes) -> int:
    """The bytes of a built batch's keys and values (uncompressed)."""
    return sum(len(r.key or b"") + len(r.value or b"") for r in DefaultRecordBatch(built))


def _records(built: list[bytes]) -> list[tuple[bytes | None, bytes | None]]:
    return [(r.key, r.value) for b in built for r in DefaultRecordBatch(b)]


def test_compressible_batches_grow_past_the_request_size_and_stay_under_it() -> None:
    batches = _batches(1 << 20)
    values = [_value(i, True) for i in range(20_000)]
    built = _drain(batches, values)
    assert _records(built) == [(b"%d" % i, v) for i, v in enumerate(values)]
    assert max(len(b) for b in built) <= LIMIT
    sizes = [_uncompressed(b) for b in built]
    # the first batch, before anything was known of the compression, no larger than the limit;
    # later ones (but the last) up to max_batch_size uncompressed, several times the limit
    assert LIMIT * 0.8 < sizes[0] <= LIMIT
    assert min(sizes[3:-1]) > 4 * LIMIT
    assert max(sizes) <= 1 << 20
    assert batches.splits == 0


def test_records_that_do_not_compress_are_never_in_a_batch_over_the_limit() -> None:
    batches = _batches(1 << 20)
    values = [_value(i, True) for i in range(10_000)]  # batches of ~1 MiB uncompressed
    values += [_value(i, False) for i in range(10_000, 12_000)]
    values += [_value(i, True) for i in range(12_000, 15_000)]
    built = _drain(batches, values)
    assert _records(built) == [(b"%d" % i, v) for i, v in enumerate(values)]
    assert max(len(b) for b in built) <= LIMIT
    assert batches.splits >= 1  # the batch open when the records changed was split
    assert all(isinstance(entry, Batch) for entry in batches.window)
    assert [len(b.records.built or b"") for b in batches.window] == [len(b) for b in built]


def test_batches_no_larger_than_the_request_size_are_not_cut_by_their_compression() -> None:
    batches = _batches(LIMIT)
    values = [_value(i, True) for i in range(2_000)]
    built = _drain(batches, values)
    assert _records(built) == [(b"%d" % i, v) for i, v in enumerate(values)]
    uncompressed = [_uncompressed(b) for b in built]
    assert LIMIT * 0.8 < max(uncompressed) <= LIMIT
    assert not batches.ratios
