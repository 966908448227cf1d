"""Kafka's default partition choice for a keyed record, without aiokafka's per-record overhead.

Kafka's Java producer (``org.apache.kafka.clients.producer.internals.BuiltInPartitioner``)
puts a record with a key in partition ``toPositive(murmur2(key)) % numPartitions``, where
``murmur2`` is ``org.apache.kafka.common.utils.Utils.murmur2`` (MurmurHash2, 32 bit, seed
``0x9747b28c``, little-endian words) and ``toPositive`` clears the sign bit. aiokafka's
``DefaultPartitioner`` does the same with a byte-at-a-time pure-Python loop; this one reads the
key's 32-bit words with one ``struct.unpack_from`` call, which is several times faster for the
short JSON keys cdcd writes. Invariant: ``partition_for(key, n)`` equals what the Java and
aiokafka producers choose for ``key`` on a topic of ``n`` partitions (unit-tested against the
Java client's published values and aiokafka's implementation).
"""

from __future__ import annotations

import struct

_SEED = 0x9747B28C
_M = 0x5BD1E995
_MASK = 0xFFFFFFFF
# precompiled readers of n little-endian 32-bit words, for keys up to 256 bytes
_WORDS = [struct.Struct(f"<{n}I").unpack_from for n in range(65)]


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 of ``data`` as an unsigned 32-bit integer."""
    length = len(data)
    h = _SEED ^ length
    words = length >> 2
    m, mask = _M, _MASK
    unpack = _WORDS[words] if words < 65 else struct.Struct(f"<{words}I").unpack_from
    for k in unpack(data):
        k = (k * m) & mask
        k ^= k >> 24
        h = ((h * m) & mask) ^ ((k * m) & mask)
    tail = length & 3
    if tail:
        base = length & ~3
        if tail == 3:
            h ^= data[base + 2] << 16
        if tail >= 2:
            h ^= data[base + 1] << 8
        h = ((h ^ data[base]) * m) & mask
    h ^= h >> 13
    h = (h * m) & mask
    return h ^ (h >> 15)


def partition_for(key: bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner gives ``key`` on a topic of ``partitions``."""
    if partitions == 1:
        return 0
    return (murmur2(key) & 0x7FFFFFFF) % partitions
