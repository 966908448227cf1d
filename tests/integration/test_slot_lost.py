"""``source.on_slot_lost`` (docs/high-availability.md) against a real server: the real daemon,
a slot invalidated by ``max_slot_wal_keep_size`` (WAL generated past it, then a CHECKPOINT,
until ``wal_status`` is ``lost``), rows inserted, updated and *deleted* while the slot could not
follow them.

* ``recreate``, the slot lost while cdcd is stopped: cdcd replaces it at start, emits a reset
  (``op: t``, ``source.snapshot: reset``) per table before anything of the new slot, backfills
  every table, and the tables rebuilt from the files equal the source (the rows deleted in the
  gap are gone), with more changes made during and after the backfill;
* ``recreate``, the slot lost while cdcd is connected (the process stopped with SIGSTOP, so
  its walsender falls behind and is terminated by the invalidation): cdcd replaces it on the
  reconnect and goes on, same outcome;
* ``recreate`` after 18's ``idle_replication_slot_timeout``, after a dropped slot
  (``snapshot.mode: incremental``), with cdcd SIGKILLed right after it replaced the slot, and
  with the Kafka sink (the tables rebuilt from the topics equal the source);
* ``fail``: exit 3 with the reason and the advice, on every version.

Every outcome is checked in the JSON Lines and the Parquet files.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e import (
    apply_events,
    checked_events,
    comparable,
    consume_prefix,
    parquet_events,
    position,
    run_cdcd,
    start_cdcd,
    write_config,
)
from tests.pgharness import PgCluster

pytestmark = [pytest.mark.pg, pytest.mark.timeout(240)]

DB = "shop"
SLOT = "cdcd_e2e"
FAST = {"reconnect_min_backoff": "0.2s", "reconnect_max_backoff": "1s", "status_interval": "1s"}
TABLES = ("public.t", "public.u")


def _cluster(factory: Callable[..., PgCluster]) -> PgCluster:
    cluster = factory(settings={"max_slot_wal_keep_size": "1MB"})
    cluster.execute(f"CREATE DATABASE {DB}")
    cluster.execute(
        "CREATE TABLE t (id int PRIMARY KEY, v text NOT NULL, n int NOT NULL DEFAULT 0);"
        "CREATE TABLE u (k text PRIMARY KEY, w int);"
        "CREATE TABLE filler (id int PRIMARY KEY, pad text);"
        # no primary key: keyed for the backfill by its replica identity index
        "CREATE TABLE nokey (v int NOT NULL); CREATE UNIQUE INDEX nokey_v ON nokey (v);"
        "ALTER TABLE nokey REPLICA IDENTITY USING INDEX nokey_v; INSERT INTO nokey VALUES (1);"
        "INSERT INTO t SELECT g, 'seed', 0 FROM generate_series(1, 300) g;"
        "INSERT INTO u SELECT 'k' || g, g FROM generate_series(1, 40) g",
        DB,
    )
    return cluster


def _config(tmp_path: Path, cluster: PgCluster, policy: str, snapshot: str = "initial") -> Path:
    cfg = write_config(tmp_path, cluster.dsn(DB), snapshot=snapshot, on_slot_lost=policy, **FAST)
    data = yaml.safe_load(cfg.read_text())
    data["snapshot"]["chunk_rows"] = 40
    data["sinks"][0]["flush_interval"] = 0.2
    data["sinks"].append(  # the reset in Parquet too (_assert_equal reads both)
        {"type": "file", "path": "out-parquet", "format": "parquet", "flush_interval": 0.2}
    )
    data["http"] = {"listen": "127.0.0.1:0"}
    cfg.write_text(yaml.safe_dump(data))
    return cfg


def _gap_changes(cluster: PgCluster, base: int) -> None:
    """Inserts, updates and deletes the lost slot will never deliver."""
    cluster.execute(
        f"DELETE FROM t WHERE id % 7 = {base % 7};"
        f"UPDATE t SET v = 'gap{base}', n = n + 1 WHERE id % 5 = 0;"
        f"INSERT INTO t SELECT g, 'gap', {base} FROM generate_series({base}, {base} + 30) g;"
        f"DELETE FROM u WHERE w % 3 = {base % 3};"
        f"INSERT INTO u VALUES ('gap{base}', {base})",
        DB,
    )


def _make_wal(cluster: PgCluster) -> None:
    """WAL past max_slot_wal_keep_size."""
    for _ in range(4):
        cluster.execute(
            "INSERT INTO filler SELECT g, repeat('x', 200) FROM generate_series(1, 5000) g;"
            "DELETE FROM filler; SELECT pg_switch_wal()",
            DB,
        )


def _invalidate(cluster: PgCluster) -> None:
    """WAL past max_slot_wal_keep_size, then a checkpoint removes it: the slot is lost."""
    _make_wal(cluster)
    cluster.execute("CHECKPOINT")
    _wait(lambda: _wal_status(cluster) == "lost", 60, "the slot to be invalidated")


def _wal_status(cluster: PgCluster) -> Any:
    return cluster.fetchval(
        f"SELECT wal_status FROM pg_replication_slots WHERE slot_name = '{SLOT}'", DB
    )


def _wait(
    predicate: Callable[[], bool], timeout: float, what: str, log: Path | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            tail = log.read_text()[-4000:] if log is not None and log.exists() else ""
            raise AssertionError(f"timed out waiting for {what}\n{tail}")
        time.sleep(0.2)


def _log_lines(log: Path) -> list[dict[str, Any]]:
    lines = []
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                lines.append(json.loads(line))
    return lines


ALL_TABLES = (*TABLES, "public.filler", "public.nokey")


def _backfilled(log: Path, times: int) -> bool:
    """Every table's backfill finished ``times`` times (counted per table: a count over all
    tables let the wait end with one table still running when another finished twice)."""
    done = [e for e in _log_lines(log) if e.get("event") == "incremental snapshot of table done"]
    return all(sum(e.get("table") == t for e in done) >= times for t in ALL_TABLES)


def _backfilled_in(*logs: Path) -> bool:
    """Every table's backfill finished in one run or another (a run killed midway left the
    rest to the next)."""
    done = {
        e.get("table")
        for log in logs
        for e in _log_lines(log)
        if e.get("event") == "incremental snapshot of table done"
    }
    return all(t in done for t in ALL_TABLES)


def _source(cluster: PgCluster, table: str) -> list[dict[str, Any]]:
    if table == "public.t":
        rows = cluster.fetch("SELECT id, v, n FROM t", DB)
        return comparable({"id": i, "v": v, "n": n} for i, v, n in rows)
    return comparable({"k": k, "w": w} for k, w in cluster.fetch("SELECT k, w FROM u", DB))


def _assert_equal(out: Path, cluster: PgCluster, resets: int) -> None:
    for table in TABLES:
        _assert_table(checked_events(out, table), cluster, table, resets)
        _assert_table(parquet_events(out.with_name("out-parquet"), table), cluster, table, resets)


def _assert_table(
    events: list[dict[str, Any]], cluster: PgCluster, table: str, resets: int
) -> None:
    marks = [e for e in events if e["op"] == "t"]
    assert len(marks) == resets, (table, marks)
    for mark in marks:
        assert mark["source"]["snapshot"] == "reset", mark
        assert mark["key"] is None and mark["before"] is None and mark["after"] is None
    assert comparable(apply_events(events)) == _source(cluster, table), table


def _stop(proc: Any) -> int:
    proc.send_signal(signal.SIGTERM)
    return int(proc.wait(timeout=60))


def _metric(log: Path, name: str) -> float:
    """A metric of the running daemon, from the port its log names."""
    import urllib.request

    listen = next(e for e in _log_lines(log) if e.get("event") == "http endpoint listening")
    url = f"http://{listen['host']}:{listen['port']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics:\n{text}")


def test_recreate_after_loss_while_stopped(
    tmp_path: Path, pg_cluster_factory: Callable[..., PgCluster]
) -> None:
    cluster = _cluster(pg_cluster_factory)
    cfg = _config(tmp_path, cluster, "recreate")
    out = tmp_path / "out"
    end = cluster.fetchval("SELECT pg_current_wal_lsn()::text")
    run_cdcd("run", "--config", str(cfg), "--endpos", end)  # initial snapshot, then streams
    cluster.execute("UPDATE t SET n = 1 WHERE id <= 10; DELETE FROM t WHERE id = 300", DB)
    end = cluster.fetchval("SELECT pg_current_wal_lsn()::text")
    run_cdcd("run", "--config", str(cfg), "--endpos", end)
    _gap_changes(cluster, 1000)
    _invalidate(cluster)
    _gap_changes(cluster, 2000)

    log = tmp_path / "cdcd.log"
    proc = start_cdcd("run", "--config", str(cfg), log_path=log)
    try:
        _wait(lambda: "replication slot recreated" in log.read_text(), 60, "the new slot", log)
        cluster.execute(  # during the backfill, deletes of rows not backfilled yet included
            "UPDATE t SET v = 'during' WHERE id BETWEEN 250 AND 260;"
            "DELETE FROM t WHERE id BETWEEN 270 AND 280; INSERT INTO t VALUES (5000, 'during', 0)",
            DB,
        )
        _wait(lambda: _backfilled(log, 1), 120, "the backfill", log)
        cluster.execute("DELETE FROM t WHERE id < 20; UPDATE u SET w = -w", DB)
        time.sleep(1)
        assert _metric(log, "cdcd_slot_recreated_total") == 1
        assert _stop(proc) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    end = cluster.fetchval("SELECT pg_current_wal_lsn()::text")
    run_cdcd("run", "--config", str(cfg), "--endpos", end)  # a plain restart: no new reset
    _assert_equal(out, cluster, resets=1)
    recreated = [e for e in _log_lines(log) if e.get("event") == "replication slot recreated"]
    assert recreated and recreated[0]["reason"] == "wal_removed", recreated
    nokey = checked_events(out, "public.nokey")  # reset, then backfilled by its index
    assert [e["op"] for e in nokey if e["op"] == "t"] == ["t"], nokey
    assert comparable(apply_events(nokey)) == comparable([{"v": 1}]), nokey
    assert not (tmp_path / "cdcd-state" / f"{SLOT}.recreate.json").exists()
    assert _wal_status(cluster) != "lost"


def test_recreate_after_loss_while_connected(
    tmp_path: Path, pg_cluster_factory: Callable[..., PgCluster]
) -> None:
    cluster = _cluster(pg_cluster_factory)
    cfg = _config(tmp_path, cluster, "recreate")
    log = tmp_path / "cdcd.log"
    proc = start_cdcd("run", "--config", str(cfg), log_path=log)
    try:
        _wait(lambda: '"streaming"' in log.read_text(), 60, "streaming", log)
        cluster.execute("UPDATE t SET n = 1 WHERE id <= 10", DB)
        time.sleep(1)
        proc.send_signal(signal.SIGSTOP)  # cdcd stalls: its slot falls behind
        checkpoint = threading.Thread(target=cluster.execute, args=("CHECKPOINT",), daemon=True)
        try:
            _gap_changes(cluster, 1000)
            _make_wal(cluster)
            # The checkpointer terminates the walsender, which cannot exit before it has
            # written to the stalled cdcd: the checkpoint waits until cdcd runs again.
            checkpoint.start()
            _wait(
                lambda: "to release replication slot" in cluster.log_path.read_text(),
                60,
                "the checkpointer to terminate the walsender",
            )
        finally:
            proc.send_signal(signal.SIGCONT)
        checkpoint.join(60)
        _wait(lambda: "replication slot recreated" in log.read_text(), 60, "the new slot", log)
        lost = [
            e for e in _log_lines(log) if e.get("event") == "replication slot lost while streaming"
        ]
        assert lost, log.read_text()[-3000:]
        _wait(lambda: _backfilled(log, 1), 120, "the backfill", log)
        cluster.execute("DELETE FROM t WHERE id < 30; INSERT INTO u VALUES ('after', 1)", DB)
        time.sleep(1)
        assert _metric(log, "cdcd_slot_recreated_total") == 1
        assert _stop(proc) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
    end = cluster.fetchval("SELECT pg_current_wal_lsn()::text")
    run_cdcd("run", "--config", str(cfg), "--endpos", end)
    _assert_equal(tmp_path / "out", cluster, resets=1)


def _exit_3_after_loss(tmp_path: Path, cluster: PgCluster, policy: str) -> str:
    """Stream once, invalidate the slot, start again with ``policy``: exit 3; its output."""
    cfg = _config(tmp_path, cluster, policy)
    end = cluster.fetchval("SELECT pg_current_wal_lsn()::text")
    run_cdcd("run", "--config", str(cfg), "--endpos", end)
    _invalidate(cluster)
    proc = run_cdcd("run", "--config", str(cfg), check=False, timeout=60)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 3, text
    return text


def test_fail_on_invalidated_slot(
    tmp_path: Path, pg_cluster_factory: Callable[..., PgCluster]
) -> None:
    cluster = _cluster(pg_cluster_factory)
    text = _exit_3_after_loss(tmp_path, cluster, "fail")
    assert "invalidated (wal_removed)" in text, text
    assert "source.on_slot_lost: recreate" in text, text
    assert not any(e["op"] == "t" for e in checked_events(tmp_path / "out", "public.t"))


def test_recreate_refused_for_a_table_without_a_key(
    tmp_path: Path, pg_cluster_factory: Callable[..., PgCluster]
) -> None:
    """A published table with neither a primary key nor a replica identity index cannot be
    backfilled: ``recreate`` stops with exit 3 naming it, before the slot is touched, and no
    reset reaches the sinks."""
    cluster = _cluster(pg_cluster_factory)
    # FULL: publishable (cdcd refuses to publish a table whose writes would break), still keyless
    cluster.execute(
        "CREATE TABLE bare (v int); ALTER TABLE bare REPLICA IDENTITY FULL;"
        "INSERT INTO bare VALUES (1)",
        DB,
    )
    text = _exit_3_after_loss(tmp_path, cluster, "recreate")
    assert "cannot backfill public.bare" in text and "REPLICA IDENTITY USING INDEX" in text, text
    assert _wal_status(cluster) == "lost"  # the old slot is still there, untouched
    assert not (tmp_path / "cdcd-state" / f"{SLOT}.recreate.json").exists()
    assert not any(e["op"] == "t" for e in checked_events(tmp_path / "out", "public.t"))


def test_recreate_after_idle_timeout(
    tmp_path: Path, pg_cluster_factory: Callable[..., PgCluster]
) -> None:
    """PostgreSQL 18's idle_replication_slot_timeout is one more invalidation: the same."""
    cluster = _cluster(pg_cluster_factory)
    if cluster.major < 18:
        pytest.skip("idle_replication_slot_timeout is new in PostgreSQL 18")
    cfg = _config(tmp_path, cluster, "recreate", snapshot="initial")
    end = cluster.fetchval("SELECT pg_current_wal_lsn()::text")
    run_cdcd("run", "--config", str(cfg), "--endpos", end)
    cluster.set_settings(idle_replication_slot_timeout="1s")
    cluster.reload()
    _gap_changes(cluster, 1000)
    time.sleep(2)
    cluster.execute("CHECKPOINT")  # idle slots are invalidated at checkpoints
    _wait(lambda: _wal_status(cluster) == "lost", 30, "the idle slot to be invalidated")
    report = run_cdcd("check", "--config", str(cfg), check=False)
    assert "invalidated (idle_timeout)" in report.stdout, report.stdout
    assert "cdcd replaces it at start" in report.stdout, report.stdout
    cluster.set_settings(idle_replication_slot_timeout=None)
    cluster.reload()
    log = tmp_path / "cdcd.log"
    proc = start_cdcd("run", "--config", str(cfg), log_path=log)
    try:
        _wait(lambda: _backfilled(log, 1), 120, "the backfill", log)
        assert _stop(proc) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    recreated = [e for e in _log_lines(log) if e.get("event") == "replication slot recreated"]
    assert recreated and recreated[0]["reason"] == "idle_timeout", recreated
    _assert_equal(tmp_path / "out", cluster, resets=1)


