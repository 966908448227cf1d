"""Loading the configuration file: YAML, ``${VAR}`` substitution, ``CDCD_`` overrides, then
validation into :class:`~cdcd.config.models.Config` (the steps: :mod:`cdcd.config`)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    ValidationError,
)

from cdcd.config.models import (
    PLACEHOLDER_SINKS,
    TOP_LEVEL_KEYS,
    Config,
    SinkSpec,
    sink_types_hint,
    validate_sink,
)
from cdcd.config.problems import (
    annotate_sources,
    key_path,
    problem_line,
    report,
    validation_problems,
)
from cdcd.errors import ConfigError

ENV_PREFIX = "CDCD_"


class _UniqueKeyLoader(yaml.SafeLoader):  # type: ignore[misc]
    """SafeLoader that rejects a key given twice in one mapping (YAML would keep the last)."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    loader.flatten_mapping(node)
    mapping: dict[Any, Any] = {}
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in mapping:
            raise yaml.constructor.ConstructorError(
                "while reading a mapping",
                node.start_mark,
                f"found duplicate key {key!r}",
                key_node.start_mark,
            )
        mapping[key] = loader.construct_object(value_node, deep=True)
    return mapping


_UniqueKeyLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
    _construct_mapping,
)


def load_config(path: str | Path, env: Mapping[str, str] | None = None) -> Config:
    """Read, substitute, override and validate the config file at ``path``.

    ``env`` defaults to ``os.environ``. Raises :class:`ConfigError` listing every problem.
    """
    path = Path(path)
    env = os.environ if env is None else env
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        where = str(exc).replace('"<unicode string>"', f'"{path}"')
        raise ConfigError(f"{path}: not valid YAML: {where}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys (name:, source:, ...)")

    problems: list[str] = []
    data = _substitute(data, (), env, problems)
    sources = _apply_overrides(data, env, problems)
    if problems:
        raise ConfigError(report(path, problems))
    try:
        return parse_config(data, path.resolve().parent, _sources=sources)
    except ConfigError as exc:
        raise ConfigError(report(path, str(exc).splitlines())) from None


def parse_config(
    data: Mapping[str, Any], config_dir: Path, *, _sources: Mapping[str, str] | None = None
) -> Config:
    """Validate an already-read config mapping; relative paths are resolved against
    ``config_dir``. Raises :class:`ConfigError` with one line per problem."""
    sources = _sources or {}
    problems: list[str] = []
    data = dict(data)
    if "config_dir" in data:
        problems.append(problem_line(("config_dir",), "unknown key", data["config_dir"], None))
        del data["config_dir"]
    context = {"config_dir": config_dir}

    raw_sinks = data.get("sinks")
    specs: list[SinkSpec] = []
    if isinstance(raw_sinks, list):
        for index, item in enumerate(raw_sinks):
            result = validate_sink(item, ("sinks", index), config_dir)
            if isinstance(result, list):
                problems.extend(result)
            else:
                specs.append(SinkSpec(type=item["type"], config=result))
        data["sinks"] = specs if not problems else PLACEHOLDER_SINKS
    else:
        if raw_sinks is None:
            problems.append(f"sinks: at least one sink is required ({sink_types_hint()})")
        else:
            problems.append(
                problem_line(("sinks",), "must be a list of sink sections", raw_sinks, None)
            )
        data["sinks"] = PLACEHOLDER_SINKS

    try:
        config = Config.model_validate({**data, "config_dir": config_dir}, context=context)
    except ValidationError as exc:
        problems.extend(validation_problems(exc, (), Config))
        config = None
    if problems:
        raise ConfigError("\n".join(annotate_sources(problems, sources)))
    assert config is not None
    return config


# -- substitution and overrides ----------------------------------------------------------------

_SUBSTITUTION = re.compile(r"\$\$\{|\$\{([^}]*)\}")
_VAR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _substitute(
    value: Any, loc: tuple[str | int, ...], env: Mapping[str, str], problems: list[str]
) -> Any:
    if isinstance(value, dict):
        return {k: _substitute(v, (*loc, str(k)), env, problems) for k, v in value.items()}
    if isinstance(value, list):
        return [_substitute(v, (*loc, i), env, problems) for i, v in enumerate(value)]
    if not isinstance(value, str) or "${" not in value:
        return value

    def replace(match: re.Match[str]) -> str:
        if match.group(1) is None:
            return "${"
        name, sep, default = match.group(1).partition(":-")
        if not _VAR_NAME.fullmatch(name):
            problems.append(f"{key_path(loc)}: bad substitution ${{{match.group(1)}}}")
            return ""
        found = env.get(name)
        if found:
            return found
        if sep:
            return default
        problems.append(
            f"{key_path(loc)}: environment variable {name} is not set "
            f"(set it, or write ${{{name}:-default}})"
        )
        return ""

    return _SUBSTITUTION.sub(replace, value)


def _override_value(text: str) -> Any:
    """An override's value read as a YAML scalar (or a ``[...]`` list); else the raw text."""
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, list) and text.lstrip().startswith("["):
        return value
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return text


def _apply_overrides(
    data: dict[str, Any], env: Mapping[str, str], problems: list[str]
) -> dict[str, str]:
    """Apply ``CDCD_<PATH>`` variables to ``data`` in place; returns {key path: variable}."""
    sources: dict[str, str] = {}
    for variable in sorted(env):
        if not variable.startswith(ENV_PREFIX):
            continue
        segments = variable[len(ENV_PREFIX) :].lower().split("__")
        if segments[0] not in TOP_LEVEL_KEYS:
            continue
        loc: tuple[str | int, ...] = tuple(int(s) if s.isdigit() else s for s in segments)
        if any(segment == "" for segment in segments):
            problems.append(f"{variable}: empty level in the key path")
            continue
        error = _set_path(data, loc, _override_value(env[variable]))
        if error:
            problems.append(f"{variable}: {error}")
        else:
            sources[key_path(loc)] = variable
    return sources


def _set_path(data: dict[str, Any], loc: tuple[str | int, ...], value: Any) -> str | None:
    node: Any = data
    for depth, key in enumerate(loc):
        last = depth == len(loc) - 1
        where = key_path(loc[: depth + 1])
        if isinstance(node, dict) and isinstance(key, str):
            if last:
                if isinstance(node.get(key), dict | list):
                    return f"{where} is a section; override its keys one by one"
                node[key] = value
                return None
            if node.get(key) is None:
                node[key] = {}
            node = node[key]
        elif isinstance(node, list) and isinstance(key, int):
            if key >= len(node):
                return f"{where}: the list has only {len(node)} item(s)"
            if last:
                node[key] = value
                return None
            node = node[key]
        else:
            return f"{key_path(loc[:depth])} is not a section that has {key!r}"
    return None


# -- error messages --------------------------------------------------------------------------
