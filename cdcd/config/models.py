"""The configuration's models: every section of the YAML file, validated (pydantic), and the
validation of sink sections by their sink class's ``Config`` model. How a file becomes a
:class:`Config`: :mod:`cdcd.config` (the README's "Configuration" section lists every key)."""

from __future__ import annotations

import builtins
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from cdcd.config.problems import key_path, problem_line, validation_problems
from cdcd.errors import ConfigError
from cdcd.log import mask_dsn, mask_secrets, register_secret
from cdcd.sinks.base import Sink
from cdcd.sinks.registry import available_sink_types, load_sink_class
from cdcd.units import ByteSize, ConfigPath, Duration, parse_duration
from cdcd.wire.dsn import parse_dsn


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# -- field types ---------------------------------------------------------------------------


def _on_off(value: Any) -> Any:
    """YAML reads a bare ``on``/``off`` as a boolean; map it back."""
    if value is True:
        return "on"
    if value is False:
        return "off"
    return value.lower() if isinstance(value, str) else value


def _numeric_string(value: Any) -> Any:
    return int(value) if isinstance(value, str) and value.strip().isdigit() else value


def _lowercase(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def _optional_duration(value: Any) -> float | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "never")):
        return None
    return parse_duration(value)


def _comma_list(value: Any) -> Any:
    """``"public.a, public.b"`` (an environment override) as a list."""
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return value


OnOff = Annotated[Literal["off", "on", "parallel", "auto"], BeforeValidator(_on_off)]
OptionalDuration = Annotated[float | None, BeforeValidator(_optional_duration)]

_IDENT = r'(?:[A-Za-z_][A-Za-z0-9_$]*|"(?:[^"]|"")+")'
_TABLE_NAME = re.compile(rf"{_IDENT}\.{_IDENT}")
_SLOT_NAME = re.compile(r"[a-z0-9_]{1,63}")
_SERVER_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")


# -- sections --------------------------------------------------------------------------------


