"""PostgreSQL text output, converted to the JSON values of docs/events.md and to native values.

Text-mode columns (TupleData ``t``) carry the type's output-function text. cdcd's replication
session always sets ``DateStyle=ISO, MDY``, ``TimeZone=UTC``, ``IntervalStyle=iso_8601``,
``extra_float_digits=3``, ``bytea_output=hex`` (and should set ``lc_monetary=C``), so the
common conversions are small string edits; timestamptz is still parsed correctly whatever its
offset. Every function here is pure.

Array text (``array_out``): ``{a,"b c",NULL,{...}}``, elements quoted with ``"`` when needed and
``\\`` escaping inside quotes; a ``[lb:ub]=`` prefix when a lower bound is not 1 (then the
whole text is the JSON value, docs/events.md).
"""

from __future__ import annotations

import binascii
import datetime as _dt
import re
from collections.abc import Callable
from decimal import Decimal
from typing import Any, Final

from cdcd.errors import RemoteProtocolError
from cdcd.values import binary as vb

Converter = Callable[[bytes], Any]

_FLOAT_SPECIALS: Final = {"NaN", "Infinity", "-Infinity"}


def text(b: bytes) -> str:
    return b.decode()


def float_json(b: bytes) -> float | str:
    """float4/float8: a JSON number, or ``"NaN"``/``"Infinity"``/``"-Infinity"``."""
    x = float(b)
    if x - x == 0.0:
        return x
    return b.decode()


def bool_value(b: bytes) -> bool:
    return b == b"t"


def bytea_json(b: bytes) -> str:
    """``\\x`` hex (bytea_output=hex) to base64."""
    if b[:2] != b"\\x":
        raise RemoteProtocolError("bytea text is not in hex format (bytea_output=hex expected)")
    return binascii.b2a_base64(binascii.a2b_hex(b[2:]), newline=False).decode("ascii")


def bytea_native(b: bytes) -> bytes:
    if b[:2] != b"\\x":
        raise RemoteProtocolError("bytea text is not in hex format (bytea_output=hex expected)")
    return binascii.a2b_hex(b[2:])


_MONEY_DROP: Final = str.maketrans("", "", "$,()- ")


def money_json(b: bytes) -> str:
    """``$1,234.56`` / ``-$1,234.56`` (lc_monetary=C) to the exact decimal ``"-1234.56"``.
    Assumes a monetary locale with ``.`` as decimal point."""
    s = b.decode()
    neg = "-" in s or "(" in s
    digits = s.translate(_MONEY_DROP)
    return "-" + digits if neg else digits


def money_native(b: bytes) -> Decimal:
    return Decimal(money_json(b))


def numeric_native(b: bytes) -> Decimal | str:
    """numeric as Decimal; ``NaN``/``Infinity``/``-Infinity`` stay strings (no Decimal column
    can hold them)."""
    s = b.decode()
    if s[-1] in "Ny":
        return s
    return Decimal(s)


# --- dates and times -------------------------------------------------------------------------


def timestamp_json(b: bytes) -> str:
    """``2024-01-02 03:04:05.5`` → ``2024-01-02T03:04:05.5``; infinity and BC stay as text."""
    s = b.decode()
    if s[-1] in "Cy":
        return s
    return s.replace(" ", "T", 1)


_TS_RE: Final = re.compile(
    r"(\d{4,})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:\.(\d{1,6}))?"
    r"(?:([+-])(\d\d)(?::?(\d\d))?(?::?(\d\d))?)?( BC)?"
)


def parse_timestamp_us(s: str) -> tuple[int, bool]:
    """PostgreSQL ISO timestamp text to (µs since 2000-01-01 UTC, had an offset), applying
    any ``±HH[:MM[:SS]]`` offset. Raises RemoteProtocolError when malformed."""
    m = _TS_RE.fullmatch(s)
    if m is None:
        raise RemoteProtocolError(f"unparsable timestamp text {s!r}")
    y, mo, d, hh, mi, ss, frac, sign, oh, om, osec, bc = m.groups()
    year = int(y)
    if bc:
        year = 1 - year
    days = vb.date2j(year, int(mo), int(d)) - vb.POSTGRES_EPOCH_JDATE
    secs = days * 86400 + int(hh) * 3600 + int(mi) * 60 + int(ss)
    if sign:
        off = int(oh) * 3600 + int(om or 0) * 60 + int(osec or 0)
        secs -= off if sign == "+" else -off
    us = secs * 1_000_000 + (int(frac.ljust(6, "0")) if frac else 0)
    return us, sign is not None


