"""Choosing a server from a multi-host connection string, as libpq does.

PostgreSQL docs, libpq "Specifying Multiple Hosts" (34.1.1.3) and ``target_session_attrs``
(34.1.2). Each host is tried in the order given, on every (re)connect; a host that cannot be
reached, or whose server does not suit ``target_session_attrs``, is skipped for the next one.
``prefer-standby`` first looks for a standby and, finding none, takes the first server that
answers. An authentication or other definite error stops the search at once (libpq does not
try the other hosts either): it will not go away by itself.

The same loop serves the replication connection (:class:`cdcd.replication.client.
ReplicationClient`) and the asyncpg SQL connections (:func:`cdcd.source.open_sql`); what
differs is passed in: how to open one host, and how to read what it is.

Whether a server is a standby comes from the ``in_hot_standby`` parameter the server reports
at start-up (14+); for older servers from ``pg_is_in_recovery()``. When no host will do, the
error is transient: while a standby waits to be promoted the caller retries with its backoff,
and the message says which host is what.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from cdcd.errors import TransientSourceError
from cdcd.log import LazyLogger
from cdcd.wire.dsn import ConnParams, accepts

log = LazyLogger("cdcd.replication")

C = TypeVar("C")

#: (in_hot_standby, default_transaction_read_only) of a connected server
Role = tuple[bool, bool]


async def connect_first(
    params: ConnParams,
    open_one: Callable[[ConnParams], Awaitable[C]],
    role: Callable[[C], Awaitable[Role]],
    discard: Callable[[C], Awaitable[None]],
) -> C:
    """A connection to the first host of ``params`` that answers and suits its
    ``target_session_attrs``. ``open_one`` connects to one host (raising
    :class:`TransientSourceError` when it cannot), ``role`` tells what the server is,
    ``discard`` closes a connection that will not be used."""
    target = params.target_session_attrs
    hosts = params.each_host()
    if target == "any":
        if len(hosts) == 1:
            return await open_one(hosts[0])
        passes = ["any"]
    elif target == "prefer-standby":
        passes = ["standby", "any"]
    else:
        passes = [target]
    notes: dict[str, str] = {}
    for wanted in passes:
        for host in hosts:
            where = f"{host.host}:{host.port}"
            if notes.get(where, "").startswith("unreachable"):
                continue  # tried in the first pass already
            try:
                conn = await open_one(host)
            except TransientSourceError as exc:
                notes[where] = f"unreachable ({exc})"
                continue
            if wanted == "any":
                return conn
            try:
                in_hot_standby, read_only = await role(conn)
            except TransientSourceError as exc:
                notes[where] = f"unreachable ({exc})"
                await discard(conn)
                continue
            if accepts(wanted, in_hot_standby=in_hot_standby, read_only=read_only):
                return conn
            await discard(conn)
            notes[where] = (
                "a standby (in recovery)"
                if in_hot_standby
                else "read-only (default_transaction_read_only)"
                if read_only
                else "a primary"
            )
            log.info(
                "server does not suit target_session_attrs; trying the next host",
                host=where,
                target_session_attrs=target,
                server=notes[where],
            )
    summary = "; ".join(f"{where} is {what}" for where, what in notes.items())
    if any(not what.startswith("unreachable") for what in notes.values()):
        raise TransientSourceError(
            f"no server suits target_session_attrs={target} ({summary}); waiting for one "
            "(a standby being promoted, a primary coming back)"
        )
    raise TransientSourceError(f"cannot connect to any host: {summary}")
