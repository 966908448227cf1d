"""cdcd.config and cdcd.units: loading, substitution, overrides, validation and its messages."""

from __future__ import annotations

import importlib
import textwrap
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml
from pydantic import BaseModel, ConfigDict, SecretStr

from cdcd.config import Config, SinkSpec, SourceConfig, load_config, parse_config
from cdcd.errors import ConfigError
from cdcd.sinks import registry
from cdcd.sinks.base import Sink
from cdcd.units import ByteSize, ConfigPath, parse_duration, parse_size

REPO = Path(__file__).resolve().parents[2]


class _FakeSink(Sink):
    async def begin(self, txn: Any) -> None: ...
    async def write(self, events: Any) -> None: ...
    async def commit(self, txn: Any) -> None: ...
    async def flush(self) -> None: ...


class FakeFileSink(_FakeSink):
    """Stands in for a file sink: a path, an enum, a size, a secret."""

    type_name = "testfile"

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        path: ConfigPath
        format: Literal["jsonl", "parquet"] = "jsonl"
        max_file_size: ByteSize = 64 * 1024**2
        sasl_password: SecretStr | None = None
        ssl_cafile: str | None = None


class FakeFileSinkWithoutContext(_FakeSink):
    """A sink whose path is a plain Path (not ConfigPath): resolved by cdcd.config anyway."""

    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")
        path: Path


@pytest.fixture(autouse=True)
def fake_sinks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.BUILTIN_SINKS, "testfile", f"{__name__}:FakeFileSink")
    monkeypatch.setitem(
        registry.BUILTIN_SINKS, "testplain", f"{__name__}:FakeFileSinkWithoutContext"
    )


