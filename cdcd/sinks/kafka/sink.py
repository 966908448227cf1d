"""The Kafka sink: every change event becomes a record on a per-table topic (docs/kafka.md).

Records::

    topic   <prefix>.<schema>.<table>     (or ``routing["schema.table"]``); prefix = pipeline name
    key     event.key_json()              JSON object of the key columns; null without a key
    value   event.value_json()            the Debezium-compatible event (docs/events.md)
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

Batches. The sink builds Kafka record batches itself, one open batch per topic-partition, and
hands each to aiokafka whole (``send_batch``), instead of one ``send()`` per record: that path
costs a coroutine, a future and a partitioner call per record. The per-record work is compiled
with mypyc: :mod:`cdcd.sinks.kafka.batches` makes records of events and picks their batch,
:mod:`cdcd.sinks.kafka.recordbatch` writes them into the batch's buffer in Kafka's record
format (v2), compressed and checksummed when the batch is sent; no object is kept per record.
A record's partition is what Kafka's default partitioner gives its key
(:mod:`cdcd.sinks.kafka.partition`: murmur2 of the key bytes, made positive, modulo the topic's
partition count, learnt once per topic); a keyless record goes to a random partition. A batch is closed when the next record does not fit in
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
record; a batch's buffer, grown by doubling, holds up to twice its records' bytes, and
``buffered_bytes`` reports three times the counted bytes; ``buffer_bytes`` is lowered to a third of the sink's
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
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import orjson
import structlog
from aiokafka import AIOKafkaProducer
from aiokafka import errors as kerrors
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.conn import create_conn

from cdcd.errors import (
    ConfigError,
    DefiniteSinkError,
    SinkError,
    SinkSetupError,
    TransientSinkError,
)
from cdcd.lsn import pg_to_unix_us
from cdcd.sinks.base import Sink, SinkContext, run_events
from cdcd.sinks.kafka.batches import Batch, Batches
from cdcd.sinks.kafka.client import (
    BuiltBatch,
    KafkaSinkConfig,
    client_kwargs,
    compression_available,
    translate_error,
)
from cdcd.sinks.kafka.position import TOPIC_CONFIG, Position, read_position
from cdcd.sinks.kafka.recordbatch import CODECS, Record, Where, encode_headers, record_size

if TYPE_CHECKING:
    from cdcd.assembler.transaction import Transaction
    from cdcd.events import ChangeEvent

log = structlog.get_logger(__name__)

_TOPIC_ALREADY_EXISTS = 36


class KafkaSink(Sink):
    """Writes change events to Kafka; see the module docstring for records and guarantees."""

    type_name = "kafka"
    writes_json = True
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
        self._batches = Batches(
            prefix=self.prefix,
            message_topic=self.message_topic,
            routing=config.routing,
            tombstones=config.tombstones,
            count_tables=config.transaction_topic,
            max_batch_size=config.max_batch_size,
            max_request_size=config.max_request_size,
            check_size=self._check_size,
        )
        self._partitions = self._batches.partitions  # known topics: their partitions, sorted
        self._window = self._batches.window  # batches and transaction end LSNs
        self._flushing = 0  # flush() calls waiting: hand open batches over without lingering
        self._changed = asyncio.Event()  # the window moved or failed
        self._send_lock = asyncio.Lock()  # one of submitter / replay hands batches over
        self._failure: SinkError | None = None
        self._submitter: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._stats = {"records_sent": 0, "records_acked": 0, "send_retries": 0, "replays": 0}
        # exactly once (docs/kafka.md): the window is released only by a Kafka commit
        self.exactly_once = config.exactly_once
        self.transactional_id = config.transactional_id or f"cdcd-{context.name}"
        self.position_topic = config.position_topic or f"{self.prefix}.cdcd-positions"
        self._resume: Position | None = None  # what Kafka held at the start, until passed
        self._skip_txn = False  # the current transaction is in Kafka already
        self._skip_seq = -1  # its events up to this seq are in Kafka already
        self._position: Position | None = None  # the last event added (exactly once)
        self._stats["kafka_commits"] = 0

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
            **(
                {
                    "transactional_id": self.transactional_id,
                    "transaction_timeout_ms": int(c.transaction_timeout * 1000),
                }
                if self.exactly_once
                else {}
            ),
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
                if isinstance(err, TransientSinkError):
                    err = await self._check_login() or err
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
            if self.exactly_once:
                await self._start_exactly_once()
            self._submitter = asyncio.get_running_loop().create_task(self._submit_loop())
            self._watcher = asyncio.get_running_loop().create_task(self._watch())
            log.info("kafka_connected", bootstrap=self._bootstrap(), prefix=self.prefix)
            return

    async def _check_login(self) -> SinkError | None:
        """The error of a refused SASL login, which aiokafka's bootstrap reports only as
        "unable to bootstrap": one direct connection to each bootstrap server tells."""
        c = self.config
        if not c.security_protocol.startswith("SASL"):
            return None
        kwargs = self._client_kwargs()
        servers = [c.bootstrap_servers] if isinstance(c.bootstrap_servers, str) else []
        servers = servers or list(c.bootstrap_servers)
        for server in (s.strip() for entry in servers for s in entry.split(",")):
            host, _, port = server.rpartition(":")
            try:
                conn = await create_conn(
                    host,
                    int(port),
                    request_timeout_ms=kwargs["request_timeout_ms"],
                    ssl_context=kwargs.get("ssl_context"),
                    security_protocol=c.security_protocol,
                    sasl_mechanism=kwargs["sasl_mechanism"],
                    sasl_plain_username=kwargs["sasl_plain_username"],
                    sasl_plain_password=kwargs.get("sasl_plain_password"),
                )
            except (kerrors.SaslAuthenticationFailed, kerrors.AuthenticationFailedError) as exc:
                return self._translate(exc, starting=True)
            except Exception:  # unreachable: that is what the caller reports
                continue
            conn.close()
        return None

    async def _start_exactly_once(self) -> None:
        """Create (or check) the position topic, read what Kafka holds (the producer's start
        aborted what a previous one left open), open the first Kafka transaction."""
        assert self._producer is not None
        await self._prepare_topic(self.position_topic, "the position topic")
        delay = self.config.retry_backoff
        while True:
            try:
                self._resume = await read_position(
                    self._client_kwargs(),
                    self.position_topic,
                    self.transactional_id.encode(),
                    int(self.config.request_timeout * 1000),
                )
                break
            except Exception as exc:
                err = self._translate(exc, topic=self.position_topic, starting=True)
                if not isinstance(err, TransientSinkError):
                    raise err from exc
                log.warning("kafka_position_retry", topic=self.position_topic, error=str(err))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        log.info(
            "kafka_exactly_once",
            transactional_id=self.transactional_id,
            position_topic=self.position_topic,
            resume=None if self._resume is None else str(self._resume),
        )
        await self._producer.begin_transaction()

    async def close(self) -> None:
        for task in (self._replay_task, self._submitter, self._watcher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        self._submitter = self._watcher = None
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
        self._batches.txn_counts = {}
        resume = self._resume
        if resume is not None:
            held = resume.holds(txn.commit_lsn)
            if held == "all":
                self._skip_txn = True
                return
            if held == "part":
                self._skip_seq = resume.seq  # its BEGIN marker is in Kafka too
                return
            self._resume = None
        if self.exactly_once:
            self._position = Position(txn.commit_lsn, -1, False)
        if self._markers_for(txn):
            await self._add_marker(txn, "BEGIN")

    async def write(self, events: Sequence[ChangeEvent]) -> None:
        self._raise_failure()
        if self._skip_txn:
            return
        if self._skip_seq >= 0:
            events = [e for e in events if e.seq > self._skip_seq]
        batches = self._batches
        batches.record_limit = self.config.buffer_records
        batches.byte_limit = self._buffer_bytes
        i = 0
        while i < len(events):
            i = batches.add_events(events, i)
            if self.exactly_once and i:
                # the last event added: a full window commits the Kafka transaction below, in
                # the middle of ``events``, and its position must not claim what follows
                last = events[i - 1]
                self._position = Position(last.commit_lsn, last.seq, False)
            topic = batches.missing_topic
            if topic is not None:
                batches.missing_topic = None
                event = events[i]
                await self._prepare_topic(topic, (event.commit_lsn, event.seq, event.lsn, ""))
            elif batches.full():
                await self._wait_for_room()
        if batches.ready:
            await asyncio.sleep(0)  # let the submitter hand the closed batches over

    async def write_transactions(
        self, run: Sequence[tuple[Transaction, Sequence[Sequence[ChangeEvent]]]]
    ) -> None:
        """A run of small transactions (docs/sinks.md): their records added in one pass, and
        the run durable once all of them are acknowledged. Call by call with
        ``transaction_topic`` (a marker before and after each transaction)."""
        if self.config.transaction_topic or self._resume is not None:
            await super().write_transactions(run)
            return
        self._raise_failure()
        events = run_events(run)
        if events:
            await self.write(events)
        self._raise_failure()
        last = run[-1][0]
        if self.exactly_once:
            seq = events[-1].seq if events and events[-1].commit_lsn == last.commit_lsn else -1
            self._position = Position(last.commit_lsn, seq, True, last.end_lsn)
        self._window.append(last.end_lsn)
        self._pump()

    async def commit(self, txn: Transaction) -> None:
        self._raise_failure()
        if self._skip_txn:  # in Kafka already: durable there
            self._skip_txn = False
            if not self._window:
                self._mark_durable(txn.end_lsn)
            else:
                self._window.append(txn.end_lsn)
            return
        self._skip_seq = -1
        self._resume = None
        if self._markers_for(txn):
            await self._add_marker(txn, "END")
        if self.exactly_once:
            seq = self._position.seq if self._position is not None else -1
            self._position = Position(txn.commit_lsn, seq, True, txn.end_lsn)
        self._window.append(txn.end_lsn)
        self._pump()

    async def flush(self) -> None:
        """Wait until the broker acknowledged every record handed over. After a definite
        failure, first let what precedes the failing record become durable, then raise.
        Exactly once: commit the Kafka transaction."""
        if self.exactly_once:
            await self._commit_kafka()
            return
        self._flushing += 1
        self._batches.wake.set()
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
            "window_records": self._batches.window_records,
            "window_bytes": self._batches.window_bytes,
        }

    # --- building records --------------------------------------------------------------------

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
            "end_lsn": txn.end_lsn if txn.ends else None,  # a first part does not know it
        }
        if status == "END":
            counts = self._batches.txn_counts
            value["event_count"] = sum(counts.values())
            value["data_collections"] = [
                {"data_collection": name, "event_count": count} for name, count in counts.items()
            ]
        headers = encode_headers(
            [("cdcd.commit_lsn", b"%d" % txn.commit_lsn), ("cdcd.xid", b"%d" % txn.xid)]
        )
        where = f"transaction {txn_id} {status}"
        if self.transaction_topic not in self._partitions:
            await self._prepare_topic(self.transaction_topic, where)
        key, ts = orjson.dumps({"id": txn_id}), value["ts_ms"]
        self._batches.add(
            self.transaction_topic, ts, key, orjson.dumps(value), headers, -1, b"", 2, where
        )
        await self._wait_for_room()

    # --- batches and the window ----------------------------------------------------------------

    def _check_size(self, topic: str, record: Record, headers: bytes, where: Where) -> None:
        key, value = record
        size = record_size(key, value, headers)
        if size > self.config.max_request_size:
            error = kerrors.MessageSizeTooLargeError(size)
            err = self._translate(error, topic=topic, record=record, where=where)
            self._failure = err
            self._changed.set()
            raise err

    @property
    def _buffer_bytes(self) -> int:
        """``buffer_bytes``, or less when the sink's ``memory_budget`` is smaller (a record
        holds about three times its counted bytes in memory)."""
        budget = self.memory_budget
        limit = self.config.buffer_bytes
        return limit if budget is None else max(1024, min(limit, budget // 3))

    def buffered_bytes(self) -> int:
        return 3 * self._batches.window_bytes

    async def _wait_for_room(self) -> None:
        batches = self._batches
        while True:
            self._raise_failure()
            batches.record_limit = self.config.buffer_records
            batches.byte_limit = self._buffer_bytes
            if not batches.full():
                return
            if self.exactly_once:
                await self._commit_kafka()
                continue
            self._changed.clear()
            await self._changed.wait()

    async def _submit_loop(self) -> None:
        """Hand batches to the producer: closed ones at once, open ones after ``linger_ms``
        (at once while ``flush`` waits). ``send_batch`` waits while the producer still holds
        an unsent batch of the partition, so open batches grow meanwhile."""
        loop = asyncio.get_running_loop()
        linger = self.config.linger_ms / 1000
        batches = self._batches
        ready, wake = batches.ready, batches.wake
        while True:
            if not ready:
                if not batches.open:
                    wake.clear()
                    await wake.wait()
                    continue
                wait = batches.open_since + linger - loop.time()
                if wait > 0 and not self._flushing:
                    wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(wake.wait(), wait)
                    continue
                ready.extend(batches.open.values())
                batches.open.clear()
            async with self._send_lock:
                while ready:
                    await self._submit(ready[0])
                    ready.popleft()

    async def _submit(self, batch: Batch) -> None:
        """Hand one batch to the producer, retrying while the broker is unavailable. A definite
        failure is recorded on the batch (nothing from it on becomes durable)."""
        assert self._producer is not None, "KafkaSink.start() was not called"
        delay = self.config.retry_backoff
        while True:
            try:
                if batch.topic not in self._partitions:
                    await self._learn_topic(batch.topic)
                built = BuiltBatch(
                    batch.records, CODECS[self.config.compression], self.exactly_once
                )
                future = await self._producer.send_batch(
                    built, batch.topic, partition=batch.partition
                )
            except Exception as exc:
                err = self._translate(exc, topic=batch.topic, batch=batch)
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
            self._stats["records_sent"] += batch.records.count
            return

    async def _watch(self) -> None:
        """Say in the log when the broker acknowledged nothing for a while although records
        wait (``kafka_waiting_for_broker``: the producer keeps retrying them, the pipeline
        holds once the window is full), and when it acknowledges again."""
        interval = max(1.0, min(self.config.request_timeout, 10.0))
        acked, since = self._stats["records_acked"], time.monotonic()
        waiting = False
        while True:
            await asyncio.sleep(interval)
            now = self._stats["records_acked"]
            if now != acked or not self._window:
                if waiting:
                    log.info("kafka_broker_acknowledging", bootstrap=self._bootstrap())
                acked, since, waiting = now, time.monotonic(), False
                continue
            waiting = True
            log.warning(
                "kafka_waiting_for_broker",
                bootstrap=self._bootstrap(),
                seconds=round(time.monotonic() - since),
                window_records=self._batches.window_records,
            )

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
                err = self._translate(exc, topic=topic, where=where)
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
            if topic == self.position_topic:
                new = NewTopic(topic, 1, self.config.replication_factor, topic_configs=TOPIC_CONFIG)
            else:
                new = NewTopic(topic, self.config.partitions, self.config.replication_factor)
            response = await self._admin.create_topics([new])
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
        """Advance the window over acknowledged batches; mark passed transaction ends durable.
        Exactly once: only a Kafka commit releases the window (:meth:`_commit_kafka`)."""
        if self.exactly_once:
            return
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
                self._batches.window_records -= head.records.count
                self._batches.window_bytes -= head.size
                self._stats["records_acked"] += head.records.count
            window.popleft()
            moved = True
        if moved:
            self._changed.set()

    def _delivery_failed(self, head: Batch, exc: BaseException) -> None:
        if self._failure is not None or self._replay_task is not None:
            return
        err = self._translate(exc, topic=head.topic, batch=head)
        if isinstance(err, TransientSinkError):
            log.warning("kafka_delivery_failed_replaying", topic=head.topic, error=str(err))
            self._replay_task = asyncio.get_running_loop().create_task(self._replay())
        else:
            self._failure = err
            self._changed.set()

    async def _replay(self) -> None:
        """Resend, in order, every batch from the oldest unacknowledged one onward, with a new
        producer: the failed batch took its sequence numbers with it, so the idempotent
        producer's next batch of that partition would be out of order for the broker."""
        assert self._producer is not None
        try:
            async with self._send_lock:
                handed = [b for b in self._window if isinstance(b, Batch) and b.future]
                futures = [b.future for b in handed if b.future is not None]
                await asyncio.gather(*futures, return_exceptions=True)
                self._stats["replays"] += 1
                await self._renew_producer()
                for batch in handed:
                    batch.future = None
                for batch in handed:
                    await self._submit(batch)
        except Exception as exc:  # a bug; make it visible to the pipeline
            self._failure = DefiniteSinkError(f"kafka: replay failed: {exc!r}")
        finally:
            self._replay_task = None
            self._changed.set()
        self._pump()

    async def _renew_producer(self) -> None:
        """Replace the producer (its batches failed; with exactly_once its Kafka transaction
        is aborted by the new one's InitProducerId, which takes the same transactional id),
        retrying while the broker is unreachable."""
        old, self._producer = self._producer, None
        if old is not None:
            old._message_accumulator.fail_all(kerrors.KafkaError("producer replaced"))
            with contextlib.suppress(Exception):
                await asyncio.wait_for(old.stop(), self.config.request_timeout)
        delay = self.config.retry_backoff
        while True:
            producer = self._new_producer()
            try:
                await producer.start()
                if self.exactly_once:
                    await producer.begin_transaction()
            except Exception as exc:
                with contextlib.suppress(Exception):
                    await producer.stop()
                err = self._translate(exc, starting=True)
                if not isinstance(err, TransientSinkError):
                    self._failure = err
                    self._changed.set()
                    raise err from exc
                log.warning("kafka_unreachable", bootstrap=self._bootstrap(), error=str(err))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
                continue
            self._producer = producer
            return

    async def _commit_kafka(self) -> None:
        """Exactly once: end the Kafka transaction with cdcd's position, so that what was
        added so far becomes visible to read_committed consumers at once with it, then mark
        the transactions it completes durable and open the next one. A failed batch, or a
        failed commit that may pass, aborts it (a new producer) and sends it all again."""
        self._raise_failure()
        window = self._window
        if not any(isinstance(entry, Batch) for entry in window):
            while window:  # transactions without records: nothing to hold in Kafka
                entry = window.popleft()
                assert isinstance(entry, int)
                self._mark_durable(entry)
            return
        if self._position is not None:
            if self.position_topic not in self._partitions:
                await self._prepare_topic(self.position_topic, "the position topic")
            self._batches.add(
                self.position_topic,
                int(time.time() * 1000),
                self.transactional_id.encode(),
                self._position.encode(),
                b"",
                -1,
                b"",
                0,
                "cdcd's position",
            )
        batches = self._batches
        batches.ready.extend(batches.open.values())
        batches.open.clear()
        async with self._send_lock:
            while True:
                assert self._producer is not None
                while batches.ready:
                    await self._submit(batches.ready[0])
                    batches.ready.popleft()
                self._raise_failure()
                handed = [entry for entry in window if isinstance(entry, Batch)]
                results = await asyncio.gather(
                    *(b.future for b in handed if b.future is not None), return_exceptions=True
                )
                failed = next((r for r in results if isinstance(r, BaseException)), None)
                if failed is None:
                    try:
                        await self._producer.commit_transaction()
                    except Exception as exc:
                        # it may have committed at the broker: only a restart, which reads
                        # the position back, can tell what Kafka holds
                        err = self._translate(exc, topic=self.position_topic)
                        if not isinstance(err, SinkSetupError):
                            err = DefiniteSinkError(
                                f"kafka: committing the Kafka transaction failed ({err}); "
                                "cdcd stops, its next start reads back what Kafka holds"
                            )
                        self._failure = err
                        self._changed.set()
                        raise err from exc
                    break
                err = self._translate(failed, topic=handed[0].topic, batch=handed[0])
                if not isinstance(err, TransientSinkError):
                    self._failure = err
                    self._changed.set()
                    raise err from failed
                log.warning("kafka_transaction_retry", error=str(err))
                self._stats["replays"] += 1
                await self._renew_producer()
                for batch in handed:
                    batch.future = None
                batches.ready.extend(handed)
            self._stats["kafka_commits"] += 1
            while window:
                entry = window.popleft()
                if isinstance(entry, int):
                    self._mark_durable(entry)
                else:
                    batches.window_records -= entry.records.count
                    batches.window_bytes -= entry.size
                    self._stats["records_acked"] += entry.records.count
            self._changed.set()
            try:
                await self._producer.begin_transaction()
            except Exception as exc:
                self._failure = self._translate(exc)
                self._changed.set()
                raise self._failure from exc

    def _raise_failure(self) -> None:
        if self._failure is None and self._fenced() is not None:
            self._failure = self._translate(kerrors.ProducerFenced())
        if self._failure is not None:
            raise self._failure

    def _fenced(self) -> BaseException | None:
        """Exactly once: the error that left the producer's transactions in their fatal state
        (a newer producer with the same transactional id), or None."""
        manager = getattr(self._producer, "_txn_manager", None)
        if not self.exactly_once or manager is None or not manager.is_fatal_error():
            return None
        waiter: asyncio.Future[None] = manager.wait_for_transaction_end()
        if waiter.done() and not waiter.cancelled():
            error = waiter.exception()  # also marks it retrieved: no "never retrieved" log
            if error is not None:
                return error
        fenced: BaseException = kerrors.ProducerFenced()
        return fenced

    def _translate(
        self,
        exc: BaseException,
        *,
        topic: str | None = None,
        record: Record | None = None,
        where: Where | None = None,
        batch: Batch | None = None,
        starting: bool = False,
    ) -> SinkError:
        """aiokafka's exception as cdcd's; ``batch``: the failing one (its first record).
        Exactly once: once a newer producer fenced this one, every later call fails in some
        way of aiokafka's own (a state assertion, a batch failed by its dead sender): the
        fencing is the error to report."""
        if batch is not None:
            where = batch.where
        fenced = self._fenced()
        if fenced is not None:
            exc = fenced
        return translate_error(
            exc,
            self.config,
            self._bootstrap(),
            topic=topic,
            record=record,
            where=where,
            starting=starting,
        )
