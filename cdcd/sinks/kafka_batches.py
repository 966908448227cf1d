"""The Kafka sink's per-record path: change events into records, records into per-partition
record batches, and the window of batches waiting for the broker (README "Kafka sink").

Compiled with mypyc (``cdcd/_purepy.py``), as the sink's only per-record code: the sink
(:mod:`cdcd.sinks.kafka`) hands whole lists of events to :meth:`Batches.add_events` and does
only per-batch work itself (handing batches over, acknowledgements, replays, failures).

A record is ``(key, value, headers, timestamp_ms)``; the headers list of a record shares its
tuples with the other records of its transaction except ``cdcd.seq`` (and a key change's link
header). A batch remembers where its first record came from (``Batch.where``) for error
messages; a record that may be too large is checked as it is added (``check_size``).
Records go into aiokafka's ``BatchBuilder`` through its public ``append``; each batch keeps its
records for a replay (:meth:`cdcd.sinks.kafka.KafkaSink._replay`).
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from cdcd.errors import SinkError
from cdcd.events import ChangeEvent
from cdcd.lsn import pg_to_unix_us
from cdcd.sinks.kafka_client import Record, Where
from cdcd.sinks.kafka_partition import partition_for

RECORD_OVERHEAD = 64  # what a record counts for buffer_bytes beyond its key and value

_OP_HEADERS = {op: ("cdcd.op", op.encode()) for op in "crudtm"}
#: the header naming the other key of a key change, by the source field that holds it
_LINK_HEADERS = {"new_key": "__debezium.newkey", "old_key": "__debezium.oldkey"}


def where_of(source: ChangeEvent | str, suffix: str = "") -> Where:
    """Where a record came from, for error messages."""
    if isinstance(source, str):
        return source
    return (source.commit_lsn, source.seq, source.lsn, suffix)


class Batch:
    """Records for one topic-partition, sent to the broker as one record batch.

    ``builder`` is aiokafka's ``BatchBuilder``; ``future`` is set once the batch is handed to
    the producer (``send_batch``) and resolves when the broker acknowledged all of it."""

    def __init__(self, topic: str, partition: int, builder: Any, where: Where) -> None:
        self.topic = topic
        self.partition = partition
        self.builder = builder
        self.where = where  # of the first record
        self.records: list[Record] = []
        self.size = 0
        self.future: asyncio.Future[Any] | None = None
        self.error: SinkError | None = None  # handing it to the producer failed definitely

    def add(self, record: Record) -> bool:
        """Append one record to the builder; False when it is full (aiokafka's public
        ``BatchBuilder.append``: its internals are not relied on)."""
        key, value, headers, ts = record
        return self.builder.append(timestamp=ts, key=key, value=value, headers=headers) is not None

    def rebuild(self, builder: Any) -> None:
        """Put the same records into a fresh builder (a replay)."""
        self.builder = builder
        self.future = None
        for record in self.records:
            added = self.add(record)
            assert added, "a replayed batch holds what it held before"


class Batches:
    """Open batches (one per topic-partition), closed ones waiting to be handed over
    (``ready``), and the window: batches and transaction end LSNs in order, from the oldest
    not acknowledged."""

    def __init__(
        self,
        *,
        prefix: str,
        message_topic: str,
        routing: dict[str, str],
        tombstones: bool,
        count_tables: bool,
        max_request_size: int,
        check_size: Callable[[str, Record, Where], None],
    ) -> None:
        self.prefix = prefix
        self.message_topic = message_topic
        self.routing = routing
        self.tombstones = tombstones
        self.count_tables = count_tables
        self.max_request_size = max_request_size
        self.check_size = check_size  # raises when the record is too large
        self.create_batch: Callable[[], Any] | None = None  # the producer's, once started
        self.partitions: dict[str, list[int]] = {}  # known topics: their partitions, sorted
        # by (schema, table): (topic, "schema.table"); (None, None): (message topic, None)
        self.topics: dict[tuple[str | None, str | None], tuple[str, str | None]] = {}
        self.window: deque[Batch | int] = deque()  # batches and transaction end LSNs
        self.window_bytes = 0
        self.window_records = 0
        self.record_limit = 0  # add_events stops once the window holds this many records
        self.byte_limit = 0  # or this many bytes
        self.open: dict[tuple[str, int], Batch] = {}  # batches still taking records
        self.open_since = 0.0  # loop time the oldest open batch was started
        self.ready: deque[Batch] = deque()  # closed batches, to hand over in this order
        self.wake = asyncio.Event()  # work for the submitter
        self.missing_topic: str | None = None  # add_events stopped to have this one prepared
        self.txn_counts: dict[str, int] = {}  # events per "schema.table" in this transaction
        self._txn_commit_lsn = -1  # the transaction whose header values are cached below
        self._lsn_header: tuple[str, bytes] = ("cdcd.commit_lsn", b"")
        self._xid_header: tuple[str, bytes] | None = None
        self._ts = 0

    def full(self) -> bool:
        return self.window_records >= self.record_limit or self.window_bytes >= self.byte_limit

    def add_events(self, events: Sequence[ChangeEvent], start: int) -> int:
        """Add the records of ``events[start:]``; return the index of the first event not
        added. It stops early when an event's topic is not known yet (``missing_topic`` set,
        that event not added) or once the window is full (after the event that filled it)."""
        topics = self.topics
        partitions = self.partitions
        count = self.count_tables
        counts = self.txn_counts
        tombstones = self.tombstones
        n = len(events)
        i = start
        while i < n:
            event = events[i]
            route = topics.get((event.schema, event.table))
            if route is None:
                route = self._route_of(event)
            topic, name = route
            if topic not in partitions:
                self.missing_topic = topic
                return i
            if count and name is not None:
                counts[name] = counts.get(name, 0) + 1
            if event.commit_lsn != self._txn_commit_lsn:
                self._cache_txn_headers(event)
            op = event.op
            seq = event.seq
            headers = [self._lsn_header, ("cdcd.seq", b"%d" % seq)]
            xid_header = self._xid_header
            if xid_header is not None:
                headers.append(xid_header)
            op_header = _OP_HEADERS.get(op)
            headers.append(op_header if op_header is not None else ("cdcd.op", op.encode()))
            if op == "d" or op == "c":
                link = event.key_link()
                if link is not None:  # a key change: Debezium's header linking the pair
                    headers.append((_LINK_HEADERS[link[0]], orjson.dumps(link[1])))
            key = event.key_json()  # {"prefix": ...} for logical messages
            ts = self._ts
            self.add(topic, (key, event.value_json(), headers, ts), event)
            if op == "d" and key is not None and tombstones:
                self.add(topic, (key, None, headers, ts), event, " tombstone")
            i += 1
            if self.window_records >= self.record_limit or self.window_bytes >= self.byte_limit:
                break
        return i

    def add(self, topic: str, record: Record, source: ChangeEvent | str, suffix: str = "") -> None:
        """Append one record to its partition's open batch (Kafka's default partitioning).
        ``source``: the event the record is made of, or a marker's description."""
        key, value, _, _ = record
        partitions = self.partitions[topic]
        if key is None:
            partition = random.choice(partitions)
        elif len(partitions) == 1:
            partition = partitions[0]
        else:
            partition = partitions[partition_for(key, len(partitions))]
        size = RECORD_OVERHEAD
        if key is not None:
            size += len(key)
        if value is not None:
            size += len(value)
        if size + 1024 > self.max_request_size:  # Kafka's estimate adds < 1 KiB
            self.check_size(topic, record, where_of(source, suffix))
        tp = (topic, partition)
        batch = self.open.get(tp)
        if batch is None:
            batch = self._new_batch(topic, partition, where_of(source, suffix))
        if not batch.add(record):
            del self.open[tp]  # full: hand it over, start the next one
            self.ready.append(batch)
            self.wake.set()
            batch = self._new_batch(topic, partition, where_of(source, suffix))
            batch.add(record)
        batch.records.append(record)
        batch.size += size
        self.window_records += 1
        self.window_bytes += size

    def _new_batch(self, topic: str, partition: int, where: Where) -> Batch:
        create = self.create_batch
        assert create is not None, "KafkaSink.start() was not called"
        batch = Batch(topic, partition, create(), where)
        if not self.open:
            self.open_since = asyncio.get_running_loop().time()
            self.wake.set()
        self.open[(topic, partition)] = batch
        self.window.append(batch)
        return batch

    def _route_of(self, event: ChangeEvent) -> tuple[str, str | None]:
        """(topic, "schema.table") of an event's table, (message topic, None) for a logical
        message; remembered per table."""
        if event.schema is None:
            route: tuple[str, str | None] = (self.message_topic, None)
        else:
            name = f"{event.schema}.{event.table}"
            topic = self.routing.get(name)
            route = (topic if topic is not None else f"{self.prefix}.{name}", name)
        self.topics[(event.schema, event.table)] = route
        return route

    def _cache_txn_headers(self, event: ChangeEvent) -> None:
        """The header tuples and timestamp every record of the event's transaction shares."""
        self._txn_commit_lsn = event.commit_lsn
        xid = event.xid
        self._xid_header = None if xid is None else ("cdcd.xid", b"%d" % xid)
        self._lsn_header = ("cdcd.commit_lsn", b"%d" % event.commit_lsn)
        self._ts = pg_to_unix_us(event.commit_time) // 1000
