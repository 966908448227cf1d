"""Which regular transactions the assembler may release in parts (docs/assembler.md, "Parts").

Plain data, read by the assembler at each Begin and kept up to date by the pipeline
(:mod:`cdcd.pipeline.stream`, the handover): the assembler asks nothing of its caller.
"""

from __future__ import annotations

__all__ = ["PartPolicy"]


class PartPolicy:
    """Which regular transactions may be released in parts, by commit LSN, read at each Begin:
    none past ``until``, ``resume`` always, none committing before ``since``, none while
    ``hold``."""

    __slots__ = ("hold", "resume", "since", "until")

    def __init__(self) -> None:
        self.until: int | None = None  # --endpos: past it, never handed
        self.resume: int | None = None  # being handed in parts, resent after a reconnect
        self.since = 0  # the end of the last transaction queued: before it, a resend
        self.hold = False  # an incremental snapshot's watermark window is open

    def allows(self, commit_lsn: int) -> bool:
        if self.until is not None and commit_lsn > self.until:
            return False
        if commit_lsn == self.resume:
            return True
        return commit_lsn >= self.since and not self.hold
