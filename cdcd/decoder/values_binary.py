"""PostgreSQL binary (``send``) formats: decoded, and rendered exactly as the server's text output.

pgoutput with ``binary true`` sends each column in its type's send() format (PostgreSQL docs,
"Logical Replication Message Formats", TupleData ``b``; the formats are those of the type's
``*_send`` function in ``src/backend/utils/adt``). Every function here is pure: bytes in,
value out.

Invariant: for every type handled here, ``render`` of the binary form equals the text form the
server would send in text mode, under the session settings cdcd always uses
(``DateStyle=ISO, MDY``, ``TimeZone=UTC``, ``IntervalStyle=iso_8601``, ``extra_float_digits=3``,
``bytea_output=hex``, ``lc_monetary=C``). That makes text and binary mode interchangeable:
``json(binary) == json(text)`` for every column (tests/integration/test_types_server.py).
Where a direct binary to JSON path is faster (integers, timestamps...), it is an optimisation
that must agree with ``text_json(render(b))``.

Dates and timestamps use PostgreSQL's own Julian-day arithmetic (``date2j``/``j2date`` from
``utils/adt/datetime.c``), so BC and far-future values render like the server; Python
``datetime`` serves only as the fast path for years 1..9999.
"""

from __future__ import annotations

import binascii
import datetime as _dt
import functools
import ipaddress
import math
import struct
from collections.abc import Callable
from typing import Any, Final

from cdcd.errors import RemoteProtocolError

# --- constants ------------------------------------------------------------------------------

POSTGRES_EPOCH_JDATE: Final = 2451545  # date2j(2000, 1, 1)
USECS_PER_DAY: Final = 86_400_000_000
USECS_PER_HOUR: Final = 3_600_000_000
USECS_PER_MINUTE: Final = 60_000_000
USECS_PER_SEC: Final = 1_000_000
INT32_MIN: Final = -(2**31)
INT32_MAX: Final = 2**31 - 1
INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1
#: ``date(2000, 1, 1).toordinal()``: PostgreSQL epoch day as a Python ordinal.
_PG_EPOCH_ORDINAL: Final = 730120
PG_EPOCH_DATETIME: Final = _dt.datetime(2000, 1, 1)
PG_EPOCH_DATETIME_UTC: Final = _dt.datetime(2000, 1, 1, tzinfo=_dt.UTC)

_i16 = struct.Struct(">h")
_i32 = struct.Struct(">i")
_i64 = struct.Struct(">q")
_f32 = struct.Struct(">f")
_f64 = struct.Struct(">d")
_ii = struct.Struct(">ii")
_qi = struct.Struct(">qi")
_qii = struct.Struct(">qii")
_numeric_head = struct.Struct(">hhHH")
_dd = struct.Struct(">dd")

unpack_i16: Final = _i16.unpack
unpack_i32: Final = _i32.unpack
unpack_i64: Final = _i64.unpack
unpack_f32: Final = _f32.unpack
unpack_f64: Final = _f64.unpack


class NoRendererError(RemoteProtocolError):
    """A container holds a value of a type with no exact binary renderer."""


def _short(b: bytes, need: int, what: str) -> None:
    if len(b) < need:
        raise RemoteProtocolError(f"binary {what} value too short: {len(b)} bytes, need {need}")


# --- integers, floats, bool ------------------------------------------------------------------


#: int2/int4/int8 send format: big-endian two's complement of the type's width.
int_signed: Final[Callable[[bytes], int]] = functools.partial(
    int.from_bytes, byteorder="big", signed=True
)


#: oid/xid/cid/xid8 are unsigned.
int_unsigned: Final[Callable[[bytes], int]] = int.from_bytes


def render_int_signed(b: bytes) -> str:
    return str(int.from_bytes(b, "big", signed=True))


def render_int_unsigned(b: bytes) -> str:
    return str(int.from_bytes(b, "big"))


