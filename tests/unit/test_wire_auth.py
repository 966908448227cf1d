"""Authentication, frontend messages and the session state machine, on synthetic bytes."""

from __future__ import annotations

import base64
import hashlib
import hmac
import struct

import pytest

from cdcd.errors import (
    DefiniteSourceError,
    LocalProtocolError,
    RemoteProtocolError,
    SlotLostError,
    SourceError,
    TransientSourceError,
)
from cdcd.wire import frontend
from cdcd.wire.auth import AuthenticationError, ScramClient, choose_sasl_mechanism, md5_password
from cdcd.wire.framing import frame
from cdcd.wire.session import (
    AuthenticationOk,
    AuthenticationRequest,
    BackendKeyData,
    CommandComplete,
    CopyBothResponse,
    CopyData,
    CopyDone,
    DataRow,
    ErrorResponse,
    NoticeResponse,
    ParameterStatus,
    ReadyForQuery,
    RowDescription,
    ServerMessage,
    Session,
    SlotExists,
    State,
    parse_server_message,
    server_version_num,
    source_error,
    startup_parameters,
)

# --------------------------------------------------------------------------- MD5 / SCRAM


def test_md5_password_matches_postgres_formula() -> None:
    # pg_authid stores md5(password || user): for postgres/postgres that is this value.
    assert hashlib.md5(b"postgrespostgres").hexdigest() == "3175bce1d3201d16594cebf9d7eb3f9d"
    salt = b"\x01\x02\x03\x04"
    expected = "md5" + hashlib.md5(b"3175bce1d3201d16594cebf9d7eb3f9d" + salt).hexdigest()
    assert md5_password("postgres", "postgres", salt) == expected
    assert len(expected) == 35


