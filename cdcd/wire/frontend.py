"""Frontend (client -> server) messages, as bytes, plus SQL quoting for replication commands.

PostgreSQL docs, "Message Formats" (protocol section 55.7) and "Streaming Replication
Protocol" (55.4). Only what a replication connection sends: SSLRequest, StartupMessage,
password/SASL responses, Query (simple query protocol: the only one a walsender accepts),
CopyData, CopyDone and Terminate.

Invariants: strings are UTF-8 and must not contain NUL (a :class:`LocalProtocolError` if they
do, since the server would cut them there); every message but the two untagged startup-phase
ones goes through :func:`cdcd.wire.framing.frame`.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

from cdcd.errors import ConfigError, LocalProtocolError
from cdcd.wire.framing import frame

PROTOCOL_3_0 = 3 << 16
SSL_REQUEST_CODE = 80877103

#: What the server answers to SSLRequest, as one byte.
SSL_ACCEPTED = b"S"
SSL_REFUSED = b"N"


def cstring(text: str) -> bytes:
    """A NUL-terminated UTF-8 string."""
    data = text.encode("utf-8")
    if b"\x00" in data:
        raise LocalProtocolError(f"string contains a NUL byte: {text[:60]!r}")
    return data + b"\x00"


def ssl_request() -> bytes:
    """SSLRequest: ``Int32(8) Int32(80877103)``."""
    return struct.pack("!II", 8, SSL_REQUEST_CODE)


def startup_message(parameters: Mapping[str, str], version: int = PROTOCOL_3_0) -> bytes:
    """StartupMessage: length, protocol version, name/value pairs, final NUL."""
    body = struct.pack("!I", version)
    body += b"".join(cstring(k) + cstring(v) for k, v in parameters.items()) + b"\x00"
    return struct.pack("!I", len(body) + 4) + body


def password_message(password: str) -> bytes:
    """PasswordMessage for cleartext and MD5 authentication."""
    return frame(b"p", cstring(password))


def sasl_initial_response(mechanism: str, data: bytes) -> bytes:
    """SASLInitialResponse: mechanism name and client-first-message."""
    return frame(b"p", cstring(mechanism) + struct.pack("!i", len(data)) + data)


def sasl_response(data: bytes) -> bytes:
    """SASLResponse: client-final-message."""
    return frame(b"p", data)


def query(sql: str) -> bytes:
    """Query (simple query protocol)."""
    return frame(b"Q", cstring(sql))


def copy_data(payload: bytes) -> bytes:
    return frame(b"d", payload)


def copy_done() -> bytes:
    return frame(b"c")


def terminate() -> bytes:
    return frame(b"X")


# --------------------------------------------------------------------------- quoting


def quote_ident(name: str) -> str:
    """A double-quoted SQL identifier (``"a""b"``); never empty, never NUL."""
    if not name or "\x00" in name:
        raise LocalProtocolError(f"invalid identifier {name!r}")
    return '"' + name.replace('"', '""') + '"'


def quote_literal(value: str) -> str:
    """A single-quoted SQL string literal (standard_conforming_strings: ``'it''s'``)."""
    if "\x00" in value:
        raise LocalProtocolError(f"string literal contains a NUL byte: {value[:60]!r}")
    return "'" + value.replace("'", "''") + "'"


def quote_qualified(name: str) -> str:
    """``schema.table`` (or ``table``) with each part quoted; a part may already be quoted."""
    parts = split_qualified(name)
    return ".".join(quote_ident(p) for p in parts)


def split_qualified(name: str) -> list[str]:
    """Split ``a.b`` / ``"A.x"."b"`` into its parts, unquoting quoted ones.

    Unquoted parts are taken as exact (case-sensitive) names, as they appear in the catalog;
    a malformed name is a :class:`ConfigError` (table names come from configuration).
    """
    parts: list[str] = []
    i, n = 0, len(name)
    while i < n:
        if name[i] == '"':
            j = i + 1
            buf: list[str] = []
            while True:
                if j >= n:
                    raise ConfigError(f"unterminated quoted identifier in {name!r}")
                if name[j] == '"':
                    if j + 1 < n and name[j + 1] == '"':
                        buf.append('"')
                        j += 2
                        continue
                    break
                buf.append(name[j])
                j += 1
            parts.append("".join(buf))
            i = j + 1
        else:
            j = name.find(".", i)
            j = n if j < 0 else j
            parts.append(name[i:j])
            i = j
        if i < n:
            if name[i] != ".":
                raise ConfigError(f"malformed table name {name!r} (expected schema.table)")
            i += 1
            if i == n:
                raise ConfigError(f"malformed table name {name!r} (expected schema.table)")
    if not parts or len(parts) > 2 or not all(parts):
        raise ConfigError(f"malformed table name {name!r} (expected schema.table)")
    return parts


def escape_option_value(value: str) -> str:
    """Escape a value inside the startup ``options`` string as libpq users must:
    backslash before spaces and backslashes (the server splits ``options`` on spaces)."""
    return value.replace("\\", "\\\\").replace(" ", "\\ ")
