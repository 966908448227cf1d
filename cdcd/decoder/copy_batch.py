"""A batch of rows read with COPY, kept as COPY's text lines until something asks for the rows.

The initial snapshot hands its rows to the sinks in these (:func:`cdcd.source.copy.copy_query`
with ``lazy=True``). A sink that takes events gets them made from :meth:`CopyBatch.rows`
(:func:`cdcd.decoder.copy_text.copy_rows`, parsed once); the JSON Lines writer writes the
records straight from the lines (``cdcd._rowjson.copy_snapshot_lines``, the same bytes), and a
sink that only counts (null) parses nothing. A line with another number of fields than the
table's columns is reported where the rows are parsed: by the first sink that needs them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

from cdcd.decoder.copy_text import copy_rows
from cdcd.decoder.events import TupleData

__all__ = ["CopyBatch"]


class CopyBatch(Sequence[TupleData]):
    """``lines``: COPY text output, one row per line without its newline, of ``width``
    columns."""

    __slots__ = ("_rows", "lines", "width")

    def __init__(self, lines: list[bytes], width: int) -> None:
        self.lines = lines
        self.width = width
        self._rows: list[TupleData] | None = None

    @property
    def parsed(self) -> bool:
        return self._rows is not None

    def rows(self) -> list[TupleData]:
        """The rows as text-kind TupleData, parsed once."""
        rows = self._rows
        if rows is None:
            rows = self._rows = copy_rows(self.lines, self.width)
        return rows

    def __len__(self) -> int:
        return len(self.lines)

    @overload
    def __getitem__(self, index: int) -> TupleData: ...

    @overload
    def __getitem__(self, index: slice) -> list[TupleData]: ...

    def __getitem__(self, index: Any) -> Any:
        if self._rows is None and not isinstance(index, slice):  # one row: that line only
            line = self.lines[index]
            return copy_rows([line], self.width)[0]
        return self.rows()[index]

    def __iter__(self) -> Iterator[TupleData]:
        return iter(self.rows())
