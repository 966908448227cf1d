"""The connections an incremental snapshot reads over (:mod:`cdcd.snapshot.incremental`).

- :class:`Control`: one connection for the short queries (listing and describing tables,
  looking up the next chunk's key), one query at a time for every table being read;
- :class:`Workers`: ``snapshot.workers`` slots, each reading one chunk at a time over a worker
  connection (an idle one, else a new one), shared by the tables being read
  (:meth:`Workers.share`).

A connection a query failed on in a way that may leave it broken is closed, never reused;
what a lost connection raises (:data:`CONNECTION_LOST`) is retried by the caller after a
backoff (:func:`pause`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import asyncpg

from cdcd.errors import TransientSourceError

#: what a lost connection raises (the server restarting, a cut connection): retried
CONNECTION_LOST = (
    OSError,
    TransientSourceError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.OperatorInterventionError,
)

_T = TypeVar("_T")


class Control:
    """The connection for the short queries, opened when first needed, and again after it was
    lost."""

    def __init__(self, connect: Callable[[], Awaitable[Any]]) -> None:
        self._connect = connect
        self._conn: Any = None
        self._lock = asyncio.Lock()

    async def run(self, query: Callable[..., Awaitable[_T]], *args: Any) -> _T:
        """``query(connection, *args)``."""
        async with self._lock:
            if self._conn is None:
                self._conn = await self._connect()
            try:
                return await query(self._conn, *args)
            except BaseException as exc:
                if isinstance(exc, CONNECTION_LOST) or not isinstance(exc, Exception):
                    self._conn.terminate()  # lost, or a query cut short: not reusable
                    self._conn = None
                raise

    def close(self) -> None:
        if self._conn is not None:
            self._conn.terminate()
            self._conn = None


class Slot:
    """The worker slot a chunk holds while it reads: given back once the read ends, before its
    window closes in the stream, so that the next chunk is read while this one waits for its
    high watermark."""

    __slots__ = ("_workers", "held")

    def __init__(self, workers: Workers) -> None:
        self._workers = workers
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self._workers.free += 1

    async def take(self) -> None:
        """Hold a slot again (a chunk read a second time)."""
        while self._workers.free <= 0:
            await asyncio.sleep(0.02)
        self._workers.free -= 1
        self.held = True


class Workers:
    """``count`` worker slots and their connections; ``reading``: the tables sharing them, in
    the order they started."""

    def __init__(self, connect: Callable[[], Awaitable[Any]], count: int) -> None:
        self._connect = connect
        self.count = count
        self.free = count  # slots not in use
        self.reading: list[str] = []
        self._idle: list[Any] = []  # connections not in use

    def take(self) -> Slot:
        """A slot, taken at once (the caller checked :attr:`free`): taken before anything is
        awaited, since other tables take them too."""
        self.free -= 1
        return Slot(self)

    def share(self, name: str) -> int:
        """How many workers table ``name`` may use at once: the workers split between the
        tables being read (the first ones get the remainder), so that none waits behind
        another for a worker."""
        tables = self.reading
        return self.count // len(tables) + (tables.index(name) < self.count % len(tables))

    async def run(self, read: Callable[..., Awaitable[_T]], *args: Any) -> _T:
        """``read(connection, *args)`` on a worker connection, in the slot the caller holds;
        the connection goes back to the idle ones after, or is closed if ``read`` failed (it
        may be broken)."""
        conn = None
        ok = False
        try:
            conn = self._idle.pop() if self._idle else await self._connect()
            result = await read(conn, *args)
            ok = True
            return result
        finally:
            if conn is not None:
                if ok:
                    self._idle.append(conn)
                else:
                    conn.terminate()

    def close(self) -> None:
        for conn in self._idle:
            conn.terminate()
        self._idle.clear()


async def pause(backoff: float) -> float:
    """Wait ``backoff`` seconds after a lost connection; the next wait (:func:`longer`)."""
    await asyncio.sleep(backoff)
    return longer(backoff)


def longer(backoff: float) -> float:
    """The wait after ``backoff`` for the next lost connection: doubled, at most 10 s."""
    return min(backoff * 2, 10.0)
