"""Every exception cdcd raises, classified by consequence.

::

    CdcdError                      base; its class says what the supervisor does
    ├── ConfigError                bad configuration or usage            exit 2, definite
    ├── ProtocolError              bytes that break the protocol         definite
    │   ├── LocalProtocolError     we broke it (a bug in cdcd)
    │   └── RemoteProtocolError    the server sent something impossible (names tag and LSN)
    ├── AssemblyError              message order breaks an invariant (nested Begin, ...)
    ├── SpillError                 the spill directory failed (disk full, permissions): stop
    ├── SourceError                a problem with the PostgreSQL source
    │   ├── DefiniteSourceError    wal_level, slot lost, publication missing, auth,
    │   │   │                      permission denied: stop, exit 3, say what to do
    │   │   └── SlotLostError      the slot is invalidated or gone: exit 3, or, with
    │   │                          source.on_slot_lost: recreate, a new slot and a backfill
    │   └── TransientSourceError   connection lost, server restarting: reconnect with backoff
    └── SinkError                  a sink could not make data durable
        ├── DefiniteSinkError      oversized record, authorization, bad path: stop
        │   └── SinkSetupError     where it writes is missing or refuses cdcd (no such
        │                          bucket, access denied): exit 3, as for the source
        └── TransientSinkError     broker unavailable, disk briefly full: retry

Third-party exceptions (asyncpg, aiokafka, OSError) are translated into these in exactly one
place per component; nothing above the component sees a foreign exception type.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_SOURCE = 3


class CdcdError(Exception):
    """Base of every cdcd error; ``exit_code`` is the process's exit code when it ends cdcd."""

    exit_code: int = EXIT_FAILURE


class ConfigError(CdcdError):
    """Invalid configuration or usage; the message names the key and the problem."""

    exit_code = EXIT_USAGE


class ProtocolError(CdcdError):
    """Bytes that do not follow the protocol."""


class LocalProtocolError(ProtocolError):
    """cdcd itself broke the protocol: a bug."""


class RemoteProtocolError(ProtocolError):
    """The server sent bytes that cannot be right (unknown tag, truncated message)."""

    def __init__(self, message: str, *, tag: str | None = None, lsn: int | None = None) -> None:
        where = []
        if tag is not None:
            where.append(f"tag {tag!r}")
        if lsn is not None:
            where.append(f"at LSN {lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)
        self.tag = tag
        self.lsn = lsn


class AssemblyError(CdcdError):
    """The message sequence breaks a transaction invariant (nested Begin, stray Commit, ...)."""


class SpillError(CdcdError):
    """Buffered transactions could not be spilled to or read back from ``buffer.spill_dir``."""


class SourceError(CdcdError):
    """A problem with the PostgreSQL source."""


class DefiniteSourceError(SourceError):
    """The source cannot work until an operator acts: exit 3 with what to do."""

    exit_code = EXIT_SOURCE


class SlotLostError(DefiniteSourceError):
    """The replication slot is invalidated or no longer exists; ``reason`` says why
    (``wal_removed``, ``idle_timeout``, ``rows_removed``, ``wal_level_insufficient``,
    ``missing``, or the server's words)."""

    def __init__(self, message: str, *, reason: str = "invalidated") -> None:
        super().__init__(message)
        self.reason = reason


class TransientSourceError(SourceError):
    """The connection failed in a way that reconnecting may fix."""


class SinkError(CdcdError):
    """A sink could not make data durable."""


class DefiniteSinkError(SinkError):
    """A sink failure that retrying will not fix."""


class SinkSetupError(DefiniteSinkError):
    """Where a sink writes is missing or refuses cdcd (a bucket that does not exist, access
    denied, unknown credentials): an operator must act, as for a definite source problem
    (exit 3). Found before anything is created on the source when it can be
    (:meth:`cdcd.sinks.base.Sink.preflight`)."""

    exit_code = EXIT_SOURCE


class TransientSinkError(SinkError):
    """A sink failure that may pass (broker down, timeout)."""
