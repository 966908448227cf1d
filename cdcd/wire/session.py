"""One replication connection as a sans-I/O state machine, and the SQLSTATE -> error mapping.

PostgreSQL docs, "Message Flow" (protocol section 55.2: start-up, simple query, COPY
operations), "Streaming Replication Protocol" (55.4), "Message Formats" (55.7), "Error and
Notice Message Fields" (55.8), Appendix A "PostgreSQL Error Codes".

Use (h11 style: bytes in, events out; the caller owns the socket)::

    session = Session(user="cdc", database="shop", password="...")
    send(session.start())                  # StartupMessage
    session.receive_data(chunk)            # whatever arrived
    while (event := session.next_event()) is not None:
        send(session.data_to_send())       # authentication responses, if any
        ...

Authentication (cleartext, MD5, SCRAM-SHA-256) is answered inside the session: it queues
the response bytes for :meth:`Session.data_to_send`. Every backend message becomes one event.

Invariants: the state table :data:`_ALLOWED` lists which backend messages each state accepts;
anything else is a :class:`RemoteProtocolError`. Frontend messages may only be sent in the
state that allows them (else :class:`LocalProtocolError`). Server errors become cdcd errors in
exactly one place, :func:`source_error`.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping
from enum import Enum

from cdcd.errors import (
    DefiniteSourceError,
    LocalProtocolError,
    RemoteProtocolError,
)
from cdcd.wire import frontend
from cdcd.wire.auth import (
    AuthenticationError,
    ScramClient,
    choose_sasl_mechanism,
    md5_password,
)
from cdcd.wire.dsn import DEFAULT_GUCS
from cdcd.wire.framing import MessageReader
from cdcd.wire.messages import (
    AuthenticationOk as AuthenticationOk,
)
from cdcd.wire.messages import (
    AuthenticationRequest as AuthenticationRequest,
)
from cdcd.wire.messages import (
    BackendKeyData as BackendKeyData,
)
from cdcd.wire.messages import (
    CommandComplete as CommandComplete,
)
from cdcd.wire.messages import (
    CopyBothResponse as CopyBothResponse,
)
from cdcd.wire.messages import (
    CopyData as CopyData,
)
from cdcd.wire.messages import (
    CopyDone as CopyDone,
)
from cdcd.wire.messages import (
    DataRow as DataRow,
)
from cdcd.wire.messages import (
    EmptyQueryResponse as EmptyQueryResponse,
)
from cdcd.wire.messages import (
    ErrorResponse as ErrorResponse,
)
from cdcd.wire.messages import (
    Event as Event,
)
from cdcd.wire.messages import (
    NegotiateProtocolVersion as NegotiateProtocolVersion,
)
from cdcd.wire.messages import (
    NoticeResponse as NoticeResponse,
)
from cdcd.wire.messages import (
    ParameterStatus as ParameterStatus,
)
from cdcd.wire.messages import (
    ReadyForQuery as ReadyForQuery,
)
from cdcd.wire.messages import (
    RowDescription as RowDescription,
)
from cdcd.wire.messages import (
    ServerMessage as ServerMessage,
)
from cdcd.wire.server_errors import SlotExists as SlotExists
from cdcd.wire.server_errors import source_error as source_error

# --------------------------------------------------------------------------- states


class State(Enum):
    NEW = "new"  # nothing sent yet
    AUTHENTICATING = "authenticating"  # StartupMessage sent, until AuthenticationOk
    SETTING_UP = "setting up"  # AuthenticationOk received, until the first ReadyForQuery
    READY = "ready"  # idle: a query may be sent
    QUERY = "query"  # simple query sent, until ReadyForQuery
    COPY_BOTH = "copy both"  # replication stream in both directions
    COPY_CLIENT_DONE = "copy, client done"  # we sent CopyDone; server may still send data
    COPY_SERVER_DONE = "copy, server done"  # server sent CopyDone; we may still send data
    FAILED = "failed"  # a FATAL error during start-up: the server closes the connection
    CLOSED = "closed"  # Terminate sent


#: Backend message tags each state accepts. Notices and parameter changes may come any time.
_ALLOWED: dict[State, bytes] = {
    State.NEW: b"",
    State.AUTHENTICATING: b"REvN",
    State.SETTING_UP: b"SKZEN",
    State.READY: b"SNE",
    State.QUERY: b"TDCIEWZSN",
    # A walsender that shuts down ends the stream with CommandComplete and no CopyDone.
    State.COPY_BOTH: b"dcCENS",
    State.COPY_CLIENT_DONE: b"dcCENS",
    State.COPY_SERVER_DONE: b"ENS",
    State.FAILED: b"EN",
    State.CLOSED: b"",
}


def _cstr(payload: bytes, pos: int) -> tuple[str, int]:
    end = payload.find(b"\x00", pos)
    if end < 0:
        raise RemoteProtocolError("string without terminating NUL")
    return payload[pos:end].decode("utf-8", errors="replace"), end + 1


def parse_server_message(payload: bytes) -> ServerMessage:
    """Parse ErrorResponse/NoticeResponse fields (type byte + string, ended by a NUL)."""
    values: dict[str, str] = {}
    pos = 0
    while pos < len(payload) and payload[pos] != 0:
        kind = chr(payload[pos])
        values[kind], pos = _cstr(payload, pos + 1)
    return ServerMessage(
        severity=values.get("V") or values.get("S") or "ERROR",
        code=values.get("C", "XX000"),
        message=values.get("M", "(no message)"),
        detail=values.get("D"),
        hint=values.get("H"),
        where=values.get("W"),
    )


_VERSION = re.compile(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?")


def server_version_num(text: str) -> int:
    """``server_version`` text to ``server_version_num``: ``18.6`` -> 180006, ``9.6.2`` -> 90602."""
    match = _VERSION.match(text.strip())
    if not match:
        raise RemoteProtocolError(f"unparsable server_version {text!r}")
    major, minor, patch = (int(g) if g else 0 for g in match.groups())
    if major >= 10:
        return major * 10000 + minor
    return major * 10000 + minor * 100 + patch


def startup_parameters(
    *,
    user: str,
    database: str,
    application_name: str = "cdcd",
    extra_gucs: Mapping[str, str] | None = None,
    options: str | None = None,
    replication: str | None = "database",
) -> dict[str, str]:
    """StartupMessage parameters: user, database, ``replication``, names and GUC options.

    GUCs go into ``options`` as ``-c name=value`` with spaces and backslashes escaped the way
    the server splits that string; ``options`` from the DSN (``PGOPTIONS``) comes last.
    """
    gucs = {**DEFAULT_GUCS, **(extra_gucs or {})}
    opts = " ".join(
        f"-c {frontend.escape_option_value(name)}={frontend.escape_option_value(value)}"
        for name, value in gucs.items()
    )
    if options:
        opts = f"{opts} {options}"
    params = {"user": user, "database": database}
    if replication is not None:
        params["replication"] = replication
    params |= {
        "application_name": application_name,
        "client_encoding": "UTF8",
        "options": opts,
    }
    return params


class Session:
    """The protocol state of one connection; feed it bytes, take events, send what it says."""

    __slots__ = (
        "_out",
        "_password",
        "_reader",
        "_scram",
        "_state",
        "backend_pid",
        "database",
        "parameters",
        "startup",
        "user",
    )

    def __init__(
        self,
        *,
        user: str,
        database: str,
        password: str | None = None,
        application_name: str = "cdcd",
        extra_gucs: Mapping[str, str] | None = None,
        options: str | None = None,
        replication: str | None = "database",
    ) -> None:
        self.user = user
        self.database = database
        self._password = password
        self.startup = startup_parameters(
            user=user,
            database=database,
            application_name=application_name,
            extra_gucs=extra_gucs,
            options=options,
            replication=replication,
        )
        self._reader = MessageReader()
        self._out = bytearray()
        self._state = State.NEW
        self._scram: ScramClient | None = None
        self.parameters: dict[str, str] = {}
        self.backend_pid: int | None = None

    def __repr__(self) -> str:
        return f"Session(user={self.user!r}, database={self.database!r}, state={self._state.value})"

    @property
    def state(self) -> State:
        return self._state

    @property
    def server_version(self) -> int:
        """``server_version_num`` from the ``server_version`` ParameterStatus (0 before it)."""
        text = self.parameters.get("server_version")
        return server_version_num(text) if text else 0

    @property
    def buffered(self) -> int:
        """Received bytes not yet turned into events."""
        return self._reader.buffered

    # ------------------------------------------------------------------ sending

    @staticmethod
    def ssl_request() -> bytes:
        return frontend.ssl_request()

    def start(self) -> bytes:
        """The StartupMessage; moves to AUTHENTICATING."""
        self._expect(State.NEW, "send the startup message")
        self._state = State.AUTHENTICATING
        return frontend.startup_message(self.startup)

    def send_query(self, sql: str) -> bytes:
        self._expect(State.READY, "send a query")
        self._state = State.QUERY
        return frontend.query(sql)

    def send_copy_data(self, payload: bytes) -> bytes:
        if self._state not in (State.COPY_BOTH, State.COPY_SERVER_DONE):
            raise LocalProtocolError(f"cannot send CopyData in state {self._state.value}")
        return frontend.copy_data(payload)

    def send_copy_done(self) -> bytes:
        if self._state is State.COPY_BOTH:
            self._state = State.COPY_CLIENT_DONE
        elif self._state is State.COPY_SERVER_DONE:
            self._state = State.QUERY
        else:
            raise LocalProtocolError(f"cannot send CopyDone in state {self._state.value}")
        return frontend.copy_done()

    def send_terminate(self) -> bytes:
        self._state = State.CLOSED
        return frontend.terminate()

    def data_to_send(self) -> bytes:
        """Bytes the session wants sent (authentication responses); empties the queue."""
        data = bytes(self._out)
        self._out.clear()
        return data

    def _expect(self, state: State, action: str) -> None:
        if self._state is not state:
            raise LocalProtocolError(f"cannot {action} in state {self._state.value}")

    # ------------------------------------------------------------------ receiving

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        self._reader.feed(data)

    def next_event(self) -> Event | None:
        """The next event, or None until more bytes arrive."""
        msg = self._reader.next()
        if msg is None:
            return None
        tag, payload = msg
        if tag not in _ALLOWED[self._state]:
            raise RemoteProtocolError(
                f"unexpected message in state {self._state.value}", tag=tag.decode("latin-1")
            )
        try:
            return self._handle(tag, payload)
        except (struct.error, IndexError, UnicodeDecodeError) as exc:
            raise RemoteProtocolError(
                f"malformed message: {exc}", tag=tag.decode("latin-1")
            ) from exc

    def copy_data_run(self) -> list[bytes]:
        """Streaming fast path: the payloads of the CopyData messages at the head of the
        buffer (what :meth:`next_event` would return as :class:`CopyData` events, one by one).
        ``[]`` when the next message is not a complete CopyData, or outside a COPY that lets the
        server send data: then use :meth:`next_event`."""
        if self._state is not State.COPY_BOTH and self._state is not State.COPY_CLIENT_DONE:
            return []
        return self._reader.next_run(b"d")

    def xlog_run(self) -> tuple[list[object], list[int]]:
        """:meth:`copy_data_run` with each XLogData split into ``(wal_start, wal_end,
        send_time, data)`` (:meth:`MessageReader.next_xlog_run`); other payloads as bytes,
        their indexes in the second list."""
        if self._state is not State.COPY_BOTH and self._state is not State.COPY_CLIENT_DONE:
            return [], []
        return self._reader.next_xlog_run()

    def _handle(self, tag: bytes, payload: bytes) -> Event:
        # The hot path (CopyData during streaming) comes first.
        if tag == b"d":
            return CopyData(payload)
        if tag == b"R":
            return self._authentication(payload)
        if tag == b"S":
            name, pos = _cstr(payload, 0)
            value, _ = _cstr(payload, pos)
            self.parameters[name] = value
            return ParameterStatus(name, value)
        if tag == b"K":
            (pid,) = struct.unpack_from("!i", payload)
            self.backend_pid = pid
            return BackendKeyData(pid, payload[4:])
        if tag == b"Z":
            self._state = State.READY
            return ReadyForQuery(chr(payload[0]))
        if tag == b"T":
            return RowDescription(self._row_description(payload))
        if tag == b"D":
            return DataRow(self._data_row(payload))
        if tag == b"C":
            if self._state in (State.COPY_BOTH, State.COPY_CLIENT_DONE, State.COPY_SERVER_DONE):
                self._state = State.QUERY  # the server ended the COPY; ReadyForQuery may follow
            return CommandComplete(_cstr(payload, 0)[0])
        if tag == b"I":
            return EmptyQueryResponse()
        if tag == b"E":
            fields = parse_server_message(payload)
            if self._state in (State.AUTHENTICATING, State.SETTING_UP):
                self._state = State.FAILED
            elif self._state in (State.COPY_BOTH, State.COPY_CLIENT_DONE, State.COPY_SERVER_DONE):
                self._state = State.QUERY  # ReadyForQuery follows an error in COPY
            return ErrorResponse(fields)
        if tag == b"N":
            return NoticeResponse(parse_server_message(payload))
        if tag == b"W":
            fmt, count = struct.unpack_from("!bh", payload)
            formats = struct.unpack_from(f"!{count}h", payload, 3)
            self._state = State.COPY_BOTH
            return CopyBothResponse(fmt, tuple(formats))
        if tag == b"c":
            self._state = (
                State.QUERY if self._state is State.COPY_CLIENT_DONE else State.COPY_SERVER_DONE
            )
            return CopyDone()
        if tag == b"v":
            newest, count = struct.unpack_from("!ii", payload)
            names: list[str] = []
            pos = 8
            for _ in range(count):
                name, pos = _cstr(payload, pos)
                names.append(name)
            return NegotiateProtocolVersion(newest, tuple(names))
        raise RemoteProtocolError("unknown message", tag=tag.decode("latin-1"))

    @staticmethod
    def _row_description(payload: bytes) -> tuple[str, ...]:
        (count,) = struct.unpack_from("!h", payload)
        pos = 2
        names: list[str] = []
        for _ in range(count):
            name, pos = _cstr(payload, pos)
            names.append(name)
            pos += 18  # table oid, column number, type oid, size, modifier, format
        return tuple(names)

    @staticmethod
    def _data_row(payload: bytes) -> tuple[str | None, ...]:
        (count,) = struct.unpack_from("!h", payload)
        pos = 2
        values: list[str | None] = []
        for _ in range(count):
            (size,) = struct.unpack_from("!i", payload, pos)
            pos += 4
            if size < 0:
                values.append(None)
            else:
                values.append(payload[pos : pos + size].decode("utf-8"))
                pos += size
        return tuple(values)

    def _authentication(self, payload: bytes) -> Event:
        (code,) = struct.unpack_from("!i", payload)
        try:
            if code == 0:
                if self._scram is not None and not self._scram.done:
                    raise AuthenticationError(
                        "the server ended SCRAM authentication without proving it knows "
                        "the password"
                    )
                self._state = State.SETTING_UP
                return AuthenticationOk()
            if code == 3:
                self._out += frontend.password_message(self._need_password())
                return AuthenticationRequest("cleartext")
            if code == 5:
                response = md5_password(self.user, self._need_password(), payload[4:8])
                self._out += frontend.password_message(response)
                return AuthenticationRequest("md5")
            if code == 10:
                offered = [m for m in payload[4:].decode("utf-8").split("\x00") if m]
                mechanism = choose_sasl_mechanism(offered)
                self._scram = ScramClient(self._need_password())
                self._out += frontend.sasl_initial_response(mechanism, self._scram.client_first())
                return AuthenticationRequest("sasl", tuple(offered))
            if code == 11:
                if self._scram is None:
                    raise AuthenticationError("SASLContinue without a SASL exchange")
                self._out += frontend.sasl_response(self._scram.client_final(payload[4:]))
                return AuthenticationRequest("sasl-continue")
            if code == 12:
                if self._scram is None:
                    raise AuthenticationError("SASLFinal without a SASL exchange")
                self._scram.verify_server_final(payload[4:])
                return AuthenticationRequest("sasl-final")
        except AuthenticationError as exc:
            raise DefiniteSourceError(
                f"authentication failed for user {self.user!r}: {exc}"
            ) from exc
        methods = {2: "Kerberos V5", 6: "SCM credentials", 7: "GSSAPI", 9: "SSPI"}
        raise DefiniteSourceError(
            f"the server asks user {self.user!r} to authenticate with "
            f"{methods.get(code, f'method {code}')}, which cdcd does not support: "
            "use password, md5 or scram-sha-256 in pg_hba.conf for this connection"
        )

    def _need_password(self) -> str:
        if self._password is None:
            raise DefiniteSourceError(
                f"the server requires a password for user {self.user!r} but none was given: "
                "put it in the DSN, PGPASSWORD or ~/.pgpass"
            )
        return self._password
