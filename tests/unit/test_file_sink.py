"""The JSON Lines file sink: layout, atomic publication, rollover, exactly-once recovery
(docs/files.md). Transactions are built directly from pgoutput events."""

from __future__ import annotations

import asyncio
import errno
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
import structlog.testing

from cdcd.assembler.transaction import Transaction
from cdcd.errors import DefiniteSinkError, SinkError, TransientSinkError
from cdcd.events.encoder import Encoder
from cdcd.sinks.file.layout import (
    JsonlTableWriter,
    data_file_name,
    io_error,
    table_folder_name,
)
from cdcd.sinks.file.sink import FileSink, FileSinkConfig
from tests.unit.sink_fixtures import (
    CONTEXT,
    INT4,
    TEXT,
    TxnBuilder,
    encoder,
    relation,
    standalone_message,
    tup,
)

ORDERS = relation()
ITEMS = relation("items", (("order_id", INT4), ("sku", TEXT)), key=("order_id", "sku"), oid=16401)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_sink(out: Path, clock: Clock | None = None, **options: Any) -> FileSink:
    options.setdefault("flush_interval", 3600)
    options.setdefault("rollover_seconds", 3600)
    config = FileSinkConfig.model_validate({"path": str(out), **options})
    return FileSink(config, CONTEXT, clock=clock or Clock())


async def feed(
    sink: FileSink, enc: Encoder, txns: Iterable[Transaction], batch: int = 1000
) -> None:
    for txn in txns:
        await sink.begin(txn)
        for events in enc.batches(txn, max_events=batch):
            await sink.write(events)
        await sink.commit(txn)


def spark_read(folder: Path) -> list[dict[str, Any]]:
    """What a Spark job reading the folder sees: every visible data file, sorted by name."""
    records = []
    for path in sorted(folder.iterdir()):
        if path.name.startswith(("_", ".")) or not path.is_file():
            continue
        records.extend(orjson.loads(line) for line in path.read_bytes().splitlines())
    return records


def positions(records: list[dict[str, Any]]) -> list[tuple[int, int]]:
    return [(r["source"]["commit_lsn"], r["source"]["seq"]) for r in records]


def visible(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith((".", "_")))


def workload(first_xid: int, count: int, lsn: int) -> list[Transaction]:
    """Transactions touching two tables, with an update, a delete and a message."""
    txns = []
    for n in range(count):
        xid = first_xid + n
        b = TxnBuilder(xid, lsn + n * 1000)
        b.insert(ORDERS, tup(xid, f"name{xid}", "x" * 50))
        b.insert(ITEMS, tup(xid, "sku-a"))
        b.insert(ITEMS, tup(xid, "sku-b"))
        b.update(ORDERS, tup(xid, "renamed", None))
        if n % 3 == 0:
            b.message("audit", f"m{xid}".encode())
        if n % 4 == 1:
            b.delete(ITEMS, tup(xid, "sku-a"), kind="K")
        txns.append(b.build())
    return txns


def expected_positions(enc: Encoder, txns: Iterable[Transaction], table: str | None) -> list[Any]:
    return [
        e.position
        for txn in txns
        for e in enc.events(txn)
        if (e.table if table is not None else e.op) == (table if table is not None else "m")
    ]


async def test_layout_names_and_line_shape(tmp_path: Path) -> None:
    out = tmp_path / "out"
    sink = make_sink(out)
    await sink.start()
    enc = encoder()
    txns = workload(100, 3, 10_000)
    await feed(sink, enc, txns)
    await feed(sink, enc, [standalone_message(40_000, "hb", b"beat")])
    await sink.flush()

    assert sorted(p.name for p in out.iterdir()) == ["_messages", "public.items", "public.orders"]
    orders = spark_read(out / "public.orders")
    assert positions(orders) == expected_positions(enc, txns, "orders")
    first = orders[0]
    assert visible(out / "public.orders") == [data_file_name(positions(orders)[0], ".jsonl")]
    assert set(first) == {"before", "after", "source", "op", "ts_ms", "transaction", "key"}
    assert first["op"] == "c" and first["key"] == {"id": 100}
    assert first["after"] == {"id": 100, "name": "name100", "note": "x" * 50}
    assert first["source"]["table"] == "orders" and first["source"]["name"] == "shop"
    messages = spark_read(out / "_messages")
    assert [m["message"]["prefix"] for m in messages] == ["audit", "hb"]
    assert messages[-1]["source"]["commit_lsn"] == 39_999 and messages[-1]["transaction"] is None
    assert messages[-1]["source"]["lsn"] == 40_000
    assert sink.durable_lsn() == 40_000  # acknowledged with its LSN as sent
    # nothing hidden is left behind after a flush
    assert not [p for p in out.rglob(".*")]


