"""End to end: what the real CLI does with bad input and a broken source (README "Running against your database": exit codes).

* 2: an invalid configuration; the message names the key and the problem.
* 3: a definite source problem: ``wal_level`` not logical, a missing slot, a slot invalidated
  by ``max_slot_wal_keep_size``, a publication dropped while streaming. The run must end
  promptly with a message saying what is wrong and what to do, never retry forever.

Clusters with unusual settings are private (``pg_cluster_factory``, or one module-scoped
``wal_level=replica`` cluster of the newest installed version).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e import data_files, run_cdcd, start_cdcd, write_config
from tests.pgharness import PgCluster, PgDatabase, create_database, find_installations

pytestmark = [pytest.mark.timeout(300)]

EXIT_USAGE = 2
EXIT_SOURCE = 3

#: a DSN nothing listens on: configuration errors must be reported before any connection
NOWHERE = "postgresql://cdc@127.0.0.1:1/shop"


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("source", "key", "problem"),
    [
        ({"bogus": 1}, "source.bogus", "unknown key"),
        ({"two_phase": "maybe"}, "source.two_phase", "boolean"),
        ({"proto_version": 9}, "source.proto_version", "9"),
        ({"slot": ["a", "b"]}, "source.slot", "string"),
    ],
    ids=["unknown-key", "not-a-bool", "bad-choice", "list-for-string"],
)
@pytest.mark.parametrize("command", ["run", "check"])
def test_invalid_config_exits_2_naming_the_key(
    tmp_path: Path, command: str, source: dict[str, Any], key: str, problem: str
) -> None:
    cfg = write_config(tmp_path, NOWHERE, **source)
    proc = run_cdcd(command, "--config", str(cfg), check=False, timeout=60)
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert key in proc.stderr and problem in proc.stderr, proc.stderr


def test_invalid_config_reports_every_problem(tmp_path: Path) -> None:
    cfg = write_config(tmp_path, NOWHERE)
    raw = yaml.safe_load(cfg.read_text())
    raw["buffr"] = {}
    raw["sinks"][0]["format"] = "csv"
    cfg.write_text(yaml.safe_dump(raw))
    proc = run_cdcd("run", "--config", str(cfg), check=False, timeout=60)
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert "buffr: unknown key" in proc.stderr
    assert "sinks[0].format" in proc.stderr and "csv" in proc.stderr


@pytest.mark.parametrize(
    ("listen", "problem"),
    [("127.0.0.1:70000", "out of range"), ("localhost", "HOST:PORT")],
    ids=["port-out-of-range", "no-port"],
)
def test_bad_http_listen_exits_2(tmp_path: Path, listen: str, problem: str) -> None:
    cfg = write_config(tmp_path, NOWHERE)
    raw = yaml.safe_load(cfg.read_text())
    raw["http"] = {"listen": listen}
    cfg.write_text(yaml.safe_dump(raw))
    proc = run_cdcd("run", "--config", str(cfg), check=False, timeout=60)
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert "http.listen" in proc.stderr and problem in proc.stderr, proc.stderr


def test_http_listen_in_use_exits_2_before_connecting(tmp_path: Path) -> None:
    """The endpoint is bound before cdcd connects to the source (NOWHERE would be retried):
    an address in use stops it before any slot or publication could be created."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = write_config(tmp_path, NOWHERE)
        raw = yaml.safe_load(cfg.read_text())
        raw["http"] = {"listen": f"127.0.0.1:{port}"}
        cfg.write_text(yaml.safe_dump(raw))
        proc = run_cdcd("run", "--config", str(cfg), check=False, timeout=60)
    assert proc.returncode == EXIT_USAGE, proc.stderr
    assert f"http.listen: cannot listen on 127.0.0.1:{port}" in proc.stderr, proc.stderr
    assert "in use" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


# --------------------------------------------------------------------------- wal_level


@pytest.fixture(scope="module")
def replica_cluster() -> Iterator[PgCluster]:
    """A cluster of the newest installed version with ``wal_level=replica``."""
    installs = find_installations()
    if not installs:
        pytest.skip("no PostgreSQL installation found")
    newest = max(installs, key=lambda i: i.major)
    cluster = PgCluster(newest, settings={"wal_level": "replica"})
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.destroy()