class SourceConfig(_Model):
    """``source``: the PostgreSQL server, the replication slot and the publication."""

    dsn: SecretStr
    password_file: ConfigPath | None = None
    slot: str = "cdcd"
    create_slot: bool = True
    publication: str = "cdcd_pub"
    create_publication: bool = True
    tables: Annotated[list[str], BeforeValidator(_comma_list)] = Field(default_factory=list)
    #: tables whose UPDATE/DELETE would fail once published (no primary key, no usable replica
    #: identity; docs/keyless-tables.md): refuse to publish them, publish their inserts and
    #: truncates only (a second publication), leave them out, or set REPLICA IDENTITY FULL
    keyless_tables: Annotated[
        Literal["refuse", "insert_only", "exclude", "replica_identity_full"],
        BeforeValidator(_lowercase),
    ] = "refuse"
    proto_version: Annotated[Literal[1, 2, 3, 4, "auto"], BeforeValidator(_numeric_string)] = "auto"
    streaming: OnOff = "auto"
    two_phase: bool = False
    binary: bool = False
    messages: bool = True
    origin: Annotated[Literal["any", "none"], BeforeValidator(_lowercase)] = "any"
    #: create the slot with FAILOVER (17+) so a standby synchronises it; auto: on 17+
    failover: Annotated[Literal["auto"] | bool, BeforeValidator(_lowercase)] = "auto"
    #: what to do when the slot is invalidated or missing: fail (exit 3), or recreate (a new
    #: slot, a reset marker per table and an incremental backfill; docs/high-availability.md)
    on_slot_lost: Annotated[Literal["fail", "recreate"], BeforeValidator(_lowercase)] = "fail"
    status_interval: Duration = 10.0
    connect_timeout: Duration = 10.0
    reconnect_min_backoff: Duration = 1.0
    reconnect_max_backoff: Duration = 30.0
    give_up_after: OptionalDuration = None
    application_name: str = "cdcd"
    retained_wal_warning: ByteSize = 1024**3

    @field_validator("dsn")
    @classmethod
    def _check_dsn(cls, dsn: SecretStr) -> SecretStr:
        text = dsn.get_secret_value().strip()
        if not text:
            raise ValueError("must not be empty (e.g. postgresql://cdc@db:5432/shop)")
        if "://" in text:
            parts = urlsplit(text)
            if parts.scheme not in ("postgresql", "postgres"):
                raise ValueError("a URL DSN must start with postgresql:// or postgres://")
        elif "=" not in text:
            raise ValueError(
                "not a connection string (use postgresql://... or host=... dbname=...)"
            )
        try:  # the parser the connection code uses: unknown keywords, bad quoting, bad port
            parse_dsn(text, environ={}, use_passfile=False)
        except ConfigError as exc:
            raise ValueError(mask_secrets(str(exc))) from None
        password = _dsn_password(text)
        if password:
            register_secret(password)
        return SecretStr(text)

    @field_validator("password_file")
    @classmethod
    def _check_password_file(cls, path: Path | None) -> Path | None:
        if path is not None:
            _read_password_file(path)  # fail at load time, not at the first connection
        return path

    @field_validator("slot")
    @classmethod
    def _check_slot(cls, slot: str) -> str:
        if not _SLOT_NAME.fullmatch(slot):
            raise ValueError(
                "a slot name is 1-63 lower-case letters, digits and underscores (PostgreSQL's rule)"
            )
        return slot

    @field_validator("publication", "application_name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        if not name or len(name.encode()) > 63:
            raise ValueError("must be 1-63 bytes long")
        return name

    @field_validator("tables")
    @classmethod
    def _check_tables(cls, tables: list[str]) -> list[str]:
        bad = [table for table in tables if not _TABLE_NAME.fullmatch(table)]
        if bad:
            raise ValueError(f'expected "schema.table" names, not {", ".join(map(repr, bad))}')
        return tables

    @field_validator("keyless_tables")
    @classmethod
    def _check_keyless_tables(cls, policy: str, info: ValidationInfo) -> str:
        if policy != "refuse" and info.data.get("create_publication") is False:
            raise ValueError(
                f"{policy!r} applies to the publication cdcd creates and manages; with "
                "source.create_publication: false the publication is yours (leave this at "
                "'refuse': cdcd then only reports tables it breaks)"
            )
        return policy

    @field_validator("on_slot_lost")
    @classmethod
    def _check_on_slot_lost(cls, policy: str, info: ValidationInfo) -> str:
        if policy == "recreate" and info.data.get("binary"):
            raise ValueError(
                "'recreate' backfills with incremental snapshots, which do not work with "
                "source.binary: true (turn binary off, or use 'fail')"
            )
        return policy

    @field_validator("status_interval", "connect_timeout", "reconnect_min_backoff")
    @classmethod
    def _check_positive(cls, seconds: float) -> float:
        if seconds <= 0:
            raise ValueError("must be greater than zero")
        return seconds

    @field_validator("reconnect_max_backoff")
    @classmethod
    def _check_backoff(cls, seconds: float, info: ValidationInfo) -> float:
        minimum = info.data.get("reconnect_min_backoff")
        if minimum is not None and seconds < minimum:
            raise ValueError(f"must not be smaller than reconnect_min_backoff ({minimum:g} s)")
        return seconds

    def insert_only_publication(self) -> str:
        """The second publication under ``keyless_tables: insert_only``: ``<publication>_insert_only``
        (cut to PostgreSQL's 63 bytes)."""
        suffix = "_insert_only"
        return self.publication.encode()[: 63 - len(suffix)].decode(errors="ignore") + suffix

    def publication_names(self) -> list[str]:
        """The publications cdcd streams from (pgoutput's ``publication_names``)."""
        if self.keyless_tables == "insert_only":
            return [self.publication, self.insert_only_publication()]
        return [self.publication]

    def password(self) -> str | None:
        """The password: from ``password_file`` (read now, so a rotated file is honoured),
        else the one in the DSN, else None."""
        if self.password_file is not None:
            return _read_password_file(self.password_file)
        return _dsn_password(self.dsn.get_secret_value())

    def conninfo(self) -> str:
        """The DSN with the password from ``password_file`` applied, for the connection code."""
        dsn = self.dsn.get_secret_value()
        if self.password_file is None:
            return dsn
        return _with_password(dsn, _read_password_file(self.password_file))

    def masked_dsn(self) -> str:
        """The DSN for messages: its password replaced by ``***``."""
        return mask_dsn(self.dsn.get_secret_value())


class SnapshotConfig(_Model):
    """``snapshot``: whether to copy the tables' existing rows before streaming changes."""

    mode: Annotated[
        Literal["initial", "never", "initial_only", "incremental"], BeforeValidator(_lowercase)
    ] = "initial"
    #: where cdcd records a snapshot's progress, so an interrupted one resumes (or is redone)
    state_dir: ConfigPath = Field(default=Path("cdcd-state"), validate_default=True)
    #: rows handed to the sinks per batch while snapshotting
    batch_rows: int = Field(default=5000, ge=1)
    #: connections reading snapshot chunks at once: block ranges of the initial snapshot, key
    #: ranges of an incremental one (docs/snapshots.md, "Incremental snapshots")
    workers: int = Field(default=1, ge=1, le=64)
    #: the initial snapshot starts with one of them and adds one while that raises the rate
    #: (false: all of them from the start); docs/snapshots.md
    tune_workers: bool = True
    #: rows per chunk of the initial snapshot read by several workers (key ranges, or block
    #: ranges estimated from pg_class for a table without a key)
    initial_chunk_rows: int = Field(default=100_000, ge=1)
    #: rows per chunk of an incremental snapshot at most: the size adapts below it, and within
    #: a share of buffer.memory_limit (docs/snapshots.md "Backfill speed"); the initial
    #: snapshot's rows handed but not recorded durable, at most (what a kill emits again)
    chunk_rows: int = Field(default=131_072, ge=1)
    #: chunks queued but not yet durable in every sink (and so not recorded) at most: what a
    #: crash may emit again; throughput is at most this many chunks per sink flush interval
    chunks_in_flight: int = Field(default=4, ge=1)
    #: tables added to the publication while cdcd runs are snapshotted incrementally
    new_tables: bool = True
    #: the key signals (``cdcd snapshot --table``) are signed with; else ``CDCD_SIGNAL_KEY``,
    #: else a key file in state_dir (docs/snapshots.md "Who may ask for a snapshot")
    signal_key: SecretStr | None = None

    def signal_secret(self) -> str | None:
        return None if self.signal_key is None else self.signal_key.get_secret_value()


class BufferConfig(_Model):
    """``buffer``: memory for transactions being assembled; beyond it they spill to disk."""

    memory_limit: ByteSize = 256 * 1024**2
    spill_dir: ConfigPath = Field(default=Path("cdcd-spill"), validate_default=True)
    queue_transactions: int = Field(default=64, ge=1)


class HttpConfig(_Model):
    """``http``: the health and metrics endpoint; ``listen: null`` (or ``""``) disables it."""

    listen: str | None = "127.0.0.1:8080"

    @field_validator("listen", mode="before")
    @classmethod
    def _check_listen(cls, listen: Any) -> Any:
        if listen is None or listen is False or (isinstance(listen, str) and not listen.strip()):
            return None
        if isinstance(listen, int) and not isinstance(listen, bool):
            listen = f":{listen}"
        if isinstance(listen, str):
            _split_listen(listen.strip())
            return listen.strip()
        return listen

    @property
    def enabled(self) -> bool:
        return self.listen is not None

    @property
    def host(self) -> str | None:
        """The address to bind (``0.0.0.0`` for ``:8080``), None when disabled."""
        return None if self.listen is None else _split_listen(self.listen)[0]

    @property
    def port(self) -> int | None:
        """The TCP port (0: any free port), None when disabled."""
        return None if self.listen is None else _split_listen(self.listen)[1]


class LogConfig(_Model):
    """``log``: how and how much to log."""

    format: Annotated[Literal["auto", "json", "console"], BeforeValidator(_lowercase)] = "auto"
    level: Annotated[
        Literal["debug", "info", "warning", "error"],
        BeforeValidator(lambda v: "warning" if _lowercase(v) == "warn" else _lowercase(v)),
    ] = "info"


class ShutdownConfig(_Model):
    """``shutdown``: how long SIGTERM/SIGINT may take to drain before cdcd gives up."""

    grace_period: Duration = 30.0


class SinkSpec(_Model):
    """One item of ``sinks``: the ``type`` and that sink class's validated ``Config``."""

    type: str
    config: BaseModel

    @model_validator(mode="before")
    @classmethod
    def _from_section(cls, data: Any) -> Any:
        """Accept a raw section ``{"type": "file", "path": ...}`` (programmatic use)."""
        if not isinstance(data, Mapping) or isinstance(data.get("config"), BaseModel):
            return data
        result = validate_sink(data, ())
        if isinstance(result, list):
            raise ValueError("; ".join(result))
        return {"type": data["type"], "config": result}

    @property
    def sink_class(self) -> builtins.type[Sink]:
        """The :class:`cdcd.sinks.base.Sink` subclass for ``type``."""
        return load_sink_class(self.type)


class Config(_Model):
    """The whole configuration. ``config_dir`` is the config file's folder (not a YAML key)."""

    name: str = "cdcd"
    source: SourceConfig
    snapshot: SnapshotConfig = Field(default={}, validate_default=True)
    sinks: list[SinkSpec]
    buffer: BufferConfig = Field(default={}, validate_default=True)
    http: HttpConfig = Field(default={}, validate_default=True)
    log: LogConfig = Field(default={}, validate_default=True)
    shutdown: ShutdownConfig = Field(default={}, validate_default=True)
    config_dir: Path = Field(default_factory=Path.cwd, exclude=True)

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        if not _SERVER_NAME.fullmatch(name):
            raise ValueError(
                "use letters, digits, '.', '_' and '-' (it prefixes Kafka topic names)"
            )
        return name

    @field_validator("sinks")
    @classmethod
    def _check_sinks(cls, specs: list[SinkSpec]) -> list[SinkSpec]:
        if not specs:
            raise ValueError(f"at least one sink is required ({sink_types_hint()})")
        return specs


TOP_LEVEL_KEYS = frozenset(Config.model_fields) - {"config_dir"}


# -- DSN helpers -----------------------------------------------------------------------------

_KV_PASSWORD = re.compile(r"(?:^|\s)password\s*=\s*('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)


def _is_url(dsn: str) -> bool:
    return dsn.startswith(("postgresql://", "postgres://"))


def _dsn_password(dsn: str) -> str | None:
    if _is_url(dsn):
        parts = urlsplit(dsn)
        query = dict(parse_qsl(parts.query))
        return query.get("password") or parts.password
    match = _KV_PASSWORD.search(dsn)
    if match is None:
        return None
    value = match.group(1)
    if value.startswith("'"):
        value = re.sub(r"\\(.)", r"\1", value[1:-1])
    return value


def _with_password(dsn: str, password: str) -> str:
    """``dsn`` with its password set to ``password`` (URL or key=value form)."""
    if _is_url(dsn):
        parts = urlsplit(dsn)
        query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True)]
        query = [(k, v) for k, v in query if k != "password"]
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, _, hosts = netloc.rpartition("@")
            user = userinfo.partition(":")[0]
            netloc = f"{user}:{quote(password, safe='')}@{hosts}"
        else:
            query.append(("password", password))
        return urlunsplit(parts._replace(netloc=netloc, query=urlencode(query)))
    without = _KV_PASSWORD.sub("", dsn).strip()
    escaped = password.replace("\\", "\\\\").replace("'", "\\'")
    return f"{without} password='{escaped}'"


