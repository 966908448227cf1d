"""The Kafka sink's configuration and its aiokafka-facing parts: connection arguments, the
hand-over of record batches built by the sink, and the one place that translates aiokafka's
exceptions (docs/kafka.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from aiokafka import errors as kerrors
from aiokafka.helpers import create_ssl_context
from aiokafka.producer.message_accumulator import BatchBuilder
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from cdcd.errors import DefiniteSinkError, SinkError, SinkSetupError, TransientSinkError
from cdcd.events import SinkContext
from cdcd.lsn import format_lsn
from cdcd.sinks.kafka.recordbatch import DEFAULT_LEVELS, Record, Where
from cdcd.units import ByteSize, Duration

MiB = 1024 * 1024
#: the levels each codec takes (the ranges of Kafka's compression.<codec>.level)
LEVELS = {"zstd": (-131072, 22), "gzip": (1, 9), "lz4": (1, 17)}


def where_text(where: Where) -> str:
    if isinstance(where, str):
        return where
    commit_lsn, seq, lsn, suffix = where
    return f"commit_lsn {format_lsn(commit_lsn)} seq {seq} (LSN {format_lsn(lsn)}){suffix}"


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


class BuiltBatch(BatchBuilder):  # type: ignore[misc]
    """A record batch the sink built (``RecordBatch`` of :mod:`cdcd.sinks.kafka.recordbatch`),
    handed to ``AIOKafkaProducer.send_batch`` in place of a ``BatchBuilder`` it filled.

    aiokafka asks a batch for ``record_count()``, ``closed()``, ``close()``, and at send time
    ``_set_producer_state(...)`` (the idempotent producer's id, epoch and sequence, written
    into the header) and ``_build()`` (the bytes); this is all of that, for any aiokafka from
    0.8 on (``send_batch``'s contract). One is made per hand-over: a replay builds again.
    ``built`` is called once the bytes exist (the records' buffer may go to the next batch)."""

    def __init__(
        self,
        records: Any,
        codec: int,
        transactional: bool = False,
        level: int = 1,
        built: Callable[[], None] | None = None,
    ) -> None:
        self._records = records  # no BatchBuilder.__init__: no aiokafka builder behind it
        self._codec = codec
        self._level = level
        self._transactional = transactional  # written in a Kafka transaction
        self._built = built
        self._state = (-1, -1, -1)
        self._buffer: bytes | None = None
        self._closed = True

    def append(self, *, timestamp: Any, key: Any, value: Any, headers: Any = ()) -> None:
        return None  # closed: the sink writes records into its own batch

    def close(self) -> None:
        pass

    def closed(self) -> bool:
        return True

    def _set_producer_state(
        self, producer_id: int, producer_epoch: int, base_sequence: int
    ) -> None:
        self._state = (producer_id, producer_epoch, base_sequence)

    def _build(self) -> bytes:
        if self._buffer is None:
            self._buffer = self._records.build(
                self._codec, *self._state, self._transactional, self._level
            )
            if self._built is not None:
                self._built()
        return self._buffer

    def size(self) -> int:
        return len(self._buffer) if self._buffer is not None else int(self._records.size())

    def record_count(self) -> int:
        return int(self._records.count)


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
    # zstd: aiokafka compresses lz4 at level 9 (LZ4 HC), ~2.5x zstd's CPU for a worse ratio
    compression: Literal["lz4", "zstd", "gzip", "snappy", "none"] = "zstd"
    # None: recordbatch.DEFAULT_LEVELS (zstd 1, not Kafka's 3: half the CPU, as small)
    compression_level: int | None = None
    linger_ms: int = Field(default=5, ge=0)
    # uncompressed; over max_request_size, a batch is also closed by its estimated compressed
    # size (batches.Batches.batch_limit): larger batches, fewer requests for the broker (4 MiB
    # on W1: 15 % less of the broker's CPU, 0.5 us/row more of cdcd's, so not the default)
    max_batch_size: ByteSize = Field(default=1 * MiB, ge=1024)
    max_request_size: ByteSize = Field(default=1 * MiB, ge=1024)
    # None: 20,000; 100,000 with exactly_once, whose Kafka transactions take half the window
    # each (fewer commits; buffer_bytes still bounds the memory)
    buffer_records: int | None = Field(default=None, ge=1)
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
    # exactly once: source transactions written in Kafka transactions with cdcd's position
    exactly_once: bool = False
    transactional_id: str | None = None  # default: cdcd-<name>
    transaction_timeout: Duration = 60.0
    # a Kafka commit begins at a source transaction's end once this passed since the last one
    commit_interval: Duration = 1.0
    position_topic: str | None = None  # default: <prefix>.cdcd-positions

    @model_validator(mode="after")
    def _exactly_once_needs_idempotence(self) -> KafkaSinkConfig:
        if self.exactly_once and (not self.idempotence or self.acks != "all"):
            raise ValueError(
                "exactly_once needs the idempotent producer with acks: all "
                f"(idempotence: {self.idempotence}, acks: {self.acks})"
            )
        return self

    @model_validator(mode="after")
    def _level_fits_the_codec(self) -> KafkaSinkConfig:
        level = self.compression_level
        if level is None:
            return self
        low, high = LEVELS.get(self.compression, (0, -1))
        if not low <= level <= high:
            allowed = f"from {low} to {high}" if low <= high else "none (leave it unset)"
            raise ValueError(
                f"compression_level {level} does not fit compression {self.compression!r}: "
                f"its levels are {allowed}"
            )
        return self

    def record_bound(self) -> int:
        """``buffer_records``, or its default for the mode."""
        if self.buffer_records is not None:
            return self.buffer_records
        return 100_000 if self.exactly_once else 20_000

    def level(self) -> int:
        """The compression level batches are built with (``compression_level`` or the codec's
        default; unused by snappy and none)."""
        if self.compression_level is not None:
            return self.compression_level
        return DEFAULT_LEVELS.get(self.compression, 0)

    @field_validator("acks", mode="before")
    @classmethod
    def _acks(cls, value: object) -> object:
        return int(value) if isinstance(value, str) and value.isdigit() else value


def client_kwargs(c: KafkaSinkConfig, context: SinkContext) -> dict[str, Any]:
    """aiokafka's connection arguments (producer and admin client) for this config."""

    def path(value: str | None) -> str | None:
        return None if value is None else str(context.config_dir / value)

    kwargs: dict[str, Any] = {
        "bootstrap_servers": c.bootstrap_servers,
        "client_id": c.client_id or f"cdcd-{context.name}",
        "request_timeout_ms": int(c.request_timeout * 1000),
        "retry_backoff_ms": int(c.retry_backoff * 1000),
        "security_protocol": c.security_protocol,
    }
    if c.security_protocol in ("SSL", "SASL_SSL"):
        kwargs["ssl_context"] = create_ssl_context(
            cafile=path(c.ssl_cafile),
            certfile=path(c.ssl_certfile),
            keyfile=path(c.ssl_keyfile),
        )
    if c.security_protocol.startswith("SASL"):
        kwargs["sasl_mechanism"] = c.sasl_mechanism
        kwargs["sasl_plain_username"] = c.sasl_username
        if c.sasl_password is not None:
            kwargs["sasl_plain_password"] = c.sasl_password.get_secret_value()
    return kwargs


def translate_error(
    exc: BaseException,
    config: KafkaSinkConfig,
    bootstrap: str,
    *,
    topic: str | None = None,
    record: Record | None = None,
    where: Where | None = None,
    starting: bool = False,
) -> SinkError:
    """The one place aiokafka's exceptions become cdcd's (:mod:`cdcd.errors`): definite or
    transient, naming the topic and the record (``record``: the failing one, a batch's first;
    ``where`` it came from)."""
    if isinstance(exc, SinkError):
        return exc
    at = f" at {where_text(where)}" if where else ""
    if isinstance(exc, kerrors.MessageSizeTooLargeError | kerrors.RecordListTooLargeError):
        size: int | str = "?"
        key = None
        if record is not None:
            size = len(record[0] or b"") + len(record[1] or b"")
            key = record[0].decode(errors="replace") if record[0] else None
        return DefiniteSinkError(
            f"kafka: record for topic {topic!r} with key {key} is about {size} bytes, more "
            f"than max_request_size ({config.max_request_size}) or the broker's limit"
            f"{at}: raise sinks.kafka.max_request_size and the topic's max.message.bytes "
            f"({exc})"
        )
    if isinstance(exc, kerrors.TopicAuthorizationFailedError):
        return SinkSetupError(
            f"kafka: not authorized for topic {topic!r}{at}: grant the principal WRITE and "
            f"DESCRIBE (and CREATE, with create_topics) on it ({exc!r})"
        )
    if isinstance(
        exc,
        kerrors.ClusterAuthorizationFailedError | kerrors.TransactionalIdAuthorizationFailed,
    ):
        return SinkSetupError(
            f"kafka: the broker at {bootstrap} refused the producer ({exc!r}): grant the "
            "principal WRITE on the topics (idempotent producer) and, with exactly_once, WRITE "
            "and DESCRIBE on the transactional id"
        )
    if isinstance(exc, kerrors.SaslAuthenticationFailed | kerrors.AuthenticationFailedError):
        return SinkSetupError(
            f"kafka: authentication to {bootstrap} failed for user {config.sasl_username!r} "
            f"({config.sasl_mechanism}): check sasl_username and sasl_password ({exc})"
        )
    if isinstance(exc, kerrors.ProducerFenced | kerrors.InvalidProducerEpoch):
        return SinkSetupError(
            f"kafka: fenced: another producer with this transactional id took over (another "
            f"cdcd on the same config name and slot?), or the broker aborted a Kafka "
            f"transaction open longer than transaction_timeout ({config.transaction_timeout:g}s)"
            f"{at}; this one stops, a restart resumes from the committed position ({exc!r})"
        )
    if isinstance(exc, kerrors.UnknownTopicOrPartitionError) and not config.create_topics:
        return DefiniteSinkError(
            f"kafka: topic {topic!r} does not exist and create_topics is false{at}"
        )
    if isinstance(exc, kerrors.InvalidTopicError):
        return DefiniteSinkError(f"kafka: invalid topic name {topic!r}{at} ({exc!r})")
    if (
        starting
        and config.idempotence
        and isinstance(exc, kerrors.BrokerResponseError)
        and not exc.retriable
    ):
        return DefiniteSinkError(
            f"kafka: the broker at {bootstrap} rejected the idempotent producer "
            f"(InitProducerId failed: {exc!r}); set `idempotence: false` in the kafka sink "
            "for brokers without idempotent producers"
        )
    if isinstance(
        exc, kerrors.KafkaTimeoutError | kerrors.KafkaConnectionError | TimeoutError | OSError
    ) or (isinstance(exc, kerrors.KafkaError) and exc.retriable):
        return TransientSinkError(f"kafka: {bootstrap}: {exc!r}{at}")
    return DefiniteSinkError(f"kafka: {exc!r}{at} (topic {topic!r})")
