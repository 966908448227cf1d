"""Password authentication: MD5 and SCRAM-SHA-256 (client side), as pure functions.

PostgreSQL docs, "Password Authentication" (21.5) and "SASL Authentication" (protocol
section 55.3); RFC 5802 (SCRAM) and RFC 7677 (SCRAM-SHA-256).

* MD5: ``"md5" + md5(md5(password + user).hex + salt).hex``.
* SCRAM-SHA-256 without channel binding (GS2 header ``n,,``). PostgreSQL ignores the user
  name in client-first (it takes the startup user), so it is sent empty as libpq does. If the
  server also offers ``SCRAM-SHA-256-PLUS`` we still choose plain ``SCRAM-SHA-256``.

Invariants: :class:`ScramClient` moves strictly client-first -> server-first -> client-final
-> server-final; the server's nonce must extend ours, the iteration count must be positive,
and the server signature must verify, otherwise :class:`AuthenticationError` (the server
could not prove it knows the password: never continue on such a connection).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import unicodedata

SCRAM_SHA_256 = "SCRAM-SHA-256"
_GS2_HEADER = "n,,"


class AuthenticationError(Exception):
    """The authentication exchange itself went wrong (bad server message or signature)."""


def md5_password(user: str, password: str, salt: bytes) -> str:
    """The response to AuthenticationMD5Password (without the trailing NUL)."""
    inner = hashlib.md5(password.encode() + user.encode()).hexdigest()
    return "md5" + hashlib.md5(inner.encode() + salt).hexdigest()


def choose_sasl_mechanism(offered: list[str]) -> str:
    """Pick SCRAM-SHA-256 from the server's list; AuthenticationError if it is absent."""
    if SCRAM_SHA_256 in offered:
        return SCRAM_SHA_256
    raise AuthenticationError(
        f"the server offers SASL mechanisms {offered!r}, none of which cdcd supports "
        f"(cdcd speaks {SCRAM_SHA_256})"
    )


def saslprep(password: str) -> str:
    """SASLprep (RFC 4013) as PostgreSQL applies it: normalise if possible, else use as is.

    PostgreSQL (src/common/saslprep.c) falls back to the raw bytes when the password is not
    a valid SASLprep string, so this does the same for prohibited characters.
    """
    mapped = "".join(
        " " if unicodedata.category(ch) == "Zs" and ch != " " else ch
        for ch in password
        if ch not in "\u00ad\u034f\u1806\u180b\u180c\u180d\u200b\u200c\u200d\u2060\ufeff"
        and not ("\ufe00" <= ch <= "\ufe0f")
    )
    normalised = unicodedata.normalize("NFKC", mapped)
    for ch in normalised:
        if unicodedata.category(ch) in ("Cc", "Cs", "Co", "Cn") and ch not in "\t\n\r":
            return password
    return normalised


def _hmac(key: bytes, msg: bytes) -> bytes:
    return hmac.new(key, msg, hashlib.sha256).digest()


def _parse_attributes(message: str) -> dict[str, str]:
    attrs: dict[str, str] = {}
    for part in message.split(","):
        key, eq, value = part.partition("=")
        if len(key) != 1 or not eq:
            raise AuthenticationError(f"malformed SCRAM message from the server: {message!r}")
        attrs[key] = value
    return attrs


class ScramClient:
    """One SCRAM-SHA-256 exchange.

    ::

        scram = ScramClient(password)
        send(scram.client_first())                 # SASLInitialResponse data
        send(scram.client_final(server_first))     # SASLResponse data
        scram.verify_server_final(server_final)    # AuthenticationSASLFinal data
    """

    __slots__ = (
        "_auth_message",
        "_client_first_bare",
        "_nonce",
        "_password",
        "_server_key",
        "_state",
    )

    def __init__(self, password: str, *, nonce: str | None = None) -> None:
        self._password = saslprep(password).encode("utf-8")
        self._nonce = (
            nonce if nonce is not None else base64.b64encode(secrets.token_bytes(18)).decode()
        )
        self._client_first_bare = f"n=,r={self._nonce}"
        self._auth_message = b""
        self._server_key = b""
        self._state = "initial"

    def client_first(self, user: str = "") -> bytes:
        """client-first-message. ``user`` defaults to empty (PostgreSQL ignores it)."""
        if self._state != "initial":
            raise AuthenticationError("SCRAM client-first requested twice")
        name = user.replace("=", "=3D").replace(",", "=2C")
        self._client_first_bare = f"n={name},r={self._nonce}"
        self._state = "first-sent"
        return (_GS2_HEADER + self._client_first_bare).encode()

    def client_final(self, server_first: bytes) -> bytes:
        """Parse server-first-message and return client-final-message with the proof."""
        if self._state != "first-sent":
            raise AuthenticationError("SCRAM server-first arrived out of order")
        text = server_first.decode("utf-8", errors="replace")
        attrs = _parse_attributes(text)
        try:
            nonce, salt_b64, iter_text = attrs["r"], attrs["s"], attrs["i"]
        except KeyError:
            raise AuthenticationError(f"SCRAM server-first lacks r/s/i: {text!r}") from None
        if not nonce.startswith(self._nonce) or len(nonce) <= len(self._nonce):
            raise AuthenticationError("SCRAM server nonce does not extend the client nonce")
        try:
            salt = base64.b64decode(salt_b64, validate=True)
            iterations = int(iter_text)
        except ValueError:
            raise AuthenticationError(
                f"SCRAM server-first has a bad salt or count: {text!r}"
            ) from None
        if iterations <= 0:
            raise AuthenticationError(f"SCRAM iteration count {iterations} is not positive")

        salted = hashlib.pbkdf2_hmac("sha256", self._password, salt, iterations)
        client_key = _hmac(salted, b"Client Key")
        stored_key = hashlib.sha256(client_key).digest()
        self._server_key = _hmac(salted, b"Server Key")

        channel = base64.b64encode(_GS2_HEADER.encode()).decode()
        without_proof = f"c={channel},r={nonce}"
        self._auth_message = f"{self._client_first_bare},{text},{without_proof}".encode()
        signature = _hmac(stored_key, self._auth_message)
        proof = bytes(a ^ b for a, b in zip(client_key, signature, strict=True))
        self._state = "final-sent"
        return f"{without_proof},p={base64.b64encode(proof).decode()}".encode()

    def verify_server_final(self, server_final: bytes) -> None:
        """Check server-final-message's signature; AuthenticationError when it is wrong."""
        if self._state != "final-sent":
            raise AuthenticationError("SCRAM server-final arrived out of order")
        text = server_final.decode("utf-8", errors="replace")
        attrs = _parse_attributes(text)
        if "e" in attrs:
            raise AuthenticationError(f"SCRAM authentication failed on the server: {attrs['e']}")
        expected = base64.b64encode(_hmac(self._server_key, self._auth_message)).decode()
        if not hmac.compare_digest(attrs.get("v", ""), expected):
            raise AuthenticationError(
                "the server's SCRAM signature is wrong: it does not know the password "
                "(a man in the middle?)"
            )
        self._state = "done"

    @property
    def done(self) -> bool:
        return self._state == "done"
