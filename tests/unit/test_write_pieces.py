"""write_pieces: a snapshot batch's record pieces reach the file whole and in order, also when
``os.writev`` writes less than asked (as it may, e.g. interrupted by a signal)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdcd.sinks.file import layout as file_layout
from cdcd.sinks.file.layout import write_pieces


@settings(max_examples=200, deadline=None)
@given(
    pieces=st.lists(st.binary(min_size=1, max_size=300), max_size=1200),
    caps=st.lists(st.integers(1, 2000), min_size=1, max_size=20),
)
def test_short_writes_go_on_where_they_stopped(
    pieces: list[bytes], caps: list[int], tmp_path_factory: pytest.TempPathFactory
) -> None:
    path = tmp_path_factory.mktemp("w") / "f"
    calls = []
    real = os.writev

    def short(fd: int, buffers: list) -> int:  # writes at most the next cap's bytes
        cap = caps[len(calls) % len(caps)]
        calls.append(len(buffers))
        data = b"".join(bytes(b) for b in buffers)[:cap]
        return real(fd, [data])

    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        file_layout.os.writev = short  # type: ignore[attr-defined]
        written = write_pieces(fd, pieces)
    finally:
        file_layout.os.writev = real  # type: ignore[attr-defined]
        os.close(fd)
    assert written == sum(map(len, pieces))
    assert path.read_bytes() == b"".join(pieces)
    assert all(n <= 512 for n in calls)  # never more pieces per call than the kernel takes


def test_a_write_of_nothing_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(file_layout.os, "writev", lambda fd, buffers: 0)
    with pytest.raises(OSError, match="wrote nothing"):
        write_pieces(0, [b"abc"])
