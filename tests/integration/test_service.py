"""cdcd as a service: the real CLI against real PostgreSQL servers, observed from outside.

* ``/metrics`` (parsed with prometheus-client's own text parser) while a workload runs: the
  transaction and per-table/op event counters and the acknowledged LSN move forward, and the
  replication lag in bytes is 0 once the daemon has caught up; ``/healthz`` is 200 all along;
  ``/readyz`` is 503 until the daemon streams (held back here by an open transaction, which
  makes the server wait before it can create the slot) and 200 afterwards;
* SIGTERM in the middle of a workload drains: exit 0; a restart up to ``--endpos`` then yields
  exactly the source rows, with no position ``(commit_lsn, seq)`` twice;
* ``cdcd check`` on a healthy server (exit 0; the report names server version, wal_level,
  protocol, slot, publication and the replica identity of each table, a table without a key
  in the insert-only publication), and on a server with ``wal_level=replica`` (exit 3);
* ``cdcd quickstart`` headless: bounded time, exit 0, events of the snapshot and the workload;
* a config whose ``${VAR}`` is not set: exit 2 naming the key and the variable.

On the newest installed PostgreSQL only (``version_independent``: the service around the
stream does not depend on the server version; the metrics test uses a private cluster, so other tests' WAL does not keep its lag moving; the
quickstart brings its own embedded server). Waits are bounded polls, never timing assertions.
"""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e import (
    REPO,
    apply_events,
    cdcd_cmd,
    checked_events,
    comparable,
    run_cdcd,
    start_cdcd,
    write_config,
)
from tests.pgharness import PgCluster, PgDatabase, create_database, free_port

pytestmark = [pytest.mark.version_independent, pytest.mark.timeout(300)]

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


# -- helpers ---------------------------------------------------------------------------------


def service_config(directory: Path, dsn: str, port: int | None, **top: Any) -> Path:
    """:func:`tests.e2e.write_config` with the HTTP endpoint on ``127.0.0.1:port`` and extra
    top-level sections (``shutdown=...``)."""
    path = write_config(directory, dsn)
    cfg = yaml.safe_load(path.read_text())
    cfg["http"] = {"listen": None if port is None else f"127.0.0.1:{port}"}
    cfg.update(top)
    path.write_text(yaml.safe_dump(cfg))
    return path


def http_get(port: int, path: str) -> tuple[int, str]:
    """Status and body of ``GET http://127.0.0.1:port/path`` (non-2xx statuses included)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def scrape(port: int) -> Samples:
    """Every sample of ``/metrics``, keyed by (sample name, sorted labels)."""
    status, text = http_get(port, "/metrics")
    assert status == 200, text
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metric(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    """Poll ``predicate`` until it returns something truthy (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.2)


def endpoint_up(port: int) -> bool:
    try:
        return http_get(port, "/healthz")[0] == 200
    except OSError:
        return False


