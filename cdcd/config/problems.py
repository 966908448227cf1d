"""Problems found in a configuration, as lines that name the key, the value (never a secret)
and what is allowed: ``source.streaming: bad value (got 'sometimes'; allowed: off, on, ...)``."""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ValidationError,
)

from cdcd.log import mask_dsn, mask_secrets


def key_path(loc: tuple[str | int, ...]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "<config>"


_SECRET_LEAVES = ("password", "secret", "dsn")


def _shown(loc: tuple[str | int, ...], value: Any) -> str | None:
    """How a bad value appears in a message: short, and never a secret."""
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    leaf = str(loc[-1]).lower() if loc else ""
    if leaf == "dsn" and isinstance(value, str):
        return repr(mask_dsn(value))
    if any(word in leaf for word in _SECRET_LEAVES) and "file" not in leaf:
        return "***"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def problem_line(loc: tuple[str | int, ...], problem: str, value: Any, allowed: str | None) -> str:
    details = []
    if value is not _MISSING:
        shown = _shown(loc, value)
        if shown is not None:
            details.append(f"got {shown}")
    if allowed:
        details.append(allowed if allowed.startswith("allowed") else f"allowed: {allowed}")
    suffix = f" ({'; '.join(details)})" if details else ""
    return mask_secrets(f"{key_path(loc)}: {problem}{suffix}")


_MISSING = object()


def _unwrap(annotation: Any) -> Any:
    """The model, list or dict type inside ``Annotated[...]`` / ``X | None``."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            members = [a for a in typing.get_args(annotation) if a is not type(None)]
            annotation = members[0] if len(members) == 1 else annotation
            if len(members) != 1:
                return annotation
        else:
            return annotation


def _clean_loc(
    model: type[BaseModel], loc: tuple[str | int, ...]
) -> tuple[tuple[str | int, ...], Any]:
    """Keep the user's key path from a pydantic error location; drop pydantic's own tags
    (``function-before[...]``, union member names). Returns (path, innermost model or None)."""
    kept: list[str | int] = []
    current: Any = model
    parent: Any = None
    for part in loc:
        current = _unwrap(current)
        if isinstance(current, type) and issubclass(current, BaseModel):
            kept.append(part)
            parent = current
            field = current.model_fields.get(str(part))
            if field is None:
                break  # an unknown key
            current = field.annotation
            continue
        origin = typing.get_origin(current)
        if origin in (list, tuple) and isinstance(part, int):
            kept.append(part)
            args = typing.get_args(current)
            current = args[0] if args else Any
        elif origin is dict:
            kept.append(part)
            args = typing.get_args(current)
            current = args[1] if len(args) == 2 else Any
        else:
            break
    return tuple(kept), parent


def _allowed_from_literal(expected: str) -> str:
    """pydantic's ``"'a', 'b' or 'c'"`` as ``"a, b, c"``."""
    return expected.replace(" or ", ", ").replace("'", "")


def validation_problems(
    exc: ValidationError, prefix: tuple[str | int, ...], model: type[BaseModel]
) -> list[str]:
    lines: list[str] = []
    seen: set[str] = set()
    for error in exc.errors(include_url=False):
        loc, parent = _clean_loc(model, tuple(error["loc"]))
        full = prefix + loc
        kind = error["type"]
        value = error.get("input", _MISSING)
        allowed: str | None = None
        if kind == "extra_forbidden":
            problem = "unknown key"
            if parent is not None:
                names = [n for n in parent.model_fields if n != "config_dir"]
                allowed = ", ".join(names)
            value = _MISSING
        elif kind == "missing":
            problem, value = "required key is missing", _MISSING
        elif kind == "literal_error":
            problem = "bad value"
            allowed = _allowed_from_literal(str(error.get("ctx", {}).get("expected", "")))
        elif kind == "value_error":
            problem = str(error["msg"]).removeprefix("Value error, ")
            if isinstance(value, Mapping | list) or str(value) in problem:
                value = _MISSING  # the message already says what was wrong
        else:
            problem = str(error["msg"]).removeprefix("Input ")
        if str(problem) and str(problem)[0].isupper() and not str(problem)[:2].isupper():
            problem = problem[0].lower() + problem[1:]
        line = problem_line(full, problem, value, allowed)
        key = key_path(full)
        if key in seen and kind not in ("extra_forbidden",):
            continue  # a union reports each member; the first says enough
        seen.add(key)
        lines.append(line)
    return lines


def annotate_sources(problems: list[str], sources: Mapping[str, str]) -> list[str]:
    """Say which problems come from an environment override."""
    annotated = []
    for line in problems:
        key = line.partition(": ")[0]
        variable = sources.get(key)
        annotated.append(f"{line} [from ${variable}]" if variable else line)
    return annotated


def report(path: Path, problems: list[str]) -> str:
    count = len(problems)
    head = f"{path}: {count} problem{'s' if count != 1 else ''} in the configuration"
    return "\n".join([head, *(f"  {line}" for line in problems)])
