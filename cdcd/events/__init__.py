"""Change events: the public type sinks receive (:class:`ChangeEvent`, ``docs/sinks.md``) and the
encoder that makes them from committed transactions (:mod:`cdcd.events.encoder`)."""

from cdcd.events.change_event import UNCHANGED_TOAST, ChangeEvent
from cdcd.events.context import SinkContext

__all__ = ["UNCHANGED_TOAST", "ChangeEvent", "SinkContext"]
