"""The Kafka sink's per-record path: change events into records, records into per-partition
record batches, and the window of batches waiting for the broker (docs/kafka.md).

Compiled with mypyc (``cdcd/_purepy.py``), as the sink's only per-record code: the sink
(:mod:`cdcd.sinks.kafka.sink`) hands whole lists of events to :meth:`Batches.add_events` and does
only per-batch work itself (handing batches over, acknowledgements, replays, failures).

Records are written straight into their batch's buffer
(:class:`cdcd.sinks.kafka.recordbatch.RecordBatch`): no object is kept per record, and the
headers a transaction's records share are encoded once per transaction. A batch keeps what
it was built into (compressed) until the broker acknowledged it, for a replay
(:mod:`cdcd.sinks.kafka.sender`), its buffer going to a later batch once built (``recycle``),
and remembers where its first record came from (``Batch.where``) for error messages; a record
that may be too large is checked as it is added (``check_size``).
"""

from __future__ import annotations

import asyncio
import random
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Final

import orjson

from cdcd.errors import SinkError
from cdcd.events import ChangeEvent
from cdcd.lsn import pg_to_unix_us
from cdcd.sinks.kafka.partition import partition_for
from cdcd.sinks.kafka.recordbatch import (
    HEADER_SIZE,
    Record,
    RecordBatch,
    Where,
    encode_headers,
    header,
    header_name,
)

RECORD_OVERHEAD: Final = 64  # what a record counts for buffer_bytes beyond its key and value
#: buffers of built batches kept for the next full batches (Batches.recycle)
SPARE_BUFFERS: Final = 4
#: how much of ``max_request_size`` a batch's compressed size is estimated to fill when it
#: closes (the estimate errs by a few per cent from batch to batch)
COMPRESSED_FILL: Final = 0.9

_OP_HEADERS: Final = {op: encode_headers([("cdcd.op", op.encode())]) for op in "crudtm"}
_LSN_NAME: Final = header_name("cdcd.commit_lsn")
_XID_NAME: Final = header_name("cdcd.xid")
#: the header naming the other key of a key change, by the source field that holds it
_LINK_HEADERS: Final = {"new_key": "__debezium.newkey", "old_key": "__debezium.oldkey"}


def where_of(source: ChangeEvent | str, suffix: str = "") -> Where:
    """Where a record came from, for error messages."""
    if isinstance(source, str):
        return source
    return (source.commit_lsn, source.seq, source.lsn, suffix)


