"""pgoutput options for START_REPLICATION, from the config and the server's version.

``proto_version`` may not exceed what the server knows (14: 2, 15: 3, 16 and later: 4); streaming
needs 2 (``parallel`` needs 4), two-phase 3, ``origin`` PostgreSQL 16. See the README's
"Configuration" section and ``config/cdcd.reference.yaml``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cdcd.errors import ConfigError
from cdcd.wire.frontend import quote_ident

#: server_version_num thresholds for pgoutput protocol versions
_PROTO_BY_VERSION = ((160000, 4), (150000, 3), (140000, 2), (0, 1))


@dataclass(frozen=True, slots=True)
class StreamOptions:
    proto_version: int
    streaming: str  # off | on | parallel
    options: dict[str, str]


def stream_options(source: Any, server_version: int) -> StreamOptions:
    """pgoutput options for ``source`` (the config's ``source`` section) on this server."""
    highest = next(proto for minimum, proto in _PROTO_BY_VERSION if server_version >= minimum)
    if source.proto_version == "auto":
        proto = highest
    else:
        proto = int(source.proto_version)
        if proto > highest:
            raise ConfigError(
                f"source.proto_version: {proto} is not supported by this server "
                f"(version {server_version // 10000} supports up to {highest})"
            )
    streaming = str(source.streaming)
    if streaming == "auto":
        streaming = "parallel" if proto >= 4 else "on" if proto >= 2 else "off"
    if streaming == "on" and proto < 2:
        raise ConfigError("source.streaming: 'on' needs proto_version 2 or later")
    if streaming == "parallel" and proto < 4:
        raise ConfigError("source.streaming: 'parallel' needs proto_version 4 (PostgreSQL 16+)")
    options = {
        "proto_version": str(proto),
        # under keyless_tables: insert_only, the insert-only twin too (docs/keyless-tables.md)
        "publication_names": ",".join(quote_ident(n) for n in source.publication_names()),
    }
    if streaming != "off":
        options["streaming"] = streaming
    if source.two_phase:
        if proto < 3:
            raise ConfigError("source.two_phase: needs proto_version 3 or later (PostgreSQL 15+)")
        options["two_phase"] = "on"
    if source.binary:
        options["binary"] = "true"
    if source.messages:
        options["messages"] = "true"
    if source.origin != "any":
        if server_version < 160000:
            raise ConfigError("source.origin: 'none' needs PostgreSQL 16 or later")
        options["origin"] = source.origin
    return StreamOptions(proto, streaming, options)
