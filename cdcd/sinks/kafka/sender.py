"""The Kafka sink's hand-over to the broker: the producer, the batches it is handed, their
acknowledgements, replays and failures (docs/kafka.md).

Hand-over. One submitter task hands batches (:mod:`cdcd.sinks.kafka.batches`) to aiokafka's
producer in the order they were closed: closed ones at once, open ones ``linger_ms`` after the
oldest was started (at once while the sink's ``flush`` waits). ``send_batch`` waits while the
producer still holds an unsent batch of that partition, so open batches grow meanwhile.

Ordering. One key always lands in one partition, and batches of a partition are handed over in
order. aiokafka keeps at most one produce request in flight per broker connection and mutes a
partition while its batch is in flight; a batch that fails with a retriable error is put back
at the *front* of its partition's queue. So records of a partition reach the broker in order
even without idempotence. The one exception is a batch that expires (it waited longer than
``request_timeout``, e.g. during a long outage): aiokafka fails it while later batches may still
succeed. The sender then *replays*: it waits until nothing is in flight and resends, with a new
producer, in the original order, every batch from the oldest unacknowledged one onward
(including later batches that did arrive). A consumer may therefore see a suffix twice, each
copy carrying the same ``(commit_lsn, seq)``; deduplicating on it restores commit order. That is
the at-least-once contract of :mod:`cdcd.sinks.base`.

Durability. Batches and transaction ends form one ordered window (a batch takes its place when
its first record is added). :meth:`Sender.pump` advances it from the front while the front batch
is acknowledged by the broker (``acks: all`` by default); passing a transaction end marks that
transaction's ``end_lsn`` durable. Every record of a transaction sits in a batch started before
its end, so ``durable_lsn`` never passes a transaction with an unacknowledged record, nor one
after it. Exactly once, only a Kafka commit releases the window
(:mod:`cdcd.sinks.kafka.exactly_once`).

Failures. aiokafka's exceptions are translated in :meth:`Sender.translate` only. Retriable ones
(broker unavailable, timeouts, leader changes) are retried here with backoff, forever, holding
the pipeline; definite ones (a record too large, authorization, a missing topic with
``create_topics: false``, an idempotent producer on a broker without InitProducerId) become
``failure``: a :class:`DefiniteSinkError` naming the topic and the position; nothing at or after
that record becomes durable.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import structlog
from aiokafka import AIOKafkaProducer
from aiokafka import errors as kerrors
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.conn import create_conn

from cdcd.errors import DefiniteSinkError, SinkError, TransientSinkError
from cdcd.events import SinkContext
from cdcd.sinks.kafka.batches import Batch, Batches
from cdcd.sinks.kafka.client import BuiltBatch, KafkaSinkConfig, client_kwargs, translate_error
from cdcd.sinks.kafka.position import TOPIC_CONFIG
from cdcd.sinks.kafka.recordbatch import CODECS, Record, Where

log = structlog.get_logger(__name__)

_TOPIC_ALREADY_EXISTS = 36


class Sender:
    """The producer and admin client of one Kafka sink, the submitter handing its batches over,
    and the window of what the broker has not acknowledged yet."""

    def __init__(
        self,
        config: KafkaSinkConfig,
        context: SinkContext,
        batches: Batches,
        mark_durable: Callable[[int], None],
        *,
        transactional_id: str | None,
        position_topic: str,
    ) -> None:
        self.config = config
        self.context = context
        self.batches = batches
        self.partitions = batches.partitions  # known topics: their partitions, sorted
        self.window = batches.window  # batches and transaction end LSNs
        self.mark_durable = mark_durable
        self.transactional_id = transactional_id  # set: exactly once
        self.position_topic = position_topic  # created with the position topic's settings
        self.level = config.level()  # of compression
        self.producer: AIOKafkaProducer | None = None
        self.admin: AIOKafkaAdminClient | None = None
        self.flushing = 0  # flush() calls waiting: hand open batches over without lingering
        self.changed = asyncio.Event()  # the window moved or failed
        self.send_lock = asyncio.Lock()  # one of submitter / replay / commit hands batches over
        #: exactly once, while a Kafka commit waits: how many more of ``ready`` (from its front)
        #: belong to that Kafka transaction; the batches after them wait for the next one
        self.barrier: int | None = None
        self.failure: SinkError | None = None
        self.stats = {
            "records_sent": 0,
            "batches_sent": 0,
            "records_acked": 0,
            "send_retries": 0,
            "replays": 0,
            "kafka_commits": 0,
        }
        self._submitter: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._replay_task: asyncio.Task[None] | None = None

    # --- lifecycle -----------------------------------------------------------------------

    def client_kwargs(self) -> dict[str, Any]:
        return client_kwargs(self.config, self.context)

    def bootstrap(self) -> str:
        servers = self.config.bootstrap_servers
        return servers if isinstance(servers, str) else ",".join(servers)

    def _new_producer(self) -> AIOKafkaProducer:
        c = self.config
        return AIOKafkaProducer(
            **self.client_kwargs(),
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
                if self.transactional_id is not None
                else {}
            ),
        )

    async def connect(self) -> None:
        """Connect, retrying with backoff while the broker is unreachable; after
        ``give_up_after`` seconds (if set) raise DefiniteSinkError."""
        started = time.monotonic()
        delay = self.config.retry_backoff
        while True:
            producer = self._new_producer()
            admin = AIOKafkaAdminClient(**self.client_kwargs())
            try:
                await producer.start()
                await admin.start()
            except Exception as exc:
                with contextlib.suppress(Exception):
                    await producer.stop()
                with contextlib.suppress(Exception):
                    await admin.close()
                err = self.translate(exc, starting=True)
                if isinstance(err, TransientSinkError):
                    err = await self._check_login() or err
                if not isinstance(err, TransientSinkError):
                    raise err from exc
                waited = time.monotonic() - started
                give_up = self.config.give_up_after
                if give_up is not None and waited >= give_up:
                    raise DefiniteSinkError(
                        f"kafka: cannot reach {self.bootstrap()} after retrying for "
                        f"{waited:.1f}s (give_up_after {give_up:g}s): {err}"
                    ) from exc
                log.warning("kafka_unreachable", bootstrap=self.bootstrap(), error=str(err))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
                continue
            self.producer, self.admin = producer, admin
            return

    def run(self) -> None:
        """Start the submitter and the watcher (after :meth:`connect`)."""
        loop = asyncio.get_running_loop()
        self._submitter = loop.create_task(self._submit_loop())
        self._watcher = loop.create_task(self._watch())

    async def _check_login(self) -> SinkError | None:
        """The error of a refused SASL login, which aiokafka's bootstrap reports only as
        "unable to bootstrap": one direct connection to each bootstrap server tells."""
        c = self.config
        if not c.security_protocol.startswith("SASL"):
            return None
        kwargs = self.client_kwargs()
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
                return self.translate(exc, starting=True)
            except Exception:  # unreachable: that is what the caller reports
                continue
            conn.close()
        return None

    async def close(self) -> None:
        for task in (self._replay_task, self._submitter, self._watcher):
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        self._submitter = self._watcher = None
        producer, self.producer = self.producer, None
        admin, self.admin = self.admin, None
        if producer is not None:
            with contextlib.suppress(Exception):
                await producer.stop()
        if admin is not None:
            with contextlib.suppress(Exception):
                await admin.close()

    # --- handing batches over ------------------------------------------------------------

    async def _submit_loop(self) -> None:
        """Hand batches to the producer: closed ones at once, open ones after ``linger_ms``
        (at once while ``flush`` waits). ``send_batch`` waits while the producer still holds
        an unsent batch of the partition, so open batches grow meanwhile."""
        loop = asyncio.get_running_loop()
        linger = self.config.linger_ms / 1000
        batches = self.batches
        ready, wake = batches.ready, batches.wake
        while True:
            if self.barrier == 0:  # closed after a Kafka commit began: wait for the next one
                wake.clear()
                await wake.wait()
                continue
            if not ready:
                if not batches.open:
                    wake.clear()
                    await wake.wait()
                    continue
                wait = batches.open_since + linger - loop.time()
                if wait > 0 and not self.flushing:
                    wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(wake.wait(), wait)
                    continue
                batches.close_open()
            async with self.send_lock:
                await self.submit_ready()

    async def submit_ready(self) -> None:
        """Hand over the closed batches, in order (under ``send_lock``); while a Kafka commit
        waits, only those of its Kafka transaction (``barrier``)."""
        ready = self.batches.ready
        while ready and self.barrier != 0:
            await self._submit(ready[0])
            ready.popleft()
            if self.barrier is not None:
                self.barrier -= 1

    async def _submit(self, batch: Batch) -> None:
        """Hand one batch to the producer, retrying while the broker is unavailable. A definite
        failure is recorded on the batch (nothing from it on becomes durable)."""
        assert self.producer is not None, "KafkaSink.start() was not called"
        delay = self.config.retry_backoff
        while True:
            try:
                if batch.topic not in self.partitions:
                    await self._learn_topic(batch.topic)
                built = BuiltBatch(
                    batch.records,
                    CODECS[self.config.compression],
                    self.transactional_id is not None,
                    self.level,
                    partial(self.batches.recycle, batch),
                )
                future = await self.producer.send_batch(
                    built, batch.topic, partition=batch.partition
                )
            except Exception as exc:
                err = self.translate(exc, topic=batch.topic, batch=batch)
                if not isinstance(err, TransientSinkError):
                    batch.error = err
                    self.fail(err)
                    return
                self.stats["send_retries"] += 1
                log.warning("kafka_send_retry", topic=batch.topic, error=str(err))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            batch.future = future
            future.add_done_callback(self._on_delivery)
            self.stats["records_sent"] += batch.records.count
            self.stats["batches_sent"] += 1
            return

    async def _watch(self) -> None:
        """Say in the log when the broker acknowledged nothing for a while although records
        wait (``kafka_waiting_for_broker``: the producer keeps retrying them, the pipeline
        holds once the window is full), and when it acknowledges again."""
        interval = max(1.0, min(self.config.request_timeout, 10.0))
        acked, since = self.stats["records_acked"], time.monotonic()
        waiting = False
        while True:
            await asyncio.sleep(interval)
            now = self.stats["records_acked"]
            if now != acked or not self.window:
                if waiting:
                    log.info("kafka_broker_acknowledging", bootstrap=self.bootstrap())
                acked, since, waiting = now, time.monotonic(), False
                continue
            waiting = True
            log.warning(
                "kafka_waiting_for_broker",
                bootstrap=self.bootstrap(),
                seconds=round(time.monotonic() - since),
                window_records=self.batches.window_records,
            )

    # --- topics --------------------------------------------------------------------------

    async def prepare_topic(self, topic: str, where: Where) -> None:
        """Create (or check) ``topic`` and learn its partitions, retrying while the broker is
        unavailable."""
        delay = self.config.retry_backoff
        while True:
            self.raise_failure()
            try:
                await self._learn_topic(topic)
                return
            except Exception as exc:
                err = self.translate(exc, topic=topic, where=where)
                if not isinstance(err, TransientSinkError):
                    self.fail(err)
                    raise err from exc
                self.stats["send_retries"] += 1
                log.warning("kafka_send_retry", topic=topic, error=str(err))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    async def _learn_topic(self, topic: str) -> None:
        """Create (or check) ``topic``, then remember its partitions."""
        assert self.admin is not None and self.producer is not None
        if self.config.create_topics:
            if topic == self.position_topic:
                new = NewTopic(topic, 1, self.config.replication_factor, topic_configs=TOPIC_CONFIG)
            else:
                new = NewTopic(topic, self.config.partitions, self.config.replication_factor)
            response = await self.admin.create_topics([new])
            for _name, code, *_ in response.topic_errors:
                if code not in (0, _TOPIC_ALREADY_EXISTS):
                    raise kerrors.for_code(code)(f"creating topic {topic!r}")
        else:
            for info in await self.admin.describe_topics([topic]):
                if info["error_code"]:
                    raise kerrors.for_code(info["error_code"])(f"topic {topic!r}")
        self.partitions[topic] = sorted(await self.producer.partitions_for(topic))

    # --- acknowledgements and replays ----------------------------------------------------

    def _on_delivery(self, _future: asyncio.Future[Any]) -> None:
        self.pump()

    def pump(self) -> None:
        """Advance the window over acknowledged batches; mark passed transaction ends durable.
        Exactly once: only a Kafka commit releases the window."""
        if self.transactional_id is not None:
            return
        window = self.window
        moved = False
        while window:
            head = window[0]
            if isinstance(head, int):
                self.mark_durable(head)
            else:
                fut = head.future
                if fut is None or not fut.done():
                    break
                exc = fut.exception() if not fut.cancelled() else asyncio.CancelledError()
                if exc is not None:
                    self._delivery_failed(head, exc)
                    break
                self.acknowledged(head)
            window.popleft()
            moved = True
        if moved:
            self.changed.set()

    def acknowledged(self, batch: Batch) -> None:
        """``batch`` left the window: the broker has it."""
        self.batches.window_records -= batch.records.count
        self.batches.window_bytes -= batch.size
        self.stats["records_acked"] += batch.records.count

    def _delivery_failed(self, head: Batch, exc: BaseException) -> None:
        if self.failure is not None or self._replay_task is not None:
            return
        err = self.translate(exc, topic=head.topic, batch=head)
        if isinstance(err, TransientSinkError):
            log.warning("kafka_delivery_failed_replaying", topic=head.topic, error=str(err))
            self._replay_task = asyncio.get_running_loop().create_task(self._replay())
        else:
            self.fail(err)

    async def _replay(self) -> None:
        """Resend, in order, every batch from the oldest unacknowledged one onward, with a new
        producer: the failed batch took its sequence numbers with it, so the idempotent
        producer's next batch of that partition would be out of order for the broker."""
        assert self.producer is not None
        try:
            async with self.send_lock:
                handed = [b for b in self.window if isinstance(b, Batch) and b.future]
                futures = [b.future for b in handed if b.future is not None]
                await asyncio.gather(*futures, return_exceptions=True)
                self.stats["replays"] += 1
                await self.renew_producer()
                for batch in handed:
                    batch.future = None
                for batch in handed:
                    await self._submit(batch)
        except Exception as exc:  # a bug; make it visible to the pipeline
            self.failure = DefiniteSinkError(f"kafka: replay failed: {exc!r}")
        finally:
            self._replay_task = None
            self.changed.set()
        self.pump()

    async def renew_producer(self) -> None:
        """Replace the producer (its batches failed; with exactly_once its Kafka transaction
        is aborted by the new one's InitProducerId, which takes the same transactional id),
        retrying while the broker is unreachable."""
        old, self.producer = self.producer, None
        if old is not None:
            old._message_accumulator.fail_all(kerrors.KafkaError("producer replaced"))
            with contextlib.suppress(Exception):
                await asyncio.wait_for(old.stop(), self.config.request_timeout)
        delay = self.config.retry_backoff
        while True:
            producer = self._new_producer()
            try:
                await producer.start()
                if self.transactional_id is not None:
                    await producer.begin_transaction()
            except Exception as exc:
                with contextlib.suppress(Exception):
                    await producer.stop()
                err = self.translate(exc, starting=True)
                if not isinstance(err, TransientSinkError):
                    self.fail(err)
                    raise err from exc
                log.warning("kafka_unreachable", bootstrap=self.bootstrap(), error=str(err))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
                continue
            self.producer = producer
            return

    # --- failures --------------------------------------------------------------------------

    def fail(self, err: SinkError) -> None:
        """Record a definite failure (the first one stays) and wake who waits on the window."""
        self.failure = self.failure or err
        self.changed.set()

    def raise_failure(self) -> None:
        if self.failure is None and self._fenced() is not None:
            self.failure = self.translate(kerrors.ProducerFenced())
        if self.failure is not None:
            raise self.failure

    def head_is_stuck(self) -> bool:
        """The window's front batch failed: nothing after it can become durable."""
        head = self.window[0]
        if isinstance(head, int):
            return False
        if head.error is not None:
            return True
        fut = head.future
        return fut is not None and fut.done() and (fut.cancelled() or fut.exception() is not None)

    def _fenced(self) -> BaseException | None:
        """Exactly once: the error that left the producer's transactions in their fatal state
        (a newer producer with the same transactional id), or None."""
        manager = getattr(self.producer, "_txn_manager", None)
        if self.transactional_id is None or manager is None or not manager.is_fatal_error():
            return None
        waiter: asyncio.Future[None] = manager.wait_for_transaction_end()
        if waiter.done() and not waiter.cancelled():
            error = waiter.exception()  # also marks it retrieved: no "never retrieved" log
            if error is not None:
                return error
        fenced: BaseException = kerrors.ProducerFenced()
        return fenced

    def translate(
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
            self.bootstrap(),
            topic=topic,
            record=record,
            where=where,
            starting=starting,
        )