def write(tmp_path: Path, text: str, name: str = "cdcd.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


MINIMAL = """\
source:
  dsn: postgresql://cdc@db:5432/shop
sinks:
  - type: testfile
    path: out
"""


def load(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> Config:
    return load_config(write(tmp_path, text), env=env or {})


def problems(tmp_path: Path, text: str, env: dict[str, str] | None = None) -> list[str]:
    """The problem lines of the ConfigError raised for ``text`` (header dropped)."""
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, text, env)
    assert caught.value.exit_code == 2
    lines = str(caught.value).splitlines()
    return [line.strip() for line in lines[1:]] if len(lines) > 1 else lines


# -- defaults ----------------------------------------------------------------------------------


def test_minimal_config_gets_every_default(tmp_path: Path) -> None:
    config = load(tmp_path, MINIMAL)
    assert config.name == "cdcd"
    src = config.source
    assert src.dsn.get_secret_value() == "postgresql://cdc@db:5432/shop"
    assert src.password_file is None
    assert (src.slot, src.create_slot) == ("cdcd", True)
    assert (src.publication, src.create_publication) == ("cdcd_pub", True)
    assert src.tables == []
    assert (src.proto_version, src.streaming) == ("auto", "auto")
    assert (src.two_phase, src.binary, src.messages, src.origin) == (False, False, True, "any")
    assert (src.status_interval, src.connect_timeout) == (10.0, 10.0)
    assert (src.reconnect_min_backoff, src.reconnect_max_backoff) == (1.0, 30.0)
    assert src.give_up_after is None
    assert src.application_name == "cdcd"
    assert src.retained_wal_warning == 1024**3
    assert config.snapshot.mode == "initial"
    assert config.buffer.memory_limit == 256 * 1024**2
    assert config.buffer.spill_dir == tmp_path / "cdcd-spill"
    assert config.buffer.queue_transactions == 64
    assert config.http.listen == "127.0.0.1:8080"
    assert (config.http.enabled, config.http.host, config.http.port) == (True, "127.0.0.1", 8080)
    assert (config.log.format, config.log.level) == ("auto", "info")
    assert config.shutdown.grace_period == 30.0
    assert config.config_dir == tmp_path
    [spec] = config.sinks
    assert spec.type == "testfile"
    assert spec.sink_class is FakeFileSink
    assert isinstance(spec.config, FakeFileSink.Config)
    assert spec.config.path == tmp_path / "out"


def test_config_is_immutable(tmp_path: Path) -> None:
    config = load(tmp_path, MINIMAL)
    with pytest.raises(ValueError):
        config.name = "other"  # type: ignore[misc]


def test_full_config_values(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        """\
        name: shop
        source:
          dsn: host=db dbname=shop user=cdc
          slot: shop_slot
          tables: [public.orders, 'sales."Line Items"']
          proto_version: 2
          streaming: parallel
          origin: none
          status_interval: 500ms
          give_up_after: 5m
          retained_wal_warning: 10GB
        snapshot: {mode: initial_only}
        sinks:
          - {type: testfile, path: /abs/out, format: parquet, max_file_size: 1MiB}
        buffer: {memory_limit: 1GB, spill_dir: /var/spill, queue_transactions: 8}
        http: {listen: "[::1]:9000"}
        log: {format: JSON, level: WARN}
        shutdown: {grace_period: 2m}
        """,
    )
    assert config.name == "shop"
    assert config.source.tables == ["public.orders", 'sales."Line Items"']
    assert config.source.proto_version == 2
    assert config.source.streaming == "parallel"
    assert config.source.origin == "none"
    assert config.source.status_interval == 0.5
    assert config.source.give_up_after == 300.0
    assert config.source.retained_wal_warning == 10 * 1000**3
    assert config.snapshot.mode == "initial_only"
    assert config.sinks[0].config.path == Path("/abs/out")
    assert config.sinks[0].config.max_file_size == 1024**2
    assert config.buffer.memory_limit == 1000**3
    assert config.buffer.spill_dir == Path("/var/spill")
    assert (config.http.host, config.http.port) == ("::1", 9000)
    assert (config.log.format, config.log.level) == ("json", "warning")
    assert config.shutdown.grace_period == 120.0


@pytest.mark.parametrize("listen", ["null", '""', "false"])
def test_http_can_be_disabled(tmp_path: Path, listen: str) -> None:
    config = load(tmp_path, MINIMAL + f"http: {{listen: {listen}}}\n")
    assert (config.http.enabled, config.http.host, config.http.port) == (False, None, None)


def test_http_listen_without_host_means_every_interface(tmp_path: Path) -> None:
    config = load(tmp_path, MINIMAL + 'http: {listen: ":0"}\n')
    assert (config.http.host, config.http.port) == ("0.0.0.0", 0)


@pytest.mark.parametrize(
    ("yaml_value", "expected"),
    [("off", "off"), ("on", "on"), ("false", "off"), ("true", "on"), ("'off'", "off")],
)
def test_streaming_accepts_yaml_booleans(tmp_path: Path, yaml_value: str, expected: str) -> None:
    text = MINIMAL.replace("dsn: postgresql://cdc@db:5432/shop", "dsn: host=db")
    config = load(tmp_path, text + "")
    assert config.source.streaming == "auto"
    config = load(
        tmp_path, text.replace("dsn: host=db", f"dsn: host=db\n  streaming: {yaml_value}")
    )
    assert config.source.streaming == expected


# -- error messages ----------------------------------------------------------------------------


def test_unknown_keys_are_named_at_every_level(tmp_path: Path) -> None:
    lines = problems(
        tmp_path,
        """\
        colour: blue
        source:
          dsn: postgresql://cdc@db/shop
          slto: cdcd
        sinks:
          - type: testfile
            path: out
            compresion: zstd
        """,
    )
    assert any(line.startswith("colour: unknown key (allowed: name, source,") for line in lines)
    assert any(line.startswith("source.slto: unknown key (allowed: dsn,") for line in lines)
    assert any(
        line.startswith("sinks[0].compresion: unknown key (allowed: path, format") for line in lines
    )
    assert len(lines) == 3


def test_config_dir_is_not_a_yaml_key(tmp_path: Path) -> None:
    lines = problems(tmp_path, MINIMAL + "config_dir: /etc\n")
    assert lines == ["config_dir: unknown key (got '/etc')"]


def test_wrong_type(tmp_path: Path) -> None:
    text = MINIMAL.replace("shop\n", "shop\n  create_slot: maybe\n", 1)
    [line] = problems(tmp_path, text)
    assert line.startswith("source.create_slot: should be a valid boolean")
    assert "got 'maybe'" in line


def test_bad_units_name_the_key(tmp_path: Path) -> None:
    lines = problems(
        tmp_path,
        MINIMAL.replace("shop\n", "shop\n  status_interval: 10 parsecs\n", 1)
        + "buffer: {memory_limit: 12XB}\n",
    )
    assert "buffer.memory_limit: bad size '12XB' (use e.g. 256MiB, 1GB, 4096)" in lines
    assert any(
        line.startswith("source.status_interval: bad duration '10 parsecs'") for line in lines
    )


def test_bad_enum_lists_the_allowed_values(tmp_path: Path) -> None:
    text = MINIMAL.replace("shop\n", "shop\n  streaming: sometimes\n  proto_version: 9\n", 1)
    lines = problems(tmp_path, text + "snapshot: {mode: always}\n")
    assert (
        "source.streaming: bad value (got 'sometimes'; allowed: off, on, parallel, auto)" in lines
    )
    assert "source.proto_version: bad value (got 9; allowed: 1, 2, 3, 4, auto)" in lines
    assert (
        "snapshot.mode: bad value (got 'always'; allowed: initial, never, initial_only, incremental)"
        in lines
    )


def test_bad_enum_in_a_sink(tmp_path: Path) -> None:
    [line] = problems(tmp_path, MINIMAL + "    format: csv\n")
    assert line == "sinks[0].format: bad value (got 'csv'; allowed: jsonl, parquet)"


def test_missing_dsn(tmp_path: Path) -> None:
    lines = problems(tmp_path, "source: {slot: x}\nsinks: [{type: testfile, path: out}]\n")
    assert lines == ["source.dsn: required key is missing"]


def test_missing_source_section(tmp_path: Path) -> None:
    lines = problems(tmp_path, "sinks: [{type: testfile, path: out}]\n")
    assert lines == ["source: required key is missing"]


@pytest.mark.parametrize("sinks", ["", "sinks: []\n", "sinks:\n"])
def test_at_least_one_sink(tmp_path: Path, sinks: str) -> None:
    [line] = problems(tmp_path, "source: {dsn: 'host=db'}\n" + sinks)
    assert line.startswith("sinks: at least one sink is required (allowed types: ")
    assert "testfile" in line


def test_sink_problems(tmp_path: Path) -> None:
    lines = problems(
        tmp_path,
        """\
        source: {dsn: 'host=db'}
        sinks:
          - {type: nosuch}
          - {path: out}
          - just-a-string
          - {type: testfile}
        """,
    )
    assert lines[0].startswith("sinks[0].type: unknown sink type (got 'nosuch'; allowed types:")
    assert lines[1].startswith("sinks[1].type: required key is missing (allowed types:")
    assert lines[2].startswith("sinks[2]: a sink section must be a mapping")
    assert lines[3] == "sinks[3].path: required key is missing"
    assert len(lines) == 4


def test_sink_that_cannot_be_imported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.BUILTIN_SINKS, "broken", "cdcd.sinks.no_such_module:Sink")
    [line] = problems(tmp_path, "source: {dsn: 'host=db'}\nsinks: [{type: broken}]\n")
    assert line.startswith("sinks[0].type: sink 'broken' cannot be loaded: No module named")