def _float_text(x: float, fixed_limit: int) -> str:
    """``float8out``/``float4out`` with extra_float_digits > 0 (Ryu shortest digits): fixed
    notation for decimal exponents in ``[-4, fixed_limit)``, else ``d.ddde+XX``."""
    if x != x:
        return "NaN"
    if x == math.inf:
        return "Infinity"
    if x == -math.inf:
        return "-Infinity"
    if x == 0.0:
        return "-0" if math.copysign(1.0, x) < 0 else "0"
    r = repr(x) if fixed_limit == 15 else _float4_shortest(x)
    sign = ""
    if r[0] == "-":
        sign, r = "-", r[1:]
    mant, _, exp_s = r.partition("e")
    exp = int(exp_s) if exp_s else 0
    ip, _, fp = mant.partition(".")
    digits = ip + fp
    point = len(ip) + exp
    stripped = digits.lstrip("0")
    point -= len(digits) - len(stripped)
    digits = stripped.rstrip("0") or "0"
    e10 = point - 1
    if -4 <= e10 < fixed_limit:
        if point <= 0:
            body = "0." + "0" * (-point) + digits
        elif point >= len(digits):
            body = digits + "0" * (point - len(digits))
        else:
            body = digits[:point] + "." + digits[point:]
    else:
        body = digits[0] + ("." + digits[1:] if len(digits) > 1 else "")
        body += f"e{'-' if e10 < 0 else '+'}{abs(e10):02d}"
    return sign + body


def _float4_shortest(x: float) -> str:
    """Shortest decimal string that reads back as the same float4 (what Ryu's f2s yields)."""
    packed = _f32.pack(x)
    for p in range(1, 10):
        s = f"{x:.{p}g}"
        try:
            if _f32.pack(float(s)) == packed:
                return s
        except OverflowError:  # rounded up past FLT_MAX: needs more digits
            continue
    return repr(x)  # pragma: no cover - 9 digits always round-trip a float4


def float8_text(x: float) -> str:
    return _float_text(x, 15)


def float4_text(x: float) -> str:
    return _float_text(x, 6)


def float4_value(b: bytes) -> float:
    """A float4 as the Python float the server's text output reads back as (shortest digits),
    so that binary and text mode give the same JSON number."""
    (x,) = _f32.unpack(b)
    if x != x or x in (math.inf, -math.inf):
        return float(x)
    return float(_float4_shortest(x))


def render_float4(b: bytes) -> str:
    return float4_text(_f32.unpack(b)[0])


def render_float8(b: bytes) -> str:
    return float8_text(_f64.unpack(b)[0])


def bool_value(b: bytes) -> bool:
    return b != b"\x00"


def render_bool(b: bytes) -> str:
    return "f" if b == b"\x00" else "t"


# --- numeric and money -----------------------------------------------------------------------

NUMERIC_POS: Final = 0x0000
NUMERIC_NEG: Final = 0x4000
NUMERIC_NAN: Final = 0xC000
NUMERIC_PINF: Final = 0xD000
NUMERIC_NINF: Final = 0xF000


def render_numeric(b: bytes) -> str:
    """``numeric_send`` (ndigits, weight, sign, dscale, base-10000 digits) rendered like
    ``get_str_from_var``: all integer digits, then exactly ``dscale`` fraction digits."""
    _short(b, 8, "numeric")
    ndigits, weight, sign, dscale = _numeric_head.unpack_from(b)
    if sign == NUMERIC_NAN:
        return "NaN"
    if sign == NUMERIC_PINF:
        return "Infinity"
    if sign == NUMERIC_NINF:
        return "-Infinity"
    _short(b, 8 + 2 * ndigits, "numeric")
    digits = struct.unpack_from(f">{ndigits}h", b, 8)
    s = ("%04d" * ndigits) % digits
    point = 4 * (weight + 1)
    if point < 0:
        s = "0" * (-point) + s
        point = 0
    if len(s) < point + dscale:
        s += "0" * (point + dscale - len(s))
    out = s[:point].lstrip("0") or "0"
    if dscale > 0:
        out += "." + s[point : point + dscale]
    return "-" + out if sign == NUMERIC_NEG else out


def money_decimal_text(cents: int) -> str:
    """money as an exact decimal string with the two fraction digits of ``lc_monetary=C``."""
    sign = "-" if cents < 0 else ""
    q, r = divmod(abs(cents), 100)
    return f"{sign}{q}.{r:02d}"


def money_value(b: bytes) -> str:
    return money_decimal_text(_i64.unpack(b)[0])


def render_money(b: bytes) -> str:
    """``cash_out`` under ``lc_monetary=C``: ``$1,234.56``, ``-$1,234.56``."""
    cents = _i64.unpack(b)[0]
    q, r = divmod(abs(cents), 100)
    return f"{'-' if cents < 0 else ''}${q:,}.{r:02d}"


# --- text-like -------------------------------------------------------------------------------


def render_text(b: bytes) -> str:
    return b.decode()


