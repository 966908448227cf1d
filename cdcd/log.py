"""Logging: one structlog pipeline for cdcd's own logs and the standard library's.

``configure_logging(format, level)`` is called once by the CLI. Every record — from
``get_logger(...)`` or from a library that uses :mod:`logging` (asyncpg, aiokafka, asyncio) —
passes through the same processors:

1. context bound with ``structlog.contextvars.bind_contextvars(slot=..., lsn=..., xid=...)``
   is merged in, so a task's log lines carry its slot, LSN and transaction;
2. level and logger name are added, and an ISO-8601 UTC timestamp;
3. secrets are masked: values of keys such as ``password``, ``dsn``, ``sasl_password``, the
   password in ``postgresql://user:password@`` URLs and ``password=...`` conninfo strings, and
   any value passed to :func:`register_secret` (a password read from a file);
4. rendered as one JSON object per line (orjson) when ``format`` is ``json``, or ``auto`` and
   stderr is not a terminal; as coloured console lines on a terminal.

structlog (and rich, which it loads on import) is imported only when logging is set up, so the
masking functions cost nothing to import. ``configure_logging(..., when_needed=True)`` sets the
levels at once but builds the pipeline at the first record that reaches it (or the first
:func:`get_logger`): a short command that logs nothing (``cdcd snapshot --table``) never loads
it, about a tenth of a second of start-up.

Logs go to stderr; stdout is kept for command output (``cdcd check``, ``cdcd slot status``).
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Callable, Iterable, MutableMapping
from typing import TYPE_CHECKING, Any, Literal, TextIO

if TYPE_CHECKING:
    import structlog
    from structlog.typing import EventDict, Processor, WrappedLogger

LogFormat = Literal["auto", "json", "console"]

MASK = "***"

#: Keys whose values are always masked entirely (compared case-insensitively).
_SECRET_KEYS = frozenset(
    {"password", "passwd", "sasl_password", "sasl_plain_password", "ssl_password", "secret"}
)
#: Keys holding a connection string: only the password inside is masked.
_DSN_KEYS = frozenset({"dsn", "conninfo", "connection_string"})

_URL_PASSWORD = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^:/?#@\s]*:)[^@\s]*@")
_KV_PASSWORD = re.compile(
    r"(?P<head>\bpassword\s*=\s*)(?:'(?:[^'\\]|\\.)*'|[^\s&]+)", flags=re.IGNORECASE
)

_registered_secrets: set[str] = set()


def register_secret(value: str) -> None:
    """Mask ``value`` wherever it appears in a log line from now on (passwords read from files)."""
    if len(value) >= 3:  # masking one or two characters everywhere would garble every line
        _registered_secrets.add(value)


def mask_dsn(dsn: str) -> str:
    """The connection string with its password replaced by ``***`` (URL or key=value form)."""
    masked = _URL_PASSWORD.sub(lambda m: f"{m.group('head')}{MASK}@", dsn)
    return _KV_PASSWORD.sub(lambda m: f"{m.group('head')}{MASK}", masked)


def mask_secrets(text: str) -> str:
    """``text`` with connection-string passwords and registered secrets replaced by ``***``."""
    masked = mask_dsn(text)
    for secret in _registered_secrets:
        if secret in masked:
            masked = masked.replace(secret, MASK)
    return masked


def _mask_value(key: str, value: Any) -> Any:
    lowered = key.lower()
    if lowered in _SECRET_KEYS and value is not None:
        return MASK
    if isinstance(value, str):
        return mask_secrets(value)
    if isinstance(value, MutableMapping):
        return {k: _mask_value(str(k), v) for k, v in value.items()}
    return value


def mask_secrets_processor(_logger: WrappedLogger, _name: str, event_dict: EventDict) -> EventDict:
    """structlog processor: mask secret-looking values (see the module docstring)."""
    for key, value in event_dict.items():
        if key.startswith("_"):  # structlog's own bookkeeping (_record, _from_structlog)
            continue
        event_dict[key] = _mask_value(key, value)
    return event_dict


def _orjson_dumps(obj: Any, **_kw: Any) -> str:
    import orjson

    return orjson.dumps(obj, default=repr, option=orjson.OPT_NON_STR_KEYS).decode()


def _chain(first: Processor, renderer: Processor) -> Processor:
    def render(logger: WrappedLogger, name: str, event_dict: EventDict) -> Any:
        return renderer(logger, name, first(logger, name, event_dict))  # type: ignore[arg-type]

    return render


def _masking(renderer: Processor) -> Processor:
    """Wrap the final renderer so tracebacks and anything else rendered late are masked too."""

    def render(logger: WrappedLogger, name: str, event_dict: EventDict) -> str:
        rendered = renderer(logger, name, event_dict)
        text = rendered.decode() if isinstance(rendered, bytes) else str(rendered)
        return mask_secrets(text)

    return render


def _shared_processors(json: bool) -> list[Processor]:
    import structlog

    processors: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.PositionalArgumentsFormatter(),
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    if json:
        processors.append(structlog.processors.format_exc_info)
    processors.append(mask_secrets_processor)
    return processors


_LEADING_KEYS = ("timestamp", "level", "logger", "event")


def _leading_keys_first(_logger: WrappedLogger, _name: str, event_dict: EventDict) -> EventDict:
    """Put timestamp, level, logger and event first so JSON lines read left to right."""
    ordered = {key: event_dict[key] for key in _LEADING_KEYS if key in event_dict}
    ordered.update(event_dict)
    return ordered


def _wants_json(format: LogFormat, stream: TextIO) -> bool:
    if format == "json":
        return True
    if format == "console":
        return False
    isatty: Callable[[], bool] | None = getattr(stream, "isatty", None)
    return not (isatty is not None and isatty())


_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
_LEVELS |= {"warn": logging.WARNING, "error": logging.ERROR, "critical": logging.CRITICAL}

#: Libraries whose INFO chatter is noise at cdcd's INFO level.
_QUIET_LIBRARIES: Iterable[str] = ("aiokafka", "kafka", "asyncio")


def configure_logging(
    format: LogFormat = "auto",
    level: str = "info",
    *,
    stream: TextIO | None = None,
    when_needed: bool = False,
) -> None:
    """Route cdcd's and the standard library's logs through one structlog pipeline.

    ``stream`` defaults to stderr (looked up at call time, so pytest's capture sees it).
    Calling it again replaces the previous configuration. ``when_needed``: set the levels now
    and build the pipeline (importing structlog) at the first record or :func:`get_logger`;
    what is logged is the same.
    """
    global _pending
    try:
        numeric_level = _LEVELS[level.lower()]
    except KeyError:
        raise ValueError(f"unknown log level {level!r}; allowed: {', '.join(_LEVELS)}") from None
    out = stream if stream is not None else sys.stderr
    if when_needed:
        _pending = (format, level, out)
        _install(_SetUpAtFirstRecord(), numeric_level)
        return
    _pending = None
    import structlog

    json = _wants_json(format, out)
    shared = _shared_processors(json)
    renderer: Processor = (
        _chain(_leading_keys_first, structlog.processors.JSONRenderer(serializer=_orjson_dumps))
        if json
        else structlog.dev.ConsoleRenderer(colors=bool(getattr(out, "isatty", lambda: False)()))
    )

    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        context_class=dict,
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, _masking(renderer)],
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    _install(handler, numeric_level)


#: ``(format, level, stream)`` of a set-up left for the first record (``when_needed``)
_pending: tuple[LogFormat, str, TextIO] | None = None


def _install(handler: logging.Handler, numeric_level: int) -> None:
    """Make ``handler`` the root logger's cdcd handler, in the place of the previous one (in
    place: a record being handed to the root's handlers reaches each of them once)."""
    handler.set_name("cdcd")
    root = logging.getLogger()
    old = [i for i, h in enumerate(root.handlers) if h.get_name() == "cdcd"]
    if old:
        root.handlers[old[0]] = handler
        for i in reversed(old[1:]):
            del root.handlers[i]
    else:
        root.addHandler(handler)
    root.setLevel(numeric_level)
    library_level = logging.INFO if numeric_level <= logging.DEBUG else logging.WARNING
    for name in _QUIET_LIBRARIES:
        logging.getLogger(name).setLevel(max(numeric_level, library_level))


def _set_up_pending() -> logging.Handler | None:
    """Build the pipeline left for later, if one is; the root's cdcd handler then."""
    if _pending is None:
        return None
    format, level, out = _pending
    configure_logging(format, level, stream=out)
    return next((h for h in logging.getLogger().handlers if h.get_name() == "cdcd"), None)


class _SetUpAtFirstRecord(logging.Handler):
    """The root's cdcd handler until something logs: builds the pipeline, then hands it the
    record."""

    def emit(self, record: logging.LogRecord) -> None:
        handler = _set_up_pending()
        if handler is not None and handler is not self:
            handler.handle(record)


def get_logger(name: str | None = None) -> structlog.stdlib.BoundLogger:
    """A structlog logger; ``name`` is shown as ``logger`` (use ``__name__``)."""
    import structlog

    _set_up_pending()
    logger: structlog.stdlib.BoundLogger = structlog.stdlib.get_logger(name)
    return logger


class LazyLogger:
    """A module's logger that imports structlog at its first use (:func:`get_logger` then):
    for modules a short command imports without logging."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(get_logger(self._name), attr)
