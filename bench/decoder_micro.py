"""Micro-benchmark of the pgoutput decoder's hot path: a 10-column text Insert.

Usage: python bench/decoder_micro.py [N] [--memoryview] [--corpus]
Decodes one synthetic Insert (10 text columns, ~8 bytes each; one NULL) N times (default
1,000,000) and prints messages/s. ``--memoryview`` passes the payload as a memoryview slice
of a larger buffer, as the replication client does (XLogData.data). ``--corpus`` also decodes
every captured message of ``tests/corpus`` (real bytes, all message types) until about N
messages were decoded, and prints that rate too.
"""

from __future__ import annotations

import struct
import sys
import time

from cdcd.decoder.pgoutput import PgOutputDecoder


def insert_message(ncols: int = 10) -> bytes:
    parts = [b"I", struct.pack("!I", 16384), b"N", struct.pack("!H", ncols)]
    for i in range(ncols):
        if i == 7:
            parts.append(b"n")
        else:
            value = f"value-{i:02d}".encode()
            parts.append(b"t" + struct.pack("!i", len(value)) + value)
    return b"".join(parts)


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    n = int(args[0]) if args else 1_000_000
    msg = insert_message()
    data: bytes | memoryview = msg
    if "--memoryview" in sys.argv:
        data = memoryview(b"w" + bytes(24) + msg)[25:]
    decode = PgOutputDecoder(1).decode
    decode(data, 0)
    t0 = time.perf_counter()
    for _ in range(n):
        decode(data, 0)
    dt = time.perf_counter() - t0
    kind = "memoryview" if isinstance(data, memoryview) else "bytes"
    print(
        f"decoded {n} Insert messages (10 columns, {len(msg)} bytes, {kind}) in {dt:.2f} s: "
        f"{n / dt:,.0f} messages/s, {dt / n * 1e9:.0f} ns/message"
    )


def corpus(n: int) -> None:
    from tests.corpusutil import all_corpus_files, load_corpus

    files = [load_corpus(p) for p in all_corpus_files()]
    total = sum(len(rows) for _h, rows in files)
    if not total:
        print("tests/corpus is empty")
        return
    rounds = max(1, n // total)
    t0 = time.perf_counter()
    for _ in range(rounds):
        for header, rows in files:
            decode = PgOutputDecoder(int(header["options"]["proto_version"])).decode
            for lsn, _xid, data in rows:
                decode(data, lsn)
    dt = time.perf_counter() - t0
    count = rounds * total
    print(
        f"decoded the corpus ({len(files)} files, {total} messages) {rounds} times in "
        f"{dt:.2f} s: {count / dt:,.0f} messages/s"
    )


if __name__ == "__main__":
    main()
    if "--corpus" in sys.argv:
        corpus(int(next((a for a in sys.argv[1:] if not a.startswith("--")), "1000000")))
