"""The incremental snapshot's chunk size (cdcd.snapshot.chunk_size): grows while chunks are
cheap, shrinks when their windows drop rows or reads run long, bounded by the limit and memory."""

from __future__ import annotations

from cdcd.snapshot.chunk_size import ChunkSizer


def test_grows_while_reads_are_quick_up_to_the_limit() -> None:
    sizer = ChunkSizer(2048, most=50_000, memory=10**9)
    sizes = [sizer.observe(sizer.rows, sizer.rows * 100, 0.01, 0) for _ in range(8)]
    assert sizes[:3] == [4096, 8192, 16384] and sizes[-1] == 50_000


def test_a_last_short_chunk_does_not_grow_it() -> None:
    sizer = ChunkSizer(2048, most=50_000, memory=10**9)
    assert sizer.observe(10, 1000, 0.001, 0) == 2048


def test_shrinks_when_windows_drop_rows_or_reads_run_long() -> None:
    sizer = ChunkSizer(8192, most=50_000, memory=10**9)
    assert sizer.observe(8192, 8192 * 100, 0.01, 1000) == 4096  # the stream changes it a lot
    assert sizer.observe(4096, 4096 * 100, 1.0, 0) == 2048  # a slow read
    assert sizer.observe(2048, 2048 * 100, 0.1, 30) == 2048  # a few dropped: it stays
    for _ in range(10):
        sizer.observe(sizer.rows, sizer.rows * 100, 0.01, sizer.rows)
    assert sizer.rows == 256  # never below the least


def test_memory_bounds_it_at_the_rows_mean_size() -> None:
    sizer = ChunkSizer(2048, most=1_000_000, memory=1_000_000)
    for _ in range(12):
        sizer.observe(sizer.rows, sizer.rows * 200, 0.01, 0)
    assert sizer.rows == 5000
