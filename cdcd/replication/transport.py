"""The replication connection's asyncio protocol: bytes from the transport into the session
(:mod:`cdcd.wire.session`), reading paused past a high-water mark, and, while the walsender
writes without a break, small reads coalesced (it writes message by message; keeping pace with
it gives ~1 KB reads otherwise); and the SSLRequest that may wrap it in TLS before start-up."""

from __future__ import annotations

import asyncio
import ssl
from time import perf_counter
from typing import cast

from cdcd.errors import DefiniteSourceError, RemoteProtocolError, TransientSourceError
from cdcd.wire import frontend
from cdcd.wire import session as wire
from cdcd.wire.dsn import ConnParams, ssl_context

#: Stop reading the socket while this many received bytes wait to be consumed.
HIGH_WATER = 4 * 1024 * 1024
#: While streaming, a read smaller than this may pause reading for COALESCE_SECONDS, so that
#: the next read takes what the walsender wrote meanwhile in one piece (it writes message by
#: message: keeping pace with it, reads are ~1 KB each otherwise). See
#: docs/development.md, "Socket reads".
SMALL_READ = 32 * 1024
#: uvloop rounds timer delays to whole milliseconds: 0.5 ms would not wait at all.
COALESCE_SECONDS = 0.001
#: Only a read that ends a run of QUICK_READS reads, each within QUICK_GAP seconds of the one
#: before (or of the end of a pause), pauses: the walsender is then writing without a break (a
#: large or streamed transaction, a backlog) and the pause costs no throughput. A read after a
#: quiet spell (a live transaction's commit) wakes the consumer at once, adding no latency.
QUICK_GAP = 0.0002
QUICK_READS = 4


class ReplicationProtocol(asyncio.Protocol):
    """Moves bytes between the transport and the session; pauses reading past HIGH_WATER."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.raw = bytearray()  # before the session is attached (the SSLRequest answer)
        self.session: wire.Session | None = None
        self.lost: OSError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._drain_waiter: asyncio.Future[None] | None = None
        self._reading_paused = False
        self._writing_paused = False
        self.coalesce = False  # set once streaming: see SMALL_READ
        self._coalescing = False
        self._last_read = 0.0
        self._quick = 0  # reads in a row within QUICK_GAP of the one before
        self.reads = 0
        self.pauses = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.reads += 1
        now = perf_counter()
        quick = self._quick + 1 if now - self._last_read < QUICK_GAP else 0
        self._quick = quick
        self._last_read = now
        session = self.session
        if session is None:
            self.raw += data
            buffered = len(self.raw)
        else:
            session.receive_data(data)
            buffered = session.buffered
        transport = self.transport
        if transport is None:
            self._wake()
            return
        if buffered >= HIGH_WATER and not self._reading_paused:
            self._reading_paused = True
            transport.pause_reading()
        elif (
            self.coalesce
            and quick >= QUICK_READS
            and len(data) < SMALL_READ
            and not self._reading_paused
        ):
            # a small read while the walsender writes on: let its writes gather in the socket
            self.pauses += 1
            self._coalescing = True
            self._reading_paused = True
            transport.pause_reading()
            self._loop.call_later(COALESCE_SECONDS, self._coalesced)
            return  # the consumer is woken with what has gathered
        self._wake()

    def _coalesced(self) -> None:
        self._coalescing = False
        self._last_read = perf_counter()  # the read after the pause continues the run
        if self._reading_paused and self.transport is not None and self.lost is None:
            buffered = len(self.raw) if self.session is None else self.session.buffered
            if buffered < HIGH_WATER:
                self._reading_paused = False
                self.transport.resume_reading()
        self._wake()

    def eof_received(self) -> bool:
        self._lose(ConnectionResetError("the server closed the connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._lose(exc or ConnectionResetError("the connection was closed"))

    def _lose(self, exc: BaseException) -> None:
        if self.lost is None:
            self.lost = exc if isinstance(exc, OSError) else ConnectionResetError(str(exc))
        self._wake()
        waiter, self._drain_waiter = self._drain_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def pause_writing(self) -> None:
        self._writing_paused = True

    def resume_writing(self) -> None:
        self._writing_paused = False
        waiter, self._drain_waiter = self._drain_waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait_data(self) -> None:
        """Wait until more bytes arrived (resuming reading) or the connection is lost."""
        if self._reading_paused and not self._coalescing and self.transport is not None:
            self._reading_paused = False
            self.transport.resume_reading()
        if self.lost is not None:
            raise self.lost
        # Several tasks may wait (the consumer, close()): they share one future.
        if self._waiter is None or self._waiter.done():
            self._waiter = self._loop.create_future()
        await asyncio.shield(self._waiter)
        if (
            self.lost is not None
            and not self.raw
            and (self.session is None or not self.session.buffered)
        ):
            raise self.lost

    async def drain(self) -> None:
        if self.lost is not None:
            raise self.lost
        if self._writing_paused:
            if self._drain_waiter is None or self._drain_waiter.done():
                self._drain_waiter = self._loop.create_future()
            await asyncio.shield(self._drain_waiter)
            if self.lost is not None:
                raise self.lost


class TlsHandshakeFailed(Exception):
    """Internal: the TLS handshake failed in a way ``sslmode=prefer`` may retry without TLS."""

    def __init__(self, error: TransientSourceError) -> None:
        super().__init__(str(error))
        self.error = error


async def negotiate_tls(
    loop: asyncio.AbstractEventLoop, protocol: ReplicationProtocol, params: ConnParams
) -> bool:
    """SSLRequest; on 'S' wrap the transport in TLS. Returns whether TLS is on."""
    assert protocol.transport is not None
    context = ssl_context(params)
    assert context is not None
    protocol.transport.write(frontend.ssl_request())
    try:
        while not protocol.raw:
            await protocol.wait_data()
    except OSError as exc:
        raise TransientSourceError(
            f"connection to {params.describe()} lost during TLS negotiation: {exc}"
        ) from exc
    answer = bytes(protocol.raw)
    protocol.raw.clear()
    if answer == frontend.SSL_REFUSED:
        if params.sslmode in ("allow", "prefer"):
            return False
        raise DefiniteSourceError(
            f"the server at {params.describe()} does not support TLS but "
            f"sslmode={params.sslmode}: enable ssl on the server or lower sslmode"
        )
    if answer != frontend.SSL_ACCEPTED:
        # More than the one byte means someone injected plaintext (CVE-2021-23222).
        raise RemoteProtocolError(
            f"unexpected answer {answer[:16]!r} to SSLRequest from {params.describe()}"
        )
    try:
        new_transport = await loop.start_tls(
            protocol.transport,
            protocol,
            context,
            server_hostname=params.host,
        )
    except ssl.SSLCertVerificationError as exc:
        raise DefiniteSourceError(
            f"TLS certificate verification failed for {params.describe()} "
            f"(sslmode={params.sslmode}): {exc.verify_message or exc}. Check sslrootcert and "
            "that the server certificate names this host"
        ) from exc
    except (ssl.SSLError, OSError) as exc:
        raise TlsHandshakeFailed(
            TransientSourceError(f"TLS handshake with {params.describe()} failed: {exc}")
        ) from exc
    if new_transport is None:
        raise TransientSourceError(f"TLS handshake with {params.describe()} failed")
    protocol.transport = new_transport
    return True
