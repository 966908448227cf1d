"""The backend messages the session hands out, as small frozen events (PostgreSQL docs,
"Message Formats"), and the fields of ErrorResponse / NoticeResponse."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ServerMessage:
    """The fields of an ErrorResponse or NoticeResponse (55.8)."""

    severity: str
    code: str
    message: str
    detail: str | None = None
    hint: str | None = None
    where: str | None = None

    def __str__(self) -> str:
        text = f"{self.severity}: {self.message} (SQLSTATE {self.code})"
        if self.detail:
            text += f"; DETAIL: {self.detail}"
        if self.hint:
            text += f"; HINT: {self.hint}"
        return text


@dataclass(frozen=True, slots=True)
class AuthenticationOk:
    pass


@dataclass(frozen=True, slots=True)
class AuthenticationRequest:
    """The server asked for credentials; the session has queued the answer.

    ``method``: ``cleartext``, ``md5``, ``sasl`` (``mechanisms`` lists the offer),
    ``sasl-continue`` or ``sasl-final``.
    """

    method: str
    mechanisms: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ParameterStatus:
    name: str
    value: str


@dataclass(frozen=True, slots=True)
class BackendKeyData:
    pid: int
    secret_key: bytes


@dataclass(frozen=True, slots=True)
class ReadyForQuery:
    status: str  # 'I' idle, 'T' in transaction, 'E' failed transaction


@dataclass(frozen=True, slots=True)
class RowDescription:
    columns: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class DataRow:
    values: tuple[str | None, ...]


@dataclass(frozen=True, slots=True)
class CommandComplete:
    tag: str


@dataclass(frozen=True, slots=True)
class EmptyQueryResponse:
    pass


@dataclass(frozen=True, slots=True)
class ErrorResponse:
    fields: ServerMessage


@dataclass(frozen=True, slots=True)
class NoticeResponse:
    fields: ServerMessage


@dataclass(frozen=True, slots=True)
class CopyBothResponse:
    format: int
    column_formats: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CopyData:
    payload: bytes


@dataclass(frozen=True, slots=True)
class CopyDone:
    pass


@dataclass(frozen=True, slots=True)
class NegotiateProtocolVersion:
    newest_minor: int
    unrecognized: tuple[str, ...]


Event = (
    AuthenticationOk
    | AuthenticationRequest
    | ParameterStatus
    | BackendKeyData
    | ReadyForQuery
    | RowDescription
    | DataRow
    | CommandComplete
    | EmptyQueryResponse
    | ErrorResponse
    | NoticeResponse
    | CopyBothResponse
    | CopyData
    | CopyDone
    | NegotiateProtocolVersion
)
