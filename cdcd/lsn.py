"""Log sequence numbers and PostgreSQL timestamps: the only place that does their arithmetic.

An LSN is a 64-bit byte position in the WAL, shown by PostgreSQL as two hexadecimal halves
``XXXXXXXX/XXXXXXXX``. cdcd carries LSNs as plain ``int`` everywhere and formats them only at
the edges (logs, CLI, file names). Progress only moves forward: :class:`Progress` enforces it.

PostgreSQL timestamps on the wire (TimestampTz) are microseconds since 2000-01-01 00:00 UTC.
"""

from __future__ import annotations

INVALID_LSN = 0
MAX_LSN = 0xFFFF_FFFF_FFFF_FFFF

#: Microseconds between the Unix epoch (1970-01-01) and the PostgreSQL epoch (2000-01-01).
PG_EPOCH_OFFSET_US = 946_684_800_000_000


def parse_lsn(text: str) -> int:
    """Parse ``"16/B374D848"`` (or a plain decimal integer) into an int; ValueError when malformed."""
    text = text.strip()
    hi, sep, lo = text.partition("/")
    try:
        if not sep:
            value = int(text, 10)
        else:
            if not hi or not lo or len(hi) > 8 or len(lo) > 8:
                raise ValueError
            value = (int(hi, 16) << 32) | int(lo, 16)
    except ValueError:
        raise ValueError(f"not an LSN: {text!r} (expected XXXXXXXX/XXXXXXXX)") from None
    if not 0 <= value <= MAX_LSN:
        raise ValueError(f"LSN out of range: {text!r}")
    return value


def format_lsn(lsn: int) -> str:
    """Format an int LSN the way PostgreSQL shows it: ``16/B374D848``."""
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def pg_to_unix_us(pg_us: int) -> int:
    """PostgreSQL epoch microseconds to Unix epoch microseconds."""
    return pg_us + PG_EPOCH_OFFSET_US


def unix_to_pg_us(unix_us: int) -> int:
    """Unix epoch microseconds to PostgreSQL epoch microseconds (for standby status updates)."""
    return unix_us - PG_EPOCH_OFFSET_US


class Progress:
    """A position that only moves forward. ``advance`` ignores older positions; ``value`` reads it."""

    __slots__ = ("_value",)

    def __init__(self, start: int = INVALID_LSN) -> None:
        self._value = start

    @property
    def value(self) -> int:
        return self._value

    def advance(self, lsn: int) -> bool:
        """Move to ``lsn`` if it is ahead; return whether it moved."""
        if lsn > self._value:
            self._value = lsn
            return True
        return False

    def __repr__(self) -> str:
        return f"Progress({format_lsn(self._value)})"
