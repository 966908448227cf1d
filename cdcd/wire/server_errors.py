"""Server errors (ErrorResponse) classified into cdcd's errors: the one place SQLSTATEs are
mapped, each to a definite or a transient :mod:`cdcd.errors` class with what to do."""

from __future__ import annotations

from cdcd.errors import DefiniteSourceError, SlotLostError, SourceError, TransientSourceError
from cdcd.wire import frontend
from cdcd.wire.messages import ServerMessage


class SlotExists(DefiniteSourceError):
    """CREATE_REPLICATION_SLOT found a slot of that name: callers may treat it as done."""


_SLOT_LOST = ("can no longer get changes", "can no longer access", "invalidated")


def source_error(err: ServerMessage, *, user: str = "", context: str = "") -> SourceError:
    """The cdcd error for a server ErrorResponse: the one place SQLSTATEs are classified.

    ``context`` names what was being done (``START_REPLICATION SLOT "x"``) and is prefixed to
    the message; the server's own text, detail and hint follow, then what to do.
    """
    code = err.code
    text = err.message
    if err.detail:
        text += f" (DETAIL: {err.detail})"
    if err.hint:
        text += f" (HINT: {err.hint})"
    head = f"{context}: " if context else ""
    lowered = err.message.lower()

    if code in ("28P01", "28000"):
        return DefiniteSourceError(
            f"{head}authentication failed for user {user!r}: {text}. Check the password "
            "(DSN, PGPASSWORD or ~/.pgpass) and that pg_hba.conf allows this user, database "
            "and address with a password method"
        )
    if code == "42501" or "must be superuser or replication role" in lowered:
        return DefiniteSourceError(
            f"{head}permission denied for user {user!r}: {text}. Grant it: "
            f"ALTER ROLE {frontend.quote_ident(user or 'cdc')} REPLICATION (and CREATE on the "
            "database to create publications)"
        )
    if code == "55000":
        if any(s in f"{lowered} {err.detail or ''}".lower() for s in _SLOT_LOST):
            return SlotLostError(
                f"{head}{text}. The slot was invalidated (it fell behind "
                "max_slot_wal_keep_size or was otherwise lost): drop and re-create the slot "
                "and take a new snapshot; changes in between are gone"
            )
        if "wal_level" in lowered or "logical decoding requires" in lowered:
            return DefiniteSourceError(
                f"{head}{text}. Set wal_level=logical in postgresql.conf and restart the server"
            )
        return DefiniteSourceError(f"{head}{text} (SQLSTATE 55000): fix the server state first")
    if code == "42704" and "replication slot" in lowered:
        return SlotLostError(
            f"{head}{text}. Create it (cdcd slot create, or source.create_slot), or set "
            "source.on_slot_lost: recreate if it was lost (docs/high-availability.md)",
            reason="missing",
        )
    if code == "42704":
        return DefiniteSourceError(
            f"{head}{text}. Create it (cdcd slot create, or create_slot/create_publication in "
            "the configuration) or fix the name in the configuration"
        )
    if code in ("42P01", "3F000"):
        return DefiniteSourceError(
            f"{head}{text}. Check the table names (source.tables) and that they exist"
        )
    if code == "42710" and "replication slot" in lowered:
        return SlotExists(f"{head}{text}")
    if code == "55006":
        return TransientSourceError(
            f"{head}{text}. Another consumer is using the slot (see pg_stat_replication); "
            "cdcd will retry, stop the other consumer if it should not run"
        )
    if code == "53400":
        return DefiniteSourceError(
            f"{head}{text}. Raise the server limit (max_replication_slots / max_wal_senders) "
            "or drop unused slots"
        )
    if code == "3D000":
        return DefiniteSourceError(f"{head}{text}. Fix dbname in the DSN")
    if code in ("57P01", "57P02", "57P03", "57P05", "53300", "57014") or code.startswith("08"):
        return TransientSourceError(f"{head}{text} (SQLSTATE {code}); will reconnect")
    return SourceError(f"{head}server error SQLSTATE {code}: {text}")