def test_scram_rfc7677_vector() -> None:
    scram = ScramClient("pencil", nonce="rOprNGfwEbeRWgbNEkqO")
    assert scram.client_first("user") == b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO"
    server_first = (
        b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"
    )
    assert scram.client_final(server_first) == (
        b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
        b"p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ="
    )
    scram.verify_server_final(b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4=")
    assert scram.done


def _server_first_for(client_nonce: str) -> bytes:
    return f"r={client_nonce}srv,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096".encode()


def test_scram_rejects_wrong_server_signature() -> None:
    scram = ScramClient("pencil", nonce="abc")
    scram.client_first()
    scram.client_final(_server_first_for("abc"))
    with pytest.raises(AuthenticationError, match="signature"):
        scram.verify_server_final(b"v=" + base64.b64encode(b"x" * 32))


@pytest.mark.parametrize(
    "server_first",
    [
        b"r=zzz,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096",  # nonce does not extend ours
        b"r=abc,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096",  # nonce not extended at all
        b"r=abcX,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=0",  # iteration count
        b"r=abcX,s=***,i=4096",  # salt not base64
        b"r=abcX,i=4096",  # no salt
        b"garbage",
    ],
)
def test_scram_rejects_bad_server_first(server_first: bytes) -> None:
    scram = ScramClient("pencil", nonce="abc")
    scram.client_first()
    with pytest.raises(AuthenticationError):
        scram.client_final(server_first)


def test_scram_server_error_attribute() -> None:
    scram = ScramClient("pencil", nonce="abc")
    scram.client_first()
    scram.client_final(_server_first_for("abc"))
    with pytest.raises(AuthenticationError, match="invalid-proof"):
        scram.verify_server_final(b"e=invalid-proof")


def test_scram_order_enforced() -> None:
    scram = ScramClient("pencil")
    with pytest.raises(AuthenticationError):
        scram.client_final(b"r=x,s=AA==,i=1")
    with pytest.raises(AuthenticationError):
        scram.verify_server_final(b"v=AA==")


def test_mechanism_choice_prefers_plain_scram_over_plus() -> None:
    assert choose_sasl_mechanism(["SCRAM-SHA-256-PLUS", "SCRAM-SHA-256"]) == "SCRAM-SHA-256"
    with pytest.raises(AuthenticationError, match="OAUTHBEARER"):
        choose_sasl_mechanism(["OAUTHBEARER"])


# --------------------------------------------------------------------------- frontend bytes


def test_ssl_request_bytes() -> None:
    assert frontend.ssl_request() == b"\x00\x00\x00\x08\x04\xd2\x16\x2f"


def test_startup_message_bytes() -> None:
    params = startup_parameters(user="cdc", database="shop", application_name="app")
    msg = frontend.startup_message(params)
    (length, version) = struct.unpack_from("!II", msg)
    assert length == len(msg)
    assert version == 196608
    body = msg[8:]
    assert body.endswith(b"\x00\x00")
    items = body[:-2].split(b"\x00")
    pairs = dict(zip(items[::2], items[1::2], strict=True))
    assert pairs[b"user"] == b"cdc"
    assert pairs[b"database"] == b"shop"
    assert pairs[b"replication"] == b"database"
    assert pairs[b"application_name"] == b"app"
    assert pairs[b"client_encoding"] == b"UTF8"
    assert pairs[b"options"] == (
        b"-c DateStyle=ISO,MDY -c TimeZone=UTC -c IntervalStyle=iso_8601 "
        b"-c extra_float_digits=3 -c bytea_output=hex -c lc_monetary=C"
    )


def test_startup_options_escape_spaces_and_backslashes() -> None:
    params = startup_parameters(
        user="u",
        database="d",
        extra_gucs={"search_path": "a b", "x.y": "c\\d", "TimeZone": "Europe/Paris"},
        options="-c work_mem=64MB",
    )
    opts = params["options"]
    assert "-c search_path=a\\ b" in opts
    assert "-c x.y=c\\\\d" in opts
    assert "TimeZone=Europe/Paris" in opts and "TimeZone=UTC" not in opts
    assert opts.endswith(" -c work_mem=64MB")


def test_nul_in_strings_is_local_error() -> None:
    with pytest.raises(LocalProtocolError):
        frontend.query("SELECT 1\x00")


def test_quoting() -> None:
    assert frontend.quote_ident('a"b') == '"a""b"'
    assert frontend.quote_literal("it's") == "'it''s'"
    assert frontend.quote_qualified("public.Orders") == '"public"."Orders"'
    assert frontend.quote_qualified('"a.b"."c""d"') == '"a.b"."c""d"'
    assert frontend.quote_qualified("t") == '"t"'


# --------------------------------------------------------------------------- session


def _auth(code: int, data: bytes = b"") -> bytes:
    return frame(b"R", struct.pack("!i", code) + data)


def _param(name: str, value: str) -> bytes:
    return frame(b"S", name.encode() + b"\x00" + value.encode() + b"\x00")


def _ready() -> bytes:
    return frame(b"Z", b"I")


def _error(code: str, message: str, severity: str = "ERROR", **extra: str) -> bytes:
    fields = b"S" + severity.encode() + b"\x00V" + severity.encode() + b"\x00"
    fields += b"C" + code.encode() + b"\x00M" + message.encode() + b"\x00"
    for key, value in extra.items():
        fields += {"detail": b"D", "hint": b"H"}[key] + value.encode() + b"\x00"
    return frame(b"E", fields + b"\x00")


def _events(session: Session, data: bytes, chunk: int | None = None) -> list[object]:
    """Feed ``data`` whole or ``chunk`` bytes at a time; collect the events."""
    out: list[object] = []
    pieces = [data] if chunk is None else [data[i : i + chunk] for i in range(0, len(data), chunk)]
    for piece in pieces:
        session.receive_data(piece)
        while (event := session.next_event()) is not None:
            out.append(event)
    return out


def _scram_server(password: str, client_first: bytes) -> tuple[bytes, object]:
    """A minimal SCRAM server: returns server-first and a function checking client-final."""
    bare = client_first[3:].decode()
    nonce = dict(p.split("=", 1) for p in bare.split(","))["r"] + "SERVER"
    salt = b"saltsalt"
    server_first = f"r={nonce},s={base64.b64encode(salt).decode()},i=4096"
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, 4096)

    def final(client_final: bytes) -> bytes:
        text = client_final.decode()
        without_proof, _, proof = text.rpartition(",p=")
        auth_message = f"{bare},{server_first},{without_proof}".encode()
        client_key = hmac.new(salted, b"Client Key", "sha256").digest()
        stored = hashlib.sha256(client_key).digest()
        sig = hmac.new(stored, auth_message, "sha256").digest()
        recovered = bytes(a ^ b for a, b in zip(base64.b64decode(proof), sig, strict=True))
        assert hashlib.sha256(recovered).digest() == stored, "bad client proof"
        server_key = hmac.new(salted, b"Server Key", "sha256").digest()
        return b"v=" + base64.b64encode(hmac.new(server_key, auth_message, "sha256").digest())

    return server_first.encode(), final


def _parse_frontend(data: bytes) -> list[tuple[bytes, bytes]]:
    out = []
    while data:
        tag, length = data[:1], struct.unpack_from("!I", data, 1)[0]
        out.append((tag, data[5 : 1 + length]))
        data = data[1 + length :]
    return out


