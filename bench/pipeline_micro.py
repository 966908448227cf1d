"""CPU cost of cdcd's pipeline per row, without a server: captured bytes in, events out.

Usage::

    python bench/pipeline_micro.py capture FILE [--rows N] [--workload W1]
    python bench/pipeline_micro.py run FILE [--sink null|encode] [--profile OUT]
    python bench/pipeline_micro.py writer FILE --sink-config '{"type": "file", ...}'

``capture`` starts a PostgreSQL (tests/pgharness.py), runs a bench/run.py workload once and
stores the pgoutput messages (``pg_logical_slot_get_binary_changes``, proto_version 1) as the
replication stream would carry them: CopyData frames of XLogData. ``run`` feeds that stream in
64 KiB chunks through the same code as the daemon's reader and writer tasks (Session framing,
XLogData parsing, decoder, assembler, encoder; ``encode`` builds every JSON Lines record) and
prints CPU seconds and rows/s. No sockets, no event loop: what is left is Python CPU time, so
figures are stable on a busy machine and comparable across commits.
"""

from __future__ import annotations

import argparse
import shutil
import struct
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def capture(path: Path, rows: int, workload: str) -> None:
    from bench.run import PUBLICATION, WORKLOADS
    from tests.pgharness import PgCluster, create_database, get_installation

    install = get_installation(18) or get_installation(15)
    assert install is not None, "no PostgreSQL installed"
    wl = WORKLOADS[workload]
    with PgCluster(install) as cluster:
        cluster.start()
        db = create_database(cluster)
        db.execute(wl.ddl)
        table = workload.lower().rstrip("s")
        db.execute(f"CREATE PUBLICATION {PUBLICATION} FOR TABLE {table}")
        db.execute("SELECT pg_create_logical_replication_slot('micro', 'pgoutput')")
        wl.load(db, rows / 1_000_000)
        frames = []
        with db.connect() as conn, conn.cursor() as cur:
            cur.execute(
                "SELECT lsn::text, data FROM pg_logical_slot_get_binary_changes('micro', NULL, "
                f"NULL, 'proto_version', '1', 'publication_names', '{PUBLICATION}')"
            )
            for lsn, data in cur:
                hi, lo = lsn.split("/")
                pos = (int(hi, 16) << 32) | int(lo, 16)
                body = b"w" + struct.pack("!QQq", pos, pos, 0) + bytes(data)
                frames.append(b"d" + struct.pack("!I", len(body) + 4) + body)
        path.write_bytes(b"".join(frames))
        print(f"{len(frames)} messages, {path.stat().st_size / 2**20:.1f} MiB -> {path}")