def test_many_problems_are_reported_together(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, "name: 'bad name!'\nsource: {dsn: '', slot: Bad-Slot}\nlog: {level: loud}\n")
    message = str(caught.value)
    assert message.startswith(f"{tmp_path / 'cdcd.yaml'}: 5 problems in the configuration")
    for key in ("name:", "source.dsn:", "source.slot:", "log.level:", "sinks:"):
        assert f"\n  {key}" in message


def test_value_checks(tmp_path: Path) -> None:
    text = MINIMAL.replace(
        "shop\n",
        "shop\n  tables: [orders]\n  reconnect_min_backoff: 1m\n  reconnect_max_backoff: 10s\n",
        1,
    )
    lines = problems(tmp_path, text + "buffer: {queue_transactions: 0}\n")
    assert "source.tables: expected \"schema.table\" names, not 'orders'" in lines
    assert (
        "source.reconnect_max_backoff: must not be smaller than reconnect_min_backoff (60 s) (got '10s')"
        in lines
    )
    assert any(line.startswith("buffer.queue_transactions: should be greater") for line in lines)


def test_dsn_is_checked_by_the_connection_parser(tmp_path: Path) -> None:
    [line] = problems(
        tmp_path, MINIMAL.replace("postgresql://cdc@db:5432/shop", "'host=db hots=x'")
    )
    assert line.startswith("source.dsn: invalid connection option 'hots'")