def _read_password_file(path: Path) -> str:
    try:
        password = path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read password file {str(path)!r}: {exc}") from None
    if not password:
        raise ValueError(f"password file {str(path)!r} is empty")
    register_secret(password)
    return password


def _split_listen(listen: str) -> tuple[str, int]:
    """``"127.0.0.1:8080"``, ``"[::1]:8080"``, ``":8080"`` -> (host, port)."""
    host, sep, port_text = listen.rpartition(":")
    if not sep or not port_text.isdigit():
        raise ValueError("expected HOST:PORT such as 127.0.0.1:8080 (or null to disable)")
    if int(port_text) > 65535:
        raise ValueError(f"port {port_text} is out of range (0-65535; 0: any free port)")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host or "0.0.0.0", int(port_text)


# -- loading ---------------------------------------------------------------------------------


class _Placeholder(_Model):
    pass


#: stands in for the sinks while their own problems are reported, so Config does not add
#: "at least one sink is required" on top
PLACEHOLDER_SINKS = [SinkSpec(type="null", config=_Placeholder())]


def sink_types_hint() -> str:
    return f"allowed types: {', '.join(available_sink_types())}"


def validate_sink(
    item: Any, loc: tuple[str | int, ...], config_dir: Path | None = None
) -> BaseModel | list[str]:
    """The validated ``Config`` of one sink section, or the problems found."""
    # the hint lists the installed sink plugins (entry points): looked up only to report
    if not isinstance(item, Mapping):
        return [problem_line(loc, "a sink section must be a mapping with a 'type' key", item, None)]
    if "type" not in item:
        return [f"{key_path((*loc, 'type'))}: required key is missing ({sink_types_hint()})"]
    type_name = item["type"]
    if not isinstance(type_name, str):
        return [problem_line((*loc, "type"), "unknown sink type", type_name, sink_types_hint())]
    try:
        cls = load_sink_class(type_name)
    except ConfigError:
        return [problem_line((*loc, "type"), "unknown sink type", type_name, sink_types_hint())]
    except Exception as exc:  # the sink's module failed to import: say which and why
        return [f"{key_path((*loc, 'type'))}: sink {type_name!r} cannot be loaded: {exc}"]
    rest = {key: value for key, value in item.items() if key != "type"}
    base = config_dir if config_dir is not None else Path.cwd()
    try:
        config = cls.Config.model_validate(rest, context={"config_dir": base})
    except ValidationError as exc:
        return validation_problems(exc, loc, cls.Config)
    return _resolve_sink_paths(config, base)


#: names of string fields in sink configs that hold file paths (``ssl_cafile``, ``spill_dir``)
_PATH_FIELD_SUFFIXES = ("file", "_dir", "key_path")


def _resolve_sink_paths(config: BaseModel, config_dir: Path) -> BaseModel:
    """Make the sink's relative paths absolute against the config folder: :class:`Path`
    values, and strings in fields named ``path`` or ending in ``file``/``_dir``/``key_path``."""
    updates: dict[str, Any] = {}
    for name, value in config:
        if isinstance(value, Path):
            path = value.expanduser()
            if not path.is_absolute():
                updates[name] = config_dir / path
        elif (
            isinstance(value, str)
            and value
            and "://" not in value  # a URL (s3://bucket/prefix) is not a local path
            and (name == "path" or name.endswith(_PATH_FIELD_SUFFIXES))
        ):
            path = Path(value).expanduser()
            if not path.is_absolute():
                updates[name] = str(config_dir / path)
    return config.model_copy(update=updates) if updates else config
