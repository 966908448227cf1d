"""cdcd.sinks.kafka.partition against Kafka's Java client values and aiokafka's murmur2."""

from __future__ import annotations

import pytest
from aiokafka.partitioner import murmur2 as aiokafka_murmur2
from hypothesis import given
from hypothesis import strategies as st

from cdcd.sinks.kafka.partition import murmur2, partition_for


def signed(value: int) -> int:
    return value - (1 << 32) if value & 0x80000000 else value


# org.apache.kafka.common.utils.UtilsTest#testMurmur2 (Java's int result)
JAVA_MURMUR2 = {
    b"21": -973932308,
    b"foobar": -790332482,
    b"a-little-bit-long-string": -985981536,
    b"a-little-bit-longer-string": -1486304829,
    b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
    b"abc": 479470107,
}


@pytest.mark.parametrize(("key", "expected"), JAVA_MURMUR2.items())
def test_murmur2_matches_the_java_client(key: bytes, expected: int) -> None:
    assert signed(murmur2(key)) == expected


# kafka-python's test_murmur2_java_compatibility: partitions of a 1000-partition topic
JAVA_PARTITIONS = {b"": 681, b"a": 524, b"ab": 434, b"abc": 107, b"123456789": 566, b"\x00 ": 742}


@pytest.mark.parametrize(("key", "expected"), JAVA_PARTITIONS.items())
def test_partition_matches_the_java_client(key: bytes, expected: int) -> None:
    assert partition_for(key, 1000) == expected


@given(st.binary(max_size=600))
def test_murmur2_equals_aiokafkas(key: bytes) -> None:
    assert murmur2(key) == aiokafka_murmur2(key)


@given(st.binary(max_size=80), st.integers(min_value=1, max_value=64))
def test_partition_is_positive_hash_mod_count(key: bytes, partitions: int) -> None:
    assert partition_for(key, partitions) == (aiokafka_murmur2(key) & 0x7FFFFFFF) % partitions
