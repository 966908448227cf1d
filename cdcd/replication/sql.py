"""Replication commands as text: START_REPLICATION and CREATE_REPLICATION_SLOT by server
version (PostgreSQL docs, "Streaming Replication Protocol", 55.4). Pure: no I/O."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from cdcd.errors import ConfigError
from cdcd.lsn import format_lsn
from cdcd.wire import frontend


def publication_names_option(names: str | Sequence[str]) -> str:
    """The ``publication_names`` value: a comma list of quoted identifiers."""
    if isinstance(names, str):
        names = [names]
    if not names:
        raise ConfigError("publication_names: at least one publication is needed")
    return ",".join(frontend.quote_ident(n) for n in names)


def start_replication_sql(
    slot: str, start_lsn: int, options: Mapping[str, str | Sequence[str]]
) -> str:
    """``START_REPLICATION SLOT "slot" LOGICAL X/Y ("name" 'value', ...)``.

    Option names are quoted identifiers, values string literals. ``publication_names`` given
    as a list is formatted with :func:`publication_names_option`; given as a string it is used
    as is (so callers may pass ``'"pub"'`` already quoted; an unquoted name is folded to lower
    case by the server).
    """
    parts = []
    for name, value in options.items():
        if not isinstance(value, str):
            value = publication_names_option(value)
        parts.append(f"{frontend.quote_ident(name)} {frontend.quote_literal(value)}")
    sql = f"START_REPLICATION SLOT {frontend.quote_ident(slot)} LOGICAL {format_lsn(start_lsn)}"
    return f"{sql} ({', '.join(parts)})" if parts else sql


def create_slot_sql(
    name: str,
    server_version: int,
    *,
    two_phase: bool = False,
    snapshot: Literal["nothing", "export", "use"] = "nothing",
    temporary: bool = False,
    failover: bool = False,
) -> str:
    """CREATE_REPLICATION_SLOT for pgoutput, in the syntax the server version understands.

    ``failover`` (17+) is set here, at creation: altering it later on the connection that
    exported the snapshot would destroy the snapshot. 17 refuses FAILOVER with TWO_PHASE;
    18 accepts both (checked on 18.6)."""
    head = f"CREATE_REPLICATION_SLOT {frontend.quote_ident(name)}"
    if temporary:
        head += " TEMPORARY"
    head += " LOGICAL pgoutput"
    if snapshot not in ("nothing", "export", "use"):
        raise ConfigError(f"snapshot must be nothing, export or use, not {snapshot!r}")
    if server_version >= 150000:
        opts = [f"SNAPSHOT {frontend.quote_literal(snapshot)}"]
        if two_phase:
            opts.insert(0, "TWO_PHASE true")
        if failover:
            if server_version < 170000:
                raise ConfigError(
                    "failover slots need PostgreSQL 17 or later "
                    f"(the server is {server_version // 10000}); set source.failover: false"
                )
            if two_phase and server_version < 180000:
                raise ConfigError(
                    "PostgreSQL 17 cannot create a slot with both FAILOVER and TWO_PHASE: set "
                    "source.two_phase or source.failover to false (18 allows both)"
                )
            opts.insert(0, "FAILOVER true")
        return f"{head} ({', '.join(opts)})"
    if two_phase or failover:
        what = "two_phase" if two_phase else "failover"
        raise ConfigError(
            f"{what} slots need PostgreSQL {15 if two_phase else 17} or later "
            f"(the server is {server_version // 10000})"
        )
    keyword = {"nothing": "NOEXPORT_SNAPSHOT", "export": "EXPORT_SNAPSHOT", "use": "USE_SNAPSHOT"}
    return f"{head} {keyword[snapshot]}"
