"""The replication connection: the only socket code between cdcd and the walsender.

PostgreSQL docs, "Streaming Replication Protocol" (protocol section 55.4), "SSL Session
Encryption" (55.2.10), libpq "SSL Support" (34.19). asyncpg cannot run START_REPLICATION's
CopyBoth stream, so this module drives the sans-I/O :class:`cdcd.wire.session.Session` over an
asyncio transport (plain ``asyncio`` or ``uvloop``)::

    socket ──bytes──▶ ReplicationProtocol.data_received ──▶ Session (MessageReader) ──events──▶ client
    client ──frontend bytes (query, CopyData 'r', CopyDone, Terminate)──▶ transport.write

Backpressure: bytes go straight into the session's buffer; past ``HIGH_WATER`` buffered bytes
the transport stops reading until :meth:`ReplicationClient.messages` has consumed them, so a
slow consumer holds the server back through TCP instead of growing memory.

Feedback: positions come from :meth:`ReplicationClient.set_positions` and only move forward
(:class:`cdcd.lsn.Progress`). A standby status update is sent every ``status_interval`` seconds
by a background task (also while the consumer is busy), at once when a keepalive asks for a
reply (before that keepalive is yielded), and on :meth:`send_status`. The flush position is
never more than the caller said is durable.

Errors: server errors become cdcd errors in :func:`cdcd.wire.session.source_error`; socket
errors, EOF and timeouts become :class:`TransientSourceError`; certificate verification
failures and missing TLS under ``sslmode=require`` or stricter are :class:`DefiniteSourceError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, cast

import structlog

from cdcd.errors import (
    LocalProtocolError,
    RemoteProtocolError,
    TransientSourceError,
)
from cdcd.lsn import Progress, parse_lsn, unix_to_pg_us
from cdcd.replication.hosts import Role, connect_first
from cdcd.replication.sql import create_slot_sql, publication_names_option, start_replication_sql
from cdcd.replication.transport import ReplicationProtocol, TlsHandshakeFailed, negotiate_tls
from cdcd.wire import frontend
from cdcd.wire import session as wire
from cdcd.wire.copydata import (
    PrimaryKeepalive,
    XLogData,
    parse_copy_data,
    standby_status_update,
)
from cdcd.wire.dsn import ConnParams
from cdcd.wire.session import SlotExists, source_error

__all__ = [
    "ReplicationClient",
    "SlotCreated",
    "SlotExists",
    "SystemInfo",
    "XLogTuple",
    "publication_names_option",
    "start_replication_sql",
]

log = structlog.get_logger("cdcd.replication")

_COPY_STATES = (wire.State.COPY_BOTH, wire.State.COPY_SERVER_DONE)

#: One XLogData in a batch of :meth:`ReplicationClient.message_batches`:
#: ``(wal_start, wal_end, send_time, data)``, the fields of :class:`XLogData`.
XLogTuple = tuple[int, int, int, bytes]


@dataclass(frozen=True, slots=True)
class SystemInfo:
    """IDENTIFY_SYSTEM: cluster id, timeline, current WAL flush position, database."""

    systemid: str
    timeline: int
    xlogpos: int
    dbname: str | None


@dataclass(frozen=True, slots=True)
class SlotCreated:
    """CREATE_REPLICATION_SLOT's answer."""

    slot_name: str
    consistent_point: int
    snapshot_name: str | None
    output_plugin: str | None


