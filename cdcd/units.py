"""Human-friendly sizes and durations in the configuration.

Sizes are byte counts: a plain integer (``4096``) or a number with a unit, decimal
(``kB``, ``MB``, ``GB``, ``TB``: powers of 1000) or binary (``KiB``, ``MiB``, ``GiB``, ``TiB``:
powers of 1024). Units are case-insensitive, so ``512kb`` is ``512kB``; a bare ``B`` is bytes.

Durations are seconds as a float: a plain number (``10``, ``0.5``) or a number with a unit
(``500ms``, ``10s``, ``2m``, ``1h``, ``1d``; also ``us``). Neither may be negative.

:data:`ByteSize` and :data:`Duration` are pydantic annotated types, so a bad value is reported
under the key it was given for. :data:`ConfigPath` is a path that, when relative, is resolved
against the folder of the config file (passed as validation context ``{"config_dir": ...}``;
without it, against the working directory); ``~`` is expanded. Sinks use it for their paths.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, ValidationInfo

_SIZE_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}

_DURATION_UNITS: dict[str, float] = {
    "": 1.0,
    "us": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "min": 60.0,
    "h": 3600.0,
    "d": 86400.0,
}

_NUMBER_WITH_UNIT = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def _split(text: str) -> tuple[float, str] | None:
    match = _NUMBER_WITH_UNIT.fullmatch(text)
    if match is None:
        return None
    return float(match.group(1)), match.group(2).lower()


def parse_size(value: Any) -> int:
    """Bytes from ``"256MiB"``, ``"1GB"``, ``"512kB"``, ``"1024"`` or an int; ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"bad size {value!r} (use e.g. 256MiB, 1GB, 4096)")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"bad size {value!r}: must not be negative")
        return value
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    if isinstance(value, str):
        parts = _split(value)
        if parts is not None and parts[1] in _SIZE_UNITS:
            number, unit = parts
            size = number * _SIZE_UNITS[unit]
            if size.is_integer():
                return int(size)
            raise ValueError(f"bad size {value!r}: not a whole number of bytes")
    raise ValueError(f"bad size {value!r} (use e.g. 256MiB, 1GB, 4096)")


def parse_duration(value: Any) -> float:
    """Seconds from ``"10s"``, ``"500ms"``, ``"2m"``, ``"1h"`` or a number; ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"bad duration {value!r} (use e.g. 500ms, 10s, 2m, 1h)")
    if isinstance(value, int | float):
        if value < 0 or math.isnan(value) or math.isinf(value):
            raise ValueError(f"bad duration {value!r}: must be a finite number >= 0")
        return float(value)
    if isinstance(value, str):
        parts = _split(value)
        if parts is not None and parts[1] in _DURATION_UNITS:
            number, unit = parts
            return number * _DURATION_UNITS[unit]
    raise ValueError(f"bad duration {value!r} (use e.g. 500ms, 10s, 2m, 1h)")


ByteSize = Annotated[int, BeforeValidator(parse_size)]
Duration = Annotated[float, BeforeValidator(parse_duration)]


def resolve_path(path: Path, info: ValidationInfo) -> Path:
    """``path`` made absolute against the context's ``config_dir`` (or the working directory)."""
    path = path.expanduser()
    if path.is_absolute():
        return path
    context = info.context if isinstance(info.context, dict) else {}
    base = context.get("config_dir")
    return (Path(base) if base is not None else Path.cwd()) / path


ConfigPath = Annotated[Path, AfterValidator(resolve_path)]
