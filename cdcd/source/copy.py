"""Rows read with ``COPY (SELECT ...) TO STDOUT``: the snapshots' reads (README "Initial
snapshot": COPY's text output is already the bytes the encoder takes, where a ``SELECT`` goes
through ``str`` and back; measured about twice as fast). The lines become text-kind
:class:`~cdcd.decoder.events.TupleData`, as the stream's text values do, in
:mod:`cdcd.decoder.copy_text` (compiled).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from cdcd.decoder.copy_batch import CopyBatch
from cdcd.decoder.copy_text import copy_rows

__all__ = ["accounted", "copy_query", "copy_rows"]


async def copy_query(
    conn: Any,
    sql: str,
    width: int,
    on_rows: Callable[[Any, int], Awaitable[None]],
    batch_size: int = 5000,
    *,
    lazy: bool = False,
) -> int:
    """Read the rows of ``sql`` (its ``width`` columns as text) with ``COPY (sql) TO STDOUT``,
    handing them to ``on_rows`` in batches of about ``batch_size``, with their accounted bytes
    (:func:`accounted`); the row count. ``on_rows`` may wait: the server's output waits with
    it. The batches are lists of TupleData, or with ``lazy``
    :class:`~cdcd.decoder.copy_batch.CopyBatch`: the lines, parsed when asked for."""
    rest = b""
    pending: list[Any] = []
    count = 0
    received = 0  # bytes of the rows in ``pending``, and of ``rest``

    async def take(data: bytes | bytearray) -> None:
        nonlocal rest, pending, count, received
        data = bytes(data)  # asyncpg hands a bytearray; values must be bytes
        received += len(data)
        lines = (rest + data).split(b"\n") if rest else data.split(b"\n")
        rest = lines.pop()
        if lines:
            pending += lines if lazy else copy_rows(lines, width)
        if len(pending) >= batch_size:
            count += len(pending)
            batch, pending = pending, []
            size, received = received - len(rest), len(rest)
            await on_rows(CopyBatch(batch, width) if lazy else batch, accounted(len(batch), size))

    await conn.copy_from_query(sql, output=take)
    if rest:
        raise ValueError(f"COPY output ends inside a row: {sql[:200]}")
    if pending:
        count += len(pending)
        last = CopyBatch(pending, width) if lazy else pending
        await on_rows(last, accounted(len(pending), received))
    return count


def accounted(rows: int, text_bytes: int) -> int:
    """Bytes counted against ``buffer.memory_limit`` for ``rows`` rows of ``text_bytes`` bytes of
    COPY text (as the watermarks count a chunk's rows: 64 per row and the values)."""
    return 64 * rows + text_bytes