def test_not_yaml_and_not_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"(?s)cdcd.yaml: not valid YAML.*line 2"):
        load(tmp_path, "source:\n  dsn: [unclosed\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load(tmp_path, "- a\n- b\n")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml", env={})


def test_duplicate_keys_are_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="found duplicate key 'slot'"):
        load(tmp_path, MINIMAL.replace("shop\n", "shop\n  slot: a\n  slot: b\n", 1))


# -- secrets -----------------------------------------------------------------------------------


def test_dsn_password_never_shown(tmp_path: Path) -> None:
    text = MINIMAL.replace("cdc@db:5432/shop", "cdc:T0pSecret@db:99999/shop")
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, text)
    assert "T0pSecret" not in str(caught.value)
    assert "source.dsn:" in str(caught.value)

    text = MINIMAL.replace("postgresql://cdc@db:5432/shop", "'mysql://cdc:T0pSecret@db/shop'")
    [line] = problems(tmp_path, text)
    assert "T0pSecret" not in line
    assert "got 'mysql://cdc:***@db/shop'" in line

    text = MINIMAL.replace("postgresql://cdc@db:5432/shop", "'host=db password=T0pSecret hots=1'")
    [line] = problems(tmp_path, text)
    assert "T0pSecret" not in line
    assert "password=***" in line


def test_sink_secret_never_shown(tmp_path: Path) -> None:
    [line] = problems(tmp_path, MINIMAL + "    sasl_password: [T0pSecret]\n")
    assert line.startswith("sinks[0].sasl_password:")
    assert "T0pSecret" not in line


def test_reprs_hide_the_dsn(tmp_path: Path) -> None:
    config = load(tmp_path, MINIMAL.replace("cdc@db", "cdc:T0pSecret@db"))
    assert "T0pSecret" not in repr(config)
    assert "T0pSecret" not in str(config.model_dump())
    assert config.source.masked_dsn() == "postgresql://cdc:***@db:5432/shop"
    assert config.source.conninfo() == "postgresql://cdc:T0pSecret@db:5432/shop"
    assert config.source.password() == "T0pSecret"


# -- password_file -----------------------------------------------------------------------------


def test_password_file_relative_to_the_config(tmp_path: Path) -> None:
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "pg").write_text("s3cr3t p@ss\n")
    text = MINIMAL.replace("shop\n", "shop\n  password_file: secrets/pg\n", 1)
    config = load(tmp_path, text)
    assert config.source.password_file == tmp_path / "secrets" / "pg"
    assert config.source.password() == "s3cr3t p@ss"
    assert config.source.conninfo() == "postgresql://cdc:s3cr3t%20p%40ss@db:5432/shop"


def test_password_file_with_keyvalue_dsn_and_url_without_user(tmp_path: Path) -> None:
    secret = tmp_path / "pw"
    secret.write_text("it's\\x")
    source = SourceConfig(dsn="host=db user=cdc password=old", password_file=secret)
    assert source.conninfo() == "host=db user=cdc password='it\\'s\\\\x'"
    from cdcd.wire.dsn import parse_dsn

    assert parse_dsn(source.conninfo(), environ={}, use_passfile=False).password == "it's\\x"

    source = SourceConfig(dsn="postgresql://db/shop?sslmode=require", password_file=secret)
    params = parse_dsn(source.conninfo(), environ={}, use_passfile=False)
    assert params.password == "it's\\x"
    assert params.sslmode == "require"


