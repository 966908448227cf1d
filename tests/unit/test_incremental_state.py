"""What an incremental snapshot records in snapshot.state_dir (cdcd.snapshot.incremental):
requests, signals taken once, progress reloaded after a restart."""

from __future__ import annotations

from pathlib import Path

import pytest

from cdcd.config import load_config
from cdcd.errors import ConfigError
from cdcd.pipeline.progress import ProgressTracker
from cdcd.snapshot.incremental import IncrementalSnapshot
from cdcd.snapshot.state import IncrementalState
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