def run(
    path: Path,
    sink: str,
    memory_limit: int,
    raw: bool = True,
    general: frozenset[str] = frozenset(),
    parts: bool = True,
) -> None:
    """``general``: fast paths replaced by their general twin, to measure what each buys:
    ``framing`` (Session.next_event per message instead of xlog_run), ``undecoded`` (every
    change decoded and fed one by one in Python, instead of Assembler.feed_run), ``plain_insert``
    (spill read-back through decode_change only), ``body`` (each JSON Lines record serialised
    from the whole value dict instead of ChangeEvent's cached pieces). ``parts``: transactions
    released in parts while they arrive, as in the daemon (docs/assembler.md, "Parts")."""
    import gc

    import orjson

    gc.set_threshold(50_000, 20, 100)  # as cdcd.runtime.tune_gc
    from cdcd.assembler.assembler import COMPACT_BYTES, Assembler
    from cdcd.decoder.events import Relation
    from cdcd.decoder.pgoutput import PgOutputDecoder
    from cdcd.events.catalog import StaticCatalog
    from cdcd.events.encoder import Encoder, EventCursor
    from cdcd.sinks.base import SinkContext
    from cdcd.wire.session import Session, State

    if "plain_insert" in general:
        from cdcd.assembler import spill as spill_module

        spill_module.plain_insert = lambda buf, start, stop, streamed=False: None  # type: ignore[assignment]
    from cdcd.wire.session import CopyData

    def copy_data(session: Session) -> list[bytes]:
        if "framing" not in general:
            return session.copy_data_run()
        out = []
        while (event := session.next_event()) is not None:
            assert type(event) is CopyData
            out.append(event.payload)
        return out

    stream = path.read_bytes()
    session = Session(user="u", database="d")
    session._state = State.COPY_BOTH  # as after START_REPLICATION
    decoder = PgOutputDecoder(1)
    spill = Path(tempfile.mkdtemp(prefix="cdcd-micro-spill-"))
    assembler = Assembler(
        memory_limit=memory_limit, spill_dir=spill, part_bytes=COMPACT_BYTES if parts else None
    )
    cursor: EventCursor | None = None
    encoder = Encoder(SinkContext("bench", "bench", Path()), StaticCatalog())
    encode = sink == "encode"
    events = 0
    writer = 0.0  # CPU seconds spent on released transactions (the daemon's writer task)
    t0 = time.process_time()
    w0 = time.perf_counter()
    header = struct.Struct("!cQQq").unpack_from

    def batches(session: Session) -> list[tuple[int, int, int, bytes]]:
        if "framing" not in general:  # as ReplicationClient.message_batches
            items, others = session.xlog_run()
            assert not others
            return items  # type: ignore[return-value]
        out = []
        for payload in copy_data(session):
            _, lsn, wal_end, sent = header(payload)
            out.append((lsn, wal_end, sent, payload[25:]))
        return out

    fast = raw and "undecoded" not in general
    for start in range(0, len(stream), 65536):
        session.receive_data(stream[start : start + 65536])
        batch = batches(session)
        position = 0
        while position < len(batch):
            txn = None
            if fast:  # as the daemon's reader: runs of changes fed in one call
                run, _, _, txn = assembler.feed_run(
                    batch, position, decoder.decode, decoder.in_stream
                )
                position += run
            if txn is None:
                if fast and run:
                    continue
                lsn, _, _, data = batch[position]
                position += 1
                msg = decoder.decode(data, lsn)
                if type(msg) is Relation:
                    pass  # the daemon's live catalog looks the key up here
                txn = assembler.feed(msg, lsn, data if raw else None)
                if txn is None:
                    continue
            w = time.process_time()
            if txn.begins:  # as the daemon's writer
                cursor = None if txn.ends else EventCursor()
            if sink == "changes":
                events += sum(1 for _ in txn.changes())
            for made in encoder.batches(txn, cursor=cursor) if sink != "changes" else ():
                events += len(made)
                if encode and "body" in general:
                    for ev in made:
                        orjson.dumps({**ev.value(), "key": ev.key()})
                elif encode:
                    for ev in made:
                        ev.record_json()
            txn.release()
            writer += time.process_time() - w
    cpu = time.process_time() - t0
    shutil.rmtree(spill, ignore_errors=True)
    wall = time.perf_counter() - w0
    print(
        f"{events} events, cpu {cpu:.2f}s ({events / cpu:,.0f} rows/s, {cpu / events * 1e6:.2f} "
        f"us/row), wall {wall:.2f}s, sink={sink}, spilled {assembler.total_spilled_bytes} bytes"
    )
    print(
        f"  receiving {(cpu - writer) / events * 1e6:.2f} us/row, released transactions "
        f"{writer / events * 1e6:.2f} us/row"
    )