@pytest.mark.pg
@pytest.mark.parametrize("command", [("run",), ("slot", "create"), ("check",)], ids=" ".join)
def test_wal_level_replica_exits_3(
    replica_cluster: PgCluster, tmp_path: Path, command: tuple[str, ...]
) -> None:
    db = create_database(replica_cluster)
    try:
        cfg = write_config(tmp_path, db.dsn, create_slot=True)
        proc = run_cdcd(*command, "--config", str(cfg), check=False, timeout=60)
        assert proc.returncode == EXIT_SOURCE, proc.stderr
        assert "wal_level" in proc.stdout + proc.stderr
        assert "logical" in proc.stdout + proc.stderr
    finally:
        db.drop()


# --------------------------------------------------------------------------- slots


@pytest.mark.pg
@pytest.mark.version_independent  # cdcd's own check: newest PostgreSQL only (conftest.py)
def test_missing_slot_without_create_slot_exits_3(pg_db: PgDatabase, tmp_path: Path) -> None:
    cfg = write_config(tmp_path, pg_db.dsn, slot="no_such_slot", create_slot=False)
    proc = run_cdcd("run", "--config", str(cfg), check=False, timeout=60)
    assert proc.returncode == EXIT_SOURCE, proc.stderr
    assert "no_such_slot" in proc.stderr and "does not exist" in proc.stderr
    assert pg_db.slots() == []  # and it did not create one


def _invalidate(db: PgDatabase, slot: str) -> None:
    """Write WAL, switch segments and checkpoint until the slot is lost (bounded)."""
    db.execute("CREATE TABLE filler (b text)")
    for _ in range(20):
        db.execute(
            "INSERT INTO filler SELECT repeat(md5(g::text), 32) FROM generate_series(1, 2000) g"
        )
        db.execute("SELECT pg_switch_wal(); CHECKPOINT")
        status = db.fetchval(
            f"SELECT wal_status FROM pg_replication_slots WHERE slot_name = '{slot}'"
        )
        if status == "lost":
            return
    raise AssertionError(f"slot {slot} not invalidated (wal_status {status})")


@pytest.mark.pg
def test_invalidated_slot_exits_3(
    pg_cluster_factory: Callable[..., PgCluster], tmp_path: Path
) -> None:
    cluster = pg_cluster_factory(settings={"max_slot_wal_keep_size": "1MB"})
    db = create_database(cluster)
    cfg = write_config(tmp_path, db.dsn, create_slot=False)
    run_cdcd("slot", "create", "--config", str(cfg))
    _invalidate(db, "cdcd_e2e")
    endpos = str(db.fetchval("SELECT pg_current_wal_insert_lsn()::text"))
    proc = run_cdcd("run", "--config", str(cfg), "--endpos", endpos, check=False, timeout=60)
    assert proc.returncode == EXIT_SOURCE, proc.stderr
    assert "invalidated" in proc.stderr, proc.stderr
    assert "slot drop" in proc.stderr and "snapshot" in proc.stderr  # what to do
    status = run_cdcd("slot", "status", "--config", str(cfg), check=False, timeout=60)
    assert status.returncode == EXIT_SOURCE and "lost" in status.stdout


# --------------------------------------------------------------------------- publication


@pytest.mark.pg
def test_publication_dropped_while_running_exits_3(pg_db: PgDatabase, tmp_path: Path) -> None:
    """15-17 fail the stream with an error; 18 only warns "skipped loading publication" and
    carries on without publishing: cdcd checks pg_publication when it sees that warning."""
    pg_db.execute("CREATE TABLE t (id int PRIMARY KEY)")
    cfg = write_config(tmp_path, pg_db.dsn)
    run_cdcd("slot", "create", "--config", str(cfg))
    log = tmp_path / "cdcd.log"
    proc = start_cdcd("run", "--config", str(cfg), log_path=log)
    try:
        pg_db.execute("INSERT INTO t VALUES (1)")
        deadline = time.monotonic() + 60
        while not data_files(tmp_path / "out" / "public.t"):
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "no file published within 60 s"
            time.sleep(0.1)
        pg_db.execute("DROP PUBLICATION cdcd_e2e_pub")
        pg_db.execute("INSERT INTO t VALUES (2)")
        returncode = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text()
    assert returncode == EXIT_SOURCE, text
    assert (
        'publication \\"cdcd_e2e_pub\\" does not exist' in text
        or "publication 'cdcd_e2e_pub' does not exist" in text
    ), text