def render_char(b: bytes) -> str:
    """``"char"`` (charout): high-bit bytes as ``\\ooo`` octal, NUL as the empty string."""
    if not b or b[0] == 0:
        return ""
    c = b[0]
    return f"\\{c:03o}" if c & 0x80 else chr(c)


def render_jsonb(b: bytes) -> str:
    """``jsonb_send``: a version byte (1) then the text."""
    if not b or b[0] != 1:
        raise RemoteProtocolError(f"unsupported binary jsonb/jsonpath version {b[:1]!r}")
    return b[1:].decode()


def render_bytea(b: bytes) -> str:
    return "\\x" + b.hex()


def bytea_base64(b: bytes) -> str:
    return binascii.b2a_base64(b, newline=False).decode("ascii")


def render_uuid(b: bytes) -> str:
    _short(b, 16, "uuid")
    h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


# --- date and time ---------------------------------------------------------------------------


def date2j(year: int, month: int, day: int) -> int:
    """Julian day of a proleptic Gregorian date (astronomical year: 1 BC is 0)."""
    if month > 2:
        month += 1
        year += 4800
    else:
        month += 13
        year += 4799
    century = year // 100
    julian = year * 365 - 32167
    julian += year // 4 - century + century // 4
    julian += 7834 * month // 256 + day
    return julian


def j2date(jd: int) -> tuple[int, int, int]:
    julian = jd + 32044
    quad = julian // 146097
    extra = (julian - quad * 146097) * 4 + 3
    julian += 60 + quad * 3 + extra // 146097
    quad = julian // 1461
    julian -= quad * 1461
    y = julian * 4 // 1461
    julian = ((julian + 305) % 365 if y != 0 else (julian + 306) % 366) + 123
    y += quad * 4
    quad = julian * 2141 // 65536
    day = julian - 7834 * quad // 256
    month = (quad + 10) % 12 + 1
    return y - 4800, month, day


def _ymd_text(year: int) -> tuple[str, bool]:
    """Year as PostgreSQL prints it (``%04d``, BC years counted from 1) and whether it is BC."""
    if year > 0:
        return f"{year:04d}", False
    return f"{1 - year:04d}", True


def _date_text_from_days(days: int) -> str:
    y, m, d = j2date(days + POSTGRES_EPOCH_JDATE)
    ys, bc = _ymd_text(y)
    return f"{ys}-{m:02d}-{d:02d}" + (" BC" if bc else "")


def _fraction(us: int) -> str:
    """``.ffffff`` with trailing zeros trimmed, or nothing (PostgreSQL's AppendSeconds)."""
    return ("." + f"{us:06d}".rstrip("0")) if us else ""


def _time_text(us: int) -> str:
    hh, rem = divmod(us, USECS_PER_HOUR)
    mi, rem = divmod(rem, USECS_PER_MINUTE)
    ss, fr = divmod(rem, USECS_PER_SEC)
    return f"{hh:02d}:{mi:02d}:{ss:02d}{_fraction(fr)}"


def timezone_text(tz_west: int) -> str:
    """``EncodeTimezone``: ``tz_west`` is seconds *west* of Greenwich (PostgreSQL's sign)."""
    sec = abs(tz_west)
    mi, sec = divmod(sec, 60)
    hh, mi = divmod(mi, 60)
    sign = "+" if tz_west <= 0 else "-"
    if sec:
        return f"{sign}{hh:02d}:{mi:02d}:{sec:02d}"
    if mi:
        return f"{sign}{hh:02d}:{mi:02d}"
    return f"{sign}{hh:02d}"


def render_date(b: bytes) -> str:
    days = _i32.unpack(b)[0]
    if days == INT32_MAX:
        return "infinity"
    if days == INT32_MIN:
        return "-infinity"
    if -730119 <= days <= 2921939:  # 0001-01-01 .. 9999-12-31
        return _dt.date.fromordinal(days + _PG_EPOCH_ORDINAL).isoformat()
    return _date_text_from_days(days)


def date_native(b: bytes) -> _dt.date | None:
    days = _i32.unpack(b)[0]
    if -730119 <= days <= 2921939:
        return _dt.date.fromordinal(days + _PG_EPOCH_ORDINAL)
    return None


def render_time(b: bytes) -> str:
    return _time_text(_i64.unpack(b)[0])


