"""Finding sink classes by their config ``type``: built-ins first, then the ``cdcd.sinks``
entry-point group, so a third-party package adds a sink without touching cdcd::

    [project.entry-points."cdcd.sinks"]
    mysink = "my_package.sink:MySink"
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from cdcd.errors import ConfigError
from cdcd.sinks.base import Sink

BUILTIN_SINKS: dict[str, str] = {
    "file": "cdcd.sinks.file.sink:FileSink",
    "kafka": "cdcd.sinks.kafka.sink:KafkaSink",
    "null": "cdcd.sinks.null:NullSink",
    "memory": "cdcd.sinks.memory:MemorySink",
}


def _load(target: str) -> type[Sink]:
    module_name, _, attr = target.partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    if not (isinstance(cls, type) and issubclass(cls, Sink)):
        raise ConfigError(f"sink entry point {target!r} is not a cdcd.sinks.base.Sink subclass")
    return cls


def available_sink_types() -> list[str]:
    names = set(BUILTIN_SINKS)
    names.update(ep.name for ep in entry_points(group="cdcd.sinks"))
    return sorted(names)


def load_sink_class(type_name: str) -> type[Sink]:
    """The Sink class for a config ``type``; ConfigError listing the known types otherwise."""
    if type_name in BUILTIN_SINKS:
        return _load(BUILTIN_SINKS[type_name])
    for ep in entry_points(group="cdcd.sinks"):
        if ep.name == type_name:
            return _load(ep.value)
    raise ConfigError(
        f"sinks: unknown sink type {type_name!r}; known types: {', '.join(available_sink_types())}"
    )