class ReplicationClient:
    """A logical replication connection (``replication=database``) to one server."""

    def __init__(
        self,
        params: ConnParams,
        protocol: ReplicationProtocol,
        session: wire.Session,
        *,
        status_interval: float,
    ) -> None:
        self.params = params
        self._protocol = protocol
        self._session = session
        self.status_interval = status_interval
        self._written = Progress()
        self._flushed = Progress()
        self._applied = Progress()
        self._last_status = 0.0
        self._status_task: asyncio.Task[None] | None = None
        self._closed = False
        self.tls = False
        #: called with every notice or warning that arrives during :meth:`messages`
        self.on_notice: Callable[[wire.ServerMessage], None] | None = None

    def __repr__(self) -> str:
        return f"ReplicationClient({self.params.describe()}, state={self._session.state.value})"

    # ------------------------------------------------------------------ connecting

    @classmethod
    async def connect(
        cls,
        params: ConnParams,
        *,
        application_name: str | None = None,
        extra_gucs: Mapping[str, str] | None = None,
        connect_timeout: float | None = None,
        status_interval: float = 10.0,
    ) -> ReplicationClient:
        """Open, encrypt as ``params.sslmode`` says, authenticate, wait for ReadyForQuery.

        ``application_name`` defaults to the DSN's, else ``cdcd``; ``connect_timeout`` to the
        DSN's, else 10 s; it bounds the start-up (TCP, TLS, authentication) of each host.
        With several hosts they are tried in order until one suits ``target_session_attrs``
        (:mod:`cdcd.replication.hosts`).
        """
        timeout = connect_timeout if connect_timeout is not None else params.connect_timeout or 10.0
        name = application_name or params.application_name or "cdcd"

        async def open_one(host: ConnParams) -> ReplicationClient:
            try:
                async with asyncio.timeout(timeout):
                    return await cls._connect(host, name, extra_gucs, status_interval)
            except TimeoutError:
                raise TransientSourceError(
                    f"timed out after {timeout:g}s connecting to {host.describe()}"
                ) from None

        return await connect_first(params, open_one, _role, _discard)

    @classmethod
    async def _connect(
        cls,
        params: ConnParams,
        application_name: str,
        extra_gucs: Mapping[str, str] | None,
        status_interval: float,
    ) -> ReplicationClient:
        use_tls = params.sslmode != "disable" and not params.is_unix_socket
        if use_tls:
            try:
                return await cls._attempt(
                    params, application_name, extra_gucs, status_interval, True
                )
            except TlsHandshakeFailed as exc:
                if params.sslmode not in ("allow", "prefer"):
                    raise exc.error from exc.__cause__
                log.info("TLS handshake failed, retrying without TLS", error=str(exc.error))
        return await cls._attempt(params, application_name, extra_gucs, status_interval, False)

    @classmethod
    async def _attempt(
        cls,
        params: ConnParams,
        application_name: str,
        extra_gucs: Mapping[str, str] | None,
        status_interval: float,
        try_tls: bool,
    ) -> ReplicationClient:
        loop = asyncio.get_running_loop()
        protocol = ReplicationProtocol(loop)
        try:
            if params.is_unix_socket:
                await loop.create_unix_connection(lambda: protocol, params.socket_path)
            else:
                await loop.create_connection(
                    lambda: protocol, params.hostaddr or params.host, params.port
                )
        except OSError as exc:
            raise TransientSourceError(f"cannot connect to {params.describe()}: {exc}") from exc
        assert protocol.transport is not None
        client: ReplicationClient | None = None
        try:
            sock = protocol.transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            tls = False
            if try_tls:
                tls = await negotiate_tls(loop, protocol, params)
            session = wire.Session(
                user=params.user,
                database=params.dbname,
                password=params.password,
                application_name=application_name,
                extra_gucs=extra_gucs,
                options=params.options,
            )
            protocol.session = session
            client = cls(params, protocol, session, status_interval=status_interval)
            client.tls = tls
            client._write(session.start())
            await client._startup()
            return client
        except BaseException:
            if protocol.transport is not None:
                protocol.transport.abort()
            raise

    async def _startup(self) -> None:
        session = self._session
        while True:
            event = await self._next_event()
            pending = session.data_to_send()
            if pending:
                self._write(pending)
            if isinstance(event, wire.ErrorResponse):
                raise source_error(event.fields, user=self.params.user)
            if isinstance(event, wire.ReadyForQuery):
                return
            if isinstance(event, wire.NoticeResponse):
                _log_notice(event.fields)

    # ------------------------------------------------------------------ I/O helpers

    def _write(self, data: bytes) -> None:
        transport = self._protocol.transport
        if transport is None or self._protocol.lost is not None or transport.is_closing():
            raise TransientSourceError(
                f"the replication connection to {self.params.describe()} is closed"
            )
        transport.write(data)

    async def _next_event(self) -> wire.Event:
        session = self._session
        while (event := session.next_event()) is None:
            try:
                await self._protocol.wait_data()
            except OSError as exc:
                raise TransientSourceError(
                    f"replication connection to {self.params.describe()} lost: {exc}"
                ) from exc
        return event

    # ------------------------------------------------------------------ queries

    @property
    def server_version(self) -> int:
        """``server_version_num`` of the server, e.g. 180006."""
        return self._session.server_version

    @property
    def buffered(self) -> int:
        """Bytes received and not yet consumed (bounded by about ``HIGH_WATER``)."""
        return self._session.buffered + len(self._protocol.raw)

    @property
    def in_hot_standby(self) -> bool:
        """Whether the server is a standby (its ``in_hot_standby`` parameter, 14+)."""
        return self._session.parameters.get("in_hot_standby") == "on"

    @property
    def backend_pid(self) -> int | None:
        return self._session.backend_pid

    async def _query(self, sql: str) -> tuple[tuple[str, ...], list[list[str | None]]]:
        self._write(self._session.send_query(sql))
        columns: tuple[str, ...] = ()
        rows: list[list[str | None]] = []
        error: wire.ServerMessage | None = None
        while True:
            event = await self._next_event()
            if isinstance(event, wire.DataRow):
                rows.append(list(event.values))
            elif isinstance(event, wire.RowDescription):
                columns = event.columns
            elif isinstance(event, wire.ErrorResponse):
                error = event.fields
            elif isinstance(event, wire.ReadyForQuery):
                break
            elif isinstance(event, wire.NoticeResponse):
                _log_notice(event.fields)
            elif isinstance(event, wire.CopyBothResponse):
                raise LocalProtocolError(f"{sql[:60]!r} started a COPY; use start_replication")
        if error is not None:
            raise source_error(error, user=self.params.user, context=_summary(sql))
        return columns, rows

    async def simple_query(self, sql: str) -> list[list[str | None]]:
        """Run one command with the simple query protocol; rows of text (None for NULL)."""
        return (await self._query(sql))[1]

    async def identify_system(self) -> SystemInfo:
        columns, rows = await self._query("IDENTIFY_SYSTEM")
        row = dict(zip(columns, rows[0], strict=True))
        return SystemInfo(
            systemid=row["systemid"] or "",
            timeline=int(row["timeline"] or 0),
            xlogpos=parse_lsn(row["xlogpos"] or "0/0"),
            dbname=row.get("dbname"),
        )

    async def create_slot(
        self,
        name: str,
        *,
        two_phase: bool = False,
        snapshot: Literal["nothing", "export", "use"] = "nothing",
        temporary: bool = False,
        failover: bool = False,
    ) -> SlotCreated:
        """Create a pgoutput slot; :class:`SlotExists` if one of that name exists."""
        sql = create_slot_sql(
            name,
            self.server_version,
            two_phase=two_phase,
            snapshot=snapshot,
            temporary=temporary,
            failover=failover,
        )
        columns, rows = await self._query(sql)
        row = dict(zip(columns, rows[0], strict=True))
        return SlotCreated(
            slot_name=row.get("slot_name") or name,
            consistent_point=parse_lsn(row.get("consistent_point") or "0/0"),
            snapshot_name=row.get("snapshot_name"),
            output_plugin=row.get("output_plugin"),
        )

    async def alter_slot_failover(self, name: str, failover: bool) -> None:
        """ALTER_REPLICATION_SLOT ... (FAILOVER ...) (17+). Never on a connection that
        exported a snapshot still in use: it would destroy the snapshot."""
        value = "true" if failover else "false"
        await self._query(f"ALTER_REPLICATION_SLOT {frontend.quote_ident(name)} (FAILOVER {value})")

    async def drop_slot(self, name: str, wait: bool = True) -> None:
        """DROP_REPLICATION_SLOT; with ``wait`` (13+) it waits for an active consumer to go."""
        sql = f"DROP_REPLICATION_SLOT {frontend.quote_ident(name)}"
        if wait and self.server_version >= 130000:
            sql += " WAIT"
        await self._query(sql)

    # ------------------------------------------------------------------ streaming

    async def start_replication(
        self, slot: str, start_lsn: int, options: Mapping[str, str | Sequence[str]]
    ) -> None:
        """START_REPLICATION; returns once the server switched to CopyBoth.

        ``start_lsn`` 0 means "from the slot's confirmed position". Errors the server reports
        later (a missing publication is noticed while decoding) come from :meth:`messages`.
        """
        sql = start_replication_sql(slot, start_lsn, options)
        self._write(self._session.send_query(sql))
        error: wire.ServerMessage | None = None
        while True:
            event = await self._next_event()
            if isinstance(event, wire.CopyBothResponse):
                break
            if isinstance(event, wire.ErrorResponse):
                error = event.fields
            elif isinstance(event, wire.ReadyForQuery):
                if error is None:
                    raise RemoteProtocolError("START_REPLICATION ended without CopyBothResponse")
                raise source_error(error, user=self.params.user, context=f"slot {slot!r}")
            elif isinstance(event, wire.NoticeResponse):
                _log_notice(event.fields)
        self._last_status = time.monotonic()
        self._protocol.coalesce = True
        self._status_task = asyncio.get_running_loop().create_task(
            self._status_loop(), name=f"cdcd-status-{slot}"
        )

    @property
    def socket_reads(self) -> int:
        """Reads from the socket so far (each a ``data_received`` call)."""
        return self._protocol.reads

    async def messages(self) -> AsyncIterator[XLogData | PrimaryKeepalive]:
        """The CopyBoth stream: XLogData and keepalives, pulled one at a time.

        A keepalive asking for a reply is answered before it is yielded. The server ending
        the stream, or any error, raises (the stream never just stops).
        """
        async for batch in self.message_batches():
            for item in batch:
                yield item if isinstance(item, PrimaryKeepalive) else XLogData(*item)

    async def message_batches(self) -> AsyncIterator[list[XLogTuple | PrimaryKeepalive]]:
        """The CopyBoth stream in batches: everything already received, in order.

        The fast path of :meth:`messages` (one await per socket read rather than per message;
        no object per XLogData): each XLogData is a plain :data:`XLogTuple`
        ``(wal_start, wal_end, send_time, data)`` with ``data`` as bytes; keepalives are
        :class:`PrimaryKeepalive`. A keepalive asking for a reply is answered before its batch
        is yielded. Batches are never empty.
        """
        session = self._session
        protocol = self._protocol
        while True:
            items, others = session.xlog_run()  # XLogData already as tuples (compiled)
            if items:
                reply = False
                for index in others:
                    message = parse_copy_data(cast(bytes, items[index]))
                    if isinstance(message, PrimaryKeepalive):
                        reply = reply or message.reply_requested
                        items[index] = message
                    else:  # unreachable: a short XLogData raises in parse_copy_data
                        items[index] = _xlog_tuple(message)
                if reply:
                    await self.send_status()
                yield cast(list[XLogTuple | PrimaryKeepalive], items)
                continue
            event = session.next_event()
            if event is None:
                try:
                    await protocol.wait_data()
                except OSError as exc:
                    raise TransientSourceError(
                        f"replication connection to {self.params.describe()} lost: {exc}"
                    ) from exc
                continue
            if type(event) is wire.CopyData:  # xlog_run takes these; kept for safety
                message = parse_copy_data(event.payload)
                if isinstance(message, PrimaryKeepalive):
                    if message.reply_requested:
                        await self.send_status()
                    yield [message]
                else:
                    yield [_xlog_tuple(message)]
            elif isinstance(event, wire.ErrorResponse):
                raise source_error(
                    event.fields, user=self.params.user, context="replication stream"
                )
            elif isinstance(event, wire.CopyDone):
                with contextlib.suppress(Exception):
                    await self.send_status()
                    self._write(session.send_copy_done())
                raise TransientSourceError(
                    f"the server at {self.params.describe()} ended the replication stream "
                    "(shutting down?); will reconnect"
                )
            elif isinstance(event, wire.CommandComplete):  # a walsender's shutdown (WalSndDone)
                raise TransientSourceError(
                    f"the server at {self.params.describe()} ended the replication stream "
                    f"({event.tag}; shutting down?); will reconnect"
                )
            elif isinstance(event, wire.NoticeResponse):
                _log_notice(event.fields)
                if self.on_notice is not None:
                    self.on_notice(event.fields)

    def set_positions(self, *, written: int, flushed: int, applied: int | None = None) -> None:
        """Positions the next status updates report; each only moves forward.

        ``flushed`` must be durable (everything up to it is safe in every sink): the server
        may discard WAL up to it. ``applied`` defaults to ``flushed``.
        """
        self._written.advance(written)
        self._flushed.advance(flushed)
        self._applied.advance(flushed if applied is None else applied)

    @property
    def positions(self) -> tuple[int, int, int]:
        """(written, flushed, applied) as the next status update reports them."""
        return self._written.value, self._flushed.value, self._applied.value

    async def send_status(self, reply_requested: bool = False) -> None:
        """Send a standby status update now. Outside the stream there is nothing to report:
        it does nothing."""
        if self._session.state not in _COPY_STATES or self._protocol.lost is not None:
            return
        payload = standby_status_update(
            max(self._written.value, self._flushed.value),
            self._flushed.value,
            self._applied.value,
            unix_to_pg_us(time.time_ns() // 1000),
            reply_requested,
        )
        self._write(self._session.send_copy_data(payload))
        self._last_status = time.monotonic()
        try:
            await self._protocol.drain()
        except OSError as exc:
            raise TransientSourceError(
                f"replication connection to {self.params.describe()} lost: {exc}"
            ) from exc

    async def _status_loop(self) -> None:
        interval = self.status_interval
        while self._session.state in _COPY_STATES and self._protocol.lost is None:
            await asyncio.sleep(max(0.05, self._last_status + interval - time.monotonic()))
            if time.monotonic() - self._last_status >= interval:
                try:
                    await self.send_status()
                except Exception:  # the reading side reports what went wrong
                    return

    # ------------------------------------------------------------------ closing

    async def close(self, timeout: float = 5.0) -> None:
        """Report positions, end the stream (CopyDone), say goodbye (Terminate), close.

        Waits at most ``timeout`` seconds for the server to end the stream; data that still
        arrives is discarded (it was never confirmed, so the server sends it again).
        """
        if self._closed:
            return
        self._closed = True
        task, self._status_task = self._status_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        transport = self._protocol.transport
        try:
            if self._session.state in _COPY_STATES and self._protocol.lost is None:
                await self.send_status()
                self._write(self._session.send_copy_done())
                async with asyncio.timeout(timeout):
                    while not isinstance(await self._next_event(), wire.ReadyForQuery):
                        pass
            if self._protocol.lost is None:
                self._write(self._session.send_terminate())
        except (Exception, TimeoutError):
            pass
        finally:
            if transport is not None:
                transport.close()

    async def __aenter__(self) -> ReplicationClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


async def _role(client: ReplicationClient) -> Role:
    """(in hot standby, read only by default) from the start-up parameters; before 14,
    which does not report ``in_hot_standby``, from ``pg_is_in_recovery()``."""
    reported = client._session.parameters
    standby = reported.get("in_hot_standby")
    if standby is None:
        rows = await client.simple_query("SELECT pg_catalog.pg_is_in_recovery()")
        standby = "on" if rows and rows[0][0] == "t" else "off"
    read_only = reported.get("default_transaction_read_only", "off")
    return standby == "on", read_only == "on"


async def _discard(client: ReplicationClient) -> None:
    await client.close()


def _xlog_tuple(message: XLogData) -> XLogTuple:
    return (message.wal_start, message.wal_end, message.send_time, bytes(message.data))


def _log_notice(fields: wire.ServerMessage) -> None:
    """Server notices go to the log; warnings (e.g. a publication skipped on 18) as warnings."""
    if fields.severity == "WARNING":
        log.warning("server warning", notice=str(fields))
    else:
        log.info("server notice", notice=str(fields))


def _summary(sql: str) -> str:
    first = sql.split("(", 1)[0].strip()
    return first if len(first) <= 80 else first[:77] + "..."