def time_native(b: bytes) -> _dt.time | None:
    us = _i64.unpack(b)[0]
    if not 0 <= us < USECS_PER_DAY:
        return None  # 24:00:00 has no datetime.time
    hh, rem = divmod(us, USECS_PER_HOUR)
    mi, rem = divmod(rem, USECS_PER_MINUTE)
    ss, fr = divmod(rem, USECS_PER_SEC)
    return _dt.time(hh, mi, ss, fr)


def render_timetz(b: bytes) -> str:
    _short(b, 12, "timetz")
    us, zone = _qi.unpack(b)
    return _time_text(us) + timezone_text(zone)


def timestamp_text(us: int, *, utc_suffix: bool) -> str:
    """PostgreSQL's ISO text of a timestamp (µs since 2000-01-01); ``utc_suffix`` appends the
    ``+00`` of a timestamptz shown with TimeZone=UTC, before any `` BC``."""
    if us == INT64_MAX:
        return "infinity"
    if us == INT64_MIN:
        return "-infinity"
    days, tod = divmod(us, USECS_PER_DAY)
    y, m, d = j2date(days + POSTGRES_EPOCH_JDATE)
    ys, bc = _ymd_text(y)
    s = f"{ys}-{m:02d}-{d:02d} {_time_text(tod)}"
    if utc_suffix:
        s += "+00"
    return s + " BC" if bc else s


def render_timestamp(b: bytes) -> str:
    return timestamp_text(_i64.unpack(b)[0], utc_suffix=False)


def render_timestamptz(b: bytes) -> str:
    return timestamp_text(_i64.unpack(b)[0], utc_suffix=True)


def timestamp_iso(us: int) -> str:
    """JSON form of a timestamp: ISO-8601 ``YYYY-MM-DDTHH:MM:SS[.ffffff]`` (fraction trimmed as
    PostgreSQL prints it); ``infinity``/``-infinity``; BC values as PostgreSQL's text."""
    try:
        dt = PG_EPOCH_DATETIME + _dt.timedelta(0, 0, us)
    except OverflowError:
        s = timestamp_text(us, utc_suffix=False)
        return s if s[-1] in "Cy" else s.replace(" ", "T", 1)
    if dt.microsecond:
        return dt.isoformat().rstrip("0")
    return dt.isoformat()


def timestamptz_iso(us: int) -> str:
    """JSON form of a timestamptz: ISO-8601 UTC with ``Z``; ``infinity``/``-infinity``; BC
    values as PostgreSQL's text under TimeZone=UTC (``0044-03-15 12:00:00+00 BC``)."""
    try:
        dt = PG_EPOCH_DATETIME + _dt.timedelta(0, 0, us)
    except OverflowError:
        s = timestamp_text(us, utc_suffix=True)
        return s if s[-1] in "Cy" else s[:-3].replace(" ", "T", 1) + "Z"
    if dt.microsecond:
        return dt.isoformat().rstrip("0") + "Z"
    return dt.isoformat() + "Z"


def timestamp_json(b: bytes) -> str:
    return timestamp_iso(_i64.unpack(b)[0])


def timestamptz_json(b: bytes) -> str:
    return timestamptz_iso(_i64.unpack(b)[0])


def timestamp_native_us(us: int) -> _dt.datetime | None:
    try:
        return PG_EPOCH_DATETIME + _dt.timedelta(0, 0, us)
    except OverflowError:
        return None  # ±infinity, BC, after 9999


def timestamptz_native_us(us: int) -> _dt.datetime | None:
    try:
        return PG_EPOCH_DATETIME_UTC + _dt.timedelta(0, 0, us)
    except OverflowError:
        return None


def timestamp_native(b: bytes) -> _dt.datetime | None:
    return timestamp_native_us(_i64.unpack(b)[0])


def timestamptz_native(b: bytes) -> _dt.datetime | None:
    return timestamptz_native_us(_i64.unpack(b)[0])


def _tdiv(a: int, b: int) -> tuple[int, int]:
    """C division: quotient truncated toward zero, remainder with the dividend's sign."""
    q = abs(a) // b
    if a < 0:
        q = -q
    return q, a - q * b


