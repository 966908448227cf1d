"""A large transaction handed to the sinks while it arrives (docs/assembler.md "Parts"), with
a fault in the middle of it (docs/progress.md rule 10), against a real PostgreSQL:

* the connection cut by a TCP proxy while the transaction arrives: the server resends it from
  its start, the reader drops what it handed already, and the sinks go on where they stopped
  (one BEGIN and one END marker, every position once);
* SIGKILL while it arrives: the next run receives it again and the file sink skips what the
  killed run published.

Either way the table rebuilt from the files equals the source and no ``(commit_lsn, seq)`` is
published twice. The transaction is not streamed (``streaming: off``), and a small
``buffer.memory_limit`` keeps the reader close to the sinks, so the fault lands while the
transaction is still arriving.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml

from tests.e2e import all_events, assert_no_duplicates, read_events, rebuild, run_cdcd, write_config
from tests.integration.test_crash_safety import (
    Daemon,
    assert_well_formed,
    proxied_dsn,
    published,
    source_rows,
    wait_for,
)
from tests.pgharness import PgDatabase
from tests.tcpproxy import TcpProxy

pytestmark = [pytest.mark.version_independent, pytest.mark.timeout(400)]

ROWS = 200_000
UPDATED = ROWS // 10  # every tenth row updated in the same transaction
EVENTS = ROWS + UPDATED
RESUMED = "transaction resent after a reconnect: dropping the changes handed before"


@pytest.fixture
def daemons() -> Iterator[Callable[[Path, Path], Daemon]]:
    made: list[Daemon] = []

    def make(cfg: Path, log_path: Path) -> Daemon:
        made.append(Daemon(cfg, log_path))
        return made[-1]

    yield make
    for daemon in made:
        daemon.stop_quietly()


def make_config(directory: Path, dsn: str) -> Path:
    path = write_config(
        directory,
        dsn,
        sinks=[
            {
                "type": "file",
                "path": "out",
                "format": "jsonl",
                "flush_interval": 0.2,
                "rollover_rows": 5000,  # files published while the transaction arrives
                "transactions": True,
            }
        ],
        streaming="off",
        reconnect_min_backoff=0.2,
        reconnect_max_backoff=1.0,
    )
    cfg = yaml.safe_load(path.read_text())
    cfg["buffer"]["memory_limit"] = "4MiB"  # the reader stays a few parts ahead of the sinks
    cfg["shutdown"] = {"grace_period": 20}
    path.write_text(yaml.safe_dump(cfg))
    run_cdcd("slot", "create", "--config", str(path))
    return path


def big_transaction(db: PgDatabase) -> threading.Thread:
    """One transaction: ROWS inserts, then an update of every tenth row; committed in a thread."""
    db.execute(
        "CREATE TABLE item (id int PRIMARY KEY, payload text, n int);"
        "CREATE PUBLICATION cdcd_e2e_pub FOR TABLE item"
    )

    def run() -> None:
        db.execute(
            "BEGIN;"
            f"INSERT INTO item SELECT g, repeat(md5(g::text), 2), 0 FROM generate_series(1, {ROWS}) g;"
            "UPDATE item SET n = 1, payload = 'u' || id WHERE id % 10 = 0;"
            "COMMIT"
        )

    return threading.Thread(target=run, name="big-transaction")


def until(daemon: Daemon, condition: Callable[[], bool], what: str, timeout: float) -> None:
    """wait_for, while the daemon runs; its log tail when the wait fails."""

    def check() -> bool:
        daemon.assert_running()
        return condition()

    try:
        wait_for(check, what, timeout)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- cdcd log\n{daemon.log()[-6000:]}") from None


def mid_transaction(out: Path, daemon: Daemon) -> int:
    """Wait until the sinks published part of the transaction, well before its end."""
    until(daemon, lambda: published(out) >= 30_000, "first parts", 180)
    count = published(out)
    assert count < EVENTS * 3 // 4, f"{count} of {EVENTS} published: not mid-transaction"
    return count


def markers(out: Path) -> list[dict[str, Any]]:
    folder = out / "_transactions"
    return [
        orjson.loads(line)
        for path in sorted(folder.glob("*.jsonl"))
        for line in path.read_bytes().splitlines()
        if line.strip()
    ]


def assert_complete(db: PgDatabase, out: Path) -> None:
    assert_well_formed(out)
    events = list(all_events(out))
    assert_no_duplicates(events)
    assert len(events) == EVENTS
    assert {e["source"]["commit_lsn"] for e in events} == {events[0]["source"]["commit_lsn"]}
    assert sorted(e["source"]["seq"] for e in events) == list(range(EVENTS))
    rebuilt = rebuild(read_events(out, "public.item"), ("id",))
    assert rebuilt == source_rows(db, "item")


def test_connection_cut_in_the_middle_of_a_transaction(
    pg_db: PgDatabase, tmp_path: Path, daemons: Callable[[Path, Path], Daemon]
) -> None:
    out = tmp_path / "out"
    writer = big_transaction(pg_db)
    # about 25 MB of pgoutput arrive at 3 MB/s: the cut lands while the transaction arrives even
    # when a busy host lets cdcd receive far ahead of the files' publication
    with TcpProxy("127.0.0.1", pg_db.cluster.port, downstream_rate=3e6) as proxy:
        cfg = make_config(tmp_path, proxied_dsn(pg_db, proxy.port))
        daemon = daemons(cfg, tmp_path / "cdcd.log")
        daemon.start()
        daemon.wait_streaming()
        writer.start()
        writer.join(120)
        first = mid_transaction(out, daemon)
        assert proxy.cut() >= 1
        until(daemon, lambda: daemon.log().count(RESUMED) >= 1, "the resent transaction", 120)
        until(daemon, lambda: published(out) > first + 10_000, "progress after the cut", 180)
        if published(out) < EVENTS // 2:  # once more, further on (it may land after the end)
            assert proxy.cut() >= 1
        until(daemon, lambda: published(out) >= EVENTS, "the rest", 240)
        assert daemon.terminate() == 0
    log = daemon.log()
    assert log.count("source connection lost; reconnecting") >= 1, log[-6000:]
    assert_complete(pg_db, out)
    # the sinks saw one transaction: one BEGIN (end LSN unknown then), one END with every event
    (begin, end) = markers(out)
    assert (begin["status"], begin["end_lsn"], end["status"]) == ("BEGIN", None, "END")
    assert end["event_count"] == EVENTS and end["end_lsn"] > end["commit_lsn"]


def test_sigkill_in_the_middle_of_a_transaction(
    pg_db: PgDatabase, tmp_path: Path, daemons: Callable[[Path, Path], Daemon]
) -> None:
    out = tmp_path / "out"
    writer = big_transaction(pg_db)
    cfg = make_config(tmp_path, pg_db.dsn)
    daemon = daemons(cfg, tmp_path / "cdcd.log")
    daemon.start()
    daemon.wait_streaming()
    writer.start()
    writer.join(120)
    before = mid_transaction(out, daemon)
    daemon.kill()
    assert published(out) < EVENTS
    daemon.start()
    until(daemon, lambda: published(out) >= EVENTS, "the rest", 240)
    assert daemon.terminate() == 0
    assert before > 0
    assert_complete(pg_db, out)
    statuses = [m["status"] for m in markers(out)]
    assert statuses.count("END") == 1 and statuses.count("BEGIN") == 1
