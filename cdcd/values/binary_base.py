"""What the binary value codecs share: constants, struct formats, length checks."""

from __future__ import annotations

import datetime as _dt
import struct
from typing import Final

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


def check_length(b: bytes, need: int, what: str) -> None:
    if len(b) < need:
        raise RemoteProtocolError(f"binary {what} value too short: {len(b)} bytes, need {need}")