def test_password_file_problems(tmp_path: Path) -> None:
    text = MINIMAL.replace("shop\n", "shop\n  password_file: nope.txt\n", 1)
    [line] = problems(tmp_path, text)
    assert line.startswith(f"source.password_file: cannot read password file '{tmp_path}/nope.txt'")
    (tmp_path / "nope.txt").write_text("  \n")
    [line] = problems(tmp_path, text)
    assert line == f"source.password_file: password file '{tmp_path}/nope.txt' is empty"


def test_password_from_file_is_masked_in_logs(tmp_path: Path) -> None:
    from cdcd.log import mask_secrets

    (tmp_path / "pw").write_text("Zebra-Umbrella-42\n")
    load(tmp_path, MINIMAL.replace("shop\n", "shop\n  password_file: pw\n", 1))
    assert mask_secrets("auth failed with Zebra-Umbrella-42") == "auth failed with ***"


# -- paths -------------------------------------------------------------------------------------


def test_relative_paths_resolve_against_the_config_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir("/")
    conf = tmp_path / "conf"
    conf.mkdir()
    text = MINIMAL + "  - {type: testplain, path: plain}\nbuffer: {spill_dir: ../spill}\n"
    text = text.replace("path: out", "path: out\n    ssl_cafile: ca.pem")
    config = load_config(write(conf, text), env={})
    assert config.config_dir == conf
    assert config.sinks[0].config.path == conf / "out"
    assert config.sinks[0].config.ssl_cafile == str(conf / "ca.pem")
    assert config.sinks[1].config.path == conf / "plain"
    assert config.buffer.spill_dir == conf / "../spill"


def test_home_is_expanded(tmp_path: Path) -> None:
    config = load(tmp_path, MINIMAL.replace("path: out", "path: ~/cdc"))
    assert config.sinks[0].config.path == Path.home() / "cdc"


# -- ${VAR} substitution -----------------------------------------------------------------------


def test_substitution(tmp_path: Path) -> None:
    text = """\
        name: ${NAME:-fallback}
        source:
          dsn: postgresql://cdc:${PGPASS}@${PGHOST:-localhost}/shop
          proto_version: ${PROTO:-2}
          application_name: cost$${literal}
        sinks: [{type: testfile, path: "${OUT}/cdc"}]
        """
    config = load(tmp_path, text, env={"PGPASS": "pw", "OUT": "/data"})
    assert config.name == "fallback"
    assert config.source.conninfo() == "postgresql://cdc:pw@localhost/shop"
    assert config.source.proto_version == 2
    assert config.source.application_name == "cost${literal}"
    assert config.sinks[0].config.path == Path("/data/cdc")


def test_missing_variable_names_key_and_variable(tmp_path: Path) -> None:
    text = MINIMAL.replace("postgresql://cdc@db:5432/shop", "${CDCD_TEST_NOT_SET}")
    lines = problems(tmp_path, text + "buffer: {spill_dir: '${ALSO_NOT_SET}'}\n")
    assert lines == [
        "source.dsn: environment variable CDCD_TEST_NOT_SET is not set "
        "(set it, or write ${CDCD_TEST_NOT_SET:-default})",
        "buffer.spill_dir: environment variable ALSO_NOT_SET is not set "
        "(set it, or write ${ALSO_NOT_SET:-default})",
    ]


def test_bad_substitution(tmp_path: Path) -> None:
    [line] = problems(tmp_path, MINIMAL.replace("path: out", "path: ${not a name}"))
    assert line == "sinks[0].path: bad substitution ${not a name}"


# -- CDCD_* overrides --------------------------------------------------------------------------


