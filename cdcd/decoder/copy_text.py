"""COPY's text output (one line per row, without its newline) as text-kind TupleData: the
per-row part of :mod:`cdcd.source.copy`, compiled with mypyc (``cdcd/_purepy.py``), so it
imports nothing but the standard library and the decoder's event types.

The text format (PostgreSQL docs, COPY "Text Format"): columns separated by tabs, ``\\N`` for
null, and backslash escapes for backslash and the control characters COPY TO writes escaped.
"""

from __future__ import annotations

import re
from typing import Final

from cdcd.decoder.events import KIND_NULL, KIND_TEXT, TupleData

__all__ = ["copy_rows"]

_UNESCAPES: Final = {
    b"b": b"\b",
    b"f": b"\f",
    b"n": b"\n",
    b"r": b"\r",
    b"t": b"\t",
    b"v": b"\v",
    b"\\": b"\\",
}
_BACKSLASH: Final = ord("\\")
_ESCAPE: Final = re.compile(rb"\\(.)", re.DOTALL)


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
        if _BACKSLASH not in line:  # an int: memchr, where a bytes needle is ten times slower
            rows.append(TupleData(all_text, tuple(fields)))
            continue
        values = tuple(None if f == b"\\N" else _ESCAPE.sub(_unescape, f) for f in fields)
        kinds = bytes(KIND_NULL if v is None else KIND_TEXT for v in values)
        rows.append(TupleData(kinds, values))
    return rows
