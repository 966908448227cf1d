"""The Kafka sink: every change event becomes a record on a per-table topic (README "Kafka sink").

Records::

    topic   <prefix>.<schema>.<table>     (or ``routing["schema.table"]``); prefix = pipeline name
    key     event.key_json()              JSON object of the key columns; null without a key
    value   event.value_json()            the Debezium-compatible event (README "Change events")
    headers cdcd.commit_lsn, cdcd.seq, cdcd.xid, cdcd.op   (ASCII decimal; op as its letter;
                                          cdcd.xid is left out when the event has no xid)
            __debezium.newkey             on the delete of a key change: the new key as JSON
            __debezium.oldkey             on the create of a key change: the old key as JSON
                                          (Debezium's headers; the value's source.new_key /
                                          source.old_key hold the same objects)
    after a delete with a key: a tombstone (same key and headers, null value) unless
    ``tombstones: false``

Logical decoding messages go to ``<prefix>.message`` keyed by ``{"prefix": <message prefix>}``
(Debezium's key, ``event.key_json()``), so messages of one prefix stay in order. With
``transaction_topic: true``, BEGIN and END markers in Debezium's transaction-metadata shape
(plus ``commit_lsn`` and ``end_lsn``, as in the file sink's ``_transactions``) go to
``<prefix>.transaction`` keyed by ``{"id": "<xid>:<commit_lsn>"}``; END carries
``event_count`` and per-table ``data_collections`` counts (logical messages not counted).

Batches. The sink builds Kafka record batches itself, one open batch per topic-partition
(aiokafka's ``create_batch``/``send_batch``), instead of one ``send()`` per record: that path
costs a coroutine, a future and a partitioner call per record. A record's partition is what
Kafka's default partitioner gives its key (:mod:`cdcd.sinks.kafka_partition`: murmur2 of the
key bytes, made positive, modulo the topic's partition count, learnt once per topic); a keyless
record goes to a random partition. A batch is closed when the next record does not fit in
``max_batch_size`` (a larger record goes alone in its batch). One submitter task hands batches
to the producer in the order they were closed: closed ones at once, open ones ``linger_ms``
after the oldest was started (at once while ``flush`` waits). ``send_batch`` waits while the
producer still holds an unsent batch of that partition, so open batches grow meanwhile.

Ordering. One key always lands in one partition, and batches of a partition are handed over in
order. aiokafka keeps at most one produce request in flight per broker connection and mutes a
partition while its batch is in flight; a batch that fails with a retriable error is put back
at the *front* of its partition's queue. So records of a partition reach the broker in order
even without idempotence. The one exception is a batch that expires (it waited longer than
``request_timeout``, e.g. during a long outage): aiokafka fails it while later batches may still
succeed. The sink then *replays*: it waits until nothing is in flight and resends, in the
original order, every batch from the oldest unacknowledged one onward (including later batches
that did arrive). A consumer may therefore see a suffix twice, each copy carrying the same
``(commit_lsn, seq)``; deduplicating on it restores commit order. That is the at-least-once
contract of :mod:`cdcd.sinks.base`.

Durability. Batches and transaction ends form one ordered window (a batch takes its place when
its first record is added). It advances from the front while the front batch is acknowledged
by the broker (``acks: all`` by default); passing a transaction end marks that transaction's
``end_lsn`` durable. Every record of a transaction sits in a batch started before its end, so
``durable_lsn`` never passes a transaction with an unacknowledged record, nor one after it. The
window is bounded by ``buffer_records`` and ``buffer_bytes`` (key and value bytes plus 64 per
record; what a record really holds in memory is about three times that, which is what
``buffered_bytes`` reports; ``buffer_bytes`` is lowered to a third of the sink's
``memory_budget``, its share of ``buffer.memory_limit``, when that is smaller): ``write`` waits for
acknowledgements beyond them, which blocks the pipeline while the broker is away instead of
growing memory.

Failures. aiokafka's exceptions are translated in :meth:`KafkaSink._translate` only. Retriable
ones (broker unavailable, timeouts, leader changes) are retried here with backoff, forever,
holding the pipeline; definite ones (a record too large, authorization, a missing topic with
``create_topics: false``, an idempotent producer on a broker without InitProducerId) raise
:class:`DefiniteSinkError` naming the topic and the position, and nothing at or after that
record becomes durable.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
import structlog
from aiokafka import AIOKafkaProducer
from aiokafka import errors as kerrors
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.producer.message_accumulator import BatchBuilder
from aiokafka.record.default_records import DefaultRecordBatchBuilder

from cdcd.errors import ConfigError, DefiniteSinkError, SinkError, TransientSinkError
from cdcd.lsn import pg_to_unix_us
from cdcd.sinks.base import Sink, SinkContext
from cdcd.sinks.kafka_client import (
    KafkaSinkConfig,
    Record,
    Where,
    client_kwargs,
    compression_available,
    translate_error,
)
from cdcd.sinks.kafka_partition import partition_for

if TYPE_CHECKING:
    from cdcd.assembler.transaction import Transaction
    from cdcd.events import ChangeEvent

log = structlog.get_logger(__name__)

_TOPIC_ALREADY_EXISTS = 36


_RECORD_OVERHEAD = 64  # what a record counts for buffer_bytes beyond its key and value
_OP_HEADERS = {op: ("cdcd.op", op.encode()) for op in "crudtm"}
#: the header naming the other key of a key change, by the source field that holds it
_LINK_HEADERS = {"new_key": "__debezium.newkey", "old_key": "__debezium.oldkey"}


@dataclass(slots=True, eq=False)
class _Batch:
    """Records for one topic-partition, sent to the broker as one record batch.

    ``builder`` is aiokafka's :class:`BatchBuilder`; ``future`` is set once the batch is handed
    to the producer (``send_batch``) and resolves when the broker acknowledged all of it."""

    topic: str
    partition: int
    builder: BatchBuilder
    records: list[Record] = field(default_factory=list)
    size: int = 0
    future: asyncio.Future[Any] | None = None
    error: SinkError | None = None  # handing it to the producer failed definitely

    def add(self, ts: int, key: bytes | None, value: bytes | None, headers: Any) -> bool:
        """Append one record to the batch; False when it is full (aiokafka's public
        ``BatchBuilder.append``: its internals are not relied on)."""
        return self.builder.append(timestamp=ts, key=key, value=value, headers=headers) is not None


class KafkaSink(Sink):
    """Writes change events to Kafka; see the module docstring for records and guarantees."""

    type_name = "kafka"
    Config = KafkaSinkConfig

    def __init__(self, config: KafkaSinkConfig, context: SinkContext) -> None:
        super().__init__()
        self.config = config
        self.context = context
        self.prefix = config.topic_prefix or context.name
        self.message_topic = config.message_topic or f"{self.prefix}.message"
        self.transaction_topic = f"{self.prefix}.transaction"
        if not compression_available(config.compression):
            raise ConfigError(
                f"sinks.kafka.compression: {config.compression!r} needs the cramjam package "
                "(pip install 'aiokafka[lz4]'); or choose gzip or none"
            )
        self._producer: AIOKafkaProducer | None = None
        self._admin: AIOKafkaAdminClient | None = None
        self._partitions: dict[str, list[int]] = {}  # known topics: their partitions, sorted
        # by (schema, table): (topic, "schema.table"); (None, None): (message topic, None)
        self._topics: dict[tuple[str | None, str | None], tuple[str, str | None]] = {}
        self._window: deque[_Batch | int] = deque()  # batches and transaction end LSNs
        self._window_bytes = 0
        self._window_records = 0
        self._open: dict[tuple[str, int], _Batch] = {}  # batches still taking records
        self._open_since = 0.0  # loop time the oldest open batch was started
        self._ready: deque[_Batch] = deque()  # closed batches, to hand over in this order
        self._flushing = 0  # flush() calls waiting: hand open batches over without lingering
        self._changed = asyncio.Event()  # the window moved or failed
        self._wake = asyncio.Event()  # work for the submitter
        self._send_lock = asyncio.Lock()  # one of submitter / replay hands batches over
        self._failure: SinkError | None = None
        self._submitter: asyncio.Task[None] | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._txn_counts: dict[str, int] = {}
        self._txn_commit_lsn = -1  # the transaction whose header values are cached below
        # (commit_lsn header, [xid header] or [], timestamp ms)
        self._txn_header_values: tuple[tuple[str, bytes], list[tuple[str, bytes]], int] = (
            ("cdcd.commit_lsn", b""),
            [],
            0,
        )
        self._stats = {"records_sent": 0, "records_acked": 0, "send_retries": 0, "replays": 0}

    # --- lifecycle -----------------------------------------------------------------------

    def _client_kwargs(self) -> dict[str, Any]:
        return client_kwargs(self.config, self.context)

    def _new_producer(self) -> AIOKafkaProducer:
        c = self.config
        return AIOKafkaProducer(
            **self._client_kwargs(),
            acks=c.acks,
            enable_idempotence=c.idempotence,
            compression_type=None if c.compression == "none" else c.compression,
            linger_ms=0,  # the sink lingers itself, before it hands a batch over
            max_batch_size=c.max_batch_size,
            max_request_size=c.max_request_size,
        )

    async def start(self) -> None:
        """Connect, retrying with backoff while the broker is unreachable; after
        ``give_up_after`` seconds (if set) raise DefiniteSinkError."""
        started = time.monotonic()
        delay = self.config.retry_backoff
        while True:
            producer = self._new_producer()
            admin = AIOKafkaAdminClient(**self._client_kwargs())
            try:
                await producer.start()
                await admin.start()
            except Exception as exc:
                with contextlib.suppress(Exception):
                    await producer.stop()
                with contextlib.suppress(Exception):
                    await admin.close()
                err = self._translate(exc, starting=True)
                if not isinstance(err, TransientSinkError):
                    raise err from exc
                waited = time.monotonic() - started
                give_up = self.config.give_up_after
                if give_up is not None and waited >= give_up:
                    raise DefiniteSinkError(
                        f"kafka: cannot reach {self._bootstrap()} after retrying for "
                        f"{waited:.1f}s (give_up_after {give_up:g}s): {err}"
                    ) from exc
                log.warning("kafka_unreachable", bootstrap=self._bootstrap(), error=str(err))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
                continue
            self._producer, self._admin = producer, admin
            self._submitter = asyncio.get_running_loop().create_task(self._submit_loop())
            log.info("kafka_connected", bootstrap=self._bootstrap(), prefix=self.prefix)
            return

    async def close(self) -> None:
        for task in (self._replay_task, self._submitter):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        self._submitter = None
        producer, self._producer = self._producer, None
        admin, self._admin = self._admin, None
        if producer is not None:
            with contextlib.suppress(Exception):
                await producer.stop()
        if admin is not None:
            with contextlib.suppress(Exception):
                await admin.close()

    def _bootstrap(self) -> str:
        servers = self.config.bootstrap_servers
        return servers if isinstance(servers, str) else ",".join(servers)

    # --- the pipeline's calls ----------------------------------------------------------------

    async def begin(self, txn: Transaction) -> None:
        self._raise_failure()
        self._txn_counts = {}
        if self._markers_for(txn):
            await self._add_marker(txn, "BEGIN")

    async def write(self, events: Sequence[ChangeEvent]) -> None:
        self._raise_failure()
        config = self.config
        tombstones = config.tombstones
        count = config.transaction_topic
        counts = self._txn_counts
        topics = self._topics
        partitions = self._partitions
        op_headers = _OP_HEADERS
        add = self._add
        buffer_bytes = self._buffer_bytes
        for event in events:
            op = event.op
            route = topics.get((event.schema, event.table))
            if route is None:
                route = self._route_of(event)
            topic, name = route
            if count and name is not None:
                counts[name] = counts.get(name, 0) + 1
            if topic not in partitions:
                await self._prepare_topic(topic, (event.commit_lsn, event.seq, event.lsn, ""))
            if event.commit_lsn != self._txn_commit_lsn:
                self._cache_txn_headers(event)
            lsn_header, xid_headers, ts = self._txn_header_values
            headers = [lsn_header, ("cdcd.seq", b"%d" % event.seq), *xid_headers]
            headers.append(op_headers.get(op) or ("cdcd.op", op.encode()))
            if op == "d" or op == "c":
                link = event.key_link()
                if link is not None:  # a key change: Debezium's header linking the pair
                    headers.append((_LINK_HEADERS[link[0]], orjson.dumps(link[1])))
            key = event.key_json()  # {"prefix": ...} for logical messages
            where = (event.commit_lsn, event.seq, event.lsn, "")
            add(topic, key, event.value_json(), headers, ts, where)
            if op == "d" and key is not None and tombstones:
                where = (event.commit_lsn, event.seq, event.lsn, " tombstone")
                add(topic, key, None, headers, ts, where)
            if self._window_records >= config.buffer_records or self._window_bytes >= buffer_bytes:
                await self._wait_for_room()
        if self._ready:
            await asyncio.sleep(0)  # let the submitter hand the closed batches over

    async def commit(self, txn: Transaction) -> None:
        self._raise_failure()
        if self._markers_for(txn):
            await self._add_marker(txn, "END")
        self._window.append(txn.end_lsn)
        self._pump()

    async def flush(self) -> None:
        """Wait until the broker acknowledged every record handed over. After a definite
        failure, first let what precedes the failing record become durable, then raise."""
        self._flushing += 1
        self._wake.set()
        try:
            while True:
                if not self._window:
                    self._raise_failure()
                    return
                if self._failure is not None and self._head_is_stuck():
                    raise self._failure
                self._changed.clear()
                await self._changed.wait()
        finally:
            self._flushing -= 1

    def _head_is_stuck(self) -> bool:
        head = self._window[0]
        if isinstance(head, int):
            return False
        if head.error is not None:
            return True
        fut = head.future
        return fut is not None and fut.done() and (fut.cancelled() or fut.exception() is not None)

    def stats(self) -> dict[str, Any]:
        return {
            **self._stats,
            "window_records": self._window_records,
            "window_bytes": self._window_bytes,
        }

    # --- building records --------------------------------------------------------------------

    def _route_of(self, event: ChangeEvent) -> tuple[str, str | None]:
        """(topic, "schema.table") of an event's table, (message topic, None) for a logical
        message; remembered per table."""
        if event.schema is None:
            route: tuple[str, str | None] = (self.message_topic, None)
        else:
            name = f"{event.schema}.{event.table}"
            route = (self.config.routing.get(name) or f"{self.prefix}.{name}", name)
        self._topics[(event.schema, event.table)] = route
        return route

    def _cache_txn_headers(self, event: ChangeEvent) -> None:
        """The header tuples every record of the event's transaction shares."""
        self._txn_commit_lsn = event.commit_lsn
        xid = [] if event.xid is None else [("cdcd.xid", b"%d" % event.xid)]
        ts = pg_to_unix_us(event.commit_time) // 1000
        self._txn_header_values = (("cdcd.commit_lsn", b"%d" % event.commit_lsn), xid, ts)

    def _markers_for(self, txn: Transaction) -> bool:
        return self.config.transaction_topic and txn.kind != "message"

    async def _add_marker(self, txn: Transaction, status: str) -> None:
        txn_id = f"{txn.xid}:{txn.commit_lsn}"
        value: dict[str, Any] = {
            "status": status,
            "id": txn_id,
            "event_count": None,
            "data_collections": None,
            "ts_ms": pg_to_unix_us(txn.commit_time) // 1000,
            "commit_lsn": txn.commit_lsn,
            "end_lsn": txn.end_lsn,
        }
        if status == "END":
            value["event_count"] = sum(self._txn_counts.values())
            value["data_collections"] = [
                {"data_collection": name, "event_count": count}
                for name, count in self._txn_counts.items()
            ]
        headers = [
            ("cdcd.commit_lsn", str(txn.commit_lsn).encode()),
            ("cdcd.xid", str(txn.xid).encode()),
        ]
        where = f"transaction {txn_id} {status}"
        if self.transaction_topic not in self._partitions:
            await self._prepare_topic(self.transaction_topic, where)
        key = orjson.dumps({"id": txn_id})
        self._add(self.transaction_topic, key, orjson.dumps(value), headers, value["ts_ms"], where)
        await self._wait_for_room()

    # --- batches and the window ----------------------------------------------------------------

    def _add(
        self,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: list[tuple[str, bytes]],
        ts: int,
        where: Where,
    ) -> None:
        """Append one record to its partition's open batch (Kafka's default partitioning)."""
        partitions = self._partitions[topic]
        if key is None:
            partition = random.choice(partitions)
        elif len(partitions) == 1:
            partition = partitions[0]
        else:
            partition = partitions[partition_for(key, len(partitions))]
        size = (len(key) if key else 0) + (len(value) if value else 0) + _RECORD_OVERHEAD
        if size + 1024 > self.config.max_request_size:  # Kafka's estimate adds < 1 KiB
            self._check_size(topic, (key, value, headers, ts, where))
        tp = (topic, partition)
        batch = self._open.get(tp) or self._new_batch(topic, partition)
        if not batch.add(ts, key, value, headers):
            del self._open[tp]  # full: hand it over, start the next one
            self._ready.append(batch)
            self._wake.set()
            batch = self._new_batch(topic, partition)
            batch.add(ts, key, value, headers)
        batch.records.append((key, value, headers, ts, where))
        batch.size += size
        self._window_records += 1
        self._window_bytes += size

    def _check_size(self, topic: str, record: Record) -> None:
        key, value, headers, _, _ = record
        size = DefaultRecordBatchBuilder.estimate_size_in_bytes(key, value, headers)
        if size > self.config.max_request_size:
            err = self._translate(
                kerrors.MessageSizeTooLargeError(size), topic=topic, record=record
            )
            self._failure = err
            self._changed.set()
            raise err

    def _new_batch(self, topic: str, partition: int) -> _Batch:
        assert self._producer is not None, "KafkaSink.start() was not called"
        batch = _Batch(topic, partition, self._producer.create_batch())
        if not self._open:
            self._open_since = asyncio.get_running_loop().time()
            self._wake.set()
        self._open[(topic, partition)] = batch
        self._window.append(batch)
        return batch

    @property
    def _buffer_bytes(self) -> int:
        """``buffer_bytes``, or less when the sink's ``memory_budget`` is smaller (a record
        holds about three times its counted bytes in memory)."""
        budget = self.memory_budget
        limit = self.config.buffer_bytes
        return limit if budget is None else max(1024, min(limit, budget // 3))

    def buffered_bytes(self) -> int:
        return 3 * self._window_bytes

    async def _wait_for_room(self) -> None:
        c = self.config
        while True:
            self._raise_failure()
            if self._window_records < c.buffer_records and self._window_bytes < self._buffer_bytes:
                return
            self._changed.clear()
            await self._changed.wait()

    async def _submit_loop(self) -> None:
        """Hand batches to the producer: closed ones at once, open ones after ``linger_ms``
        (at once while ``flush`` waits). ``send_batch`` waits while the producer still holds
        an unsent batch of the partition, so open batches grow meanwhile."""
        loop = asyncio.get_running_loop()
        linger = self.config.linger_ms / 1000
        while True:
            if not self._ready:
                if not self._open:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                wait = self._open_since + linger - loop.time()
                if wait > 0 and not self._flushing:
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), wait)
                    continue
                self._ready.extend(self._open.values())
                self._open.clear()
            async with self._send_lock:
                while self._ready:
                    await self._submit(self._ready[0])
                    self._ready.popleft()

    async def _submit(self, batch: _Batch) -> None:
        """Hand one batch to the producer, retrying while the broker is unavailable. A definite
        failure is recorded on the batch (nothing from it on becomes durable)."""
        assert self._producer is not None, "KafkaSink.start() was not called"
        delay = self.config.retry_backoff
        while True:
            try:
                if batch.topic not in self._partitions:
                    await self._learn_topic(batch.topic)
                future = await self._producer.send_batch(
                    batch.builder, batch.topic, partition=batch.partition
                )
            except Exception as exc:
                err = self._translate(exc, topic=batch.topic, record=batch.records[0])
                if not isinstance(err, TransientSinkError):
                    batch.error = err
                    self._failure = self._failure or err
                    self._changed.set()
                    return
                self._stats["send_retries"] += 1
                log.warning("kafka_send_retry", topic=batch.topic, error=str(err))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            batch.future = future
            future.add_done_callback(self._on_delivery)
            self._stats["records_sent"] += len(batch.records)
            return

    async def _prepare_topic(self, topic: str, where: Where) -> None:
        """Create (or check) ``topic`` and learn its partitions, retrying while the broker is
        unavailable."""
        delay = self.config.retry_backoff
        while True:
            self._raise_failure()
            try:
                await self._learn_topic(topic)
                return
            except Exception as exc:
                err = self._translate(exc, topic=topic, record=(None, None, [], 0, where))
                if not isinstance(err, TransientSinkError):
                    self._failure = err
                    self._changed.set()
                    raise err from exc
                self._stats["send_retries"] += 1
                log.warning("kafka_send_retry", topic=topic, error=str(err))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _learn_topic(self, topic: str) -> None:
        """Create (or check) ``topic``, then remember its partitions."""
        assert self._admin is not None and self._producer is not None
        if self.config.create_topics:
            response = await self._admin.create_topics(
                [NewTopic(topic, self.config.partitions, self.config.replication_factor)]
            )
            for _name, code, *_ in response.topic_errors:
                if code not in (0, _TOPIC_ALREADY_EXISTS):
                    raise kerrors.for_code(code)(f"creating topic {topic!r}")
        else:
            for info in await self._admin.describe_topics([topic]):
                if info["error_code"]:
                    raise kerrors.for_code(info["error_code"])(f"topic {topic!r}")
        self._partitions[topic] = sorted(await self._producer.partitions_for(topic))

    def _on_delivery(self, _future: asyncio.Future[Any]) -> None:
        self._pump()

    def _pump(self) -> None:
        """Advance the window over acknowledged batches; mark passed transaction ends durable."""
        window = self._window
        moved = False
        while window:
            head = window[0]
            if isinstance(head, int):
                self._mark_durable(head)
            else:
                fut = head.future
                if fut is None or not fut.done():
                    break
                exc = fut.exception() if not fut.cancelled() else asyncio.CancelledError()
                if exc is not None:
                    self._delivery_failed(head, exc)
                    break
                self._window_records -= len(head.records)
                self._window_bytes -= head.size
                self._stats["records_acked"] += len(head.records)
            window.popleft()
            moved = True
        if moved:
            self._changed.set()

    def _delivery_failed(self, head: _Batch, exc: BaseException) -> None:
        if self._failure is not None or self._replay_task is not None:
            return
        err = self._translate(exc, topic=head.topic, record=head.records[0])
        if isinstance(err, TransientSinkError):
            log.warning("kafka_delivery_failed_replaying", topic=head.topic, error=str(err))
            self._replay_task = asyncio.get_running_loop().create_task(self._replay())
        else:
            self._failure = err
            self._changed.set()

    async def _replay(self) -> None:
        """Resend, in order, every batch from the oldest unacknowledged one onward."""
        assert self._producer is not None
        try:
            async with self._send_lock:
                handed = [b for b in self._window if isinstance(b, _Batch) and b.future]
                futures = [b.future for b in handed if b.future is not None]
                await asyncio.gather(*futures, return_exceptions=True)
                self._stats["replays"] += 1
                self._partitions.clear()  # the broker may have come back without the topics
                for batch in handed:
                    batch.future = None
                for batch in handed:
                    batch.builder = self._producer.create_batch()
                    for key, value, headers, ts, _ in batch.records:
                        added = batch.add(ts, key, value, headers)
                        assert added, "a replayed batch holds what it held before"
                    await self._submit(batch)
        except Exception as exc:  # a bug; make it visible to the pipeline
            self._failure = DefiniteSinkError(f"kafka: replay failed: {exc!r}")
        finally:
            self._replay_task = None
            self._changed.set()
        self._pump()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _translate(
        self,
        exc: BaseException,
        *,
        topic: str | None = None,
        record: Record | None = None,
        starting: bool = False,
    ) -> SinkError:
        return translate_error(
            exc, self.config, self._bootstrap(), topic=topic, record=record, starting=starting
        )
