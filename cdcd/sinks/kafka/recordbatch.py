"""Kafka record batches (message format v2) written into one buffer, no object per record.

Compiled with mypyc (``cdcd/_purepy.py``). The format is Kafka's ("Record Batch" in Kafka's
protocol documentation): a 61-byte header ::

    baseOffset int64 (0)  batchLength int32  partitionLeaderEpoch int32 (-1)  magic int8 (2)
    crc uint32 (CRC-32C of everything after it)  attributes int16 (codec in bits 0-2,
    bit 4 set in a Kafka transaction)
    lastOffsetDelta int32  baseTimestamp int64  maxTimestamp int64  producerId int64
    producerEpoch int16  baseSequence int32  recordCount int32

then the records, compressed as one block when compression pays. A record is ::

    length varint  attributes int8 (0)  timestampDelta varint  offsetDelta varint
    keyLength varint  key  valueLength varint  value  headerCount varint
    per header: keyLength varint  key (UTF-8)  valueLength varint  value

with zigzag varints (a null key or value has length -1). This is what aiokafka's
``DefaultRecordBatchBuilder`` writes (the unit tests read these batches back with aiokafka's
reader); building them here costs one buffer per batch instead of aiokafka's per-record
objects, and the sink keeps the buffer for a replay instead of every record.

A record is written by ``cdcd._kafkarec.kafka_record`` (hand-written C, docs/development.md), or where that is not in use by :func:`write_record_python`, which writes the same
bytes.

Headers are handed over encoded (:func:`encode_headers`): the sink encodes those a
transaction's records share once, and :meth:`RecordBatch.append` writes the per-record
``cdcd.seq`` header between them.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Final

import zstandard
from aiokafka.codec import gzip_encode, lz4_encode, snappy_encode
from aiokafka.record.util import calc_crc32c

from cdcd._purepy import c_module

# A record's key and value, for error messages.
Record = tuple[bytes | None, bytes | None]
# Where a record came from: an event's (commit_lsn, seq, lsn, suffix) or a marker's text,
# formatted only for an error message. (Here, not beside the sink's configuration: what the
# compiled modules import must type-check without pydantic, which a package build lacks.)
Where = tuple[int, int, int, str] | str

HEADER_SIZE: Final = 61
_HEADER: Final = struct.Struct(">qiibIhiqqqhii")
_ATTRIBUTES_OFFSET: Final = 21  # the CRC covers the batch from here on
TRANSACTIONAL: Final = 0x10  # the attributes bit of a batch written in a Kafka transaction
_CRC: Final = struct.Struct(">I")
_CODEC_BITS: Final = 0x07  # of the attributes' low byte
CODECS: Final = {"none": 0, "gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}
_SEQ_KEY: Final = b"\x10cdcd.seq"  # keyLength varint (8) and the key of the cdcd.seq header
#: an upper bound of what a record adds beyond its key, value and headers (aiokafka's: 21)
RECORD_OVERHEAD: Final = 32

WriteRecord = Callable[..., int]
_NO_LIMIT: Final = 1 << 62


#: the level of ``compression_level: null``: zstd's 1 (Kafka's default is 3, which took twice the
#: CPU for batches of W1's rows and no smaller ones, bench/results/2026-11-28-kafka-w1-faster.md);
#: gzip and lz4 at aiokafka's 9
DEFAULT_LEVELS: Final = {"zstd": 1, "gzip": 9, "lz4": 9}

#: zstd compressors by level, one context each for every batch: a context made per call
#: (cramjam's, aiokafka's) allocates about 2.5 MiB, mapped on its own (cdcd.runtime) and so
#: page-faulted afresh for each batch, which cost more CPU than compressing
_ZSTD: Final[dict[int, zstandard.ZstdCompressor]] = {}


def zstd_compressor(level: int) -> zstandard.ZstdCompressor:
    """The zstd compressor of ``level``, made once."""
    compressor = _ZSTD.get(level)
    if compressor is None:
        compressor = _ZSTD[level] = zstandard.ZstdCompressor(level=level)
    return compressor


_KAFKAREC: Final = c_module("cdcd._kafkarec")
#: cdcd._kafkarec.kafka_record (hand-written C), or None where it is not in use
C_KAFKA_RECORD: Final[WriteRecord | None] = None if _KAFKAREC is None else _KAFKAREC.kafka_record


def varint(value: int) -> bytes:
    """``value`` as a zigzag varint."""
    v = (value << 1) ^ (value >> 63)
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _varint_size(value: int) -> int:
    v = (value << 1) ^ (value >> 63)
    size = 1
    while v >= 0x80:
        v >>= 7
        size += 1
    return size


def header_name(name: str) -> bytes:
    """A header's key as a record holds it (length and UTF-8), for :func:`header`."""
    raw = name.encode()
    return varint(len(raw)) + raw


