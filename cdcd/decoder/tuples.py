"""The innermost loop of the decoder: one pgoutput TupleData part to its kinds and raw values.

Written to be compiled by mypyc (``python -m cdcd.accel build``) and to run unchanged as plain
Python when it is not (see :mod:`cdcd.accel`). :func:`parse_tuple` takes the hand-written C
``cdcd._tupledata.parse_tuple`` where it is in use (about three times as fast: one pass, each
value written straight into the values tuple), and :func:`parse_tuple_python` otherwise, or
whenever the C function declines (anything malformed: the Python loop then says what).
Format (PostgreSQL docs "Logical Replication Message Formats", TupleData)::

    Int16 ncols, then per column: Byte1 kind ('n' null, 'u' unchanged TOAST,
    't' text, 'b' binary), and for 't'/'b' Int32 length + that many bytes.

:func:`build_tuple` is the inverse (spill files store changes in pgoutput's own format).

Invariants: :func:`parse_tuple` never reads a byte twice and copies each value once (one
``bytes`` slice). It does not describe errors, only detects them: a length running past the
end raises IndexError (or returns a position past the end, which the caller checks), and an
unknown kind raises :class:`BadKind`; :mod:`cdcd.decoder.pgoutput` then rescans the part to
say which column was wrong.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Final

from cdcd._purepy import c_module

_TEXT: Final = 116  # 't'
_BINARY: Final = 98  # 'b'
_NULL: Final = 110  # 'n'
_UNCHANGED_TOAST: Final = 117  # 'u'

_U16: Final = struct.Struct("!H")
_HEAD: Final = struct.Struct("!BI")  # kind, value length
_SINGLE: Final = {_NULL: b"n", _UNCHANGED_TOAST: b"u"}


class BadKind(Exception):
    """An unknown kind byte: ``column`` (0-based) of ``ncols`` had ``kind``."""

    def __init__(self, column: int, ncols: int, kind: int) -> None:
        super().__init__(column, ncols, kind)
        self.column = column
        self.ncols = ncols
        self.kind = kind


_Parsed = tuple[bytes, tuple[bytes | None, ...], int]

_TUPLEDATA: Final = c_module("cdcd._tupledata")
#: cdcd._tupledata.parse_tuple (hand-written C), or None where it is not in use
_C_PARSE_TUPLE: Final[Callable[[bytes, int], _Parsed | None] | None] = (
    None if _TUPLEDATA is None else _TUPLEDATA.parse_tuple
)


def parse_tuple(buf: bytes, pos: int) -> _Parsed:
    """The TupleData at ``pos``: (kind bytes, values, position after it).

    The returned position may lie past ``len(buf)`` when the last length lied; the caller
    must check it.
    """
    fast = _C_PARSE_TUPLE
    if fast is not None:
        found = fast(buf, pos)
        if found is not None:
            return found
    return parse_tuple_python(buf, pos)


def parse_tuple_python(buf: bytes, pos: int) -> _Parsed:
    """:func:`parse_tuple` in Python: what the C function computes, and the errors."""
    ncols: int = (buf[pos] << 8) | buf[pos + 1]
    pos += 2
    kinds = bytearray(ncols)
    values: list[bytes | None] = [None] * ncols
    for i in range(ncols):
        kind: int = buf[pos]
        if kind in (_TEXT, _BINARY):
            start = pos + 5
            # unsigned, so pos only moves forward: a huge length ends past the end
            length: int = (
                (buf[pos + 1] << 24) | (buf[pos + 2] << 16) | (buf[pos + 3] << 8) | buf[pos + 4]
            )
            pos = start + length
            values[i] = buf[start:pos]
        elif kind in (_NULL, _UNCHANGED_TOAST):
            pos += 1
        else:
            raise BadKind(i, ncols, kind)
        kinds[i] = kind
    return bytes(kinds), tuple(values), pos


def build_tuple(kinds: bytes, values: tuple[bytes | None, ...]) -> bytes:
    """The TupleData bytes of ``kinds`` and ``values`` (inverse of :func:`parse_tuple`).

    ``kinds`` and ``values`` have the same length, a value for each 't'/'b' column.
    """
    ncols = len(kinds)
    if ncols != len(values) or ncols > 0xFFFF:
        raise ValueError(f"{ncols} kinds for {len(values)} values")
    parts: list[bytes] = [_U16.pack(ncols)]
    for i in range(ncols):
        kind: int = kinds[i]
        if kind in (_TEXT, _BINARY):
            value = values[i]
            if value is None:
                raise ValueError(f"column {i + 1}: kind {chr(kind)!r} without a value")
            parts.append(_HEAD.pack(kind, len(value)))
            parts.append(value)
        else:
            parts.append(_SINGLE[kind])
    return b"".join(parts)
