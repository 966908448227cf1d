"""CPU cost of the Kafka sink per row: captured changes in, records acknowledged by a broker out.

Usage::

    python bench/pipeline_micro.py capture FILE --rows 100000     # once (needs PostgreSQL)
    python bench/kafka_micro.py FILE [--compression zstd] [--partitions 1] [--profile OUT]
                                     [--runs] [--flush-every SECONDS] [--exactly-once]

The captured pgoutput stream (see ``bench/pipeline_micro.py``) is decoded and assembled first,
outside the measurement; then its events are built and handed to a :class:`KafkaSink` writing
to a fresh Apache Kafka broker (``bench.run.kafka_broker``), as the daemon's writer does (``begin``,
``write`` per batch of 1,000, ``commit``, ``flush``). Printed: this process's CPU seconds per
row for that part (event encoding, key and headers, partitioning, batches, compression,
aiokafka's send path), and wall time. The broker runs in its own process and is not counted.

``--runs`` hands small transactions over as the daemon's writer does, in runs of up to 1,000
changes (``write_transactions``); ``--flush-every S`` flushes the sink whenever ``S`` seconds
passed since the last flush (what the writer did before the sink flushed itself) and prints
the wall time spent waiting in those flushes.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import cProfile
import os
import resource
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def transactions(path: Path) -> list:
    """The captured stream's committed transactions, assembled (kept unreleased)."""
    from cdcd.assembler.assembler import Assembler
    from cdcd.decoder.pgoutput import PgOutputDecoder
    from cdcd.wire.session import Session, State

    stream = path.read_bytes()
    session = Session(user="u", database="d")
    session._state = State.COPY_BOTH
    decoder = PgOutputDecoder(1)
    spill = Path(tempfile.mkdtemp(prefix="cdcd-kmicro-spill-"))
    atexit.register(shutil.rmtree, spill, True)  # the transactions may read their spill
    assembler = Assembler(memory_limit=4 << 30, spill_dir=spill)
    header = struct.Struct("!cQQq").unpack_from
    txns = []
    for start in range(0, len(stream), 65536):
        session.receive_data(stream[start : start + 65536])
        for payload in session.copy_data_run():
            _, lsn, _, _ = header(payload)
            data = payload[25:]
            txn = assembler.feed(decoder.decode(data, lsn), lsn, data)
            if txn is not None:
                txns.append(txn)
    return txns


def encode_only(txns: list) -> tuple[int, float, float]:
    """The floor: the same events built, with the key and value JSON the sink asks for."""
    from cdcd.events.catalog import StaticCatalog
    from cdcd.events.encoder import Encoder
    from cdcd.sinks.base import SinkContext

    encoder = Encoder(SinkContext("bench", "bench", Path()), StaticCatalog())
    events = 0
    t0 = time.process_time()
    w0 = time.perf_counter()
    for txn in txns:
        for batch in encoder.batches(txn):
            events += len(batch)
            for event in batch:
                event.key_json()
                event.value_json()
    return events, time.process_time() - t0, time.perf_counter() - w0