def test_dropped_slot(tmp_path: Path, pg_cluster_factory: Callable[..., PgCluster]) -> None:
    """A slot dropped while cdcd was stopped, with ``snapshot.mode: incremental`` (whose state
    file shows cdcd streamed from it): ``fail`` exits 3 naming it; ``recreate`` replaces it."""
    cluster = _cluster(pg_cluster_factory)
    cfg = _config(tmp_path, cluster, "fail", snapshot="incremental")
    log = tmp_path / "cdcd.log"
    proc = start_cdcd("run", "--config", str(cfg), log_path=log)
    try:
        _wait(lambda: _backfilled(log, 1), 120, "the incremental snapshot", log)
        assert _stop(proc) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    cluster.execute(f"SELECT pg_drop_replication_slot('{SLOT}')", DB)
    _gap_changes(cluster, 1000)
    failed = run_cdcd("run", "--config", str(cfg), check=False, timeout=60)
    text = failed.stdout + failed.stderr
    assert failed.returncode == 3, text
    assert "no longer exists" in text and f"{SLOT}.slot.json" in text, text

    data = yaml.safe_load(cfg.read_text())
    data["source"]["on_slot_lost"] = "recreate"
    cfg.write_text(yaml.safe_dump(data))
    log.write_text("")
    proc = start_cdcd("run", "--config", str(cfg), log_path=log)
    try:
        _wait(lambda: _backfilled(log, 1), 120, "the backfill", log)
        assert _stop(proc) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    recreated = [e for e in _log_lines(log) if e.get("event") == "replication slot recreated"]
    assert recreated and recreated[0]["reason"] == "missing", recreated
    _assert_equal(tmp_path / "out", cluster, resets=1)


