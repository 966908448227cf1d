"""Rows read with ``COPY (SELECT ...) TO STDOUT``: the snapshots' reads (README "Initial
snapshot": COPY's text output is already the bytes the encoder takes, where a ``SELECT`` goes
through ``str`` and back; measured about twice as fast).

The text format (PostgreSQL docs, COPY "Text Format"): one line per row, columns separated by
tabs, ``\\N`` for null, and backslash escapes for backslash and the control characters COPY TO
writes escaped. Values come out as text-kind :class:`~cdcd.decoder.events.TupleData`, as the
stream's text values do.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import Any

from cdcd.decoder.events import KIND_NULL, KIND_TEXT, TupleData

_UNESCAPES = {
    b"b": b"\b",
    b"f": b"\f",
    b"n": b"\n",
    b"r": b"\r",
    b"t": b"\t",
    b"v": b"\v",
    b"\\": b"\\",
}
_ESCAPE = re.compile(rb"\\(.)", re.DOTALL)


def _unescape(match: re.Match[bytes]) -> bytes:
    return _UNESCAPES.get(match.group(1), match.group(1))


def copy_rows(lines: list[bytes], width: int) -> list[TupleData]:
    """Rows of COPY text output (one line each, without the newline) as text-kind TupleData."""
    all_text = bytes([KIND_TEXT]) * width
    rows = []
    for line in lines:
        fields = line.split(b"\t")
        if len(fields) != width:
            raise ValueError(f"COPY row with {len(fields)} fields, expected {width}")
        if b"\\" not in line:
            rows.append(TupleData(all_text, tuple(fields)))
            continue
        values = tuple(None if f == b"\\N" else _ESCAPE.sub(_unescape, f) for f in fields)
        kinds = bytes(KIND_NULL if v is None else KIND_TEXT for v in values)
        rows.append(TupleData(kinds, values))
    return rows


async def copy_query(
    conn: Any,
    sql: str,
    width: int,
    on_rows: Callable[[list[TupleData], int], Awaitable[None]],
    batch_size: int = 5000,
) -> int:
    """Read the rows of ``sql`` (its ``width`` columns as text) with ``COPY (sql) TO STDOUT``,
    handing them to ``on_rows`` in batches of about ``batch_size``, with their accounted bytes
    (:func:`accounted`); the row count. ``on_rows`` may wait: the server's output waits with
    it."""
    rest = b""
    pending: list[TupleData] = []
    count = 0
    received = 0  # bytes of the rows in ``pending``, and of ``rest``

    async def take(data: bytes | bytearray) -> None:
        nonlocal rest, pending, count, received
        data = bytes(data)  # asyncpg hands a bytearray; values must be bytes
        received += len(data)
        lines = (rest + data).split(b"\n") if rest else data.split(b"\n")
        rest = lines.pop()
        if lines:
            pending += copy_rows(lines, width)
        if len(pending) >= batch_size:
            count += len(pending)
            batch, pending = pending, []
            size, received = received - len(rest), len(rest)
            await on_rows(batch, accounted(len(batch), size))

    await conn.copy_from_query(sql, output=take)
    if rest:
        raise ValueError(f"COPY output ends inside a row: {sql[:200]}")
    if pending:
        count += len(pending)
        await on_rows(pending, accounted(len(pending), received))
    return count


def accounted(rows: int, text_bytes: int) -> int:
    """Bytes counted against ``buffer.memory_limit`` for ``rows`` rows of ``text_bytes`` bytes of
    COPY text (as the watermarks count a chunk's rows: 64 per row and the values)."""
    return 64 * rows + text_bytes
