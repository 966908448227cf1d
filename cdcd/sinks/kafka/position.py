"""cdcd's source position in Kafka, for the exactly-once mode (docs/kafka.md).

Each Kafka transaction of the sink ends with one record on the position topic
(``<prefix>.cdcd-positions``, compacted, one partition), keyed by the transactional id: the
position of the last event the transaction holds, ``(commit_lsn, seq)``, whether its source
transaction was complete (``complete``; then ``end_lsn`` too), as Kafka Connect keeps the
offsets of an exactly-once source. On a start the sink reads the newest committed one
(``read_committed``) and skips what Kafka already holds, since PostgreSQL resends every
transaction after the confirmed LSN.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

import orjson
from aiokafka import AIOKafkaConsumer, TopicPartition

#: the position topic's settings: compacted, small segments so compaction keeps it short
TOPIC_CONFIG = {"cleanup.policy": "compact", "segment.ms": "3600000"}
#: records read back from the end at first (a position is written per Kafka transaction)
_TAIL = 500


@dataclass(frozen=True, slots=True)
class Position:
    """The last event a committed Kafka transaction holds."""

    commit_lsn: int
    seq: int  # -1: none of the transaction's events yet
    complete: bool  # every event (and marker) of the source transaction is in Kafka
    end_lsn: int = 0  # of the source transaction, when complete

    def encode(self) -> bytes:
        return orjson.dumps(
            {
                "commit_lsn": self.commit_lsn,
                "seq": self.seq,
                "complete": self.complete,
                "end_lsn": self.end_lsn,
            }
        )

    @classmethod
    def decode(cls, value: bytes) -> Position:
        v = orjson.loads(value)
        return cls(int(v["commit_lsn"]), int(v["seq"]), bool(v["complete"]), int(v["end_lsn"]))

    def holds(self, commit_lsn: int) -> str:
        """What Kafka holds of the source transaction at ``commit_lsn``: ``"all"``, ``"part"``
        (its events up to ``seq``) or ``"none"``. Transactions arrive in commit order."""
        if commit_lsn < self.commit_lsn or (commit_lsn == self.commit_lsn and self.complete):
            return "all"
        return "part" if commit_lsn == self.commit_lsn else "none"


async def read_position(
    client: dict[str, Any], topic: str, key: bytes, timeout_ms: int
) -> Position | None:
    """The newest committed position under ``key`` (None: there is none). Call it after the
    transactional producer started: its InitProducerId aborted what an earlier producer of the
    same id left open, so the read_committed end is not held back by it."""
    consumer = AIOKafkaConsumer(
        **client,
        isolation_level="read_committed",
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        end = (await consumer.end_offsets([tp]))[tp]
        if not end:
            return None
        first = max(0, end - _TAIL)
        found = await _last_with_key(consumer, tp, first, end, key, timeout_ms)
        if found is None and first > 0:
            found = await _last_with_key(consumer, tp, 0, end, key, timeout_ms)
        return None if found is None else Position.decode(found)
    finally:
        with contextlib.suppress(Exception):
            await consumer.stop()


async def _last_with_key(
    consumer: AIOKafkaConsumer, tp: TopicPartition, first: int, end: int, key: bytes, timeout: int
) -> bytes | None:
    """The value of the last record under ``key`` in ``[first, end)`` that a read_committed
    consumer sees. The tail may hold only an aborted transaction's records and its marker
    (cdcd killed while committing: its successor's InitProducerId aborted them); the
    consumer's position does not move past those, but the last stable offset the broker
    reports with them does."""
    consumer.seek(tp, first)
    found: bytes | None = None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout / 1000
    while await consumer.position(tp) < end:
        batch = await consumer.getmany(tp, timeout_ms=200)
        if not batch:
            stable = consumer.last_stable_offset(tp)
            if stable is not None and stable >= end:
                # fetched up to the end: what is left is not for read_committed consumers
                # (records fetched with that offset are buffered already: take them first)
                batch = await consumer.getmany(tp, timeout_ms=0)
                if not batch:
                    break
            elif loop.time() > deadline:
                raise TimeoutError(f"reading {tp.topic} stopped short of offset {end}")
        for record in batch.get(tp, []):
            if record.key == key and record.value is not None:
                found = record.value
    return found