def test_dropped_slot_without_snapshots(
    tmp_path: Path, pg_cluster_factory: Callable[..., PgCluster]
) -> None:
    """``snapshot.mode: never`` keeps no snapshot state, yet a slot dropped after cdcd streamed
    from it is still known as lost (its slot record): exit 3, not a silent new slot; ``cdcd
    slot drop`` starts over."""
    cluster = _cluster(pg_cluster_factory)
    cfg = _config(tmp_path, cluster, "fail", snapshot="never")
    end = cluster.fetchval("SELECT pg_current_wal_lsn()::text")
    run_cdcd("run", "--config", str(cfg), "--endpos", end)
    assert (tmp_path / "cdcd-state" / f"{SLOT}.slot.json").exists()
    cluster.execute(f"SELECT pg_drop_replication_slot('{SLOT}')", DB)
    failed = run_cdcd("run", "--config", str(cfg), check=False, timeout=60)
    text = failed.stdout + failed.stderr
    assert failed.returncode == 3, text
    assert "no longer exists" in text and f"{SLOT}.slot.json" in text, text
    assert _wal_status(cluster) is None  # no slot was created
    run_cdcd("slot", "drop", "--config", str(cfg))
    assert not (tmp_path / "cdcd-state" / f"{SLOT}.slot.json").exists()
    end = cluster.fetchval("SELECT pg_current_wal_lsn()::text")
    run_cdcd("run", "--config", str(cfg), "--endpos", end)  # a new slot, recorded again
    assert _wal_status(cluster) is not None
    assert (tmp_path / "cdcd-state" / f"{SLOT}.slot.json").exists()


