"""The public event type sinks receive: :class:`ChangeEvent` (see ``docs/sinks.md``).

Its fields and methods are documented in ``docs/sinks.md`` and the README's "Change events"
section; the event's JSON form is the contract consumers rely on.
"""

from cdcd.sinks.encoding import UNCHANGED_TOAST, ChangeEvent

__all__ = ["UNCHANGED_TOAST", "ChangeEvent"]
