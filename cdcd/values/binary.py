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
import functools
import ipaddress
import math
import struct
from collections.abc import Callable
from typing import Final

from cdcd.errors import RemoteProtocolError
from cdcd.values.binary_base import (
    POSTGRES_EPOCH_JDATE as POSTGRES_EPOCH_JDATE,
)
from cdcd.values.binary_base import (
    NoRendererError as NoRendererError,
)
from cdcd.values.binary_base import (
    _dd,
    _f32,
    _f64,
    _i32,
    _i64,
    _ii,
    _numeric_head,
)
from cdcd.values.binary_base import (
    check_length as check_length,
)
from cdcd.values.binary_base import (
    unpack_f64 as unpack_f64,
)
from cdcd.values.binary_containers import (
    RANGE_EMPTY as RANGE_EMPTY,
)
from cdcd.values.binary_containers import (
    RANGE_LB_INC as RANGE_LB_INC,
)
from cdcd.values.binary_containers import (
    RANGE_LB_INF as RANGE_LB_INF,
)
from cdcd.values.binary_containers import (
    RANGE_UB_INC as RANGE_UB_INC,
)
from cdcd.values.binary_containers import (
    RANGE_UB_INF as RANGE_UB_INF,
)
from cdcd.values.binary_containers import (
    ArrayHeader as ArrayHeader,
)
from cdcd.values.binary_containers import (
    RendererLookup as RendererLookup,
)
from cdcd.values.binary_containers import (
    array_elements as array_elements,
)
from cdcd.values.binary_containers import (
    array_header as array_header,
)
from cdcd.values.binary_containers import (
    nest as nest,
)
from cdcd.values.binary_containers import (
    render_array as render_array,
)
from cdcd.values.binary_containers import (
    render_multirange as render_multirange,
)
from cdcd.values.binary_containers import (
    render_range as render_range,
)
from cdcd.values.binary_containers import (
    render_record as render_record,
)
from cdcd.values.binary_time import (
    date2j as date2j,
)
from cdcd.values.binary_time import (
    date_native as date_native,
)
from cdcd.values.binary_time import (
    interval_iso as interval_iso,
)
from cdcd.values.binary_time import (
    j2date as j2date,
)
from cdcd.values.binary_time import (
    render_date as render_date,
)
from cdcd.values.binary_time import (
    render_interval as render_interval,
)
from cdcd.values.binary_time import (
    render_time as render_time,
)
from cdcd.values.binary_time import (
    render_timestamp as render_timestamp,
)
from cdcd.values.binary_time import (
    render_timestamptz as render_timestamptz,
)
from cdcd.values.binary_time import (
    render_timetz as render_timetz,
)
from cdcd.values.binary_time import (
    time_native as time_native,
)
from cdcd.values.binary_time import (
    timestamp_iso as timestamp_iso,
)
from cdcd.values.binary_time import (
    timestamp_json as timestamp_json,
)
from cdcd.values.binary_time import (
    timestamp_native as timestamp_native,
)
from cdcd.values.binary_time import (
    timestamp_native_us as timestamp_native_us,
)
from cdcd.values.binary_time import (
    timestamp_text as timestamp_text,
)
from cdcd.values.binary_time import (
    timestamptz_iso as timestamptz_iso,
)
from cdcd.values.binary_time import (
    timestamptz_json as timestamptz_json,
)
from cdcd.values.binary_time import (
    timestamptz_native as timestamptz_native,
)
from cdcd.values.binary_time import (
    timestamptz_native_us as timestamptz_native_us,
)
from cdcd.values.binary_time import (
    timezone_text as timezone_text,
)

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
    check_length(b, 8, "numeric")
    ndigits, weight, sign, dscale = _numeric_head.unpack_from(b)
    if sign == NUMERIC_NAN:
        return "NaN"
    if sign == NUMERIC_PINF:
        return "Infinity"
    if sign == NUMERIC_NINF:
        return "-Infinity"
    check_length(b, 8 + 2 * ndigits, "numeric")
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
    check_length(b, 16, "uuid")
    h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


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
    check_length(b, 4, "inet/cidr")
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
    check_length(b, 4, "bit")
    (nbits,) = _i32.unpack_from(b)
    if nbits == 0:
        return ""
    return bin(int.from_bytes(b[4:], "big") | (1 << (8 * (len(b) - 4))))[3 : 3 + nbits]


def render_tid(b: bytes) -> str:
    check_length(b, 6, "tid")
    block = int.from_bytes(b[:4], "big")
    offset = int.from_bytes(b[4:6], "big")
    return f"({block},{offset})"


def render_pg_lsn(b: bytes) -> str:
    v = int.from_bytes(b, "big")
    return f"{v >> 32:X}/{v & 0xFFFFFFFF:X}"


def render_snapshot(b: bytes) -> str:
    """txid_snapshot / pg_snapshot: int4 nxip, int8 xmin, int8 xmax, nxip int8 values."""
    check_length(b, 20, "snapshot")
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