@contextmanager
def daemon(cfg: Path, log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``cdcd run`` in the background; killed at the end if it is still running."""
    proc = start_cdcd("run", "--config", str(cfg), log_path=log_path)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def alive(proc: subprocess.Popen[bytes], log_path: Path) -> bool:
    """True while ``proc`` runs; fails the test with its log if it exited."""
    if proc.poll() is not None:
        raise AssertionError(f"cdcd exited {proc.returncode}:\n{log_path.read_text()[-6000:]}")
    return True


def scrape_until(
    proc: subprocess.Popen[bytes],
    log_path: Path,
    port: int,
    condition: Callable[[Samples], bool],
    what: str,
) -> Samples:
    """Scrape ``/metrics`` until ``condition`` holds (bounded); returns that scrape."""

    def attempt() -> Samples | None:
        alive(proc, log_path)
        samples = scrape(port)
        return samples if condition(samples) else None

    result: Samples = wait_for(attempt, what)
    return result


def inserts_at_least(count: int, samples: Samples) -> bool:
    return metric(samples, "cdcd_events_total", table="public.orders", op="c") >= count


def current_lsn(db: PgDatabase) -> str:
    return str(db.fetchval("SELECT pg_current_wal_lsn()::text"))


def lsn_int(text: str) -> int:
    high, low = text.split("/")
    return (int(high, 16) << 32) | int(low, 16)


# -- /metrics, /healthz, /readyz -------------------------------------------------------------


@pytest.mark.pg
def test_metrics_and_probes_during_a_workload(
    pg_cluster_factory: Callable[..., PgCluster], tmp_path: Path
) -> None:
    # A private cluster: WAL written by other tests' databases would keep the lag moving.
    pg_db = create_database(pg_cluster_factory())
    pg_db.enable_streaming()
    pg_db.execute("CREATE TABLE orders (id serial PRIMARY KEY, amount int NOT NULL)")
    port = free_port()
    cfg = service_config(tmp_path, pg_db.dsn, port)
    log_path = tmp_path / "cdcd.log"

    # A transaction that holds an xid makes CREATE_REPLICATION_SLOT wait for it: the daemon is
    # up (its endpoint answers) but cannot stream yet.
    with pg_db.connect() as blocker:
        blocker.autocommit = False
        with blocker.cursor() as cur:
            cur.execute("SELECT txid_current()")
        with daemon(cfg, log_path) as proc:
            wait_for(lambda: alive(proc, log_path) and endpoint_up(port), "the HTTP endpoint")
            assert http_get(port, "/healthz") == (200, "ok\n")
            assert http_get(port, "/readyz")[0] == 503
            assert metric(scrape(port), "cdcd_up") == 0
            blocker.rollback()

            wait_for(
                lambda: alive(proc, log_path) and http_get(port, "/readyz")[0] == 200,
                "/readyz to turn 200 once streaming",
            )
            before = scrape(port)
            assert metric(before, "cdcd_up") == 1

            rounds, per_round = 3, 5
            history = [before]
            inserted = 0
            # rounds of small transactions, then one large enough to stream, past the
            # assembler's compact threshold: its rows' JSON is made as its segments arrive
            # (docs/assembler.md)
            for txns, rows_per_txn in [(per_round, 4)] * rounds + [(1, 20000)]:
                for _ in range(txns):
                    pg_db.execute(
                        f"INSERT INTO orders (amount) SELECT g FROM generate_series(1, {rows_per_txn}) g"
                    )
                    inserted += rows_per_txn
                history.append(
                    scrape_until(
                        proc,
                        log_path,
                        port,
                        partial(inserts_at_least, inserted),
                        f"{inserted} insert events in /metrics",
                    )
                )
            assert metric(history[-1], "cdcd_streamed_changes_rendered_total") > 10000
            assert metric(history[-2], "cdcd_streamed_changes_rendered_total") == 0
            end_lsn = lsn_int(current_lsn(pg_db))

            # counters and the acknowledged LSN only move forward, and moved with each round
            for name, labels in (
                ("cdcd_transactions_total", {}),
                ("cdcd_events_total", {"table": "public.orders", "op": "c"}),
                ("cdcd_received_messages_total", {}),
                ("cdcd_received_bytes_total", {}),
            ):
                values = [metric(s, name, **labels) for s in history]
                assert values == sorted(values), (name, values)
                assert values[-1] > values[0], (name, values)
            assert (
                metric(history[-1], "cdcd_transactions_total")
                - metric(before, "cdcd_transactions_total")
                >= rounds * per_round
            )
            assert (
                metric(history[-1], "cdcd_events_total", table="public.orders", op="c") == inserted
            )

            # once idle: everything acknowledged, no lag
            caught_up = scrape_until(
                proc,
                log_path,
                port,
                lambda s: (
                    metric(s, "cdcd_acknowledged_lsn") >= end_lsn
                    and metric(s, "cdcd_server_wal_lsn") >= end_lsn
                    and metric(s, "cdcd_replication_lag_bytes") == 0
                ),
                "the acknowledged LSN to reach the server's position with no lag",
            )
            acked = [metric(s, "cdcd_acknowledged_lsn") for s in [*history, caught_up]]
            assert acked == sorted(acked) and acked[-1] > acked[0], acked
            assert metric(caught_up, "cdcd_replication_lag_seconds") == 0
            assert metric(caught_up, "cdcd_slot_wal_status", status="reserved") == 1
            assert metric(caught_up, "cdcd_sink_write_seconds_count", sink="file") >= (
                rounds * per_round
            )
            assert http_get(port, "/healthz")[0] == 200
            assert http_get(port, "/nope")[0] == 404

            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, log_path.read_text()[-6000:]
    events = checked_events(tmp_path / "out", "public.orders")
    assert len(events) == inserted


# -- SIGTERM drains --------------------------------------------------------------------------


class Inserts(threading.Thread):
    """Small insert transactions (and some updates) until stopped, at most ``seconds``."""

    def __init__(self, db: PgDatabase, seconds: float = 240.0) -> None:
        super().__init__(daemon=True)
        self.db = db
        self.seconds = seconds
        self.stop_flag = threading.Event()
        self.committed = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            deadline = time.monotonic() + self.seconds
            with self.db.connect() as conn, conn.cursor() as cur:
                while not self.stop_flag.is_set() and time.monotonic() < deadline:
                    cur.execute(
                        "INSERT INTO items (payload) VALUES (repeat('x', 50)), (repeat('y', 10))"
                    )
                    if self.committed % 7 == 0:
                        cur.execute(
                            "UPDATE items SET payload = 'z' WHERE id = %s", (self.committed,)
                        )
                    self.committed += 1
                    time.sleep(0.005)
        except BaseException as exc:  # reported by the test
            self.error = exc


@pytest.mark.pg
def test_sigterm_drains_and_a_restart_loses_and_repeats_nothing(
    pg_db: PgDatabase, tmp_path: Path
) -> None:
    pg_db.execute("CREATE TABLE items (id serial PRIMARY KEY, payload text)")
    grace = 20
    cfg = service_config(tmp_path, pg_db.dsn, None, shutdown={"grace_period": f"{grace}s"})
    run_cdcd("slot", "create", "--config", str(cfg))
    log_path = tmp_path / "cdcd.log"
    out = tmp_path / "out"
    workload = Inserts(pg_db)
    workload.start()
    try:
        with daemon(cfg, log_path) as proc:
            wait_for(
                lambda: (
                    alive(proc, log_path) and len(list((out / "public.items").glob("*.jsonl"))) >= 3
                ),
                "the first files while the workload runs",
            )
            assert workload.is_alive(), f"the workload ended before SIGTERM: {workload.error!r}"
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=grace + 30)
            assert code == 0, log_path.read_text()[-6000:]
            assert workload.is_alive(), (
                f"the workload ended before the drain did: {workload.error!r}"
            )
    finally:
        workload.stop_flag.set()
        workload.join(timeout=30)
    assert workload.error is None, workload.error
    assert "stopping: draining sinks" in log_path.read_text()

    run_cdcd("run", "--config", str(cfg), "--endpos", current_lsn(pg_db))
    events = checked_events(out, "public.items")  # asserts: no (commit_lsn, seq) twice
    expected = [r[0] for r in pg_db.fetch("SELECT to_jsonb(i) FROM items i")]
    assert comparable(apply_events(events)) == comparable(expected)
    inserts = [e for e in events if e["op"] == "c"]
    assert len(inserts) == 2 * workload.committed


# -- cdcd check ------------------------------------------------------------------------------


REPORT_ROW = re.compile(r"^\s*(?P<item>\S.*?)\s{2,}(?P<status>ok|warn|FAIL)\s+(?P<detail>.*?)\s*$")


def check_report(cfg: Path) -> tuple[int, dict[str, tuple[str, str]]]:
    """Exit code and the report's rows ``item -> (status, detail)``."""
    proc = run_cdcd("check", "--config", str(cfg), check=False)
    rows: dict[str, tuple[str, str]] = {}
    for line in proc.stdout.splitlines():
        match = REPORT_ROW.match(line)
        if match:
            rows[match["item"]] = (match["status"], match["detail"])
    assert rows, f"no report rows in:\n{proc.stdout}\n{proc.stderr}"
    return proc.returncode, rows


@pytest.mark.pg
def test_check_healthy_server_reports_every_item(pg_db: PgDatabase, tmp_path: Path) -> None:
    pg_db.execute("CREATE TABLE orders (id int PRIMARY KEY, note text)")
    pg_db.execute("CREATE TABLE events_log (at timestamptz, what text)")  # no key, DEFAULT
    pg_db.execute("CREATE TABLE audit (id int, what text)")
    pg_db.execute("ALTER TABLE audit REPLICA IDENTITY FULL")
    cfg = service_config(tmp_path, pg_db.dsn, None)
    # events_log's writes would fail once published for updates: its inserts only
    data = yaml.safe_load(cfg.read_text())
    data["source"]["keyless_tables"] = "insert_only"
    cfg.write_text(yaml.safe_dump(data))
    run_cdcd("slot", "create", "--config", str(cfg))
    code, rows = check_report(cfg)
    assert code == 0, rows
    version = str(pg_db.fetchval("SHOW server_version"))
    assert rows["server version"] == ("ok", version)
    assert rows["wal_level"] == ("ok", "logical")
    assert rows["protocol"][0] == "ok" and "proto_version=" in rows["protocol"][1]
    assert rows["slot"][0] == "ok" and "'cdcd_e2e'" in rows["slot"][1]
    assert rows["publication"] == ("ok", "'cdcd_e2e_pub': 2 tables (managed by cdcd)")
    assert rows["public.orders"][0] == "ok" and "primary key" in rows["public.orders"][1]
    assert rows["public.audit"][0] == "ok" and "replica identity full" in rows["public.audit"][1]
    status, detail = rows["public.events_log"]
    assert status == "ok" and "replica identity default without a primary key" in detail
    assert "'cdcd_e2e_pub_insert_only': inserts and truncates only" in detail


@pytest.mark.pg
def test_check_fails_on_wal_level_replica(
    pg_cluster_factory: Callable[..., Any], tmp_path: Path
) -> None:
    cluster = pg_cluster_factory(settings={"wal_level": "replica"})
    cfg = service_config(tmp_path, cluster.dsn("postgres"), None)
    code, rows = check_report(cfg)
    assert code == 3, rows
    assert rows["wal_level"][0] == "FAIL" and "replica" in rows["wal_level"][1]


# -- quickstart and config errors ------------------------------------------------------------


@pytest.mark.pg
def test_quickstart_runs_headless(tmp_path: Path) -> None:
    base = tmp_path / "qs"
    proc = subprocess.run(
        [*cdcd_cmd("quickstart", "--duration", "6", "--dir", str(base), "--rate", "20")],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "done:" in proc.stdout
    out = base / "cdc-out"
    customers = checked_events(out, "public.customers")
    assert len(customers) >= 50 and {e["op"] for e in customers} == {"r"}
    orders = checked_events(out, "public.orders")
    # the workload starts with the pipeline: orders made before the snapshot are read as r
    assert orders and {e["op"] for e in orders} <= {"r", "c", "u", "d"}
    assert "c" in {e["op"] for e in orders}


def test_missing_env_var_exits_2_naming_the_key(tmp_path: Path) -> None:
    cfg = tmp_path / "cdcd.yaml"
    cfg.write_text(
        "source:\n  dsn: ${CDCD_TEST_UNSET_DSN_H11}\nsinks:\n  - type: file\n    path: out\n"
    )
    for command in (("run",), ("check",), ("slot", "status")):
        proc = run_cdcd(*command, "--config", str(cfg), check=False)
        assert proc.returncode == 2, proc.stderr
        assert "source.dsn" in proc.stderr and "CDCD_TEST_UNSET_DSN_H11" in proc.stderr
