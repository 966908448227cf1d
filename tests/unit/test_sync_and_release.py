"""sync_and_release: a completed data file is fsynced, then its pages leave the page cache (the
next file's writes reuse them; docs/files.md). Checked on a real file with util-linux's
``fincore``, which counts a file's cached pages."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from cdcd.sinks.file import layout as file_layout
from cdcd.sinks.file.layout import sync_and_release


def _cached_bytes(path: Path) -> int:
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.split()[0])


@pytest.mark.skipif(shutil.which("fincore") is None, reason="util-linux fincore not installed")
def test_the_file_is_durable_and_its_pages_leave_the_cache(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    data = os.urandom(1 << 22)
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        before = _cached_bytes(path)
        sync_and_release(f.fileno())
        after = _cached_bytes(path)
    if before == 0:
        pytest.skip(f"{tmp_path} keeps no page cache (fincore shows nothing cached)")
    assert before >= len(data) // 2
    assert after < before // 4
    assert path.read_bytes() == data


def test_fsync_happens_and_a_refused_advice_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        calls.append("fsync")
        real_fsync(fd)

    def refuse(fd: int, offset: int, length: int, advice: int) -> None:
        calls.append("fadvise")
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(file_layout.os, "fsync", fsync)
    monkeypatch.setattr(file_layout.os, "posix_fadvise", refuse)
    with (tmp_path / "f").open("wb") as f:
        f.write(b"x")
        sync_and_release(f.fileno())
    assert calls == ["fsync", "fadvise"]  # durable first, then the advice