async def test_files_are_hidden_until_published(tmp_path: Path) -> None:
    out = tmp_path / "out"
    sink = make_sink(out)
    await sink.start()
    await feed(sink, encoder(), workload(1, 2, 1000))
    folder = out / "public.orders"
    assert visible(folder) == []
    assert spark_read(folder) == []
    hidden = [p.name for p in folder.iterdir() if p.is_file()]
    assert len(hidden) == 1 and hidden[0].startswith(".") and hidden[0].endswith(".jsonl.tmp")
    assert sink.durable_lsn() == 0
    await sink.flush()
    assert [p.name for p in folder.iterdir() if p.is_file()] == [hidden[0][1:-4]]
    assert sink.durable_lsn() == workload(1, 2, 1000)[-1].end_lsn


async def test_flush_interval_zero_publishes_every_commit(tmp_path: Path) -> None:
    sink = make_sink(tmp_path / "out", flush_interval=0)
    await sink.start()
    txns = workload(1, 3, 1000)
    enc = encoder()
    for n, txn in enumerate(txns):
        await feed(sink, enc, [txn])
        assert sink.durable_lsn() == txn.end_lsn
        assert len(visible(tmp_path / "out" / "public.orders")) == n + 1


async def test_commit_publishes_once_flush_interval_elapsed(tmp_path: Path) -> None:
    clock = Clock()
    sink = make_sink(tmp_path / "out", clock, flush_interval=5)
    await sink.start()
    first, second = workload(1, 2, 1000)
    enc = encoder()
    await feed(sink, enc, [first])
    assert sink.durable_lsn() == 0
    clock.now += 6
    await feed(sink, enc, [second])  # starts a flush in the background
    await sink.settled()
    assert sink.durable_lsn() == second.end_lsn
    assert len(visible(tmp_path / "out" / "public.orders")) == 1


async def test_writing_goes_on_while_a_flush_publishes(tmp_path: Path) -> None:
    """A flush covers what was committed before it began; transactions written while it runs
    go to new files (rolling over too), published by the next flush, in order, once each."""
    out = tmp_path / "out"
    sink = make_sink(out, rollover_bytes="1KiB")
    await sink.start()
    enc = encoder()
    txns = workload(1, 12, 1000)
    await feed(sink, enc, txns[:4])
    flushing = asyncio.create_task(sink.flush())
    await asyncio.sleep(0)  # the flush has sealed the open files and waits for its job
    assert not sink.open_folders
    await feed(sink, enc, txns[4:], batch=2)
    await flushing
    assert txns[3].end_lsn <= sink.durable_lsn() < txns[-1].end_lsn
    await sink.flush()
    assert sink.durable_lsn() == txns[-1].end_lsn
    for table in ("orders", "items"):
        assert positions(spark_read(out / f"public.{table}")) == expected_positions(
            enc, txns, table
        )
    assert not [p for p in out.rglob(".*")]


