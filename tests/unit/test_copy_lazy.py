"""copy_batches: COPY's output, however the server's chunks split it, becomes
CopyBatches of whole lines whose rows are exactly the rows of the whole output."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdcd.decoder.copy_batch import CopyBatch
from cdcd.decoder.copy_text import copy_rows
from cdcd.source.copy import copy_batches, count_newlines


class _Conn:
    """asyncpg's copy_from_query, handing ``output`` the given chunks (as bytearrays)."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def copy_from_query(
        self, sql: str, *, output: Callable[[bytearray], Awaitable[None]]
    ) -> None:
        for chunk in self.chunks:
            await output(bytearray(chunk))


def _read(chunks: list[bytes], batch_size: int) -> tuple[int, list[tuple[Any, int]]]:
    got: list[tuple[Any, int]] = []

    async def on_rows(batch: Any, size: int) -> None:
        got.append((batch, size))

    count = asyncio.run(copy_batches(_Conn(chunks), "q", 2, on_rows, batch_size))
    return count, got


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.binary(max_size=6), st.binary(max_size=6)).map(
            lambda r: b"\t".join(v.replace(b"\n", b"").replace(b"\t", b"") for v in r)
        ),
        max_size=30,
    ),
    cuts=st.lists(st.integers(0, 400), max_size=8),
    batch_size=st.integers(1, 7),
)
def test_batches_hold_the_rows_of_the_whole_output(
    rows: list[bytes], cuts: list[int], batch_size: int
) -> None:
    output = b"".join(r + b"\n" for r in rows)
    points = sorted({0, len(output), *(c for c in cuts if c < len(output))})
    chunks = [output[a:b] for a, b in itertools.pairwise(points)]
    count, got = _read(chunks, batch_size)
    assert count == len(rows)
    assert all(isinstance(b, CopyBatch) and len(b) > 0 for b, _ in got)
    assert all(type(b.text) is bytes for b, _ in got)  # not the bytearrays asyncpg hands
    assert [row for b, _ in got for row in b] == copy_rows(rows, 2)
    assert all(len(b) >= batch_size for b, _ in got[:-1])  # whole batches but the last
    assert [b[-1] for b, _ in got] == [list(b)[-1] for b, _ in got]  # the last line alone


def test_output_that_ends_inside_a_row_is_an_error() -> None:
    with pytest.raises(ValueError, match="ends inside a row"):
        _read([b"1\ta\n2\t"], 5)


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=10_000), newlines=st.integers(0, 9000), at=st.integers(0, 10_000))
def test_count_newlines_is_bytes_count(data: bytes, newlines: int, at: int) -> None:
    """Whatever the length (the compiled count works in blocks of 4080 bytes), and in
    bytearrays as asyncpg hands them."""
    data = data[:at] + b"\n" * newlines + data[at:]
    assert count_newlines(data) == data.count(b"\n")
    assert count_newlines(bytearray(data)) == data.count(b"\n")