def timestamptz_json(b: bytes) -> str:
    """ISO-8601 UTC with ``Z``: ``2024-01-02 03:04:05.5+00`` → ``2024-01-02T03:04:05.5Z``; other
    offsets converted to UTC; infinity stays; BC as PostgreSQL's UTC text."""
    s = b.decode()
    if s[-3:] == "+00" and s[4:5] == "-":
        return s[:-3].replace(" ", "T", 1) + "Z"
    if s[-1] == "y":
        return s
    return vb.timestamptz_iso(parse_timestamp_us(s)[0])


def date_native(b: bytes) -> _dt.date | None:
    """datetime.date, or None for ±infinity, BC and years after 9999."""
    s = b.decode()
    if len(s) != 10:
        return None
    return _dt.date.fromisoformat(s)


def time_native(b: bytes) -> _dt.time | None:
    """datetime.time, or None for 24:00:00."""
    s = b.decode()
    if s[:2] == "24":
        return None
    return _dt.time.fromisoformat(s)


def timestamp_native(b: bytes) -> _dt.datetime | None:
    s = b.decode()
    if s[-1] in "Cy" or s[4:5] != "-":
        return None
    return _dt.datetime.fromisoformat(s)


def timestamptz_native(b: bytes) -> _dt.datetime | None:
    """Aware UTC datetime, or None for ±infinity, BC and years outside 1..9999."""
    s = b.decode()
    if s[-1] in "Cy" or s[4:5] != "-":
        return None
    try:
        return _dt.datetime.fromisoformat(s).astimezone(_dt.UTC)
    except (ValueError, OverflowError):
        return None  # an offset pushed it past year 1 or 9999


# --- arrays ----------------------------------------------------------------------------------


def _parse_quoted(s: str, i: int) -> tuple[str, int]:
    """A ``"..."`` element starting at ``s[i] == '"'``: (unescaped text, index after it)."""
    out: list[str] = []
    i += 1
    start = i
    while True:
        j = s.find('"', i)
        k = s.find("\\", i, j if j >= 0 else len(s))
        if j < 0:
            raise RemoteProtocolError(f"unterminated quote in array text {s!r}")
        if k < 0:
            out.append(s[start:j])
            return "".join(out), j + 1
        out.append(s[start:k])
        out.append(s[k + 1 : k + 2])
        i = start = k + 2


def parse_array(s: str, elem: Converter, delim: str = ",") -> list[Any]:
    """Parse ``array_out`` text (no ``[lb:ub]=`` prefix) into nested lists, converting each
    element's text with ``elem`` (which receives the element's UTF-8 bytes)."""
    if s == "{}":
        return []
    if '"' not in s and s[1] != "{":  # 1-D, nothing quoted: the common case
        return [None if t == "NULL" else elem(t.encode()) for t in s[1:-1].split(delim)]
    stack: list[list[Any]] = []
    result: list[Any] | None = None
    i, n = 0, len(s)
    stop = "{}" + delim
    while i < n:
        c = s[i]
        if c == "{":
            new: list[Any] = []
            if stack:
                stack[-1].append(new)
            stack.append(new)
            i += 1
        elif c == "}":
            result = stack.pop()
            i += 1
        elif c == delim:
            i += 1
        elif c == '"':
            val, i = _parse_quoted(s, i)
            stack[-1].append(elem(val.encode()))
        else:
            j = i
            while j < n and s[j] not in stop:
                j += 1
            tok = s[i:j].strip()
            stack[-1].append(None if tok == "NULL" else elem(tok.encode()))
            i = j
    if result is None or stack:
        raise RemoteProtocolError(f"malformed array text {s!r}")
    return result


def array_converter(elem: Converter, delim: str = ",") -> Converter:
    """Text-mode array column: nested lists, or the text itself when a lower bound is not 1."""

    def convert(b: bytes) -> Any:
        s = b.decode()
        if s[0] == "[":
            return s
        return parse_array(s, elem, delim)

    return convert
