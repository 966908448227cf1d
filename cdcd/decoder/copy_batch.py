"""A batch of rows read with COPY, kept as COPY's text until something asks for the rows.

The initial snapshot hands its rows to the sinks in these (:func:`cdcd.source.copy.copy_batches`).
A sink that takes events gets them made from :meth:`CopyBatch.rows`
(:func:`cdcd.decoder.copy_text.copy_rows`, parsed once); the JSON Lines writer writes the
records straight from the text (``cdcd._rowjson.copy_snapshot_lines``, the same bytes), and a
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
    """``text``: COPY text output of ``length`` rows of ``width`` columns, one per line, with
    no newline after the last."""

    __slots__ = ("_rows", "length", "text", "width")

    def __init__(self, text: bytes, length: int, width: int) -> None:
        self.text = text
        self.length = length
        self.width = width
        self._rows: list[TupleData] | None = None

    @property
    def parsed(self) -> bool:
        return self._rows is not None

    def rows(self) -> list[TupleData]:
        """The rows as text-kind TupleData, parsed once."""
        rows = self._rows
        if rows is None:
            lines = self.text.split(b"\n")
            if len(lines) != self.length:
                raise ValueError(f"COPY batch of {len(lines)} lines, expected {self.length}")
            rows = self._rows = copy_rows(lines, self.width)
        return rows

    def __len__(self) -> int:
        return self.length

    @overload
    def __getitem__(self, index: int) -> TupleData: ...

    @overload
    def __getitem__(self, index: slice) -> list[TupleData]: ...

    def __getitem__(self, index: Any) -> Any:
        if self._rows is None and isinstance(index, int):  # the first or last: that line only
            at = index + self.length if index < 0 else index
            text = self.text
            if at == 0:
                first = text.find(b"\n")
                return copy_rows([text if first < 0 else text[:first]], self.width)[0]
            if at == self.length - 1:
                return copy_rows([text[text.rfind(b"\n") + 1 :]], self.width)[0]
        return self.rows()[index]

    def __iter__(self) -> Iterator[TupleData]:
        return iter(self.rows())