def interval_iso(us: int, days: int, months: int) -> str:
    """``EncodeInterval`` with IntervalStyle=iso_8601 (``P1Y2M3DT4H5M6.5S``, ``PT0S``,
    ``P-1Y-2M3DT-4H-5M-6.5S``; ``infinity``/``-infinity`` on 17+)."""
    if months == INT32_MAX and days == INT32_MAX and us == INT64_MAX:
        return "infinity"
    if months == INT32_MIN and days == INT32_MIN and us == INT64_MIN:
        return "-infinity"
    year, mon = _tdiv(months, 12)
    hour, rem = _tdiv(us, USECS_PER_HOUR)
    minute, rem = _tdiv(rem, USECS_PER_MINUTE)
    sec, fsec = _tdiv(rem, USECS_PER_SEC)
    if not (year or mon or days or hour or minute or sec or fsec):
        return "PT0S"
    parts = ["P"]
    for v, unit in ((year, "Y"), (mon, "M"), (days, "D")):
        if v:
            parts.append(f"{v}{unit}")
    if hour or minute or sec or fsec:
        parts.append("T")
    for v, unit in ((hour, "H"), (minute, "M")):
        if v:
            parts.append(f"{v}{unit}")
    if sec or fsec:
        sign = "-" if sec < 0 or fsec < 0 else ""
        parts.append(f"{sign}{abs(sec)}{_fraction(abs(fsec))}S")
    return "".join(parts)


def render_interval(b: bytes) -> str:
    _short(b, 16, "interval")
    return interval_iso(*_qii.unpack(b))


# --- network, bits, misc ---------------------------------------------------------------------

PGSQL_AF_INET: Final = 2
PGSQL_AF_INET6: Final = 3


def _ipv6_text(addr: bytes) -> str:
    """``inet_net_ntop_ipv6``: longest (first) run of >= 2 zero words as ``::``; an embedded
    IPv4 address (``::a.b.c.d``, ``::ffff:a.b.c.d``) in dotted form."""
    words = struct.unpack(">8H", addr)
    best_base, best_len, cur_base, cur_len = -1, 0, -1, 0
    for i, w in enumerate(words):
        if w == 0:
            if cur_base == -1:
                cur_base, cur_len = i, 1
            else:
                cur_len += 1
        elif cur_base != -1:
            if best_base == -1 or cur_len > best_len:
                best_base, best_len = cur_base, cur_len
            cur_base = -1
    if cur_base != -1 and (best_base == -1 or cur_len > best_len):
        best_base, best_len = cur_base, cur_len
    if best_base != -1 and best_len < 2:
        best_base = -1
    out: list[str] = []
    i = 0
    while i < 8:
        if best_base != -1 and best_base <= i < best_base + best_len:
            if i == best_base:
                out.append(":")
            i += 1
            continue
        if i != 0:
            out.append(":")
        if i == 6 and best_base == 0 and (best_len == 6 or (best_len == 5 and words[5] == 0xFFFF)):
            out.append(str(ipaddress.IPv4Address(addr[12:16])))
            break
        out.append(f"{words[i]:x}")
        i += 1
    if best_base != -1 and best_base + best_len == 8:
        out.append(":")
    return "".join(out)


def _render_network(b: bytes, is_cidr: bool) -> str:
    _short(b, 4, "inet/cidr")
    family, bits, _flag, nb = b[0], b[1], b[2], b[3]
    addr = b[4 : 4 + nb]
    if family == PGSQL_AF_INET:
        text = ".".join(str(x) for x in addr.ljust(4, b"\x00"))
        full = 32
    elif family == PGSQL_AF_INET6:
        text = _ipv6_text(addr.ljust(16, b"\x00"))
        full = 128
    else:
        raise RemoteProtocolError(f"unknown inet address family {family}")
    if bits != full or is_cidr:
        text += f"/{bits}"
    return text


def render_inet(b: bytes) -> str:
    return _render_network(b, False)


def render_cidr(b: bytes) -> str:
    return _render_network(b, True)


def render_macaddr(b: bytes) -> str:
    return b.hex(":")


def render_bits(b: bytes) -> str:
    """bit/varbit: int4 bit length, then the bits packed most significant first."""
    _short(b, 4, "bit")
    (nbits,) = _i32.unpack_from(b)
    if nbits == 0:
        return ""
    return bin(int.from_bytes(b[4:], "big") | (1 << (8 * (len(b) - 4))))[3 : 3 + nbits]


def render_tid(b: bytes) -> str:
    _short(b, 6, "tid")
    block = int.from_bytes(b[:4], "big")
    offset = int.from_bytes(b[4:6], "big")
    return f"({block},{offset})"


def render_pg_lsn(b: bytes) -> str:
    v = int.from_bytes(b, "big")
    return f"{v >> 32:X}/{v & 0xFFFFFFFF:X}"