def header(name: bytes, value: bytes) -> bytes:
    """One header as a record holds it; ``name`` from :func:`header_name`."""
    n = len(value)
    return name + (bytes((2 * n,)) if n < 64 else varint(n)) + value


def encode_headers(headers: list[tuple[str, bytes]]) -> bytes:
    """Headers as a record holds them (without their count)."""
    out = bytearray()
    for key, value in headers:
        name = key.encode()
        out += varint(len(name)) + name + varint(len(value)) + value
    return bytes(out)


def record_size(key: bytes | None, value: bytes | None, headers: bytes) -> int:
    """An upper bound of the bytes one record takes in a batch of its own."""
    size = HEADER_SIZE + RECORD_OVERHEAD + len(headers)
    if key is not None:
        size += len(key)
    if value is not None:
        size += len(value)
    return size


class RecordBatch:
    """The records of one batch, written into ``buffer`` after room for the header."""

    def __init__(self, max_size: int, buffer: bytearray | None = None) -> None:
        self.max_size = max_size
        #: grows by doubling; ``buffer``: one a finished batch left (:meth:`release`), its
        #: pages in memory already
        self.buffer = buffer if buffer is not None else bytearray(HEADER_SIZE + 16384)
        self.pos = HEADER_SIZE
        self.count = 0
        self.first_ts = 0
        self.max_ts = 0
        #: the records compressed with ``codec`` (:meth:`seal`), until built
        self.payload: bytes | None = None
        self.codec = 0
        #: the batch as first built (its producer state is rewritten when built again)
        self.built: bytes | None = None
        #: cdcd._kafkarec.kafka_record, or :func:`write_record_python` where it is not in use
        self.write_record: WriteRecord = (
            write_record_python if C_KAFKA_RECORD is None else C_KAFKA_RECORD
        )

    def size(self) -> int:
        return self.pos

    def append(
        self,
        ts: int,
        key: bytes | None,
        value: bytes | None,
        head: bytes,
        seq: int,
        tail: bytes,
        header_count: int,
    ) -> bool:
        """Add one record; False when the batch is full (a first record always fits). Its
        headers are ``head``, then ``cdcd.seq`` = ``seq`` unless ``seq`` is negative, then
        ``tail``; ``header_count`` counts them all."""
        count = self.count
        end = self.write_record(
            self.buffer,
            self.pos,
            self.max_size if count > 0 else -1,
            ts - self.first_ts if count > 0 else 0,
            count,
            key,
            value,
            head,
            seq,
            tail,
            header_count,
        )
        if end < 0:
            return False
        self.pos = end
        if count == 0:
            self.first_ts = self.max_ts = ts
        elif ts > self.max_ts:
            self.max_ts = ts
        self.count = count + 1
        return True

    def seal(self, codec: int, level: int = 1) -> bool:
        """Compress the records (before :meth:`build`), with ``codec`` at ``level``: True when
        that made them smaller, and then the buffer is no longer needed (:meth:`release`).
        Done when the producer builds its request: compressing each batch as it closed, in
        the writer's turn, measured slower on W1 (cdcd's and the broker's CPU, 2026-11-28)."""
        if codec == 0 or self.payload is not None or self.built is not None:
            return self.payload is not None or self.built is not None
        size = self.pos - HEADER_SIZE
        records = memoryview(self.buffer)[HEADER_SIZE : self.pos]
        if codec == 4:
            compressed = zstd_compressor(level).compress(records)
        else:
            compressed = _compress(codec, bytes(records), level)
        if len(compressed) >= size:
            return False
        self.payload = compressed
        self.codec = codec
        return True

    def build(
        self,
        codec: int,
        producer_id: int,
        producer_epoch: int,
        base_sequence: int,
        transactional: bool = False,
        level: int = 1,
    ) -> bytes:
        """The batch as sent: header, records (compressed with ``codec`` at ``level`` when that
        makes them smaller; snappy has no level), CRC; ``transactional``: part of a Kafka
        transaction of the producer. The same records can be built again (a replay, with a new
        producer state) from what the first build returned, after :meth:`release` too."""
        attributes = TRANSACTIONAL if transactional else 0
        out: bytearray | memoryview | None = None
        if self.built is not None:  # again: the records as first built, a new header
            out = bytearray(self.built)
            codec = out[_ATTRIBUTES_OFFSET + 1] & _CODEC_BITS
            attributes |= codec
            return self._finish(out, attributes, producer_id, producer_epoch, base_sequence)
        payload = self.payload
        if payload is None and self.seal(codec, level):
            payload = self.payload
        if payload is not None:
            out = bytearray(HEADER_SIZE)
            out += payload
            attributes |= self.codec
        else:  # uncompressed: the header goes in front of the records, in place
            out = memoryview(self.buffer)[: self.pos]
        built = self._finish(out, attributes, producer_id, producer_epoch, base_sequence)
        self.built = built
        self.payload = None  # in built
        return built

    def _finish(
        self,
        out: bytearray | memoryview,
        attributes: int,
        producer_id: int,
        producer_epoch: int,
        base_sequence: int,
    ) -> bytes:
        """``out`` (room for the header, then the records as sent) with its header and CRC."""
        _HEADER.pack_into(
            out,
            0,
            0,  # baseOffset: the broker's
            len(out) - 12,  # batchLength: after this field
            -1,  # partitionLeaderEpoch
            2,  # magic
            0,  # crc, below
            attributes,
            self.count - 1,  # lastOffsetDelta
            self.first_ts,
            self.max_ts,
            producer_id,
            producer_epoch,
            base_sequence,
            self.count,
        )
        _CRC.pack_into(out, 17, calc_crc32c(memoryview(out)[_ATTRIBUTES_OFFSET:]))
        return bytes(out)

    def compressed_size(self) -> int:
        """The size of the batch as :meth:`build` would make it now: its header and the
        records compressed (:meth:`seal`), or uncompressed when that was no smaller."""
        if self.built is not None:
            return len(self.built)
        if self.payload is not None:
            return HEADER_SIZE + len(self.payload)
        return self.pos

    def split(self) -> tuple[RecordBatch, RecordBatch]:
        """The records in two new batches, the first half of them and the rest (before
        :meth:`build`): for a batch whose compressed size came out over the broker's limit.
        The records are copied as they are, their headers included; only their offset and
        timestamp deltas, relative to a batch's first record, are written anew."""
        assert self.built is None and self.count > 1, "split a batch not built, of 2+ records"
        half = self.count // 2
        # closed batches, no limit (a timestamp delta may take a byte more in its new batch)
        first = RecordBatch(_NO_LIMIT)
        second = RecordBatch(_NO_LIMIT)
        buffer = self.buffer
        pos = HEADER_SIZE
        for i in range(self.count):
            length, body = _get_varint(buffer, pos)
            end = body + length
            delta, p = _get_varint(buffer, body + 1)  # after the attributes
            _, p = _get_varint(buffer, p)  # offsetDelta
            key_len, p = _get_varint(buffer, p)
            key: bytes | None = None
            if key_len >= 0:
                key = bytes(buffer[p : p + key_len])
                p += key_len
            value_len, p = _get_varint(buffer, p)
            value: bytes | None = None
            if value_len >= 0:
                value = bytes(buffer[p : p + value_len])
                p += value_len
            header_count, p = _get_varint(buffer, p)
            headers = bytes(buffer[p:end])
            part = first if i < half else second
            part.append(self.first_ts + delta, key, value, headers, -1, b"", header_count)
            pos = end
        return first, second

    def release(self) -> bytearray:
        """Give the buffer up once the batch is built (a replay builds it again from
        ``built``), for a new batch to write into."""
        buffer, self.buffer = self.buffer, bytearray()
        return buffer


