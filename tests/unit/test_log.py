"""cdcd.log: JSON lines with bound context, stdlib records through the same processors, masking."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import structlog

from cdcd.log import configure_logging, get_logger, mask_dsn, mask_secrets, register_secret


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    structlog.contextvars.clear_contextvars()
    yield
    structlog.contextvars.clear_contextvars()
    root = logging.getLogger()
    for handler in [h for h in root.handlers if h.get_name() == "cdcd"]:
        root.removeHandler(handler)
    structlog.reset_defaults()


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def lines(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_carry_bound_context() -> None:
    out = io.StringIO()
    configure_logging("json", "info", stream=out)
    structlog.contextvars.bind_contextvars(slot="cdcd", lsn="0/16B3748", xid=771)
    get_logger("cdcd.test").info("transaction committed", events=3)
    [record] = lines(out)
    assert record["event"] == "transaction committed"
    assert (record["slot"], record["lsn"], record["xid"], record["events"]) == (
        "cdcd",
        "0/16B3748",
        771,
        3,
    )
    assert (record["level"], record["logger"]) == ("info", "cdcd.test")
    assert record["timestamp"].endswith("Z") and "T" in record["timestamp"]
    assert list(record)[:4] == ["timestamp", "level", "logger", "event"]


def test_stdlib_records_go_through_the_same_processors() -> None:
    out = io.StringIO()
    configure_logging("json", "info", stream=out)
    structlog.contextvars.bind_contextvars(slot="s1")
    logging.getLogger("asyncpg.pool").warning("connection %s lost", "#3")
    [record] = lines(out)
    assert record["event"] == "connection #3 lost"
    assert (record["level"], record["logger"], record["slot"]) == ("warning", "asyncpg.pool", "s1")
    assert "timestamp" in record


def test_level_filters_both_kinds() -> None:
    out = io.StringIO()
    configure_logging("json", "warning", stream=out)
    log = get_logger("cdcd.test")
    log.info("not shown")
    logging.getLogger("other").info("not shown either")
    log.warning("shown")
    assert [r["event"] for r in lines(out)] == ["shown"]

    out = io.StringIO()
    configure_logging("json", "debug", stream=out)
    get_logger("cdcd.test").debug("now shown")
    assert [r["event"] for r in lines(out)] == ["now shown"]


def test_chatty_libraries_are_quieter_at_info() -> None:
    out = io.StringIO()
    configure_logging("json", "info", stream=out)
    logging.getLogger("aiokafka.conn").info("metadata refreshed")
    logging.getLogger("aiokafka.conn").warning("broker down")
    assert [r["event"] for r in lines(out)] == ["broker down"]


def test_secrets_are_masked() -> None:
    out = io.StringIO()
    configure_logging("json", "info", stream=out)
    register_secret("Zebra-Umbrella-42")
    log = get_logger("cdcd.test")
    log.info(
        "connecting",
        dsn="postgresql://cdc:T0pSecret@db:5432/shop",
        password="hunter2",
        sasl_password="kafka-pw",
        options={"password": "nested"},
        note="file said Zebra-Umbrella-42",
    )
    logging.getLogger("asyncpg").error("failed: host=db user=cdc password='T0p Secret' dbname=x")
    try:
        raise ValueError("postgres://u:T0pSecret@h/db refused")
    except ValueError:
        log.exception("connect failed")
    text = out.getvalue()
    for secret in ("T0pSecret", "T0p Secret", "hunter2", "kafka-pw", "nested", "Zebra-Umbrella-42"):
        assert secret not in text
    first, second, third = lines(out)
    assert first["dsn"] == "postgresql://cdc:***@db:5432/shop"
    assert (first["password"], first["sasl_password"]) == ("***", "***")
    assert first["options"] == {"password": "***"}
    assert first["note"] == "file said ***"
    assert second["event"] == "failed: host=db user=cdc password=*** dbname=x"
    assert "postgres://u:***@h/db refused" in third["exception"]


def test_console_on_a_tty_json_otherwise() -> None:
    tty = Tty()
    configure_logging("auto", "info", stream=tty)
    get_logger("cdcd.test").info("hello", dsn="postgresql://a:b@c/d")
    text = tty.getvalue()
    assert "hello" in text and not text.startswith("{")
    assert "a:***@c" in text

    pipe = io.StringIO()
    configure_logging("auto", "info", stream=pipe)
    get_logger("cdcd.test").info("hello")
    assert lines(pipe)[0]["event"] == "hello"

    forced = Tty()
    configure_logging("json", "info", stream=forced)
    get_logger("cdcd.test").info("hello")
    assert lines(forced)[0]["event"] == "hello"


def test_reconfiguring_replaces_the_handler() -> None:
    first, second = io.StringIO(), io.StringIO()
    configure_logging("json", "info", stream=first)
    configure_logging("json", "info", stream=second)
    logging.getLogger("x").warning("once")
    assert first.getvalue() == ""
    assert len(lines(second)) == 1


def test_unknown_level() -> None:
    with pytest.raises(ValueError, match="unknown log level 'loud'"):
        configure_logging("json", "loud")


@pytest.mark.parametrize(
    ("dsn", "masked"),
    [
        ("postgresql://cdc:pw@db/shop", "postgresql://cdc:***@db/shop"),
        ("postgresql://cdc@db/shop", "postgresql://cdc@db/shop"),
        (
            "postgresql://db/shop?password=pw&sslmode=require",
            "postgresql://db/shop?password=***&sslmode=require",
        ),
        ("host=db password=pw user=cdc", "host=db password=*** user=cdc"),
        ("host=db password = 'a b\\' c' user=cdc", "host=db password = *** user=cdc"),
        ("host=db PASSWORD=pw", "host=db PASSWORD=***"),
    ],
)
def test_mask_dsn(dsn: str, masked: str) -> None:
    assert mask_dsn(dsn) == masked
    assert mask_secrets(dsn) == masked


def test_the_benchmark_counts_warnings_in_the_json_log() -> None:
    """bench/run.py reports how often cdcd warned that publishing turned slow, read from the
    JSON log cdcd writes in a bench run (the file sink's own logger, as configured there)."""
    from bench.run import counted_log_events
    from cdcd.sinks.file import layout as file_sink

    out = io.StringIO()
    configure_logging("json", "warning", stream=out)
    file_sink.log.warning("file_publish_slow", path="/x", seconds=0.2)
    file_sink.log.info("file_publish_quick", path="/x", seconds=0.001)  # below the level
    file_sink.log.warning("file_publish_slow", path="/x", seconds=0.3)
    get_logger("cdcd.test").warning("something else")
    text = out.getvalue() + "not a JSON line\n{broken\n"
    assert counted_log_events(text) == {"file_publish_slow": 2}
    assert counted_log_events("") == {}


def test_set_up_when_needed_at_the_first_stdlib_record() -> None:
    import cdcd.log

    structlog.reset_defaults()
    out = io.StringIO()
    configure_logging("json", "warning", stream=out, when_needed=True)
    assert not structlog.is_configured()  # nothing logged yet: no pipeline built
    logging.getLogger("asyncpg").info("below the level")
    logging.getLogger("asyncio").warning("task %s destroyed", "#1")
    logging.getLogger("asyncpg").error("connection lost")
    assert structlog.is_configured()
    assert [(r["level"], r["logger"], r["event"]) for r in lines(out)] == [
        ("warning", "asyncio", "task #1 destroyed"),
        ("error", "asyncpg", "connection lost"),
    ]
    handlers = [h for h in logging.getLogger().handlers if h.get_name() == "cdcd"]
    assert len(handlers) == 1 and isinstance(handlers[0], logging.StreamHandler)
    assert cdcd.log._pending is None


def test_set_up_when_needed_at_the_first_logger() -> None:
    structlog.reset_defaults()
    out = io.StringIO()
    configure_logging("json", "info", stream=out, when_needed=True)
    assert not structlog.is_configured()
    get_logger("cdcd.cli").error(
        "refused", error="DefiniteSourceError", dsn="postgresql://u:pw@h/d"
    )
    [record] = lines(out)
    assert (record["level"], record["logger"], record["event"]) == ("error", "cdcd.cli", "refused")
    assert record["dsn"] == "postgresql://u:***@h/d"
