"""SIGTERM/SIGINT in each phase of ``cdcd run`` (docs/operating.md): the real CLI as a
subprocess, against a real PostgreSQL (or, for the unreachable source, a closed port).

* start-up, the source unreachable: the retry loop ends, exit 0;
* slot creation waiting for a transaction that holds an xid: exit 0, no slot left behind;
* the initial snapshot (cdcd stopped with SIGSTOP while the signal is sent, so the snapshot
  cannot end first): exit 0, and the next run snapshots again, every row once in the end;
* an incremental snapshot while streaming: exit 0, its progress recorded, the next run
  finishes it;
* a second signal while the first is being handled: the process ends at once, killed by it.

Streaming itself (a workload running, the drain, a restart losing and repeating nothing) is
``tests/integration/test_service.py::test_sigterm_drains_and_a_restart_loses_and_repeats_nothing``.
None of this depends on the server version: the newest installed one only
(``version_independent``).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e import checked_events, start_cdcd, write_config
from tests.pgharness import PgDatabase, free_port

pytestmark = [pytest.mark.version_independent, pytest.mark.timeout(180)]

GRACE = 10  # shutdown.grace_period in these tests


def _config(
    tmp_path: Path, dsn: str, snapshot: str = "never", source: Any = None, **snapshot_keys: Any
) -> Path:
    cfg = write_config(tmp_path, dsn, snapshot=snapshot, **(source or {}))
    data = yaml.safe_load(cfg.read_text())
    data["shutdown"] = {"grace_period": GRACE}
    data["snapshot"].update(snapshot_keys)
    cfg.write_text(yaml.safe_dump(data))
    return cfg


def _table(pg_db: PgDatabase, rows: int) -> int:
    pg_db.execute(
        "CREATE TABLE t (id int PRIMARY KEY, v text NOT NULL);"
        f"INSERT INTO t SELECT g, repeat('v', 40) FROM generate_series(1, {rows}) g"
    )
    return rows


def _events(log: Path) -> list[dict[str, Any]]:
    lines = log.read_text().splitlines() if log.exists() else []
    return [json.loads(line) for line in lines if line.startswith("{")]


def _logged(log: Path, event: str) -> list[dict[str, Any]]:
    return [e for e in _events(log) if e.get("event", "").startswith(event)]


def _wait(proc: subprocess.Popen[bytes], log: Path, ready: Callable[[], Any], what: str) -> None:
    deadline = time.monotonic() + 60
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"cdcd exited ({proc.returncode}) before {what}:\n{_tail(log)}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}:\n{_tail(log)}")
        time.sleep(0.05)


def _tail(log: Path) -> str:
    return log.read_text()[-4000:] if log.exists() else "(no log)"


def _stops(proc: subprocess.Popen[bytes], log: Path, sig: int = signal.SIGTERM) -> int:
    """Send ``sig``; the exit code (the wait is bounded: grace period plus start-up slack)."""
    proc.send_signal(sig)
    try:
        return proc.wait(GRACE + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(
            f"cdcd still ran {GRACE + 30} s after the signal:\n{_tail(log)}"
        ) from None


def _stopped_during(
    cfg: Path,
    log: Path,
    started: Callable[[], Any],
    phase: str,
    still: Callable[[], Any] | None = None,
) -> int:
    """``cdcd run``, SIGTERM once ``started()`` holds; its exit code. The signal is sent while
    cdcd is stopped (SIGSTOP), after making sure the phase is ``still()`` under way, so it cannot
    end first however fast it is; the signal waits until cdcd runs again."""
    proc = start_cdcd("run", "--config", str(cfg), log_path=log)
    try:
        _wait(proc, log, started, phase)
        proc.send_signal(signal.SIGSTOP)
        if not (still or (lambda: not _logged(log, f"{phase} done")))():
            proc.send_signal(signal.SIGCONT)
            pytest.fail(f"{phase} ended before the test could stop it: make it longer")
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGCONT)
        return proc.wait(GRACE + 30)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_stop_while_the_source_is_unreachable(tmp_path: Path) -> None:
    dsn = f"postgresql://cdcd@127.0.0.1:{free_port()}/nowhere"  # nothing listens there
    cfg = _config(tmp_path, dsn, source={"give_up_after": None})
    log = tmp_path / "cdcd.log"
    proc = start_cdcd("run", "--config", str(cfg), log_path=log)
    _wait(proc, log, lambda: _logged(log, "source not ready at start-up"), "the first retry")
    assert _stops(proc, log, signal.SIGINT) == 0, _tail(log)
    (stopped,) = _logged(log, "stopping before streaming started")
    assert stopped["phase"] == "start-up"


@pytest.mark.pg
def test_stop_while_the_slot_is_being_created(pg_db: PgDatabase, tmp_path: Path) -> None:
    # a transaction holding an xid makes CREATE_REPLICATION_SLOT wait until it ends
    cfg = _config(tmp_path, pg_db.dsn)
    log = tmp_path / "cdcd.log"
    with pg_db.connect() as blocker:
        blocker.autocommit = False
        with blocker.cursor() as cur:
            cur.execute("SELECT txid_current()")
        proc = start_cdcd("run", "--config", str(cfg), log_path=log)
        try:
            waiting = (
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND query LIKE 'CREATE_REPLICATION_SLOT%'"
            )
            _wait(proc, log, lambda: pg_db.fetchval(waiting), "CREATE_REPLICATION_SLOT")
            assert _stops(proc, log) == 0, _tail(log)
        finally:
            if proc.poll() is None:
                proc.kill()
        blocker.rollback()
    (stopped,) = _logged(log, "stopping before streaming started")
    assert stopped["phase"] == "start-up"
    assert pg_db.fetchval("SELECT count(*) FROM pg_replication_slots") == 0


@pytest.mark.pg
def test_stop_during_the_initial_snapshot(pg_db: PgDatabase, tmp_path: Path) -> None:
    rows = _table(pg_db, 50_000)
    cfg = _config(tmp_path, pg_db.dsn, snapshot="initial")
    log = tmp_path / "cdcd.log"
    snapshot = tmp_path / "cdcd-state" / "cdcd_e2e.snapshot.json"

    def recorded() -> dict[str, Any]:
        try:
            return dict(json.loads(snapshot.read_text()))
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    code = _stopped_during(cfg, log, lambda: "tables" in recorded(), "the initial snapshot")
    assert code == 0, _tail(log)
    (stopped,) = _logged(log, "stopping before streaming started")
    assert stopped["phase"] == "initial snapshot"
    assert not _logged(log, "initial snapshot done")
    assert recorded()["status"] == "running", recorded()
    state = tmp_path / "cdcd-state" / "cdcd_e2e.incremental.json"

    def rest_done() -> bool:
        tables = json.loads(state.read_text())["tables"] if state.exists() else {}
        return bool(tables.get("public.t", {}).get("status") == "done")

    proc = start_cdcd("run", "--config", str(cfg), log_path=log)  # resumes: the rest by key
    try:
        _wait(proc, log, rest_done, "the rest of the snapshot")
        assert _stops(proc, log) == 0, _tail(log)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "resuming it" in log.read_text()
    events = checked_events(tmp_path / "out", "public.t")
    assert not [e for e in events if e["op"] == "t"]  # resumed: nothing to forget
    reads = [e["after"]["id"] for e in events if e["op"] == "r"]
    assert set(reads) == set(range(1, rows + 1))
    # the stop recorded every row it had handed: none is read twice
    assert len(reads) == rows, len(reads) - rows


@pytest.mark.pg
def test_stop_during_an_incremental_snapshot(pg_db: PgDatabase, tmp_path: Path) -> None:
    rows = _table(pg_db, 6_000)
    cfg = _config(tmp_path, pg_db.dsn, snapshot="incremental", chunk_rows=50, chunks_in_flight=1)
    state = tmp_path / "cdcd-state" / "cdcd_e2e.incremental.json"

    def progress() -> dict[str, Any]:
        tables = json.loads(state.read_text())["tables"] if state.exists() else {}
        return dict(tables.get("public.t", {}))

    def under_way() -> bool:
        return progress().get("status") == "running" and progress().get("rows", 0) > 0

    log = tmp_path / "cdcd.log"
    code = _stopped_during(cfg, log, under_way, "the incremental snapshot", still=under_way)
    assert code == 0, _tail(log)
    stopped_at = progress()
    assert stopped_at["status"] == "running" and 0 < stopped_at["rows"] < rows, stopped_at

    proc = start_cdcd("run", "--config", str(cfg), log_path=log)  # goes on where it stopped
    try:
        _wait(proc, log, lambda: progress().get("status") == "done", "the rest of the snapshot")
        assert _stops(proc, log) == 0, _tail(log)
    finally:
        if proc.poll() is None:
            proc.kill()
    reads = [e["after"]["id"] for e in checked_events(tmp_path / "out", "public.t")]
    assert set(reads) == set(range(1, rows + 1))
    # resumed after the last chunk recorded: at most the chunk in flight is read twice
    assert len(reads) - rows <= 50, len(reads) - rows


def test_a_second_signal_ends_cdcd_at_once(tmp_path: Path) -> None:
    """The first signal is being handled (a stop under way) when the second arrives: both are
    sent while cdcd is stopped, so they reach it together, as a second Ctrl-C does in a busy
    moment; the second ends it, killed by that signal."""
    dsn = f"postgresql://cdcd@127.0.0.1:{free_port()}/nowhere"
    cfg = _config(tmp_path, dsn, source={"give_up_after": None})
    log = tmp_path / "cdcd.log"
    proc = start_cdcd("run", "--config", str(cfg), log_path=log)
    _wait(proc, log, lambda: _logged(log, "source not ready at start-up"), "the first retry")
    proc.send_signal(signal.SIGSTOP)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGCONT)
    code = proc.wait(30)
    assert code in (-signal.SIGINT, -signal.SIGTERM), (code, _tail(log))
    assert _logged(log, "stopping: draining sinks")  # the first was taken as a stop request
