"""Micro-benchmark of RowDecoder.decode on a 10-column row (text and binary, JSON and native).

Run: ``python bench/types_micro.py``. Prints values per second for each mode; no assertions.
Columns: int4, int8, text, varchar, numeric, bool, timestamptz, timestamp, float8, uuid.
"""

from __future__ import annotations

import struct
import time
import uuid

from cdcd.decoder.events import Column, Relation, TupleData
from cdcd.values.types import RowDecoder, TypeRegistry

OIDS = (23, 20, 25, 1043, 1700, 16, 1184, 1114, 701, 2950)
TEXT = (
    b"42",
    b"9000000000",
    b"hello world",
    b"some varchar",
    b"12345.67",
    b"t",
    b"2024-05-06 07:08:09.123456+00",
    b"2024-05-06 07:08:09",
    b"3.25",
    b"a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11",
)
BINARY = (
    struct.pack(">i", 42),
    struct.pack(">q", 9000000000),
    b"hello world",
    b"some varchar",
    struct.pack(">hhHHhh", 2, 0, 0, 2, 1, 2345) + struct.pack(">h", 6700),
    b"\x01",
    struct.pack(">q", 768_208_089_123_456),
    struct.pack(">q", 768_208_089_000_000),
    struct.pack(">d", 3.25),
    uuid.UUID("a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11").bytes,
)


def main() -> None:
    rel = Relation(
        None, 1, "public", "t", "d", tuple(Column(0, f"c{i}", o, -1) for i, o in enumerate(OIDS))
    )
    registry = TypeRegistry()
    text = TupleData(b"t" * 10, TEXT)
    binary = TupleData(b"b" * 10, BINARY)
    mixed = TupleData(
        b"tntnttutnt",
        tuple(None if k in b"nu" else v for k, v in zip(b"tntnttutnt", TEXT, strict=True)),
    )
    for target in ("json", "native"):
        dec = RowDecoder(rel, registry, target)  # type: ignore[arg-type]
        for label, tup in (("text", text), ("binary", binary), ("text+nulls", mixed)):
            n = 100_000
            best = float("inf")
            for _ in range(3):
                t0 = time.perf_counter()
                for _ in range(n):
                    dec.decode(tup)
                best = min(best, time.perf_counter() - t0)
            print(
                f"{target:6} {label:10} {n / best:10,.0f} rows/s  {10 * n / best:12,.0f} values/s"
            )


if __name__ == "__main__":
    main()