@pytest.mark.parametrize("chunk", [None, 1, 7])
def test_session_scram_handshake_to_ready(chunk: int | None) -> None:
    session = Session(user="cdc", database="shop", password="s3cret")
    session.start()
    assert session.state is State.AUTHENTICATING
    events = _events(session, _auth(10, b"SCRAM-SHA-256-PLUS\x00SCRAM-SHA-256\x00\x00"), chunk)
    assert events == [AuthenticationRequest("sasl", ("SCRAM-SHA-256-PLUS", "SCRAM-SHA-256"))]
    [(tag, body)] = _parse_frontend(session.data_to_send())
    assert tag == b"p" and body.startswith(b"SCRAM-SHA-256\x00")
    client_first = body[len(b"SCRAM-SHA-256\x00") + 4 :]
    server_first, final = _scram_server("s3cret", client_first)
    _events(session, _auth(11, server_first), chunk)
    [(tag, client_final)] = _parse_frontend(session.data_to_send())
    server_final = final(client_final)  # type: ignore[operator]
    tail = (
        _auth(12, server_final)
        + _auth(0)
        + _param("server_version", "18.6")
        + frame(b"K", struct.pack("!i", 4242) + b"\x00\x00\x00\x07")
        + _ready()
    )
    events = _events(session, tail, chunk)
    assert events == [
        AuthenticationRequest("sasl-final"),
        AuthenticationOk(),
        ParameterStatus("server_version", "18.6"),
        BackendKeyData(4242, b"\x00\x00\x00\x07"),
        ReadyForQuery("I"),
    ]
    assert session.state is State.READY
    assert session.server_version == 180006
    assert session.backend_pid == 4242


def test_session_rejects_authok_before_scram_final() -> None:
    session = Session(user="cdc", database="shop", password="pw")
    session.start()
    _events(session, _auth(10, b"SCRAM-SHA-256\x00\x00"))
    with pytest.raises(DefiniteSourceError, match="without proving"):
        _events(session, _auth(0))


def test_session_md5_and_cleartext() -> None:
    session = Session(user="u", database="d", password="pw")
    session.start()
    _events(session, _auth(5, b"abcd"))
    assert _parse_frontend(session.data_to_send()) == [
        (b"p", md5_password("u", "pw", b"abcd").encode() + b"\x00")
    ]
    session = Session(user="u", database="d", password="pw")
    session.start()
    _events(session, _auth(3))
    assert _parse_frontend(session.data_to_send()) == [(b"p", b"pw\x00")]


def test_session_password_missing_and_unsupported_method() -> None:
    session = Session(user="u", database="d")
    session.start()
    with pytest.raises(DefiniteSourceError, match="requires a password"):
        _events(session, _auth(5, b"abcd"))
    session = Session(user="u", database="d", password="x")
    session.start()
    with pytest.raises(DefiniteSourceError, match="GSSAPI"):
        _events(session, _auth(7))


def _ready_session() -> Session:
    session = Session(user="u", database="d")
    session.start()
    _events(
        session, _auth(0) + _param("server_version", "15.13 (Debian 15.13-0+deb12u1)") + _ready()
    )
    return session


def test_session_simple_query_rows() -> None:
    session = _ready_session()
    assert session.server_version == 150013
    sent = session.send_query("IDENTIFY_SYSTEM")
    assert sent == b"Q" + struct.pack("!I", 4 + 16) + b"IDENTIFY_SYSTEM\x00"
    row_desc = struct.pack("!h", 2)
    for name in (b"systemid", b"xlogpos"):
        row_desc += name + b"\x00" + struct.pack("!ihihih", 0, 0, 25, -1, -1, 0)
    data_row = struct.pack("!h", 2) + struct.pack("!i", 3) + b"123" + struct.pack("!i", -1)
    events = _events(
        session,
        frame(b"T", row_desc)
        + frame(b"D", data_row)
        + frame(b"C", b"IDENTIFY_SYSTEM\x00")
        + _ready(),
        chunk=3,
    )
    assert events == [
        RowDescription(("systemid", "xlogpos")),
        DataRow(("123", None)),
        CommandComplete("IDENTIFY_SYSTEM"),
        ReadyForQuery("I"),
    ]


def test_session_copy_both_flow_and_client_copy_done() -> None:
    session = _ready_session()
    session.send_query("START_REPLICATION ...")
    events = _events(
        session,
        frame(b"W", b"\x00\x00\x00")
        + frame(b"d", b"k" + bytes(17))
        + frame(b"N", b"SNOTICE\x00Mhi\x00\x00"),
    )
    assert events[0] == CopyBothResponse(0, ())
    assert events[1] == CopyData(b"k" + bytes(17))
    assert isinstance(events[2], NoticeResponse) and events[2].fields.message == "hi"
    assert session.state is State.COPY_BOTH
    assert session.send_copy_data(b"r") == frame(b"d", b"r")
    session.send_copy_done()
    assert session.state is State.COPY_CLIENT_DONE
    with pytest.raises(LocalProtocolError):
        session.send_copy_data(b"r")
    events = _events(
        session,
        frame(b"d", b"w" + bytes(24))
        + frame(b"c")
        + frame(b"C", b"START_STREAMING\x00")
        + _ready(),
    )
    assert [type(e) for e in events] == [CopyData, CopyDone, CommandComplete, ReadyForQuery]
    assert session.state is State.READY


