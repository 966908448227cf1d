"""Binary (``send``) formats of containers — arrays, records, ranges, multiranges — rendered
exactly as the server's text output, their elements by the renderer of their type. Part of
:mod:`cdcd.values.binary`, which re-exports every public name."""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import Any, Final

from cdcd.errors import RemoteProtocolError
from cdcd.values.binary_base import NoRendererError, _i32, check_length

# --- containers: arrays, records, ranges, multiranges ---------------------------------------

#: Resolves an element/field/subtype OID to its renderer (None: not renderable).
RendererLookup = Callable[[int], Callable[[bytes], str] | None]


def _needs_quotes(s: str, specials: str) -> bool:
    if not s:
        return True
    return any(ch in specials or ch.isspace() for ch in s)


def _array_quote(s: str, delim: str) -> str:
    if s.upper() == "NULL" or _needs_quotes(s, '{}"\\' + delim):
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return s


def _record_quote(s: str, specials: str) -> str:
    """record_out / range_bound_escape: quote when needed, doubling quotes and backslashes."""
    if _needs_quotes(s, specials):
        return '"' + s.replace("\\", "\\\\").replace('"', '""') + '"'
    return s


ArrayHeader = tuple[int, tuple[int, ...], tuple[int, ...], int]


def array_header(b: bytes) -> ArrayHeader:
    """``array_send`` header: (element oid, dims, lower bounds, offset of the first element)."""
    check_length(b, 12, "array")
    ndim, _flags, elem = struct.unpack_from(">iiI", b)
    if not 0 <= ndim <= 6:
        raise RemoteProtocolError(f"binary array with {ndim} dimensions")
    check_length(b, 12 + 8 * ndim, "array")
    dims = tuple(_i32.unpack_from(b, 12 + 8 * i)[0] for i in range(ndim))
    lbs = tuple(_i32.unpack_from(b, 16 + 8 * i)[0] for i in range(ndim))
    return elem, dims, lbs, 12 + 8 * ndim


def array_elements(b: bytes, off: int, count: int) -> list[bytes | None]:
    """The ``count`` elements of a binary array from ``off``: int4 length (-1: NULL) + bytes."""
    out: list[bytes | None] = []
    append = out.append
    unpack = _i32.unpack_from
    n = len(b)
    for _ in range(count):
        if off + 4 > n:
            raise RemoteProtocolError("binary array truncated")
        (ln,) = unpack(b, off)
        off += 4
        if ln < 0:
            append(None)
        else:
            append(b[off : off + ln])
            off += ln
    if off != n:
        raise RemoteProtocolError(f"binary array has {n - off} trailing bytes")
    return out


def nest(flat: list[Any], dims: tuple[int, ...]) -> list[Any]:
    """Reshape a flat row-major element list into nested lists of ``dims``."""
    for d in reversed(dims[1:]):
        flat = [flat[i : i + d] for i in range(0, len(flat), d)]
    return flat


def render_array(b: bytes, lookup: RendererLookup, delim: str = ",") -> str:
    """``array_out`` of a binary array, including the ``[lb:ub]=`` decoration when a lower
    bound is not 1."""
    elem, dims, lbs, off = array_header(b)
    if not dims:
        return "{}"
    render = lookup(elem)
    if render is None:
        raise NoRendererError(f"no binary renderer for array element type {elem}")
    total = math.prod(dims)
    items = [
        "NULL" if v is None else _array_quote(render(v), delim)
        for v in array_elements(b, off, total)
    ]
    for d in reversed(dims):
        items = ["{" + delim.join(items[i : i + d]) + "}" for i in range(0, len(items), d)]
    prefix = ""
    if any(lb != 1 for lb in lbs):
        prefix = "".join(f"[{lb}:{lb + d - 1}]" for lb, d in zip(lbs, dims, strict=True)) + "="
    return prefix + items[0]


def render_record(b: bytes, lookup: RendererLookup) -> str:
    """``record_send`` (int4 ncols, then per column: oid, int4 length or -1, bytes) rendered as
    ``record_out``: ``(1,"a b",,"x""y")``."""
    check_length(b, 4, "record")
    (n,) = _i32.unpack_from(b)
    off = 4
    fields: list[str] = []
    for _ in range(n):
        oid, ln = struct.unpack_from(">Ii", b, off)
        off += 8
        if ln < 0:
            fields.append("")
            continue
        render = lookup(oid)
        if render is None:
            raise NoRendererError(f"no binary renderer for record field type {oid}")
        fields.append(_record_quote(render(b[off : off + ln]), '"\\(),'))
        off += ln
    return "(" + ",".join(fields) + ")"


RANGE_EMPTY: Final = 0x01
RANGE_LB_INC: Final = 0x02
RANGE_UB_INC: Final = 0x04
RANGE_LB_INF: Final = 0x08
RANGE_UB_INF: Final = 0x10


def render_range(b: bytes, subtype_render: Callable[[bytes], str]) -> str:
    """``range_send`` (flags byte, then int4 length + bytes per finite bound) as ``range_out``."""
    flags = b[0]
    if flags & RANGE_EMPTY:
        return "empty"
    off = 1
    lower = upper = ""
    if not flags & RANGE_LB_INF:
        (ln,) = _i32.unpack_from(b, off)
        lower = _record_quote(subtype_render(b[off + 4 : off + 4 + ln]), '"\\,()[]')
        off += 4 + ln
    if not flags & RANGE_UB_INF:
        (ln,) = _i32.unpack_from(b, off)
        upper = _record_quote(subtype_render(b[off + 4 : off + 4 + ln]), '"\\,()[]')
    lo = "[" if flags & RANGE_LB_INC else "("
    hi = "]" if flags & RANGE_UB_INC else ")"
    return f"{lo}{lower},{upper}{hi}"


def render_multirange(b: bytes, range_render: Callable[[bytes], str]) -> str:
    """``multirange_send`` (int4 count, then int4 length + range per range) as text."""
    (n,) = _i32.unpack_from(b)
    off = 4
    out: list[str] = []
    for _ in range(n):
        (ln,) = _i32.unpack_from(b, off)
        out.append(range_render(b[off + 4 : off + 4 + ln]))
        off += 4 + ln
    return "{" + ",".join(out) + "}"
