"""A fault-injecting TCP proxy on 127.0.0.1 for tests (in the spirit of asyncpg's test proxy).

It forwards every accepted connection to ``target`` and can, on demand:

* :meth:`TcpProxy.cut` — abort every open connection at once, on both sides, with a TCP reset
  (``SO_LINGER 0``), as a network failure or a dying middlebox would;
* ``downstream_rate``: forward at most that many bytes per second from the server to the
  client, so a test can be sure a large transaction is still arriving when it cuts;
* :meth:`TcpProxy.refuse` — close the listening socket so new connections are refused
  (``ECONNREFUSED``) until :meth:`TcpProxy.accept` reopens it on the same port; ``refuse(3)``
  reopens by itself after three seconds.

The proxy runs its own asyncio loop in a daemon thread, so it can be driven from synchronous
test code (and from async tests) while a daemon under test talks through it. Every method is
thread-safe and returns once the change has taken effect.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

_LINGER_RESET = struct.pack("ii", 1, 0)
_CHUNK = 256 * 1024


def _hard_close(writer: asyncio.StreamWriter) -> None:
    """Close with a reset rather than a FIN: the peer sees the connection die."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    writer.transport.abort()


class TcpProxy:
    """``TcpProxy(target_host, target_port).start()``; ``.port`` is where clients connect."""

    def __init__(
        self,
        target_host: str,
        target_port: int,
        *,
        host: str = "127.0.0.1",
        downstream_rate: float | None = None,
    ) -> None:
        self.target = (target_host, target_port)
        self.host = host
        self.downstream_rate = downstream_rate
        self.port = 0
        #: connections accepted so far (a reconnecting client shows up here)
        self.accepted = 0
        #: connections aborted by :meth:`cut`
        self.cut_count = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="tcpproxy")
        self._server: asyncio.Server | None = None
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._reopen: asyncio.TimerHandle | None = None

    # --- driving from any thread ------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def start(self) -> TcpProxy:
        self._thread.start()
        self._call(self._listen())
        return self

    def close(self) -> None:
        """Stop listening, abort every connection and stop the loop's thread."""
        if not self._thread.is_alive():
            return
        self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def open_connections(self) -> int:
        return len(self._pairs)

    def cut(self) -> int:
        """Abort every open connection (both sides, with a reset); returns how many."""
        return self._call(self._cut())

    def refuse(self, seconds: float | None = None) -> None:
        """Refuse new connections (the listening socket is closed; open ones are untouched).
        With ``seconds``, accept again by itself after that long."""
        self._call(self._refuse(seconds))

    def accept(self) -> None:
        """Listen again on the same port (after :meth:`refuse`)."""
        self._call(self._listen())

    @property
    def listening(self) -> bool:
        return self._server is not None

    # --- on the proxy's loop ----------------------------------------------------------------

    async def _listen(self) -> None:
        if self._reopen is not None:
            self._reopen.cancel()
            self._reopen = None
        if self._server is None:
            self._server = await asyncio.start_server(
                self._handle, self.host, self.port, reuse_address=True
            )
            self.port = self._server.sockets[0].getsockname()[1]

    async def _refuse(self, seconds: float | None) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()  # the listening socket closes now (wait_closed would, on 3.12+,
            # also wait for the open connections, which stay)
        if seconds is not None:
            self._reopen = self._loop.call_later(
                seconds, lambda: self._loop.create_task(self._listen())
            )

    async def _cut(self) -> int:
        pairs = list(self._pairs)
        self._pairs.clear()
        for client, upstream in pairs:
            _hard_close(client)
            _hard_close(upstream)
        self.cut_count += len(pairs)
        return len(pairs)

    async def _shutdown(self) -> None:
        await self._refuse(None)
        await self._cut()

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError:
            _hard_close(client_w)
            return
        pair = (client_w, up_w)
        self._pairs.add(pair)
        try:
            await asyncio.gather(
                self._pipe(client_r, up_w), self._pipe(up_r, client_w, self.downstream_rate)
            )
        finally:
            if pair in self._pairs:  # not cut: one side closed normally
                self._pairs.discard(pair)
                for writer in pair:
                    writer.transport.abort()

    @staticmethod
    async def _pipe(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rate: float | None = None
    ) -> None:
        try:
            while data := await reader.read(_CHUNK if rate is None else 16 * 1024):
                writer.write(data)
                await writer.drain()
                if rate is not None:
                    await asyncio.sleep(len(data) / rate)
            if writer.can_write_eof():
                writer.write_eof()
        except (OSError, RuntimeError):
            writer.transport.abort()