def writer_run(path: Path, sink_config: dict[str, object], memory_limit: int) -> None:
    """See the module docstring: receive everything, then time Writer + sink alone."""
    import asyncio
    import gc

    import uvloop

    gc.set_threshold(50_000, 20, 100)
    from cdcd.assembler.assembler import Assembler
    from cdcd.config.models import validate_sink
    from cdcd.decoder.pgoutput import PgOutputDecoder
    from cdcd.events.catalog import StaticCatalog
    from cdcd.events.encoder import Encoder
    from cdcd.pipeline.progress import ProgressTracker
    from cdcd.pipeline.writer import Writer
    from cdcd.sinks.base import SinkContext
    from cdcd.sinks.registry import load_sink_class
    from cdcd.stats import Stats
    from cdcd.wire.session import Session, State

    stream = path.read_bytes()
    session = Session(user="u", database="d")
    session._state = State.COPY_BOTH
    decoder = PgOutputDecoder(1)
    spill = Path(tempfile.mkdtemp(prefix="cdcd-micro-spill-"))
    assembler = Assembler(memory_limit=1 << 40, spill_dir=spill)
    txns = []
    for start in range(0, len(stream), 65536):
        session.receive_data(stream[start : start + 65536])
        items, _ = session.xlog_run()
        for lsn, _, _, data in items:
            txn = assembler.feed(decoder.decode(data, lsn), lsn, data)
            if txn is not None:
                txns.append(txn)
    rows = sum(txn.size for txn in txns)
    config = validate_sink(sink_config, ("sink",))
    assert not isinstance(config, list), config
    context = SinkContext("bench", "bench", Path())

    async def main() -> float:
        sink = load_sink_class(str(sink_config["type"]))(config, context)
        tracker = ProgressTracker(1)
        writer = Writer(
            [sink],
            Encoder(context, StaticCatalog()),
            tracker,
            Stats(),
            memory_limit=memory_limit,
            max_transactions=1000,
        )
        await sink.start()
        t0 = time.process_time()
        task = asyncio.create_task(writer.run())
        for txn in txns:
            await writer.put(txn)
        writer.close()
        await task
        await writer.flush_all()
        cpu = time.process_time() - t0
        await sink.close()
        return cpu

    cpu = uvloop.run(main())
    shutil.rmtree(spill, ignore_errors=True)
    print(
        f"{len(txns)} transactions, {rows} rows: writer+sink cpu {cpu:.2f}s, "
        f"{cpu / rows * 1e6:.2f} us/row, {cpu / len(txns) * 1e6:.1f} us/transaction"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    sub = parser.add_subparsers(dest="command", required=True)
    cap = sub.add_parser("capture")
    cap.add_argument("file", type=Path)
    cap.add_argument("--rows", type=int, default=200_000)
    cap.add_argument("--workload", default="W1")
    r = sub.add_parser("run")
    r.add_argument("file", type=Path)
    r.add_argument(
        "--sink",
        choices=("null", "encode", "changes"),
        default="null",
        help="null: events built; encode: JSON Lines records too; changes: decoded changes only",
    )
    r.add_argument(
        "--memory-limit", type=int, default=256 << 20, help="buffer.memory_limit (bytes)"
    )
    r.add_argument(
        "--no-raw", action="store_true", help="feed the assembler without the message bytes"
    )
    r.add_argument(
        "--whole", action="store_true", help="release transactions whole, at their commit"
    )
    r.add_argument(
        "--general",
        default="",
        help="comma list of fast paths replaced by their general twin: framing,undecoded,"
        "plain_insert,body",
    )
    w = sub.add_parser("writer")
    w.add_argument("file", type=Path)
    w.add_argument("--sink-config", required=True, help="a sink section as JSON")
    w.add_argument("--memory-limit", type=int, default=256 << 20)
    args = parser.parse_args()
    if args.command == "capture":
        capture(args.file, args.rows, args.workload)
    elif args.command == "writer":
        import json

        writer_run(args.file, json.loads(args.sink_config), args.memory_limit)
    else:
        general = frozenset(g for g in args.general.split(",") if g)
        run(args.file, args.sink, args.memory_limit, not args.no_raw, general, not args.whole)


if __name__ == "__main__":
    main()