@pytest.mark.slow  # kills: newest PostgreSQL only (conftest.py)
def test_recreate_killed_midway(
    tmp_path: Path, pg_cluster_factory: Callable[..., PgCluster]
) -> None:
    """cdcd SIGKILLed just after it replaced the slot (the reset perhaps not durable yet): the
    next start finds the recreation unfinished and does it again; the outcome is the same."""
    cluster = _cluster(pg_cluster_factory)
    cfg = _config(tmp_path, cluster, "recreate")
    end = cluster.fetchval("SELECT pg_current_wal_lsn()::text")
    run_cdcd("run", "--config", str(cfg), "--endpos", end)
    _gap_changes(cluster, 1000)
    _invalidate(cluster)
    log = tmp_path / "cdcd.log"
    proc = start_cdcd("run", "--config", str(cfg), log_path=log)
    try:
        _wait(lambda: "replication slot recreated" in log.read_text(), 60, "the new slot", log)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        marker = tmp_path / "cdcd-state" / f"{SLOT}.recreate.json"
        pending = marker.exists()
        again = tmp_path / "cdcd-again.log"
        proc = start_cdcd("run", "--config", str(cfg), log_path=again)
        if pending:  # the recreation is done again, and with it every table's backfill
            _wait(lambda: _backfilled(again, 1), 120, "the backfill", again)
        else:  # the backfill resumes: a table done before the kill is not read again
            _wait(lambda: _backfilled_in(log, again), 120, "the backfill", again)
        assert _stop(proc) == 0, again.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    recreated = [
        e
        for path in (log, again)
        for e in _log_lines(path)
        if e.get("event") == "replication slot recreated"
    ]
    assert len(recreated) == (2 if pending else 1), (pending, recreated)
    assert not marker.exists()
    for table in TABLES:  # a reset that became durable before the kill is not taken back
        resets = [e for e in checked_events(tmp_path / "out", table) if e["op"] == "t"]
        assert 1 <= len(resets) <= len(recreated), resets
        assert comparable(apply_events(checked_events(tmp_path / "out", table))) == _source(
            cluster, table
        )