class Batch:
    """Records for one topic-partition, sent to the broker as one record batch. ``future``
    is set once the batch is handed to the producer (``send_batch``) and resolves when the
    broker acknowledged all of it."""

    def __init__(
        self,
        topic: str,
        partition: int,
        max_size: int,
        where: Where,
        buffer: bytearray | None = None,
    ) -> None:
        self.topic = topic
        self.partition = partition
        self.records = RecordBatch(max_size, buffer)
        self.where = where  # of the first record
        # what it counts for buffer_bytes: its records, and a third of a reused buffer
        # (buffered_bytes reports three times the count)
        self.size = 0 if buffer is None else len(buffer) // 3
        self.future: asyncio.Future[Any] | None = None
        self.error: SinkError | None = None  # handing it to the producer failed definitely


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
        max_batch_size: int,
        max_request_size: int,
        check_size: Callable[[str, Record, bytes, Where], None],
        codec: int = 0,
        level: int = 1,
    ) -> None:
        self.prefix = prefix
        self.message_topic = message_topic
        self.routing = routing
        self.tombstones = tombstones
        self.count_tables = count_tables
        self.max_batch_size = max_batch_size
        self.max_request_size = max_request_size
        self.check_size = check_size  # raises when the record is too large
        self.codec = codec  # of compression (recordbatch.CODECS), and its level
        self.level = level
        #: by topic: compressed / uncompressed size of its last batches (1.0 until known),
        #: which sets how large its next batch grows (:meth:`batch_limit`)
        self.ratios: dict[str, float] = {}
        self.splits = 0  # batches split: compressed, they came out over max_request_size
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
        self.spare: list[bytearray] = []  # buffers of built batches (recycle)
        self.spare_limit = SPARE_BUFFERS  # how many of them are kept
        #: a batch this large (half of max_request_size or of max_batch_size, the smaller)
        #: leaves its buffer for a next one; batches larger than max_request_size are mostly
        #: closed by the linger (the producer still held the one before), not full
        self.large = min(max_batch_size, max_request_size) // 2
        #: partitions whose large open batch was closed before it was full (close_open): their
        #: next batch takes a spare buffer, as one following a full batch does
        self.cut: set[tuple[str, int]] = set()
        self.wake = asyncio.Event()  # work for the submitter
        self.missing_topic: str | None = None  # add_events stopped to have this one prepared
        self.txn_counts: dict[str, int] = {}  # events per "schema.table" in this transaction
        self._txn_commit_lsn = -1  # the transaction whose header values are cached below
        self._head = b""  # the commit_lsn header, encoded
        self._tails: dict[str, bytes] = {}  # by op: the xid and op headers, encoded
        self._xid: int | None = None
        self._header_count = 0  # commit_lsn, seq, [xid], op
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
            tail = self._tails.get(op)
            if tail is None:
                tail = self._tail_for(op)
            header_count = self._header_count
            if op == "d" or op == "c":
                link = event.key_link()
                if link is not None:  # a key change: Debezium's header linking the pair
                    header = (_LINK_HEADERS[link[0]], orjson.dumps(link[1]))
                    tail += encode_headers([header])
                    header_count += 1
            key = event.key_json()  # {"prefix": ...} for logical messages
            ts = self._ts
            head = self._head
            self.add(topic, ts, key, event.value_json(), head, seq, tail, header_count, event)
            if op == "d" and key is not None and tombstones:
                self.add(topic, ts, key, None, head, seq, tail, header_count, event, " tombstone")
            i += 1
            if self.window_records >= self.record_limit or self.window_bytes >= self.byte_limit:
                break
        return i

    def add(
        self,
        topic: str,
        ts: int,
        key: bytes | None,
        value: bytes | None,
        head: bytes,
        seq: int,
        tail: bytes,
        header_count: int,
        source: ChangeEvent | str,
        suffix: str = "",
    ) -> None:
        """Append one record to its partition's open batch (Kafka's default partitioning).
        Headers as :meth:`RecordBatch.append` takes them; ``source``: the event the record is
        made of, or a marker's description."""
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
            self.check_size(topic, (key, value), head + tail, where_of(source, suffix))
        tp = (topic, partition)
        batch = self.open.get(tp)
        if batch is None:
            buffer = None
            if self.cut and tp in self.cut:
                self.cut.discard(tp)
                buffer = self.spare.pop() if self.spare else None
            batch = self._new_batch(topic, partition, where_of(source, suffix), buffer)
            self.window_bytes += batch.size
        if not batch.records.append(ts, key, value, head, seq, tail, header_count):
            del self.open[tp]  # full: hand it over, start the next one
            self.close(batch)
            self.wake.set()
            spare = self.spare
            buffer = spare.pop() if spare else None
            batch = self._new_batch(topic, partition, where_of(source, suffix), buffer)
            self.window_bytes += batch.size
            batch.records.append(ts, key, value, head, seq, tail, header_count)
        batch.size += size
        self.window_records += 1
        self.window_bytes += size

    def close_open(self) -> None:
        """Close every open batch (the linger passed, or a Kafka commit begins): ready to be
        handed over. A partition's next batch after a large one takes a spare buffer."""
        half = self.large
        for tp, batch in self.open.items():
            if batch.records.size() >= half:
                self.cut.add(tp)
            self.close(batch)
        self.open.clear()

    def batch_limit(self, topic: str) -> int:
        """How large (uncompressed) a new batch of ``topic`` may grow: ``max_batch_size``, but
        when that is over ``max_request_size`` (the broker's limit, which applies to the
        compressed batch), only as large as the topic's compression ratio lets it be and
        still fill no more than :data:`COMPRESSED_FILL` of ``max_request_size`` compressed
        (at least ``max_request_size``: a batch of that size always fits, compressed or
        sent as it is). A batch that comes out larger all the same is split as it closes."""
        limit = self.max_batch_size
        cap = self.max_request_size
        if limit <= cap:
            return limit
        ratio = self.ratios.get(topic, 1.0)
        if ratio * limit <= COMPRESSED_FILL * cap:
            return limit
        return max(cap, int(COMPRESSED_FILL * cap / ratio))

    def close(self, batch: Batch) -> None:
        """``batch`` takes no more records: ready to be handed over. One larger than
        ``max_request_size`` is compressed now, and split in two (in the window too) while
        that leaves it over the limit, so that no batch the broker gets is."""
        records = batch.records
        if records.size() <= self.max_request_size or records.count < 2:
            self.ready.append(batch)
            return
        sealed = records.seal(self.codec, self.level)
        self.observe(batch.topic, records)
        if records.compressed_size() <= self.max_request_size:
            if sealed:  # its buffer is free for the next batch (a replay builds the payload)
                self.recycle(batch)
            self.ready.append(batch)
            return
        first, second = records.split()
        self.splits += 1
        parts = []
        size = batch.size
        for part in (first, second):
            piece = Batch(batch.topic, batch.partition, batch.records.max_size, batch.where)
            piece.records = part
            piece.size = size * part.count // records.count
            parts.append(piece)
        parts[1].size = size - parts[0].size
        window = self.window
        at = window.index(batch)
        window[at] = parts[1]
        window.insert(at, parts[0])
        self.recycle(batch)
        for piece in parts:
            self.close(piece)

    def observe(self, topic: str, records: RecordBatch) -> None:
        """Learn the topic's compression ratio from a batch compressed (:meth:`batch_limit`):
        a worse one at once, a better one half way."""
        if self.max_batch_size <= self.max_request_size:
            return
        size = records.size() - HEADER_SIZE
        if size <= 0:
            return
        ratio = (records.compressed_size() - HEADER_SIZE) / size
        old = self.ratios.get(topic, 1.0)
        self.ratios[topic] = ratio if ratio >= old else (old + ratio) / 2

    def recycle(self, batch: Batch) -> None:
        """``batch`` is built or compressed (a replay builds it again from those bytes, or
        from the compressed records): keep its buffer for the next batch that follows a full
        or a large one (up to ``spare_limit``). A large
        buffer is mapped on its own (cdcd.runtime), and each of a fresh one's pages costs a
        page fault as it is first written: a stream of full batches writes into the same few
        buffers instead, also while a Kafka transaction holds its batches until the commit."""
        records = batch.records
        if records.size() <= self.max_request_size:  # a larger one was, as it closed
            self.observe(batch.topic, records)
        buffer = records.release()
        if len(self.spare) < self.spare_limit and len(buffer) >= self.large:
            self.spare.append(buffer)

    def _new_batch(
        self, topic: str, partition: int, where: Where, buffer: bytearray | None = None
    ) -> Batch:
        batch = Batch(topic, partition, self.batch_limit(topic), where, buffer)
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
        """The headers and timestamp every record of the event's transaction shares."""
        self._txn_commit_lsn = event.commit_lsn
        self._head = header(_LSN_NAME, b"%d" % event.commit_lsn)
        self._tails = {}
        self._xid = event.xid
        self._header_count = 3 if event.xid is None else 4
        self._ts = pg_to_unix_us(event.commit_time) // 1000

    def _tail_for(self, op: str) -> bytes:
        """The xid header (left out without an xid) and the op header, encoded."""
        op_header = _OP_HEADERS.get(op)
        if op_header is None:
            op_header = encode_headers([("cdcd.op", op.encode())])
        xid = self._xid
        tail = op_header
        if xid is not None:
            tail = header(_XID_NAME, b"%d" % xid) + op_header
        self._tails[op] = tail
        return tail
