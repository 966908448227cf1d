"""Signals: who may ask a running daemon for an incremental snapshot, and how it checks.

``cdcd snapshot --table`` writes a transactional logical message with the prefix
``cdcd-signal`` (:data:`SIGNAL`); every cdcd streaming from the
database sees it in commit order. Any role that can connect may write such a message
(``pg_logical_emit_message`` is granted to PUBLIC), so the message alone proves nothing. Each
signal therefore names the slot it is for and carries an HMAC (SHA-256) made with a key only
those allowed to ask hold::

    {"v": 1, "slot": "cdcd", "tables": ["public.t"], "id": "<128 random bits, hex>",
     "mac": "<hex HMAC-SHA256 of the JSON of the other four fields, keys sorted>"}

The key (:func:`signal_key`): ``snapshot.signal_key`` (e.g. ``${CDCD_SIGNAL_KEY}``), else the
environment variable ``CDCD_SIGNAL_KEY``, else a random key in ``<state_dir>/<slot>.signal-key``
(mode 0600), made by whichever of the daemon and ``cdcd snapshot`` needs it first: by default,
whoever may read cdcd's state directory may ask, and nobody else.

Why an HMAC rather than a signal table (Debezium's way, authorised by the table's INSERT
privilege): it needs no table on the source, no change to the publication (a signal table must
be published, and a ``FOR TABLE`` publication the DBA owns would have to list it) and no grant;
and it rides the same logical messages as the watermarks. What it does not give: telling
senders apart by their database role (share the key only with those allowed).

A signal for another slot is skipped quietly (several daemons share a database); one without a
valid MAC, or malformed, is logged and ignored. Replays: a signal's ``id`` is taken at most
once (the daemon keeps the last :data:`REMEMBERED` ids), and a signal the server sends again
after a restart is skipped by its position. This module does no I/O but :func:`signal_key`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

#: the prefix of a signal's logical message (a watermark's is ``cdcd-watermark``)
SIGNAL = "cdcd-signal"
#: the environment variable holding the key when ``snapshot.signal_key`` is not set
KEY_ENV = "CDCD_SIGNAL_KEY"
#: signal ids a daemon remembers as taken
REMEMBERED = 256


def key_path(state_dir: Path, slot: str) -> Path:
    return state_dir / f"{slot}.signal-key"


def signal_key(configured: str | None, state_dir: Path, slot: str) -> tuple[bytes, Path | None]:
    """The key signals are signed with, and the key file when it was made just now: the
    configured key, else :data:`KEY_ENV`, else the key file (made if missing)."""
    if configured:
        return configured.encode(), None
    from_env = os.environ.get(KEY_ENV)
    if from_env:
        return from_env.encode(), None
    path = key_path(state_dir, slot)
    try:
        return path.read_bytes().strip(), None
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    key = secrets.token_hex(32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(key + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    try:
        os.link(tmp, path)  # another process may have made one meanwhile: keep theirs
        made: Path | None = path
    except FileExistsError:
        made = None
    finally:
        tmp.unlink()
    return path.read_bytes().strip(), made


def _mac(key: bytes, fields: dict[str, object]) -> str:
    body = json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def sign(key: bytes, slot: str, tables: list[str]) -> str:
    """The content of a signal asking the daemon on ``slot`` to snapshot ``tables``."""
    fields: dict[str, object] = {
        "v": 1,
        "slot": slot,
        "tables": tables,
        "id": secrets.token_hex(16),
    }
    return json.dumps({**fields, "mac": _mac(key, fields)})


@dataclass(frozen=True, slots=True)
class Verdict:
    """What a signal asks for (``tables``, None when refused) and why it is refused: ``why``
    is empty for an accepted signal; ``other_slot`` marks one meant for another daemon."""

    tables: list[str] | None
    id: str = ""
    why: str = ""
    other_slot: bool = False


def verify(key: bytes, slot: str, content: bytes | str) -> Verdict:
    """Check ``content`` (a signal message's) against ``key`` and this daemon's ``slot``."""
    try:
        payload = json.loads(content)
    except ValueError:
        return Verdict(None, why="not JSON")
    if not isinstance(payload, dict):
        return Verdict(None, why="not a JSON object")
    tables, target, ident, mac = (payload.get(k) for k in ("tables", "slot", "id", "mac"))
    if not isinstance(target, str) or not isinstance(mac, str) or not isinstance(ident, str):
        return Verdict(None, why="unsigned (no slot, id or mac): from an older cdcd or forged")
    if target != slot:
        return Verdict(None, ident, f"for slot {target!r}", other_slot=True)
    fields = {k: v for k, v in payload.items() if k != "mac"}
    if set(fields) != {"v", "slot", "tables", "id"} or not hmac.compare_digest(
        _mac(key, fields), mac
    ):
        return Verdict(None, ident, "its mac does not match this daemon's signal key")
    if not isinstance(tables, list) or not all(isinstance(t, str) for t in tables) or not tables:
        return Verdict(None, ident, "tables is not a list of table names")
    return Verdict(tables, ident)