def test_environment_overrides(tmp_path: Path) -> None:
    env = {
        "CDCD_SOURCE__SLOT": "other_slot",
        "CDCD_BUFFER__MEMORY_LIMIT": "64MiB",
        "CDCD_SINKS__0__PATH": "/elsewhere",
        "CDCD_SINKS__0__FORMAT": "parquet",
        "CDCD_SOURCE__CREATE_SLOT": "false",
        "CDCD_SOURCE__TABLES": "public.a, public.b",
        "CDCD_HTTP__LISTEN": "",
        "CDCD_NAME": "shop",
        "CDCD_QUICKSTART_DSN": "not an override",
        "CDCD_CONFIG": "not an override either",
        "PGHOST": "ignored",
    }
    config = load(tmp_path, MINIMAL, env)
    assert config.name == "shop"
    assert config.source.slot == "other_slot"
    assert config.source.create_slot is False
    assert config.source.tables == ["public.a", "public.b"]
    assert config.buffer.memory_limit == 64 * 1024**2
    assert config.sinks[0].config.path == Path("/elsewhere")
    assert config.sinks[0].config.format == "parquet"
    assert config.http.enabled is False


def test_override_of_a_secret_dsn(tmp_path: Path) -> None:
    env = {"CDCD_SOURCE__DSN": "host=db password='a: b'"}
    config = load(tmp_path, MINIMAL, env)
    assert config.source.dsn.get_secret_value() == "host=db password='a: b'"


@pytest.mark.parametrize(
    ("value", "expected"), [("off", "off"), ("on", "on"), ("parallel", "parallel")]
)
def test_streaming_override(tmp_path: Path, value: str, expected: str) -> None:
    config = load(tmp_path, MINIMAL, {"CDCD_SOURCE__STREAMING": value})
    assert config.source.streaming == expected


def test_bad_override_names_the_variable(tmp_path: Path) -> None:
    lines = problems(tmp_path, MINIMAL, {"CDCD_BUFFER__MEMORY_LIMIT": "lots"})
    assert lines == [
        "buffer.memory_limit: bad size 'lots' (use e.g. 256MiB, 1GB, 4096) "
        "[from $CDCD_BUFFER__MEMORY_LIMIT]"
    ]
    lines = problems(tmp_path, MINIMAL, {"CDCD_SOURCE__SLTO": "x"})
    assert (
        lines[0].startswith("source.slto: unknown key") and "[from $CDCD_SOURCE__SLTO]" in lines[0]
    )


def test_override_that_does_not_fit(tmp_path: Path) -> None:
    [line] = problems(tmp_path, MINIMAL, {"CDCD_SINKS__3__PATH": "x"})
    assert line == "CDCD_SINKS__3__PATH: sinks[3]: the list has only 1 item(s)"
    [line] = problems(tmp_path, MINIMAL, {"CDCD_SOURCE": "x"})
    assert line == "CDCD_SOURCE: source is a section; override its keys one by one"


# -- the shipped config files ------------------------------------------------------------------


def _use_real_sinks_where_available(monkeypatch: pytest.MonkeyPatch) -> None:
    """The file sink is written in parallel with this module; stand in for it until it lands."""
    try:
        importlib.import_module("cdcd.sinks.file.sink")
    except ImportError:
        monkeypatch.setitem(registry.BUILTIN_SINKS, "file", f"{__name__}:FakeFileSink")


def test_reference_config_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    _use_real_sinks_where_available(monkeypatch)
    config = load_config(REPO / "config" / "cdcd.reference.yaml", env={})
    defaults = parse_config(
        {"source": {"dsn": "host=x"}, "sinks": [{"type": "file", "path": "cdc-out"}]},
        REPO / "config",
    )
    # the reference documents the defaults: it loads to exactly what leaving keys out gives
    assert config.model_dump(exclude={"source": {"dsn"}, "sinks": True}) == defaults.model_dump(
        exclude={"source": {"dsn"}, "sinks": True}
    )
    assert [spec.type for spec in config.sinks] == ["file", "kafka"]
    sections = yaml.safe_load((REPO / "config" / "cdcd.reference.yaml").read_text())["sinks"]
    for spec, section in zip(config.sinks, sections, strict=True):
        if spec.sink_class.__module__.startswith("cdcd.sinks."):  # a real sink, not a stand-in
            documented = set(section) - {"type"}
            assert documented == set(spec.sink_class.Config.model_fields), spec.type
    kafka = config.sinks[1]
    assert kafka.config == kafka.sink_class.Config.model_validate(
        {"bootstrap_servers": "localhost:9092"}
    )


