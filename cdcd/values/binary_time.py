"""Binary (``send``) formats of date, time, timestamp and interval, rendered exactly as the
server's text output (``DateStyle=ISO``, ``TimeZone=UTC``, ``IntervalStyle=iso_8601``).

PostgreSQL's own Julian-day arithmetic (``date2j``/``j2date`` from ``utils/adt/datetime.c``), so BC
and far-future values render like the server; Python ``datetime`` serves only as the fast path
for years 1..9999. Part of :mod:`cdcd.values.binary`, which re-exports every public name.
"""

from __future__ import annotations

import datetime as _dt

from cdcd.values.binary_base import (
    _PG_EPOCH_ORDINAL,
    INT32_MAX,
    INT32_MIN,
    INT64_MAX,
    INT64_MIN,
    PG_EPOCH_DATETIME,
    PG_EPOCH_DATETIME_UTC,
    POSTGRES_EPOCH_JDATE,
    USECS_PER_DAY,
    USECS_PER_HOUR,
    USECS_PER_MINUTE,
    USECS_PER_SEC,
    _i32,
    _i64,
    _qi,
    _qii,
    check_length,
)

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
    check_length(b, 12, "timetz")
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
    check_length(b, 16, "interval")
    return interval_iso(*_qii.unpack(b))
