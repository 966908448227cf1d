"""Crash safety end to end: the real ``cdcd`` daemon against a real PostgreSQL while a workload
runs, with real faults — SIGKILL of the daemon, server restarts and crashes, connections cut by a
TCP proxy, SIGTERM — and then exact checks (docs/files.md, docs/progress.md):

* every committed change is in the files exactly once: no ``(commit_lsn, seq)`` twice, the
  number of events per folder and op equals what the workload committed, and replaying the
  files rebuilds the source tables;
* every folder is well formed: each file is named after its first event, sorting file names
  sorts events, no temporary file is left over;
* the slot's ``confirmed_flush_lsn`` never covers a transaction the files do not hold
  (checked against an independent ``test_decoding`` slot).

The workload mixes multi-statement transactions over three tables, transactions large enough
to be streamed (``logical_decoding_work_mem`` = 64kB), aborted ones, savepoint rollbacks,
transactional and non-transactional logical messages and prepared transactions that stay
unresolved for a while. It counts what it commits; when a COMMIT's outcome is unknown (the
server went away), it asks the server (``pg_xact_status``, ``pg_prepared_xacts``).

Marked ``slow``: only the newest installed PostgreSQL runs these by default (they take a while),
and the SIGKILL loop kills 10 times; ``CDCD_TEST_ALL_VERSIONS=1`` runs them on every version
(tests/conftest.py) and kills 22 times. ``CDCD_CRASH_SEED`` fixes the seed.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import psycopg2
import pytest
import yaml

from cdcd.lsn import parse_lsn
from tests.e2e import (
    all_events,
    assert_no_duplicates,
    position,
    read_events,
    rebuild,
    run_cdcd,
    start_cdcd,
    thorough,
    write_config,
)
from tests.pgharness import PgCluster, PgDatabase, create_database
from tests.tcpproxy import TcpProxy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

SEED = int(os.environ.get("CDCD_CRASH_SEED", "20241122"))
SLOT = "cdcd_e2e"
#: kills of the SIGKILL loop: a few cover startup and streaming; the full count, more moments
KILLS = 22 if thorough() else 10
PUBLICATION = "cdcd_e2e_pub"
TRUTH_SLOT = "crash_truth"
#: table -> key columns; every table is in the publication
TABLES = {"acct": ("id",), "item": ("id",), "note": ("k1", "k2")}
_DATA_NAME = re.compile(r"[0-9A-F]{16}-[0-9A-F]{8}\.jsonl")


# --------------------------------------------------------------------------- the workload


class Workload(threading.Thread):
    """Random transactions against one database until :meth:`finish`; counts what committed.

    ``committed[(folder, op)]`` is the number of events the files must hold in the end. The
    workload survives server restarts and crashes: it reconnects, and resolves a COMMIT or
    PREPARE whose outcome it did not see by asking the server.
    """

    def __init__(
        self,
        cluster: PgCluster,
        dbname: str,
        seed: int,
        *,
        two_phase: bool = True,
        nontransactional_messages: bool = True,
        pause: float = 0.01,
    ) -> None:
        super().__init__(daemon=True, name="workload")
        self.cluster = cluster
        self.dbname = dbname
        self.rng = random.Random(seed)
        self.two_phase = two_phase
        self.nontransactional_messages = nontransactional_messages
        self.pause = pause
        self.committed: Counter[tuple[str, str]] = Counter()
        self.transactions = 0
        self.aborted = 0
        self.in_doubt = 0
        self.error: BaseException | None = None
        #: xid -> what the transaction was (for failure messages)
        self.kinds: dict[int, str] = {}
        self._stop_flag = threading.Event()
        self._hold = threading.Event()
        self._conn: Any = None
        self._next_id = {"acct": 0, "item": 0, "note": 0}
        self._prepared: dict[str, tuple[int, Counter[tuple[str, str]]]] = {}
        self._gid = 0

    # -- control --------------------------------------------------------------------------

    def finish(self, timeout: float = 120) -> None:
        """Stop, resolve every prepared transaction, and re-raise the workload's error."""
        self._stop_flag.set()
        self.join(timeout)
        assert not self.is_alive(), "workload did not stop"
        if self.error is not None:
            raise AssertionError(f"workload failed: {self.error!r}") from self.error

    def hold_prepares(self, hold: bool) -> None:
        """While held, prepare nothing new and commit the prepared transactions."""
        if hold:
            self._hold.set()
        else:
            self._hold.clear()

    @property
    def unresolved(self) -> int:
        return len(self._prepared)

    @property
    def total(self) -> int:
        return sum(self.committed.values())

    def run(self) -> None:
        try:
            while not self._stop_flag.is_set():
                self._step()
                time.sleep(self.pause)
            while self._prepared:
                self._resolve_prepared(commit_all=True)
        except BaseException as exc:  # reported by finish()
            self.error = exc
        finally:
            if self._conn is not None:
                self._conn.close()

    # -- connections ----------------------------------------------------------------------

    def _cursor(self) -> Any:
        deadline = time.monotonic() + 90
        while self._conn is None or self._conn.closed:
            try:
                self._conn = psycopg2.connect(
                    host=str(self.cluster.socket_dir),
                    port=self.cluster.port,
                    user=self.cluster.superuser,
                    dbname=self.dbname,
                    connect_timeout=5,
                )
                self._conn.autocommit = True
            except psycopg2.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        return self._conn.cursor()

    def _lost(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn = None

    def _ask(self, sql: str, *args: Any) -> Any:
        """One value, retried across reconnects (for resolving outcomes)."""
        while True:
            try:
                with self._cursor() as cur:
                    cur.execute(sql, args)
                    row = cur.fetchone()
                    return None if row is None else row[0]
            except (psycopg2.OperationalError, psycopg2.InterfaceError):
                self._lost()
                time.sleep(0.1)

    def _xact_outcome(self, xid: int, gid: str | None = None) -> str:
        """committed | aborted | prepared, once the server knows."""
        deadline = time.monotonic() + 60
        while True:
            if gid is not None and self._ask(
                "SELECT count(*) FROM pg_prepared_xacts WHERE gid = %s", gid
            ):
                return "prepared"
            try:
                status = self._ask("SELECT pg_xact_status(%s::text::xid8)", str(xid))
            except psycopg2.errors.InvalidParameterValue:  # "is in the future"
                return "aborted"  # a crash lost it before it reached the WAL
            if status in ("committed", "aborted"):
                return str(status)
            if time.monotonic() > deadline:
                raise AssertionError(f"transaction {xid} stayed {status!r}")
            time.sleep(0.05)

    # -- transactions ---------------------------------------------------------------------

    def _ids(self, table: str, n: int) -> list[int]:
        first = self._next_id[table] + 1
        self._next_id[table] += n
        return list(range(first, first + n))

    def _step(self) -> None:
        rng = self.rng
        roll = rng.random()
        if self._prepared and (roll < 0.08 or len(self._prepared) > 3 or self._hold.is_set()):
            self._resolve_prepared(commit_all=self._hold.is_set())
        else:
            kind = rng.choices(["small", "big", "abort", "prepare"], [70, 8, 8, 14])[0]
            if kind == "prepare" and (not self.two_phase or self._hold.is_set()):
                kind = "small"
            self._transaction(kind)

    def _nontransactional_message(self, cur: Any) -> None:
        """Emitted inside a transaction, before its first change or right before its COMMIT
        (then the message's LSN is the transaction's commit LSN: its position is one less,
        see test_nontransactional_message_position_is_unique), and counted at once (it is
        delivered whatever becomes of the transaction)."""
        cur.execute("SELECT pg_logical_emit_message(false, 'crash', %s)", ("nt",))
        self.committed[("_messages", "m")] += 1

    def _statements(self, cur: Any, kind: str, counts: Counter[tuple[str, str]]) -> None:
        rng = self.rng

        def run(sql: str, table: str, op: str, *args: Any) -> None:
            cur.execute(sql, args)
            counts[(f"public.{table}", op)] += cur.rowcount

        if kind in ("big", "big_insert"):
            ids = self._ids("item", rng.randint(400, 800))
            run(
                "INSERT INTO item SELECT g, repeat(md5(g::text), 4) FROM unnest(%s::int[]) g",
                "item",
                "c",
                ids,
            )
            if kind == "big_insert":
                return
            run("UPDATE item SET payload = 'u' || id WHERE id = ANY(%s)", "item", "u", ids[::7])
            if rng.random() < 0.5:
                run("DELETE FROM item WHERE id %% 5 = 0 AND id < %s", "item", "d", ids[0])
            return
        for _ in range(rng.randint(1, 6)):
            what = rng.random()
            if kind == "insert":  # fresh rows only (see _mode)
                what = rng.choice([0.0, 0.7, 0.85])
            if what < 0.35:
                ids = self._ids("acct", rng.randint(1, 5))
                run(
                    "INSERT INTO acct SELECT g, g * 10, 'n' || g FROM unnest(%s::int[]) g",
                    "acct",
                    "c",
                    ids,
                )
            elif what < 0.55:
                pick = rng.randint(1, max(1, self._next_id["acct"]))
                run(
                    "UPDATE acct SET balance = balance + 1 WHERE id BETWEEN %s AND %s",
                    "acct",
                    "u",
                    pick,
                    pick + 2,
                )
            elif what < 0.65:
                pick = rng.randint(1, max(1, self._next_id["acct"]))
                run("DELETE FROM acct WHERE id = %s", "acct", "d", pick)
            elif what < 0.8:
                (k,) = self._ids("note", 1)
                run(
                    "INSERT INTO note VALUES (%s, 'x', %s)",
                    "note",
                    "c",
                    k,
                    "v" * rng.randint(1, 50),
                )
                if rng.random() < 0.5:
                    run("UPDATE note SET body = body || '!' WHERE k1 = %s", "note", "u", k)
            elif what < 0.9:
                cur.execute("SELECT pg_logical_emit_message(true, 'crash', %s)", (b"tx",))
                counts[("_messages", "m")] += 1
            else:  # a rolled-back subtransaction leaves nothing behind
                cur.execute("SAVEPOINT s")
                self._ids("acct", 1)
                cur.execute("INSERT INTO acct VALUES (%s, 0, 'gone')", (self._next_id["acct"],))
                cur.execute("ROLLBACK TO SAVEPOINT s")

    def _mode(self, kind: str) -> str:
        """What a transaction does. Prepared ones only insert fresh rows: the locks they hold
        until COMMIT PREPARED must not block the workload's own later statements."""
        if kind == "prepare":
            return self.rng.choice(["insert", "big_insert"])
        return "big" if kind in ("big", "abort") else "small"

    def _transaction(self, kind: str) -> None:
        counts: Counter[tuple[str, str]] = Counter()
        gid = xid = None
        try:
            with self._cursor() as cur:
                cur.execute("BEGIN")
                cur.execute("SELECT pg_current_xact_id()::text::bigint")
                xid = cur.fetchone()[0]
                self.kinds[xid] = kind
                before_commit = False
                if (
                    self.nontransactional_messages
                    and kind != "prepare"
                    and self.rng.random() < 0.15
                ):
                    before_commit = self.rng.random() < 0.5
                    if not before_commit:
                        self._nontransactional_message(cur)
                self._statements(cur, self._mode(kind), counts)
                if kind == "abort":
                    cur.execute("ROLLBACK")
                    self.aborted += 1
                    return
                if kind == "prepare":
                    self._gid += 1
                    gid = f"crash_{self._gid}"
                    cur.execute("PREPARE TRANSACTION %s", (gid,))
                    self._prepared[gid] = (xid, counts)
                    return
                if before_commit:
                    self._nontransactional_message(cur)
                cur.execute("COMMIT")
        except (psycopg2.OperationalError, psycopg2.InterfaceError):
            self._lost()
            self._settle(xid, gid, counts)
            return
        self._committed(counts)

    def _settle(self, xid: int | None, gid: str | None, counts: Counter[tuple[str, str]]) -> None:
        """The connection died inside a transaction: find out what became of it."""
        if xid is None:
            return  # died before the transaction did anything
        self.in_doubt += 1
        outcome = self._xact_outcome(xid, gid)
        if outcome == "committed":
            self._committed(counts)
        elif outcome == "prepared":
            assert gid is not None
            self._prepared[gid] = (xid, counts)
        else:
            self._prepared.pop(gid or "", None)
            self.aborted += 1

    def _committed(self, counts: Counter[tuple[str, str]]) -> None:
        self.committed.update(counts)
        self.transactions += 1

    def _resolve_prepared(self, *, commit_all: bool) -> None:
        gid = self.rng.choice(sorted(self._prepared))
        xid, counts = self._prepared[gid]
        commit = commit_all or self.rng.random() < 0.8
        try:
            with self._cursor() as cur:
                cur.execute(("COMMIT" if commit else "ROLLBACK") + " PREPARED %s", (gid,))
        except (psycopg2.OperationalError, psycopg2.InterfaceError):
            self._lost()
            self.in_doubt += 1
            if self._xact_outcome(xid, gid) == "prepared":
                return  # not resolved yet: try again later
            commit = self._xact_outcome(xid) == "committed"
        del self._prepared[gid]
        if commit:
            self._committed(counts)
        else:
            self.aborted += 1


# --------------------------------------------------------------------------- set-up and checks


def prepare_database(db: PgDatabase) -> None:
    """Tables, the publication, a truth slot, and transactions large enough to stream."""
    db.execute(
        "CREATE TABLE acct (id int PRIMARY KEY, balance int NOT NULL, name text);"
        "CREATE TABLE item (id int PRIMARY KEY, payload text);"
        "CREATE TABLE note (k1 int, k2 text, body text, PRIMARY KEY (k1, k2));"
        f"CREATE PUBLICATION {PUBLICATION} FOR ALL TABLES"
    )
    # pgserver's PostgreSQL 16 comes without contrib: then there is no truth to compare with.
    with contextlib.suppress(psycopg2.errors.UndefinedFile):
        db.execute(f"SELECT pg_create_logical_replication_slot('{TRUTH_SLOT}', 'test_decoding')")
    db.cluster.execute(f"ALTER DATABASE \"{db.name}\" SET logical_decoding_work_mem = '64kB'")


def make_config(directory: Path, dsn: str, **source: Any) -> Path:
    """A config whose file sink publishes often (many files) and flushes often (confirmations
    move between faults); reconnects retry quickly."""
    path = write_config(
        directory,
        dsn,
        sinks=[
            {
                "type": "file",
                "path": "out",
                "format": "jsonl",
                "flush_interval": 0.2,
                "rollover_rows": 200,
            }
        ],
        two_phase=True,
        reconnect_min_backoff=0.2,
        reconnect_max_backoff=1.0,
        **source,
    )
    cfg = yaml.safe_load(path.read_text())
    cfg["shutdown"] = {"grace_period": 20}
    path.write_text(yaml.safe_dump(cfg))
    run_cdcd("slot", "create", "--config", str(path))
    return path


def proxied_dsn(db: PgDatabase, port: int) -> str:
    return f"postgresql://{db.cluster.superuser}@127.0.0.1:{port}/{db.name}"


def finish_to_endpos(db: PgDatabase, cfg: Path) -> None:
    """Run ``cdcd run --endpos`` (the WAL insert position now) to completion."""
    endpos = db.fetchval("SELECT pg_current_wal_insert_lsn()::text")
    run_cdcd("run", "--config", str(cfg), "--endpos", endpos, timeout=180)


def source_rows(db: PgDatabase, table: str) -> dict[tuple[Any, ...], dict[str, Any]]:
    with db.connect() as conn, conn.cursor() as cur:
        cur.execute(f"SELECT * FROM {table}")
        names = [d.name for d in cur.description]
        rows = [dict(zip(names, r, strict=True)) for r in cur.fetchall()]
    return {tuple(r[c] for c in TABLES[table]): r for r in rows}


def assert_well_formed(out: Path) -> None:
    """No temporary file left; every data file non-empty, complete, named after its first event;
    within a folder, sorting names sorts events strictly."""
    leftovers = [p for p in out.rglob(".*") if p.is_file()]
    assert not leftovers, f"temporary files left: {leftovers}"
    for folder in sorted(p for p in out.iterdir() if p.is_dir()):
        if folder.name == "_transactions":
            continue
        names = sorted(p.name for p in folder.iterdir() if p.is_file())
        assert all(_DATA_NAME.fullmatch(n) for n in names), f"{folder}: {names}"
        previous: tuple[int, int] | None = None
        for name in names:
            lines = (folder / name).read_bytes().split(b"\n")
            assert lines[-1] == b"", f"{folder / name} does not end with a newline"
            events = [orjson.loads(line) for line in lines[:-1]]
            assert events, f"{folder / name} is empty"
            first = position(events[0])
            assert name == f"{first[0]:016X}-{first[1]:08X}.jsonl", f"{name} vs {first}"
            for event in events:
                assert previous is None or position(event) > previous, (
                    f"{folder.name}/{name}: {position(event)} after {previous}"
                )
                previous = position(event)


def folder_of(event: dict[str, Any]) -> str:
    source = event["source"]
    return f"{source['schema']}.{source['table']}" if source.get("table") else "_messages"


def assert_exactly_once(db: PgDatabase, out: Path, workload: Workload) -> None:
    assert_well_formed(out)
    events = list(all_events(out))
    assert_no_duplicates(events)
    got = Counter((folder_of(e), e["op"]) for e in events)
    expected = {k: v for k, v in workload.committed.items() if v}
    assert dict(got) == expected, (
        f"events per folder/op; {explain_difference(db, events, workload.kinds)}"
    )
    assert len(events) == workload.total
    for table, key in TABLES.items():
        rebuilt = rebuild(read_events(out, f"public.{table}"), key)
        assert rebuilt == source_rows(db, table), f"public.{table} rebuilt from the files differs"


_truth: dict[str, dict[int, tuple[int, int]]] = {}


def truth(db: PgDatabase) -> dict[int, tuple[int, int]]:
    """From the test_decoding slot: xid -> (end LSN of its commit, number of changes) of every
    transaction committed so far; empty when the installation has no test_decoding. The slot is
    consumed; what it returned before is remembered (per database)."""
    known = _truth.setdefault(db.name, {})
    if not db.fetchval(
        f"SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{TRUTH_SLOT}'"
    ):
        return known
    changes: Counter[int] = Counter()
    rows = db.fetch(
        f"SELECT lsn::text, xid::text::bigint, data FROM pg_logical_slot_get_changes("
        f"'{TRUTH_SLOT}', NULL, NULL)"
    )
    for lsn, xid, data in rows:
        if data.startswith(("BEGIN", "message: transactional: 0")) or not xid:
            continue  # a non-transactional message is not part of the transaction around it
        if data.startswith("COMMIT"):
            known[xid] = (parse_lsn(lsn), changes.pop(xid, 0))
        else:
            changes[xid] += 1
    return known


def explain_difference(db: PgDatabase, events: list[dict[str, Any]], kinds: dict[int, str]) -> str:
    """For a failure message: the transactions whose event count differs from test_decoding's."""
    have = Counter(e["source"]["txId"] for e in events if e["source"].get("txId"))
    wrong = [
        f"xid {xid} ({kinds.get(xid)}) ends {end:X}: {n} changes, {have[xid]} events "
        + str(sorted((folder_of(e), position(e)) for e in events if e["source"].get("txId") == xid))
        for xid, (end, n) in sorted(truth(db).items(), key=lambda item: item[1])
        if have[xid] != n
    ]
    slot = db.fetch(
        "SELECT confirmed_flush_lsn::text, restart_lsn::text FROM pg_replication_slots "
        f"WHERE slot_name = '{SLOT}'"
    )
    return f"slot (confirmed, restart) {slot}; {len(wrong)} transactions differ: {wrong[:20]}"


def assert_nothing_confirmed_is_missing(
    db: PgDatabase, out: Path, workload: Workload | None = None
) -> int:
    """Every transaction that ends at or before the slot's confirmed_flush_lsn is complete in the
    files (confirmed means durable). Returns the confirmed LSN."""
    confirmed = parse_lsn(
        db.fetchval(
            f"SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = '{SLOT}'"
        )
    )
    assert confirmed <= parse_lsn(db.fetchval("SELECT pg_current_wal_lsn()::text"))
    have = Counter(e["source"]["txId"] for e in all_events(out) if e["source"].get("txId"))
    for xid, (end, n) in truth(db).items():
        if end <= confirmed and n:
            assert have[xid] == n, (
                f"confirmed_flush_lsn {confirmed:X} covers transaction {xid} (ends {end:X}, "
                f"{n} changes) but the files hold {have[xid]} of its events; "
                f"it was {workload.kinds.get(xid) if workload else '?'}"
            )
    return confirmed


# --------------------------------------------------------------------------- the daemon


class Daemon:
    """``cdcd run`` in the background, restartable; its output goes to one log file."""

    def __init__(self, cfg: Path, log_path: Path) -> None:
        self.cfg = cfg
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        self._streamed_before = 0

    def start(self) -> None:
        self._streamed_before = self.log().count('"event":"streaming"') if self.starts else 0
        self.proc = start_cdcd("run", "--config", str(self.cfg), log_path=self.log_path)
        self.starts += 1

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_streaming(self) -> None:
        """Wait until the current run has started streaming (its log says so)."""

        def streaming() -> bool:
            self.assert_running()
            return self.log().count('"event":"streaming"') > self._streamed_before

        wait_for(streaming, "cdcd to start streaming")

    def assert_running(self) -> None:
        assert self.proc is not None
        code = self.proc.poll()
        assert code is None, f"cdcd exited by itself with {code}:\n{self.log()[-8000:]}"

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def terminate(self, grace: float = 30) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(
                f"cdcd did not stop within {grace} s:\n{self.log()[-8000:]}"
            ) from None

    def stop_quietly(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def daemons() -> Iterator[Callable[[Path, Path], Daemon]]:
    made: list[Daemon] = []

    def make(cfg: Path, log_path: Path) -> Daemon:
        daemon = Daemon(cfg, log_path)
        made.append(daemon)
        return daemon

    yield make
    for daemon in made:
        daemon.stop_quietly()


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)


def published(out: Path) -> int:
    """How many events the files hold (lines counted, not parsed: this is polled)."""
    if not out.is_dir():
        return 0
    return sum(
        path.read_bytes().count(b"\n")
        for folder in out.iterdir()
        if folder.is_dir()
        for path in folder.iterdir()
        if _DATA_NAME.fullmatch(path.name)
    )


def wait_for_progress(out: Path, daemon: Daemon, timeout: float = 60) -> None:
    """Wait until the daemon publishes events beyond what the files hold now."""
    before = published(out)

    def moved() -> bool:
        daemon.assert_running()
        return published(out) > before

    wait_for(moved, "cdcd to publish new events", timeout)


# --------------------------------------------------------------------------- the tests


def test_sigkill_loop_loses_and_doubles_nothing(
    pg_db: PgDatabase, tmp_path: Path, daemons: Callable[[Path, Path], Daemon]
) -> None:
    prepare_database(pg_db)
    cfg = make_config(tmp_path, pg_db.dsn)
    rng = random.Random(SEED)
    workload = Workload(pg_db.cluster, pg_db.name, SEED)
    daemon = daemons(cfg, tmp_path / "cdcd.log")
    workload.start()
    try:
        for kill in range(KILLS):
            daemon.start()
            if kill % 2:  # every other kill lands while it streams, not while it starts up
                daemon.wait_streaming()
            time.sleep(rng.uniform(0.2, 1.5))
            daemon.assert_running()
            daemon.kill()
    finally:
        workload.finish()
    finish_to_endpos(pg_db, cfg)
    assert workload.transactions > 50 and workload.committed[("public.item", "c")] > 0
    assert_exactly_once(pg_db, tmp_path / "out", workload)


def test_server_restarts_and_crash_recovery(
    pg_cluster_factory: Callable[..., PgCluster],
    tmp_path: Path,
    daemons: Callable[[Path, Path], Daemon],
) -> None:
    cluster = pg_cluster_factory()
    db = create_database(cluster)
    prepare_database(db)
    cfg = make_config(tmp_path, db.dsn)
    out = tmp_path / "out"
    # A crashed server may lose a non-transactional message it had not flushed yet: leave them out.
    workload = Workload(cluster, db.name, SEED + 1, nontransactional_messages=False)
    daemon = daemons(cfg, tmp_path / "cdcd.log")
    daemon.start()
    workload.start()
    try:
        for fault in ("restart", "restart", "crash"):
            wait_for_progress(out, daemon)
            if fault == "restart":
                # A fast shutdown waits until every walsender's client has confirmed all that
                # was sent, which cdcd cannot do while a prepared transaction is unresolved
                # (pg_ctl then times out and the harness kills the server): resolve them first.
                workload.hold_prepares(True)
                wait_for(lambda: workload.unresolved == 0, "prepared transactions to resolve")
                cluster.restart()
                workload.hold_prepares(False)
            else:
                cluster.kill()
                cluster.start()
            wait_for_progress(out, daemon)
    finally:
        workload.finish()
    assert daemon.terminate() == 0
    reconnects = daemon.log().count("source connection lost; reconnecting")
    assert reconnects >= 3, daemon.log()[-8000:]
    finish_to_endpos(db, cfg)
    assert_exactly_once(db, out, workload)


def test_connections_cut_by_proxy(
    pg_db: PgDatabase, tmp_path: Path, daemons: Callable[[Path, Path], Daemon]
) -> None:
    prepare_database(pg_db)
    out = tmp_path / "out"
    with TcpProxy("127.0.0.1", pg_db.cluster.port) as proxy:
        cfg = make_config(tmp_path, proxied_dsn(pg_db, proxy.port))
        workload = Workload(pg_db.cluster, pg_db.name, SEED + 2)
        daemon = daemons(cfg, tmp_path / "cdcd.log")
        daemon.start()
        workload.start()
        confirmed: list[int] = []
        try:
            for round_ in range(6):
                wait_for_progress(out, daemon)
                assert proxy.cut() >= 1
                if round_ == 3:
                    proxy.refuse(3)
                confirmed.append(assert_nothing_confirmed_is_missing(pg_db, out, workload))
                wait_for_progress(out, daemon)
                confirmed.append(assert_nothing_confirmed_is_missing(pg_db, out, workload))
        finally:
            workload.finish()
        assert daemon.terminate() == 0
        assert daemon.log().count("source connection lost; reconnecting") >= 6
        assert confirmed == sorted(confirmed)
        finish_to_endpos(pg_db, cfg)
    assert_nothing_confirmed_is_missing(pg_db, out)
    assert_exactly_once(pg_db, out, workload)


def test_sigterm_drains_and_exits_zero(
    pg_db: PgDatabase, tmp_path: Path, daemons: Callable[[Path, Path], Daemon]
) -> None:
    prepare_database(pg_db)
    out = tmp_path / "out"
    cfg = make_config(tmp_path, pg_db.dsn)
    workload = Workload(pg_db.cluster, pg_db.name, SEED + 3)
    daemon = daemons(cfg, tmp_path / "cdcd.log")
    workload.start()
    try:
        for _ in range(3):
            daemon.start()
            wait_for_progress(out, daemon)
            assert daemon.terminate(grace=30) == 0, daemon.log()[-8000:]
            assert_nothing_confirmed_is_missing(pg_db, out, workload)
    finally:
        workload.finish()
    assert daemon.log().count("stopping: draining sinks") == 3
    finish_to_endpos(pg_db, cfg)
    assert_exactly_once(pg_db, out, workload)


def test_nontransactional_message_position_is_unique(pg_db: PgDatabase, tmp_path: Path) -> None:
    """PostgreSQL's Message LSN is the END of the message's WAL record: here the commit LSN of
    the transaction whose commit record follows it. docs/events.md puts the message at
    ``(its LSN - 1, 0)``, inside its own record, so the two positions differ."""
    prepare_database(pg_db)
    cfg = make_config(tmp_path, pg_db.dsn)
    # The message record is the last before the commit record: message LSN == commit LSN.
    pg_db.execute(
        "BEGIN; INSERT INTO acct VALUES (1, 1, 'a');"
        "SELECT pg_logical_emit_message(false, 'crash', 'nt'); COMMIT"
    )
    finish_to_endpos(pg_db, cfg)
    events = list(all_events(tmp_path / "out"))
    assert sorted(e["op"] for e in events) == ["c", "m"]
    assert_no_duplicates(events)
    insert, message = sorted(events, key=lambda e: e["op"])
    gap = insert["source"]["commit_lsn"] - message["source"]["lsn"]
    # the case at hand: the commit record right after the message's (the same LSN); or, when
    # the message's record ends on a WAL page boundary, the next page's header (24 bytes, 40
    # at a segment's start) between them (seen once in CI)
    assert gap == 0 or (message["source"]["lsn"] % 8192 == 0 and gap in (24, 40)), gap
    assert position(message) == (message["source"]["lsn"] - 1, 0)


def test_idle_slot_confirms_the_keepalive_position(
    pg_db: PgDatabase, tmp_path: Path, daemons: Callable[[Path, Path], Daemon]
) -> None:
    """docs/progress.md: with nothing in flight the slot follows the server's WAL, even when the
    WAL holds nothing to publish (here: DDL only)."""
    prepare_database(pg_db)
    cfg = make_config(tmp_path, pg_db.dsn)
    daemon = daemons(cfg, tmp_path / "cdcd.log")
    daemon.start()
    pg_db.execute("INSERT INTO acct VALUES (1, 1, 'a')")
    wait_for(lambda: published(tmp_path / "out") == 1, "the insert to be published")
    pg_db.execute("CREATE TABLE unpublished_ddl (); DROP TABLE unpublished_ddl")
    target = parse_lsn(pg_db.fetchval("SELECT pg_current_wal_lsn()::text"))

    def confirmed() -> int:
        daemon.assert_running()
        return parse_lsn(
            pg_db.fetchval(
                "SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
                f"WHERE slot_name = '{SLOT}'"
            )
        )

    wait_for(lambda: confirmed() >= target, "the slot to confirm past the DDL-only WAL")
    assert daemon.terminate() == 0


def test_kill_after_commit_prepared_before_it_is_durable(
    pg_db: PgDatabase, tmp_path: Path, daemons: Callable[[Path, Path], Daemon]
) -> None:
    """A prepared transaction committed while cdcd runs, killed before its events are durable:
    the confirmed position must still be before its PREPARE, or the server never resends it
    (it sends only Commit Prepared for a PREPARE behind the confirmed position)."""
    prepare_database(pg_db)
    cfg = make_config(tmp_path, pg_db.dsn)
    text = yaml.safe_load(cfg.read_text())
    text["sinks"][0]["flush_interval"] = 3  # T stays unpublished well after the acker's rounds
    cfg.write_text(yaml.safe_dump(text))
    out = tmp_path / "out"
    daemon = daemons(cfg, tmp_path / "cdcd.log")
    daemon.start()
    daemon.wait_streaming()
    with pg_db.connect() as conn, conn.cursor() as cur:
        cur.execute("BEGIN; INSERT INTO note VALUES (1, 'prepared', 'T'); PREPARE TRANSACTION 't'")
    pg_db.execute("INSERT INTO acct VALUES (1, 1, 'after the prepare')")
    wait_for(lambda: published(out) == 1, "the later transaction to be published")
    pg_db.execute("COMMIT PREPARED 't'")
    time.sleep(1)  # the acker confirms every 0.2 s; the file sink publishes after 3 s
    daemon.assert_running()
    daemon.kill()
    finish_to_endpos(pg_db, cfg)
    assert sorted(folder_of(e) for e in all_events(out)) == ["public.acct", "public.note"]