def test_quickstart_config_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    _use_real_sinks_where_available(monkeypatch)
    path = REPO / "config" / "quickstart.yaml"
    config = load_config(path, env={"CDCD_QUICKSTART_DSN": "postgresql://qs@127.0.0.1:5999/qs"})
    assert config.source.conninfo() == "postgresql://qs@127.0.0.1:5999/qs"
    assert [spec.type for spec in config.sinks] == ["file"]
    assert config.sinks[0].config.path == REPO / "config" / "cdc-out"
    assert (config.http.host, config.http.port) == ("127.0.0.1", 8080)
    with pytest.raises(ConfigError, match="CDCD_QUICKSTART_DSN is not set"):
        load_config(path, env={})


# -- programmatic construction -----------------------------------------------------------------


def test_build_config_in_code(tmp_path: Path) -> None:
    config = Config(
        source=SourceConfig(dsn="host=db"),
        sinks=[{"type": "testfile", "path": "out"}],  # type: ignore[list-item]
        config_dir=tmp_path,
    )
    assert config.sinks[0].config.path == Path.cwd() / "out"
    spec = SinkSpec(type="testfile", config=FakeFileSink.Config(path=tmp_path))
    assert Config(source=SourceConfig(dsn="host=db"), sinks=[spec]).sinks == [spec]
    with pytest.raises(ValueError, match="at least one sink"):
        Config(source=SourceConfig(dsn="host=db"), sinks=[])
    with pytest.raises(ValueError, match="format: bad value"):
        SinkSpec.model_validate({"type": "testfile", "path": "x", "format": "csv"})


# -- units -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("256MiB", 256 * 1024**2),
        ("1GB", 10**9),
        ("512kB", 512_000),
        ("512kb", 512_000),
        ("4KiB", 4096),
        ("1024", 1024),
        (1024, 1024),
        ("1.5KiB", 1536),
        (" 2 GiB ", 2 * 1024**3),
        ("10B", 10),
        ("1TiB", 1024**4),
        (0, 0),
    ],
)
def test_parse_size(text: Any, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["12XB", "", "MiB", "-1", "1.5", "1e3", True, None, -5, [1]])
def test_parse_size_rejects(bad: Any) -> None:
    with pytest.raises(ValueError, match="bad size"):
        parse_size(bad)


def test_parse_size_message() -> None:
    with pytest.raises(ValueError) as caught:
        parse_size("12XB")
    assert str(caught.value) == "bad size '12XB' (use e.g. 256MiB, 1GB, 4096)"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("10s", 10.0),
        ("500ms", 0.5),
        ("2m", 120.0),
        ("1h", 3600.0),
        ("1d", 86400.0),
        ("250us", 0.00025),
        ("1.5", 1.5),
        (3, 3.0),
        (0.25, 0.25),
        ("0", 0.0),
    ],
)
def test_parse_duration(text: Any, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["10 parsecs", "", "s", "-1s", -1, float("nan"), False, None])
def test_parse_duration_rejects(bad: Any) -> None:
    with pytest.raises(ValueError, match="bad duration"):
        parse_duration(bad)


def test_overrides_create_missing_sections(tmp_path: Path) -> None:
    text = "sinks: [{type: testfile, path: out}]\n"
    config = load(tmp_path, text, {"CDCD_SOURCE__DSN": "postgresql://cdc@db/shop"})
    assert config.source.masked_dsn() == "postgresql://cdc@db/shop"
    config = load(
        tmp_path, MINIMAL, {"CDCD_LOG__LEVEL": "debug", "CDCD_SHUTDOWN__GRACE_PERIOD": "5"}
    )
    assert (config.log.level, config.shutdown.grace_period) == ("debug", 5.0)
