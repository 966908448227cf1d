"""The file sink's formats: the table writer of each ``format`` (and file suffix). Parquet is
loaded only when used (pyarrow imports on demand)."""

from __future__ import annotations

from cdcd.errors import DefiniteSinkError
from cdcd.sinks.file.layout import JsonlTableWriter, TableWriter


def writer_class(fmt: str) -> type[TableWriter]:
    """The table writer of a ``format`` (or of a file suffix without the dot)."""
    if fmt == "jsonl":
        return JsonlTableWriter
    if fmt == "parquet":
        from cdcd.sinks.file.parquet import ParquetTableWriter  # optional: pyarrow loads on demand

        cls: type[TableWriter] = ParquetTableWriter
        return cls
    raise DefiniteSinkError(f"file sink: unknown format {fmt!r}")