def render_snapshot(b: bytes) -> str:
    """txid_snapshot / pg_snapshot: int4 nxip, int8 xmin, int8 xmax, nxip int8 values."""
    _short(b, 20, "snapshot")
    (nxip,) = _i32.unpack_from(b)
    xmin, xmax = struct.unpack_from(">qq", b, 4)
    xips = struct.unpack_from(f">{nxip}q", b, 20)
    return f"{xmin}:{xmax}:" + ",".join(str(x) for x in xips)


def _float_pair(b: bytes, off: int) -> str:
    x, y = _dd.unpack_from(b, off)
    return f"({float8_text(x)},{float8_text(y)})"


def render_point(b: bytes) -> str:
    return _float_pair(b, 0)


def render_line(b: bytes) -> str:
    a, bb, c = struct.unpack(">ddd", b)
    return "{" + f"{float8_text(a)},{float8_text(bb)},{float8_text(c)}" + "}"


def render_lseg(b: bytes) -> str:
    return f"[{_float_pair(b, 0)},{_float_pair(b, 16)}]"


def render_box(b: bytes) -> str:
    return f"{_float_pair(b, 0)},{_float_pair(b, 16)}"


def _points(b: bytes, off: int) -> list[str]:
    (n,) = _i32.unpack_from(b, off)
    return [_float_pair(b, off + 4 + 16 * i) for i in range(n)]


def render_path(b: bytes) -> str:
    closed = b[0] != 0
    pts = ",".join(_points(b, 1))
    return f"({pts})" if closed else f"[{pts}]"


def render_polygon(b: bytes) -> str:
    return "(" + ",".join(_points(b, 0)) + ")"


def render_circle(b: bytes) -> str:
    x, y, r = struct.unpack(">ddd", b)
    return f"<({float8_text(x)},{float8_text(y)}),{float8_text(r)}>"


def render_intvector(b: bytes) -> str:
    """int2vector/oidvector: sent in array format, shown space-separated."""
    ndim, _flags, _elem = struct.unpack_from(">iiI", b)
    if ndim == 0:
        return ""
    (n, _lb) = _ii.unpack_from(b, 12)
    out: list[str] = []
    off = 20
    for _ in range(n):
        (ln,) = _i32.unpack_from(b, off)
        out.append(str(int.from_bytes(b[off + 4 : off + 4 + ln], "big", signed=ln == 2)))
        off += 4 + ln
    return " ".join(out)


#: Built-in types whose send format renders exactly as their text output: oid → renderer.
RENDERERS: Final[dict[int, Callable[[bytes], str]]] = {
    16: render_bool,
    17: render_bytea,
    18: render_char,
    19: render_text,  # name
    20: render_int_signed,
    21: render_int_signed,
    22: render_intvector,
    23: render_int_signed,
    25: render_text,
    26: render_int_unsigned,  # oid
    27: render_tid,
    28: render_int_unsigned,  # xid
    29: render_int_unsigned,  # cid
    30: render_intvector,
    114: render_text,  # json
    142: render_text,  # xml
    600: render_point,
    601: render_lseg,
    602: render_path,
    603: render_box,
    604: render_polygon,
    628: render_line,
    650: render_cidr,
    700: render_float4,
    701: render_float8,
    718: render_circle,
    774: render_macaddr,  # macaddr8
    790: render_money,
    829: render_macaddr,
    869: render_inet,
    1042: render_text,  # bpchar
    1043: render_text,  # varchar
    1082: render_date,
    1083: render_time,
    1114: render_timestamp,
    1184: render_timestamptz,
    1186: render_interval,
    1266: render_timetz,
    1560: render_bits,
    1562: render_bits,
    1700: render_numeric,
    1790: render_text,  # refcursor
    2950: render_uuid,
    2970: render_snapshot,
    3220: render_pg_lsn,
    3802: render_jsonb,
    4072: render_jsonb,  # jsonpath: version byte 1 then text, like jsonb
    5038: render_snapshot,
    5069: render_int_unsigned,  # xid8
}

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
    _short(b, 12, "array")
    ndim, _flags, elem = struct.unpack_from(">iiI", b)
    if not 0 <= ndim <= 6:
        raise RemoteProtocolError(f"binary array with {ndim} dimensions")
    _short(b, 12 + 8 * ndim, "array")
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
    _short(b, 4, "record")
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