@pytest.mark.slow  # the sink's side: newest PostgreSQL only (conftest.py)
async def test_recreate_with_kafka(
    tmp_path: Path, pg_cluster_factory: Callable[..., PgCluster], kafka_broker: Any
) -> None:
    """The reset and the backfill in Kafka too: every event the files have, and the tables
    rebuilt from the topics equal the source."""
    cluster = _cluster(pg_cluster_factory)
    cfg = _config(tmp_path, cluster, "recreate")
    name = f"rc{int(time.time() * 1000) % 10**9}"
    data = yaml.safe_load(cfg.read_text())
    data["name"] = name
    data["sinks"].append(
        {
            "type": "kafka",
            "bootstrap_servers": kafka_broker.bootstrap,
        }
    )
    cfg.write_text(yaml.safe_dump(data))
    end = cluster.fetchval("SELECT pg_current_wal_lsn()::text")
    run_cdcd("run", "--config", str(cfg), "--endpos", end)
    _gap_changes(cluster, 1000)
    _invalidate(cluster)
    log = tmp_path / "cdcd.log"
    proc = start_cdcd("run", "--config", str(cfg), log_path=log)
    try:
        _wait(lambda: _backfilled(log, 1), 120, "the backfill", log)
        cluster.execute("DELETE FROM t WHERE id < 20; UPDATE u SET w = -w", DB)
        time.sleep(1)
        assert _stop(proc) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    end = cluster.fetchval("SELECT pg_current_wal_lsn()::text")
    run_cdcd("run", "--config", str(cfg), "--endpos", end)
    _assert_equal(tmp_path / "out", cluster, resets=1)
    files = {table: checked_events(tmp_path / "out", table) for table in TABLES}
    count = sum(len(e) + sum(1 for x in e if x["op"] == "d") for e in files.values())
    records = await consume_prefix(kafka_broker.bootstrap, name, count)
    for table in TABLES:
        topic = f"{name}.{table}"
        events = {}
        for record in records[topic]:
            if not record.is_tombstone:
                events[record.position] = record.event()
        assert set(events) == {position(e) for e in files[table]}, topic
        resets = [e for e in events.values() if e["op"] == "t"]
        assert len(resets) == 1 and resets[0]["source"]["snapshot"] == "reset", resets
        rebuilt = comparable(apply_events(events.values()))
        assert rebuilt == _source(cluster, table), topic
