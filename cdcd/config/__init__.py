"""The configuration file: YAML in, a validated, immutable :class:`Config` out.

``load_config(path)`` does, in order:

1. read the YAML (safe loader; duplicate keys are errors);
2. substitute ``${VAR}`` and ``${VAR:-default}`` in string values (``$${`` is a literal
   ``${``); a variable that is not set and has no default is an error naming the key;
3. apply environment overrides ``CDCD_<PATH>``: the path's levels are joined by ``__`` and
   list items are numbered (``CDCD_SOURCE__DSN``, ``CDCD_BUFFER__MEMORY_LIMIT=64MiB``,
   ``CDCD_SINKS__0__PATH``); values are read as YAML scalars, so ``true``/``42``/``off`` keep
   their YAML meaning. Only variables whose first level is a top-level key are overrides
   (``CDCD_QUICKSTART_DSN`` is not);
4. validate: unknown keys are errors everywhere, sizes (``256MiB``) and durations (``10s``)
   are parsed, relative paths are resolved against the config file's folder, and each sink
   section is validated by its sink class's ``Config`` model (found by ``type``).

Every problem found becomes one line of a single :class:`~cdcd.errors.ConfigError`::

    source.streaming: bad value (got 'sometimes'; allowed: off, on, parallel, auto)

Secrets never appear in messages or reprs: the DSN is a ``SecretStr`` and shown with its
password replaced by ``***``; a password read from ``password_file`` is registered with the
log masker.
"""

from cdcd.config.loading import ENV_PREFIX, load_config, parse_config
from cdcd.config.models import (
    BufferConfig,
    Config,
    HttpConfig,
    LogConfig,
    ShutdownConfig,
    SinkSpec,
    SnapshotConfig,
    SourceConfig,
)

__all__ = [
    "ENV_PREFIX",
    "BufferConfig",
    "Config",
    "HttpConfig",
    "LogConfig",
    "ShutdownConfig",
    "SinkSpec",
    "SnapshotConfig",
    "SourceConfig",
    "load_config",
    "parse_config",
]