async def drain(
    bootstrap: str, txns: list, options: dict, runs: bool = False, flush_every: float | None = None
) -> tuple[int, float, float, float]:
    from cdcd.events.catalog import StaticCatalog
    from cdcd.events.encoder import Encoder
    from cdcd.sinks.base import SinkContext
    from cdcd.sinks.kafka.client import KafkaSinkConfig
    from cdcd.sinks.kafka.sink import KafkaSink

    context = SinkContext("bench", "bench", Path())
    config = KafkaSinkConfig(
        bootstrap_servers=bootstrap,
        topic_prefix=f"kmicro{time.monotonic_ns()}",
        **options,
    )
    sink = KafkaSink(config, context)
    await sink.start()
    encoder = Encoder(context, StaticCatalog())
    events = 0
    flushing = 0.0  # wall seconds spent in the flushes every flush_every seconds
    flushed = time.perf_counter()
    run: list = []
    run_size = 0

    async def hand_run() -> None:
        nonlocal flushing, flushed, run, run_size
        await sink.write_transactions(run)
        run, run_size = [], 0
        if flush_every is not None and time.perf_counter() - flushed >= flush_every:
            f0 = time.perf_counter()
            await sink.flush()
            flushed = time.perf_counter()
            flushing += flushed - f0

    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t0 = time.process_time()
    w0 = time.perf_counter()
    for txn in txns:
        if runs:
            batches = list(encoder.batches(txn))
            size = sum(len(batch) for batch in batches)
            events += size
            run.append((txn, batches))
            run_size += size
            if run_size >= 1000:
                await hand_run()
            continue
        await sink.begin(txn)
        for batch in encoder.batches(txn):
            events += len(batch)
            await sink.write(batch)
        await sink.commit(txn)
    if run:
        await hand_run()
    await sink.flush()
    cpu = time.process_time() - t0
    wall = time.perf_counter() - w0
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    assert sink.durable_lsn() == txns[-1].end_lsn
    await sink.close()
    return events, cpu, wall, flushing, faults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--compression", default="zstd")
    parser.add_argument("--partitions", type=int, default=1)
    parser.add_argument(
        "--encode-only", action="store_true", help="only build events and their key/value JSON"
    )
    parser.add_argument("--exactly-once", action="store_true", help="the sink's exactly_once mode")
    parser.add_argument("--profile", type=Path, help="write cProfile stats of the drain here")
    parser.add_argument(
        "--runs", action="store_true", help="runs of small transactions, as the daemon's writer"
    )
    parser.add_argument(
        "--flush-every", type=float, help="flush whenever this many seconds passed (with --runs)"
    )
    parser.add_argument(
        "--variants",
        type=orjson.loads,
        default=[{}],
        help="JSON list of sink options drained in turn on one broker, e.g. "
        "'[{\"compression_level\": 3}, {}]' (default: [{}])",
    )
    parser.add_argument("--rounds", type=int, default=1, help="drains of each variant, in turn")
    args = parser.parse_args()
    import gc

    gc.set_threshold(50_000, 20, 100)  # as cdcd.runtime.tune_gc
    from cdcd.runtime import return_large_blocks

    return_large_blocks()  # as cdcd run: large blocks mapped on their own
    if os.environ.get("KMICRO_NOGC"):
        gc.disable()
    from bench.run import broker_cpu_seconds, kafka_broker

    txns = transactions(args.file)
    if args.encode_only:
        events, cpu, wall = encode_only(txns)
        print(f"{events} events, cpu {cpu / events * 1e6:.2f} us/row (encode only)")
        return
    options = {
        "compression": args.compression,
        "partitions": args.partitions,
        "exactly_once": args.exactly_once,
    }
    with kafka_broker() as broker:
        profiler = cProfile.Profile() if args.profile else None
        if profiler is not None:
            profiler.enable()
        for _ in range(args.rounds):
            for variant in args.variants:
                b0 = broker_cpu_seconds(broker)
                events, cpu, wall, flushing, faults = asyncio.run(
                    drain(broker.bootstrap, txns, options | variant, args.runs, args.flush_every)
                )
                broker_cpu = broker_cpu_seconds(broker) - b0
                print(
                    f"{events} events, cpu {cpu:.2f}s ({cpu / events * 1e6:.2f} us/row, "
                    f"{events / cpu:,.0f} rows/s), wall {wall:.2f}s ({events / wall:,.0f} "
                    f"rows/s), {options | variant}; broker cpu {broker_cpu:.2f}s; waiting in "
                    f"flushes {flushing:.2f}s; {faults / events * 1000:.0f} minor page faults "
                    "per 1,000 rows",
                    flush=True,
                )
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(str(args.profile))


if __name__ == "__main__":
    main()
