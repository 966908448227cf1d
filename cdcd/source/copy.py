"""Rows read with ``COPY (SELECT ...) TO STDOUT``: the snapshots' reads (docs/snapshots.md: COPY's text output is already the bytes the encoder takes, where a ``SELECT`` goes
through ``str`` and back; measured about twice as fast). The lines become text-kind
:class:`~cdcd.decoder.events.TupleData`, as the stream's text values do, in
:mod:`cdcd.decoder.copy_text` (compiled), only when a sink asks for rows
(:func:`copy_batches`, :class:`~cdcd.decoder.copy_batch.CopyBatch`; the JSON Lines writer never
does).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from cdcd._purepy import c_module
from cdcd.decoder.copy_batch import CopyBatch
from cdcd.decoder.copy_text import copy_rows

__all__ = ["accounted", "copy_batches", "copy_rows", "count_newlines", "cut_rows"]


def _count_newlines() -> Callable[[bytes | bytearray], int]:
    """cdcd._rowjson.count_newlines (about four times ``bytes.count`` here), or bytes.count
    where the compiled module is not in use."""
    rowjson = c_module("cdcd._rowjson")
    if rowjson is None:
        return lambda data: data.count(b"\n")
    count: Callable[[bytes | bytearray], int] = rowjson.count_newlines
    return count


count_newlines = _count_newlines()


async def copy_batches(
    conn: Any,
    sql: str,
    width: int,
    on_rows: Callable[[CopyBatch, int], Awaitable[None]],
    batch_size: int = 5000,
) -> int:
    """Read the rows of ``sql`` (its ``width`` columns as text) with ``COPY (sql) TO STDOUT``,
    handing them to ``on_rows`` with their accounted bytes (:func:`accounted`) left as COPY's
    text; the row count. ``on_rows`` may wait: the server's output waits with it. The
    output's chunks are kept as they come and cut into :class:`CopyBatch` es at a newline once
    they hold ``batch_size`` rows (no object per row; parsed when a sink asks). Each byte is copied once, into its
    batch: asyncpg hands each chunk in a bytearray of its own, kept until then."""
    chunks: list[bytes | bytearray] = []
    rows = 0  # newlines in ``chunks``
    count = 0

    async def hand() -> None:
        nonlocal chunks, rows, count
        batch, rest = cut_rows(chunks)
        chunks, taken, rows = [rest] if rest else [], rows, 0
        count += taken
        await on_rows(CopyBatch(batch, taken, width), accounted(taken, len(batch)))

    async def take(data: bytes | bytearray) -> None:
        nonlocal rows
        chunks.append(data)
        rows += count_newlines(data)
        if rows >= batch_size:
            await hand()

    await conn.copy_from_query(sql, output=take)
    if chunks and not chunks[-1].endswith(b"\n"):
        raise ValueError(f"COPY output ends inside a row: {sql[:200]}")
    if rows:
        await hand()  # the output ends with a newline: all of it
    return count


def cut_rows(chunks: list[bytes | bytearray]) -> tuple[bytes, bytes]:
    """The rows in ``chunks`` up to their last newline (without it), and what follows it; a
    chunk holds a newline."""
    i = len(chunks) - 1
    while (end := chunks[i].rfind(b"\n")) < 0:
        i -= 1
    last = chunks[i]
    batch = b"".join([*chunks[:i], last[:end]])
    rest = b"".join([last[end + 1 :], *chunks[i + 1 :]])
    return batch, rest


def accounted(rows: int, text_bytes: int) -> int:
    """Bytes counted against ``buffer.memory_limit`` for ``rows`` rows of ``text_bytes`` bytes of
    COPY text (as the watermarks count a chunk's rows: 64 per row and the values)."""
    return 64 * rows + text_bytes