def write_record_python(
    buffer: bytearray,
    pos: int,
    limit: int,
    delta: int,
    count: int,
    key: bytes | None,
    value: bytes | None,
    head: bytes,
    seq: int,
    tail: bytes,
    header_count: int,
) -> int:
    """Write one record into ``buffer`` at ``pos`` (growing it by doubling); the position after
    it, or -1 when ``limit`` is not negative and the record would end past it (nothing written).
    ``cdcd._kafkarec.kafka_record`` is the same in C."""
    key_len = -1 if key is None else len(key)
    value_len = -1 if value is None else len(value)
    digits = b"%d" % seq if seq >= 0 else b""
    body = (
        1
        + _varint_size(delta)
        + _varint_size(count)
        + _varint_size(key_len)
        + max(key_len, 0)
        + _varint_size(value_len)
        + max(value_len, 0)
        + _varint_size(header_count)
        + len(head)
        + len(tail)
    )
    if seq >= 0:
        body += len(_SEQ_KEY) + 1 + len(digits)
    end = pos + _varint_size(body) + body
    if limit >= 0 and end > limit:
        return -1
    if end > len(buffer):
        grown = max(end, 2 * len(buffer))
        buffer.extend(bytes(grown - len(buffer)))
    pos = _put_varint(buffer, pos, body)
    buffer[pos] = 0  # attributes
    pos = _put_varint(buffer, pos + 1, delta)
    pos = _put_varint(buffer, pos, count)
    pos = _put_varint(buffer, pos, key_len)
    if key is not None:
        buffer[pos : pos + key_len] = key
        pos += key_len
    pos = _put_varint(buffer, pos, value_len)
    if value is not None:
        buffer[pos : pos + value_len] = value
        pos += value_len
    pos = _put_varint(buffer, pos, header_count)
    buffer[pos : pos + len(head)] = head
    pos += len(head)
    if seq >= 0:
        buffer[pos : pos + 9] = _SEQ_KEY
        buffer[pos + 9] = 2 * len(digits)  # a varint below 64: one byte
        pos += 10
        buffer[pos : pos + len(digits)] = digits
        pos += len(digits)
    buffer[pos : pos + len(tail)] = tail
    return pos + len(tail)


def _get_varint(buffer: bytearray, pos: int) -> tuple[int, int]:
    """The zigzag varint at ``pos``, and the position after it."""
    v = 0
    shift = 0
    while True:
        b = buffer[pos]
        pos += 1
        v |= (b & 0x7F) << shift
        if b < 0x80:
            break
        shift += 7
    return (v >> 1) ^ -(v & 1), pos


def _put_varint(buffer: bytearray, pos: int, value: int) -> int:
    v = (value << 1) ^ (value >> 63)
    while v >= 0x80:
        buffer[pos] = (v & 0x7F) | 0x80
        v >>= 7
        pos += 1
    buffer[pos] = v
    return pos + 1


def _compress(codec: int, data: bytes, level: int) -> bytes:
    if codec == 3:
        return bytes(lz4_encode(data, level))
    if codec == 2:
        return bytes(snappy_encode(data))
    return bytes(gzip_encode(data, level))
