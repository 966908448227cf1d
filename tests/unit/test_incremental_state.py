"""What an incremental snapshot records in snapshot.state_dir (cdcd.snapshot.incremental):
requests, signals taken once, progress reloaded after a restart."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from cdcd.config import load_config
from cdcd.errors import ConfigError
from cdcd.pipeline.progress import ProgressTracker
from cdcd.snapshot.incremental import IncrementalSnapshot
from cdcd.snapshot.state import Done, IncrementalState, Ledger
from cdcd.stats import Stats
from tests.e2e import write_config


def _snapshot(tmp_path: Path) -> IncrementalSnapshot:
    config = load_config(write_config(tmp_path, "postgresql://cdc@127.0.0.1:1/db"))
    return IncrementalSnapshot(config, None, ProgressTracker(1), Stats())


def test_a_signal_is_taken_once(tmp_path: Path) -> None:
    snap = _snapshot(tmp_path)
    snap.request(["public.t"], 100)
    assert snap.state.pending() == ["public.t"]
    snap.state.tables["public.t"]["status"] = "done"
    snap.state.save()
    snap.request(["public.t"], 100)  # sent again after a reconnect or restart
    assert snap.state.pending() == []
    again = _snapshot(tmp_path)  # a restart reads what was recorded
    assert again.state.last_signal == 100
    again.request(["public.t"], 90)
    assert again.state.pending() == []
    again.request(["public.t"], 200)  # a new request starts over
    assert again.state.tables["public.t"] == {
        "status": "pending",
        "last_key": None,
        "rows": 0,
        "estimate": None,
        "estimated_from": None,
    }


def test_an_unwritable_state_dir_names_the_key(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    state = IncrementalState(blocker / "sub", "slot")
    with pytest.raises(ConfigError, match=r"snapshot.state_dir .*file/sub"):
        state.request(["public.t"])


@pytest.mark.parametrize(
    ("workers", "reading", "shares"),
    [
        (4, ["a"], [4]),
        (4, ["a", "b", "c"], [2, 1, 1]),  # the first ones take the remainder
        (4, ["a", "b", "c", "d"], [1, 1, 1, 1]),
        (5, ["a", "b"], [3, 2]),
        (1, ["a"], [1]),
    ],
)
def test_tables_read_at_once_share_the_workers(
    tmp_path: Path, workers: int, reading: list[str], shares: list[int]
) -> None:
    config = load_config(write_config(tmp_path, "postgresql://cdc@127.0.0.1:1/db"))
    snap = IncrementalSnapshot(
        config.model_copy(
            update={"snapshot": config.snapshot.model_copy(update={"workers": workers})}
        ),
        None,
        ProgressTracker(1),
        Stats(),
    )
    snap.workers.reading[:] = reading
    assert [snap.workers.share(name) for name in reading] == shares
    assert sum(shares) == workers


def _until(predicate: Any) -> None:
    deadline = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_progress_is_written_in_a_thread_and_at_once_when_asked(tmp_path: Path) -> None:
    """Durable chunks are recorded at once and written to the state file by a thread (the
    event loop does not wait for the fsyncs); an orderly stop writes before returning; a
    write that failed in the thread is reported by the next one."""
    state = IncrementalState(tmp_path / "state", "slot")
    state.request(["public.t"])
    state.tables["public.t"]["status"] = "running"
    ledger = Ledger(state, Stats())
    chunks = ledger.undurable["public.t"] = []

    def written() -> Any:
        return IncrementalState(tmp_path / "state", "slot").tables["public.t"]["last_key"]

    for n in (1, 2, 3):
        chunks.append(Done("public.t", 10 * n, [str(n)], 100 * n, False))
    ledger.record(20)
    assert state.tables["public.t"]["last_key"] == ["2"]
    _until(lambda: written() == ["2"])
    ledger.record(30, now=True)  # an orderly stop
    assert written() == ["3"]
    assert not state.unwritten

    (tmp_path / "state" / ".slot.incremental.json.tmp").mkdir()  # the next write fails
    chunks.append(Done("public.t", 40, ["4"], 400, True))
    ledger.record(40)
    _until(lambda: state._writer is None)
    assert written() == ["3"] and state.unwritten
    with pytest.raises(ConfigError, match=r"snapshot.state_dir .*state"):
        state.save_soon()