async def test_a_commit_during_a_flush_is_not_durable_before_that_flush_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transaction with nothing to write is durable at once only when nothing is being
    published: otherwise once the publication in progress (in the worker thread) ends."""
    import cdcd.sinks.file.sink as file_module

    monkeypatch.setattr(file_module, "INLINE_PUBLISH_BYTES", -1)  # every job in the thread
    out = tmp_path / "out"
    sink = make_sink(out)
    await sink.start()
    enc = encoder()
    first = workload(1, 1, 1000)[0]
    await feed(sink, enc, [first])
    flushing = asyncio.create_task(sink.flush())
    await asyncio.sleep(0)
    empty = TxnBuilder(2, 5000).build()
    await feed(sink, enc, [empty])
    assert sink.durable_lsn() < first.end_lsn
    await flushing
    assert sink.durable_lsn() == empty.end_lsn
    another_empty = TxnBuilder(3, 6000).build()
    await feed(sink, enc, [another_empty])
    assert sink.durable_lsn() == another_empty.end_lsn  # nothing unpublished: durable at once


async def test_a_timer_flushes_without_waiting_for_another_commit(tmp_path: Path) -> None:
    out = tmp_path / "out"
    config = FileSinkConfig.model_validate({"path": str(out), "flush_interval": 0.05})
    sink = FileSink(config, CONTEXT)
    await sink.start()
    txns = workload(1, 3, 1000)
    await feed(sink, encoder(), txns)
    for _ in range(400):  # waits for the outcome; no assertion on how long it took
        if sink.durable_lsn() == txns[-1].end_lsn:
            break
        await asyncio.sleep(0.05)
    await sink.settled()
    assert sink.durable_lsn() == txns[-1].end_lsn
    assert len(spark_read(out / "public.orders")) == 6
    await sink.close()


async def test_a_failed_background_flush_fails_the_next_call(
    tmp_path: Path, monkeypatch: Any
) -> None:
    clock = Clock()
    sink = make_sink(tmp_path / "out", clock, flush_interval=5)
    await sink.start()

    def broken(self: JsonlTableWriter) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(JsonlTableWriter, "finish", broken)
    first, second = workload(1, 2, 1000)
    clock.now += 6
    await feed(sink, encoder(), [first])  # the interval has passed: a background flush
    await sink.settled()
    assert sink.durable_lsn() == 0
    with pytest.raises(DefiniteSinkError, match="Input/output error"):
        await sink.begin(second)


async def test_rollover_by_size_names_files_after_their_first_event(tmp_path: Path) -> None:
    out = tmp_path / "out"
    sink = make_sink(out, rollover_bytes="2KiB")
    await sink.start()
    enc = encoder()
    txns = workload(1, 20, 1000)
    await feed(sink, enc, txns, batch=3)
    await sink.flush()
    folder = out / "public.orders"
    names = visible(folder)
    assert len(names) > 3
    for name in names:
        first = orjson.loads((folder / name).read_bytes().splitlines()[0])
        assert name == data_file_name(
            (first["source"]["commit_lsn"], first["source"]["seq"]), ".jsonl"
        )
    assert positions(spark_read(folder)) == expected_positions(enc, txns, "orders")


async def test_rollover_by_time_at_commit(tmp_path: Path) -> None:
    clock = Clock()
    out = tmp_path / "out"
    sink = make_sink(out, clock, rollover_seconds=10, flush_interval=3600)
    await sink.start()
    first, second, third = workload(1, 3, 1000)
    enc = encoder()
    await feed(sink, enc, [first])
    clock.now += 5
    await feed(sink, enc, [second])
    assert visible(out / "public.orders") == []
    clock.now += 6  # the file opened for `first` is now 11 s old
    await feed(sink, enc, [third])
    assert len(visible(out / "public.orders")) == 1
    assert len(spark_read(out / "public.orders")) == 6
    assert sink.durable_lsn() == third.end_lsn  # every open file was published


async def test_schema_file_written_when_columns_change(tmp_path: Path) -> None:
    out = tmp_path / "out"
    sink = make_sink(out)
    await sink.start()
    enc = encoder()
    same_again = relation()  # a new Relation message with the same columns
    widened = relation(columns=(("id", INT4), ("name", TEXT), ("note", TEXT), ("qty", INT4)))
    t1 = TxnBuilder(1, 1000).insert(ORDERS, tup(1, "a", None)).build()
    t2 = TxnBuilder(2, 2000).insert(same_again, tup(2, "b", None)).build()
    t3 = (
        TxnBuilder(3, 3000)
        .insert(same_again, tup(3, "c", None))
        .insert(widened, tup(4, "d", None, 7))
        .build()
    )
    await feed(sink, enc, [t1, t2, t3])
    await sink.flush()
    schema_dir = out / "public.orders" / "_schema"
    names = sorted(p.name for p in schema_dir.iterdir())
    assert names == [
        data_file_name((t1.commit_lsn, 0), ".json"),
        data_file_name((t3.commit_lsn, 1), ".json"),
    ]
    doc = orjson.loads((schema_dir / names[1]).read_bytes())
    assert doc["columns"][-1] == {
        "name": "qty",
        "type": "int4",
        "type_oid": INT4,
        "typmod": -1,
        "key": False,
    }
    assert doc["columns"][0]["key"] is True
    assert (doc["schema"], doc["table"], doc["commit_lsn"], doc["seq"]) == (
        "public",
        "orders",
        t3.commit_lsn,
        1,
    )
    rows = spark_read(out / "public.orders")
    assert rows[-1]["after"] == {"id": 4, "name": "d", "note": None, "qty": 7}


async def test_recovery_after_crash_publishes_each_event_exactly_once(tmp_path: Path) -> None:
    out = tmp_path / "out"
    enc = encoder()
    txns = workload(1, 30, 1000)
    crashed = make_sink(out, rollover_bytes="1KiB", transactions=True)
    await crashed.start()
    await feed(crashed, enc, txns[:10])
    await crashed.flush()
    durable = crashed.durable_lsn()
    assert durable == txns[9].end_lsn
    # more transactions; small files roll over and get published mid-way, the rest stays
    # in temporary files when the process dies (no flush, no close)
    await feed(crashed, enc, txns[10:20], batch=2)
    leftovers = [p for p in out.rglob(".*.tmp")]
    assert leftovers
    del crashed

    restarted = make_sink(out, rollover_bytes="1KiB", transactions=True)
    await restarted.start()
    assert not [p for p in out.rglob(".*.tmp")]
    assert restarted.durable_lsn() == 0
    # the server resends everything after the confirmed position, then new transactions
    resent = [t for t in txns if t.end_lsn > durable]
    await feed(restarted, enc, resent, batch=2)
    await restarted.flush()
    assert restarted.durable_lsn() == txns[-1].end_lsn
    assert restarted.events_skipped > 0

    for table in ("orders", "items"):
        got = positions(spark_read(out / f"public.{table}"))
        assert got == expected_positions(enc, txns, table)  # each exactly once, in order
    assert positions(spark_read(out / "_messages")) == expected_positions(enc, txns, None)
    markers = spark_read(out / "_transactions")
    assert [(m["status"], m["commit_lsn"]) for m in markers] == [
        (status, t.commit_lsn) for t in txns for status in ("BEGIN", "END")
    ]
    # schema files were not duplicated by the replay
    assert len(list((out / "public.orders" / "_schema").iterdir())) == 1


async def test_replaying_everything_after_a_clean_stop_adds_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    enc = encoder()
    txns = workload(1, 5, 1000)
    first = make_sink(out)
    await first.start()
    await feed(first, enc, txns)
    await first.flush()
    await first.close()
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    second = make_sink(out)
    await second.start()
    await feed(second, enc, txns)
    await second.flush()
    assert second.durable_lsn() == txns[-1].end_lsn
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


async def test_transaction_markers(tmp_path: Path) -> None:
    out = tmp_path / "out"
    sink = make_sink(out, transactions=True)
    await sink.start()
    txn = workload(7, 1, 1000)[0]
    await feed(sink, encoder(), [txn, standalone_message(90_000, "p", b"")])
    await sink.flush()
    assert visible(out / "_transactions") == [f"{txn.commit_lsn:016X}.jsonl"]
    begin, end = spark_read(out / "_transactions")
    assert begin["status"] == "BEGIN" and begin["id"] == f"7:{txn.commit_lsn}"
    assert begin["event_count"] is None
    assert end["status"] == "END" and end["event_count"] == 5
    assert end["data_collections"] == [
        {"data_collection": "public.orders", "event_count": 2},
        {"data_collection": "public.items", "event_count": 2},
        {"data_collection": "_messages", "event_count": 1},
    ]


async def test_spark_style_reading_reconstructs_position_order(tmp_path: Path) -> None:
    out = tmp_path / "out"
    sink = make_sink(out, rollover_bytes="700B", flush_interval=0)
    await sink.start()
    enc = encoder()
    txns = workload(1, 12, 1000)
    await feed(sink, enc, txns, batch=2)
    for table in ("orders", "items"):
        records = spark_read(out / f"public.{table}")
        assert positions(records) == sorted(positions(records))
        assert positions(records) == expected_positions(enc, txns, table)


def test_folder_names_escape_awkward_characters() -> None:
    assert table_folder_name("public", "orders") == "public.orders"
    assert table_folder_name(".hidden", "a/b%c") == "%2Ehidden.a%2Fb%25c"
    assert table_folder_name("_private", "t") == "_private.t"


def test_config_validation(tmp_path: Path) -> None:
    config = FileSinkConfig.model_validate(
        {"path": "rel", "rollover_bytes": "1MiB", "flush_interval": "500ms"},
        context={"config_dir": tmp_path},
    )
    assert config.path == tmp_path / "rel"
    assert config.rollover_bytes == 1024 * 1024
    assert config.flush_interval == 0.5
    assert FileSinkConfig.model_validate({"path": "x"}).rollover_bytes == 128 * 1024 * 1024
    with pytest.raises(ValueError, match="extra"):
        FileSinkConfig.model_validate({"path": "x", "bogus": 1})
    with pytest.raises(ValueError):
        FileSinkConfig.model_validate({"path": "x", "format": "csv"})


def test_os_errors_are_classified_and_name_the_path() -> None:
    full = io_error(OSError(errno.ENOSPC, "No space left on device"), "write", "/d/f")
    assert isinstance(full, TransientSinkError) and "/d/f" in str(full)
    denied = io_error(OSError(errno.EACCES, "Permission denied"), "write", "/d/f")
    assert isinstance(denied, DefiniteSinkError) and "Permission denied" in str(denied)


async def test_unusable_path_is_a_definite_error_and_the_sink_stays_failed(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    sink = make_sink(blocker / "out")
    with pytest.raises(DefiniteSinkError, match=str(blocker)):
        await sink.start()
    txn = workload(1, 1, 1000)[0]
    with pytest.raises(SinkError):
        await sink.begin(txn)


async def test_disk_full_while_writing_is_transient(tmp_path: Path, monkeypatch: Any) -> None:
    sink = make_sink(tmp_path / "out")
    await sink.start()

    def no_space(self: JsonlTableWriter, lines: list[bytes]) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(JsonlTableWriter, "write_lines", no_space)
    txn = workload(1, 1, 1000)[0]
    await sink.begin(txn)
    with pytest.raises(TransientSinkError, match=r"public\.orders"):
        for events in encoder().batches(txn):
            await sink.write(events)
    with pytest.raises(DefiniteSinkError, match="restart"):
        await sink.flush()
    assert sink.durable_lsn() == 0


@pytest.mark.parametrize("limit, threads", [(1 << 20, 0), (10, 1)])
async def test_small_publications_run_on_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, limit: int, threads: int
) -> None:
    """A publication job of at most INLINE_PUBLISH_BYTES runs on the event loop (no worker
    thread to hand it to and back); a larger one in the worker thread. Both publish the same."""
    import cdcd.sinks.file.sink as file_module

    handed: list[object] = []
    to_thread = asyncio.to_thread

    async def counting(func: Any, /, *args: Any) -> Any:
        if getattr(func, "__name__", "") == "publish_files":  # not start()'s recovery
            handed.append(func)
        return await to_thread(func, *args)

    monkeypatch.setattr(file_module, "INLINE_PUBLISH_BYTES", limit)
    monkeypatch.setattr(file_module.asyncio, "to_thread", counting)
    sink = make_sink(tmp_path / "out")
    await sink.start()
    txns = workload(1, 3, 1000)
    await feed(sink, encoder(), txns)
    await sink.flush()
    assert len(handed) == threads
    assert sink.durable_lsn() == txns[-1].end_lsn
    rows = spark_read(tmp_path / "out" / "public.orders")
    assert [r["after"]["id"] for r in rows if r["op"] == "c"] == [1, 2, 3]


async def test_publication_leaves_the_event_loop_while_the_disk_is_slow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A small job runs on the event loop only while the last job was quick: after one that
    took longer than QUICK_PUBLISH_SECONDS (a stalled disk), the next run in the worker thread
    (the loop keeps reading meanwhile) until one of them is quick again."""
    import cdcd.sinks.file.layout as layout_module

    stalls = iter([0.05, 0.05, 0.0, 0.0, 0.0])  # the disk stalls for two jobs, then recovers
    where: list[str] = []
    loop_thread = threading.get_ident()
    real = layout_module.publish_files
    # the publisher's clock moves only by the stalls, so a busy host cannot make a job slow
    clock = [0.0]

    def publish(files: Any, dirty: Any, fsync: bool) -> None:
        where.append("loop" if threading.get_ident() == loop_thread else "thread")
        clock[0] += next(stalls, 0.0)
        real(files, dirty, fsync)

    monkeypatch.setattr(layout_module, "publish_files", publish)
    monkeypatch.setattr(layout_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    sink = make_sink(tmp_path / "out")
    await sink.start()
    txns = workload(1, 5, 1000)
    with structlog.testing.capture_logs() as logs:
        for txn in txns:
            await feed(sink, encoder(), [txn])
            await sink.flush()
            assert sink.durable_lsn() == txn.end_lsn
    said = [entry["event"] for entry in logs if entry["event"].startswith("file_publish")]
    assert said == ["file_publish_slow", "file_publish_quick"]  # once each, not per job
    # 1: inline, stalls; 2: thread, stalls; 3: thread, quick; 4 and 5: back on the loop
    assert where == ["loop", "thread", "thread", "loop", "loop"]
    assert sink.publisher.last_seconds < layout_module.QUICK_PUBLISH_SECONDS
    rows = spark_read(tmp_path / "out" / "public.orders")
    assert [r["after"]["id"] for r in rows if r["op"] == "c"] == [1, 2, 3, 4, 5]


def test_a_slow_upload_is_not_reported_as_a_stalled_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Uploads to object storage always run in the thread and take network round trips: their
    publisher is never quick and does not time its jobs, so only a local publisher warns."""
    import cdcd.sinks.file.layout as layout_module
    from cdcd.sinks.file.storage import ObjectStorePublisher

    monkeypatch.setattr(layout_module, "publish_files", lambda *_: time.sleep(0.02))
    publisher = layout_module.Publisher(fsync=False)
    with structlog.testing.capture_logs() as logs:
        publisher.publish_files([], set())
    assert [entry["event"] for entry in logs] == ["file_publish_slow"]
    assert not publisher.quick
    assert ObjectStorePublisher.quick is False
    assert not hasattr(ObjectStorePublisher, "last_seconds")


async def test_an_object_store_publication_always_runs_in_the_worker_thread() -> None:
    from cdcd.sinks.file.layout import Publisher
    from cdcd.sinks.file.storage import ObjectStorePublisher

    assert Publisher.local and not ObjectStorePublisher.local


def test_a_flapping_disk_is_warned_about_once_a_minute(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a busy host publishing turns slow and quick again many times a second: the warning
    comes at most once per SLOW_LOG_EVERY_SECONDS and counts the turns since the last one; the
    switch between the loop and the thread still follows every job."""
    import cdcd.sinks.file.layout as layout_module

    clock = [0.0]
    took = [0.0]

    def publish(files: Any, dirty: Any, fsync: bool) -> None:
        clock[0] += took[0]

    monkeypatch.setattr(layout_module, "publish_files", publish)
    monkeypatch.setattr(layout_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    publisher = layout_module.Publisher(fsync=False)
    quick_flags = []
    with structlog.testing.capture_logs() as logs:
        for second in range(130):  # slow, then quick, every second for 130 s
            for job in (0.05, 0.001):
                took[0] = job
                publisher.publish_files([], set())
                quick_flags.append(publisher.quick)
            clock[0] = second + 1.0
    said = [(e["event"], e.get("turned_slow")) for e in logs if e["event"].startswith("file_")]
    assert said == [
        ("file_publish_slow", 1),
        ("file_publish_quick", None),
        ("file_publish_slow", 60),
        ("file_publish_quick", None),
        ("file_publish_slow", 60),
        ("file_publish_quick", None),
    ]
    assert quick_flags == [False, True] * 130
