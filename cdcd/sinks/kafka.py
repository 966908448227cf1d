"""The Kafka sink: every change event becomes a record on a per-table topic (CONTRACT.md §5).

Records::

    topic   <prefix>.<schema>.<table>     (or ``routing["schema.table"]``); prefix = pipeline name
    key     event.key_json()              JSON object of the key columns; null without a key
    value   event.value_json()            the Debezium-compatible event (CONTRACT §3)
    headers cdcd.commit_lsn, cdcd.seq, cdcd.xid, cdcd.op   (ASCII decimal; op as its letter;
                                          cdcd.xid is left out when the event has no xid)
    after a delete with a key: a tombstone (same key and headers, null value) unless
    ``tombstones: false``

Logical decoding messages go to ``<prefix>.message`` keyed by ``{"prefix": <message prefix>}``
(Debezium's key, ``event.key_json()``), so messages of one prefix stay in order. With
``transaction_topic: true``, BEGIN and END markers in Debezium's transaction-metadata shape
(plus ``commit_lsn`` and ``end_lsn``, as in the file sink's ``_transactions``) go to
``<prefix>.transaction`` keyed by ``{"id": "<xid>:<commit_lsn>"}``; END carries
``event_count`` and per-table ``data_collections`` counts (logical messages not counted).

Ordering. The default partitioner hashes the key bytes, so one key always lands in one
partition. aiokafka keeps at most one produce request in flight per broker connection and
mutes a partition while its batch is in flight; a batch that fails with a retriable error is
put back at the *front* of its partition's queue. So records of a partition reach the broker
in send order even without idempotence. The one exception is a batch that expires (it waited
longer than ``request_timeout``, e.g. during a long outage): aiokafka fails it while later
batches may still succeed. The sink then *replays*: it waits until nothing is in flight and
resends, in the original order, every record from the oldest unacknowledged one onward
(including later records that did arrive). A consumer may therefore see a suffix twice, each
copy carrying the same ``(commit_lsn, seq)``; deduplicating on it restores commit order. That is
the at-least-once contract of :mod:`cdcd.sinks.base`.

Durability. Records and transaction ends form one ordered window. It advances from the front
while the front record is acknowledged by the broker (``acks: all`` by default); passing a
transaction end marks that transaction's ``end_lsn`` durable. So ``durable_lsn`` never passes
a transaction with an unacknowledged record, nor one after it. The window is bounded by
``buffer_records`` and ``buffer_bytes``: ``write`` waits for acknowledgements beyond them, which
blocks the pipeline while the broker is away instead of growing memory.

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
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import orjson
import structlog
from aiokafka import AIOKafkaProducer
from aiokafka import errors as kerrors
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.helpers import create_ssl_context
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from cdcd.errors import ConfigError, DefiniteSinkError, SinkError, TransientSinkError
from cdcd.lsn import format_lsn, pg_to_unix_us
from cdcd.sinks.base import Sink, SinkContext
from cdcd.units import ByteSize, Duration

if TYPE_CHECKING:
    from cdcd.assembler.transaction import Transaction
    from cdcd.sinks.encoding import ChangeEvent

log = structlog.get_logger(__name__)

MiB = 1024 * 1024
_TOPIC_ALREADY_EXISTS = 36


def compression_available(codec: str) -> bool:
    """Whether aiokafka can use ``codec`` here (lz4/zstd/snappy need cramjam)."""
    from aiokafka import codec as kcodec

    checks = {
        "none": lambda: True,
        "gzip": kcodec.has_gzip,
        "lz4": kcodec.has_lz4,
        "zstd": kcodec.has_zstd,
        "snappy": kcodec.has_snappy,
    }
    return bool(checks[codec]())


class KafkaSinkConfig(BaseModel):
    """The ``type: kafka`` sink section. Durations and sizes as in :mod:`cdcd.units`."""

    model_config = ConfigDict(extra="forbid")

    bootstrap_servers: str | list[str]
    topic_prefix: str | None = None  # default: the pipeline name
    routing: dict[str, str] = Field(default_factory=dict)  # "schema.table" -> topic
    tombstones: bool = True
    transaction_topic: bool = False
    message_topic: str | None = None  # default: <prefix>.message
    acks: Literal["all", 1, 0] = "all"
    idempotence: bool = True
    compression: Literal["lz4", "zstd", "gzip", "snappy", "none"] = "lz4"
    linger_ms: int = Field(default=5, ge=0)
    max_batch_size: ByteSize = Field(default=1 * MiB, ge=1024)
    max_request_size: ByteSize = Field(default=1 * MiB, ge=1024)
    buffer_records: int = Field(default=100_000, ge=1)
    buffer_bytes: ByteSize = Field(default=64 * MiB, ge=1024)
    create_topics: bool = True
    partitions: int = Field(default=1, ge=1)
    replication_factor: int = Field(default=1, ge=1)
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = "PLAIN"
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    request_timeout: Duration = 30.0
    retry_backoff: Duration = 0.5
    give_up_after: Duration | None = None  # at start: None = retry for ever
    client_id: str | None = None  # default: cdcd-<name>

    @field_validator("acks", mode="before")
    @classmethod
    def _acks(cls, value: object) -> object:
        return int(value) if isinstance(value, str) and value.isdigit() else value


@dataclass(slots=True, eq=False)
class _Entry:
    """One slot of the ordered window: a record to send, or (``end_lsn`` set) a transaction end."""

    topic: str = ""
    key: bytes | None = None
    value: bytes | None = None
    headers: list[tuple[str, bytes]] = field(default_factory=list)
    timestamp_ms: int | None = None
    where: str = ""  # position for error messages
    end_lsn: int | None = None
    future: asyncio.Future[Any] | None = None

    @property
    def size(self) -> int:
        return len(self.key or b"") + len(self.value or b"") + 64


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
        self._known_topics: set[str] = set()
        self._window: deque[_Entry] = deque()
        self._window_bytes = 0
        self._window_records = 0
        self._changed = asyncio.Event()
        self._send_lock = asyncio.Lock()
        self._failure: SinkError | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._txn_counts: dict[str, int] = {}
        self._stats = {"records_sent": 0, "records_acked": 0, "send_retries": 0, "replays": 0}

    # --- lifecycle -----------------------------------------------------------------------

    def _client_kwargs(self) -> dict[str, Any]:
        c = self.config
        kwargs: dict[str, Any] = {
            "bootstrap_servers": c.bootstrap_servers,
            "client_id": c.client_id or f"cdcd-{self.context.name}",
            "request_timeout_ms": int(c.request_timeout * 1000),
            "retry_backoff_ms": int(c.retry_backoff * 1000),
            "security_protocol": c.security_protocol,
        }
        if c.security_protocol in ("SSL", "SASL_SSL"):
            kwargs["ssl_context"] = create_ssl_context(
                cafile=self._path(c.ssl_cafile),
                certfile=self._path(c.ssl_certfile),
                keyfile=self._path(c.ssl_keyfile),
            )
        if c.security_protocol.startswith("SASL"):
            kwargs["sasl_mechanism"] = c.sasl_mechanism
            kwargs["sasl_plain_username"] = c.sasl_username
            if c.sasl_password is not None:
                kwargs["sasl_plain_password"] = c.sasl_password.get_secret_value()
        return kwargs

    def _path(self, value: str | None) -> str | None:
        return None if value is None else str(self.context.config_dir / value)

    def _new_producer(self) -> AIOKafkaProducer:
        c = self.config
        return AIOKafkaProducer(
            **self._client_kwargs(),
            acks=c.acks,
            enable_idempotence=c.idempotence,
            compression_type=None if c.compression == "none" else c.compression,
            linger_ms=c.linger_ms,
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
            log.info("kafka_connected", bootstrap=self._bootstrap(), prefix=self.prefix)
            return

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(BaseException):
                await self._replay_task
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
            await self._enqueue(self._marker(txn, "BEGIN"))

    async def write(self, events: Sequence[ChangeEvent]) -> None:
        for event in events:
            for entry in self._records_for(event):
                await self._enqueue(entry)

    async def commit(self, txn: Transaction) -> None:
        if self._markers_for(txn):
            await self._enqueue(self._marker(txn, "END"))
        await self._enqueue(_Entry(end_lsn=txn.end_lsn))

    async def flush(self) -> None:
        """Wait until the broker acknowledged every record handed over. After a definite
        failure, first let what precedes the failing record become durable, then raise."""
        while True:
            if not self._window:
                self._raise_failure()
                return
            if self._failure is not None and self._head_is_stuck():
                raise self._failure
            self._changed.clear()
            await self._changed.wait()

    def _head_is_stuck(self) -> bool:
        head = self._window[0]
        if head.end_lsn is not None:
            return False
        return head.future is None or (head.future.done() and head.future.exception() is not None)

    def stats(self) -> dict[str, Any]:
        return {
            **self._stats,
            "window_records": self._window_records,
            "window_bytes": self._window_bytes,
        }

    # --- building records --------------------------------------------------------------------

    def topic_for(self, event: ChangeEvent) -> str:
        if event.op == "m" or event.schema is None:
            return self.message_topic
        name = f"{event.schema}.{event.table}"
        return self.config.routing.get(name) or f"{self.prefix}.{name}"

    def _records_for(self, event: ChangeEvent) -> list[_Entry]:
        topic = self.topic_for(event)
        headers = [
            ("cdcd.commit_lsn", str(event.commit_lsn).encode()),
            ("cdcd.seq", str(event.seq).encode()),
            ("cdcd.op", event.op.encode()),
        ]
        if event.xid is not None:
            headers.insert(2, ("cdcd.xid", str(event.xid).encode()))
        key = event.key_json()  # {"prefix": ...} for logical messages
        if event.op != "m":
            name = f"{event.schema}.{event.table}"
            self._txn_counts[name] = self._txn_counts.get(name, 0) + 1
        where = f"commit_lsn {format_lsn(event.commit_lsn)} seq {event.seq} (LSN {format_lsn(event.lsn)})"
        ts = pg_to_unix_us(event.commit_time) // 1000
        entry = _Entry(topic, key, event.value_json(), headers, ts, where)
        if event.op == "d" and key is not None and self.config.tombstones:
            return [entry, _Entry(topic, key, None, headers, ts, where + " tombstone")]
        return [entry]

    def _markers_for(self, txn: Transaction) -> bool:
        return self.config.transaction_topic and txn.kind != "message"

    def _marker(self, txn: Transaction, status: str) -> _Entry:
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
        return _Entry(
            self.transaction_topic,
            orjson.dumps({"id": txn_id}),
            orjson.dumps(value),
            headers,
            value["ts_ms"],
            f"transaction {txn_id} {status}",
        )

    # --- the window --------------------------------------------------------------------------

    async def _enqueue(self, entry: _Entry) -> None:
        if entry.end_lsn is None:
            await self._wait_for_room()
        async with self._send_lock:
            self._raise_failure()
            self._window.append(entry)
            if entry.end_lsn is None:
                self._window_records += 1
                self._window_bytes += entry.size
                await self._send(entry)
        self._pump()

    async def _wait_for_room(self) -> None:
        c = self.config
        while True:
            self._raise_failure()
            if self._window_records < c.buffer_records and self._window_bytes < c.buffer_bytes:
                return
            self._changed.clear()
            await self._changed.wait()

    async def _send(self, entry: _Entry) -> None:
        """Hand one record to the producer, retrying while the broker is unavailable."""
        assert self._producer is not None, "KafkaSink.start() was not called"
        delay = self.config.retry_backoff
        while True:
            self._raise_failure()
            try:
                await self._ensure_topic(entry.topic)
                future = await self._producer.send(
                    entry.topic,
                    entry.value,
                    key=entry.key,
                    headers=entry.headers,
                    timestamp_ms=entry.timestamp_ms,
                )
            except Exception as exc:
                err = self._translate(exc, entry=entry)
                if not isinstance(err, TransientSinkError):
                    self._failure = err
                    self._changed.set()
                    raise err from exc
                self._stats["send_retries"] += 1
                log.warning("kafka_send_retry", topic=entry.topic, error=str(err))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            entry.future = future
            future.add_done_callback(self._on_delivery)
            self._stats["records_sent"] += 1
            return

    async def _ensure_topic(self, topic: str) -> None:
        if topic in self._known_topics:
            return
        assert self._admin is not None
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
        self._known_topics.add(topic)

    def _on_delivery(self, _future: asyncio.Future[Any]) -> None:
        self._pump()

    def _pump(self) -> None:
        """Advance the window over acknowledged records; mark passed transaction ends durable."""
        moved = False
        while self._window:
            head = self._window[0]
            if head.end_lsn is None:
                fut = head.future
                if fut is None or not fut.done():
                    break
                exc = fut.exception() if not fut.cancelled() else asyncio.CancelledError()
                if exc is not None:
                    self._delivery_failed(head, exc)
                    break
                self._window_records -= 1
                self._window_bytes -= head.size
                self._stats["records_acked"] += 1
            else:
                self._mark_durable(head.end_lsn)
            self._window.popleft()
            moved = True
        if moved:
            self._changed.set()

    def _delivery_failed(self, head: _Entry, exc: BaseException) -> None:
        if self._failure is not None or self._replay_task is not None:
            return
        err = self._translate(exc, entry=head)
        if isinstance(err, TransientSinkError):
            log.warning("kafka_delivery_failed_replaying", topic=head.topic, error=str(err))
            self._replay_task = asyncio.get_running_loop().create_task(self._replay())
        else:
            self._failure = err
            self._changed.set()

    async def _replay(self) -> None:
        """Resend, in order, every record from the oldest unacknowledged one onward."""
        try:
            async with self._send_lock:
                pending = [e.future for e in self._window if e.future is not None]
                await asyncio.gather(*pending, return_exceptions=True)
                self._stats["replays"] += 1
                self._known_topics.clear()  # the broker may have come back without them
                for entry in self._window:
                    entry.future = None
                for entry in list(self._window):
                    if entry.end_lsn is None:
                        await self._send(entry)
        except SinkError as err:
            self._failure = self._failure or err
        except Exception as exc:  # a bug; make it visible to the pipeline
            self._failure = DefiniteSinkError(f"kafka: replay failed: {exc!r}")
        finally:
            self._replay_task = None
            self._changed.set()
        self._pump()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    # --- the one place that translates aiokafka's exceptions ---------------------------------

    def _translate(
        self, exc: BaseException, *, entry: _Entry | None = None, starting: bool = False
    ) -> SinkError:
        if isinstance(exc, SinkError):
            return exc
        topic = entry.topic if entry is not None else None
        where = f" at {entry.where}" if entry is not None and entry.where else ""
        if isinstance(exc, kerrors.MessageSizeTooLargeError | kerrors.RecordListTooLargeError):
            size = entry.size - 64 if entry is not None else "?"
            key = entry.key.decode(errors="replace") if entry and entry.key else None
            return DefiniteSinkError(
                f"kafka: record for topic {topic!r} with key {key} is about {size} bytes, more "
                f"than max_request_size ({self.config.max_request_size}) or the broker's limit"
                f"{where}: raise sinks.kafka.max_request_size and the topic's max.message.bytes "
                f"({exc})"
            )
        if isinstance(
            exc, kerrors.TopicAuthorizationFailedError | kerrors.ClusterAuthorizationFailedError
        ):
            return DefiniteSinkError(
                f"kafka: not authorized for topic {topic!r}{where}: grant the principal write "
                f"(and create, with create_topics) on it ({exc!r})"
            )
        if isinstance(exc, kerrors.UnknownTopicOrPartitionError) and not self.config.create_topics:
            return DefiniteSinkError(
                f"kafka: topic {topic!r} does not exist and create_topics is false{where}"
            )
        if isinstance(exc, kerrors.InvalidTopicError):
            return DefiniteSinkError(f"kafka: invalid topic name {topic!r}{where} ({exc!r})")
        if (
            starting
            and self.config.idempotence
            and isinstance(exc, kerrors.BrokerResponseError)
            and not exc.retriable
        ):
            return DefiniteSinkError(
                f"kafka: the broker at {self._bootstrap()} rejected the idempotent producer "
                f"(InitProducerId failed: {exc!r}); set `idempotence: false` in the kafka sink "
                "for brokers without idempotent producers (e.g. tansu)"
            )
        if isinstance(
            exc, kerrors.KafkaTimeoutError | kerrors.KafkaConnectionError | TimeoutError | OSError
        ) or (isinstance(exc, kerrors.KafkaError) and exc.retriable):
            return TransientSinkError(f"kafka: {self._bootstrap()}: {exc!r}{where}")
        return DefiniteSinkError(f"kafka: {exc!r}{where} (topic {topic!r})")