def test_session_server_copy_done_first() -> None:
    session = _ready_session()
    session.send_query("START_REPLICATION ...")
    _events(session, frame(b"W", b"\x00\x00\x00") + frame(b"c"))
    assert session.state is State.COPY_SERVER_DONE
    session.send_copy_data(b"r")  # still allowed: our direction is open
    session.send_copy_done()
    assert session.state is State.QUERY


def test_session_unexpected_messages() -> None:
    session = _ready_session()
    with pytest.raises(RemoteProtocolError, match="unexpected"):
        _events(session, frame(b"d", b"w"))
    with pytest.raises(LocalProtocolError):
        _ready_session().send_copy_done()
    session = _ready_session()
    session.send_query("SELECT 1")
    with pytest.raises(RemoteProtocolError, match="malformed"):
        _events(session, frame(b"D", b"\x00\x01\x00\x00"))


def test_session_error_during_copy_returns_to_query_state() -> None:
    session = _ready_session()
    session.send_query("START_REPLICATION ...")
    events = _events(
        session, frame(b"W", b"\x00\x00\x00") + _error("42704", 'publication "p" does not exist')
    )
    assert isinstance(events[-1], ErrorResponse)
    assert session.state is State.QUERY
    _events(session, _ready())
    assert session.state is State.READY


# --------------------------------------------------------------------------- errors


def test_parse_server_message_fields() -> None:
    payload = _error("55006", "slot busy", severity="ERROR", detail="d1", hint="h1")[5:]
    msg = parse_server_message(payload)
    assert msg == ServerMessage("ERROR", "55006", "slot busy", detail="d1", hint="h1")
    assert "SQLSTATE 55006" in str(msg) and "DETAIL: d1" in str(msg)


@pytest.mark.parametrize(
    ("code", "message", "kind", "words"),
    [
        (
            "28P01",
            'password authentication failed for user "cdc"',
            DefiniteSourceError,
            ["authentication failed", "'cdc'"],
        ),
        (
            "28000",
            "no pg_hba.conf entry for replication connection",
            DefiniteSourceError,
            ["pg_hba.conf"],
        ),
        ("42501", "permission denied to start WAL sender", DefiniteSourceError, ["REPLICATION"]),
        (
            "XX000",
            "must be superuser or replication role to start walsender",
            DefiniteSourceError,
            ["REPLICATION"],
        ),
        (
            "55000",
            'can no longer get changes from replication slot "s"',
            SlotLostError,
            ["re-create", "snapshot"],
        ),
        (
            "55000",
            'logical decoding requires "wal_level" >= "logical"',
            DefiniteSourceError,
            ["wal_level=logical", "restart"],
        ),
        (
            "42704",
            'replication slot "nope" does not exist',
            SlotLostError,
            ["does not exist", "Create it", "on_slot_lost: recreate"],
        ),
        ("42704", 'publication "p" does not exist', DefiniteSourceError, ["Create it"]),
        ("42710", 'replication slot "s" already exists', SlotExists, ["already exists"]),
        (
            "55006",
            'replication slot "s" is active for PID 123',
            TransientSourceError,
            ["active for PID", "retry"],
        ),
        (
            "57P01",
            "terminating connection due to administrator command",
            TransientSourceError,
            ["reconnect"],
        ),
        ("57P03", "the database system is starting up", TransientSourceError, ["reconnect"]),
        ("08P01", "invalid message", TransientSourceError, ["08P01"]),
        (
            "53400",
            "all replication slots are in use",
            DefiniteSourceError,
            ["max_replication_slots"],
        ),
        ("22023", "proto_version out of range", SourceError, ["SQLSTATE 22023", "proto_version"]),
    ],
)
def test_sqlstate_mapping(
    code: str, message: str, kind: type[SourceError], words: list[str]
) -> None:
    err = source_error(ServerMessage("ERROR", code, message), user="cdc", context="slot 's'")
    assert type(err) is kind
    text = str(err)
    assert text.startswith("slot 's': ")
    assert message in text
    for word in words:
        assert word in text


def test_slot_exists_is_a_source_error() -> None:
    assert issubclass(SlotExists, SourceError)


@pytest.mark.parametrize(
    ("text", "num"),
    [
        ("18.6", 180006),
        ("16.2", 160002),
        ("15.13 (Debian 15.13-0+deb12u1)", 150013),
        ("9.6.24", 90624),
        ("17beta1", 170000),
    ],
)
def test_server_version_num(text: str, num: int) -> None:
    assert server_version_num(text) == num
