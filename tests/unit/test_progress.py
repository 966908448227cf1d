"""cdcd.pipeline.progress: scenario tables (event sequence -> confirmable LSN) and a property
test on a model of the WAL, the reader, reconnects and sinks that make things durable."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdcd.pipeline.progress import ProgressTracker

# Each scenario: (name, sinks, [(method, *args) ...], in-flight ceiling, expected confirmable).
# Methods are ProgressTracker's; "confirm" records the answer at that point like the acker does.
# The ceiling is the assembler's and the first LSN of a transaction being handed in parts
# (cdcd.pipeline.stream.Handover.ceiling).
SCENARIOS = [
    ("nothing yet", 1, [("session_started",)], None, 0),
    (
        "keepalive on an idle slot",
        1,
        [("session_started",), ("keepalive", 500), ("streamed", 500)],
        None,
        500,
    ),
    (
        "durable transaction",
        1,
        [("session_started",), ("queued", 160), ("streamed", 160), ("durable", 0, 160)],
        None,
        160,
    ),
    (
        "queued, not durable: the keepalive does not count",
        1,
        [("session_started",), ("queued", 160), ("keepalive", 400), ("streamed", 400)],
        None,
        0,
    ),
    (
        # bug found by the real-server tests: a keepalive while a transaction sits between the
        # queue and the writer (taken from the queue, not yet marked busy) was confirmed
        "keepalive while a transaction sits between queue and writer",
        1,
        [
            ("session_started",),
            ("queued", 160),
            ("streamed", 160),
            ("durable", 0, 160),
            ("queued", 260),
            ("keepalive", 400),
            ("streamed", 400),
        ],
        None,
        160,
    ),
    (
        "the slowest sink decides",
        2,
        [
            ("session_started",),
            ("queued", 160),
            ("queued", 260),
            ("streamed", 260),
            ("durable", 0, 260),
            ("durable", 1, 160),
        ],
        None,
        160,
    ),
    (
        "every sink durable and idle: the keepalive counts",
        2,
        [
            ("session_started",),
            ("queued", 260),
            ("keepalive", 400),
            ("streamed", 400),
            ("durable", 0, 260),
            ("durable", 1, 260),
        ],
        None,
        400,
    ),
    (
        "the assembler holds a transaction: its first LSN caps",
        1,
        [("session_started",), ("queued", 260), ("streamed", 300), ("durable", 0, 260)],
        210,
        210,
    ),
    (
        "only what this session streamed past",
        1,
        [("session_started",), ("queued", 260), ("durable", 0, 260), ("streamed", 200)],
        None,
        200,
    ),
    (
        # a reconnect: the assembler forgot a held prepared transaction, the sinks and an old
        # keepalive lie past its PREPARE; nothing new may be confirmed until the new session
        # has streamed past (and so re-read the PREPARE)
        "reconnect forgets the ceiling, the session caps",
        1,
        [
            ("session_started",),
            ("queued", 260),
            ("keepalive", 900),
            ("streamed", 900),
            ("durable", 0, 260),
            ("session_started",),
        ],
        None,
        0,
    ),
    (
        "what was confirmed stays confirmed across a reconnect",
        1,
        [
            ("session_started",),
            ("queued", 260),
            ("streamed", 260),
            ("durable", 0, 260),
            ("confirm",),
            ("session_started",),
        ],
        None,
        260,
    ),
    (
        # bug found by the real-server tests: PREPARE confirmed before the committed transaction
        # was durable (the server then sends only Commit Prepared: the changes were lost)
        "committed prepared transaction not durable: stay before its PREPARE",
        1,
        [
            ("session_started",),
            ("queued", 300),  # a transaction committed after the PREPARE at 100
            ("durable", 0, 300),
            ("queued", 500, 100),  # Commit Prepared; the ceiling before it was 100
            ("keepalive", 600),
            ("streamed", 600),
        ],
        None,
        100,
    ),
    (
        "committed prepared transaction durable: the cap is lifted",
        1,
        [
            ("session_started",),
            ("queued", 300),
            ("queued", 500, 100),
            ("keepalive", 600),
            ("streamed", 600),
            ("durable", 0, 500),
        ],
        None,
        600,
    ),
    (
        # bug found by the real-server tests: --endpos with a held prepared transaction
        "--endpos with a held prepared transaction",
        1,
        [
            ("session_started",),
            ("queued", 300),
            ("keepalive", 1000),
            ("streamed", 1000),
            ("durable", 0, 300),
        ],
        100,
        100,
    ),
    (
        "a prepared transaction released past --endpos caps for good",
        1,
        [
            ("session_started",),
            ("queued", 300),
            ("past_endpos", 100),
            ("keepalive", 1000),
            ("streamed", 1000),
            ("durable", 0, 300),
            ("confirm",),
        ],
        None,
        100,
    ),
    # A transaction handed to the writer in parts while it arrives (docs/progress.md rule 10):
    # its first LSN (210) is in the ceiling until its last part is queued, even where the
    # assembler forgot it (a reconnect in the middle).
    (
        "parts handed: the keepalive does not confirm past its start",
        1,
        [
            ("session_started",),
            ("queued", 160),
            ("streamed", 160),
            ("durable", 0, 160),
            ("keepalive", 900),
            ("streamed", 900),
        ],
        210,
        160,
    ),
    (
        "parts handed, nothing durable before: nothing confirmed",
        1,
        [("session_started",), ("keepalive", 900), ("streamed", 900)],
        210,
        0,
    ),
    (
        # the sinks hold its parts (even durably: files published), but a durable position is
        # the end LSN of a whole transaction, so they still report the previous one
        "parts durable in the sinks are not confirmable",
        2,
        [
            ("session_started",),
            ("queued", 160),
            ("durable", 0, 160),
            ("durable", 1, 160),
            ("streamed", 600),
        ],
        210,
        160,
    ),
    (
        "a reconnect in the middle: the assembler forgot it, its start still caps",
        1,
        [
            ("session_started",),
            ("queued", 160),
            ("durable", 0, 160),
            ("keepalive", 900),
            ("streamed", 900),
            ("session_started",),
            ("streamed", 950),
        ],
        210,
        160,
    ),
    (
        "the last part queued, not durable: still before its start",
        1,
        [
            ("session_started",),
            ("queued", 160),
            ("durable", 0, 160),
            ("queued", 400),
            ("keepalive", 900),
            ("streamed", 900),
        ],
        None,
        160,
    ),
    (
        "the last part queued and durable: its end, then the keepalive",
        1,
        [
            ("session_started",),
            ("queued", 400),
            ("durable", 0, 400),
            ("keepalive", 900),
            ("streamed", 900),
        ],
        None,
        900,
    ),
    (
        "snapshot in flight",
        1,
        [("session_started",), ("snapshot_started", 1000), ("keepalive", 1200), ("streamed", 1200)],
        None,
        0,
    ),
    (
        "snapshot durable",
        1,
        [
            ("session_started",),
            ("snapshot_started", 1000),
            ("durable", 0, 1000),
            ("keepalive", 1200),
            ("streamed", 1200),
        ],
        None,
        1200,
    ),
]


def _replay(sinks: int, events: list[tuple], ceiling: int | None) -> ProgressTracker:
    tracker = ProgressTracker(sinks)
    for name, *args in events:
        if name == "confirm":
            tracker.confirm(tracker.confirmable(ceiling).position)
        else:
            getattr(tracker, name)(*args)
    return tracker


@pytest.mark.parametrize(
    ("sinks", "events", "ceiling", "expected"),
    [pytest.param(*s[1:], id=s[0]) for s in SCENARIOS],
)
def test_scenario(sinks: int, events: list[tuple], ceiling: int | None, expected: int) -> None:
    tracker = _replay(sinks, events, ceiling)
    before = [getattr(tracker, s) for s in tracker.__slots__]
    assert tracker.confirmable(ceiling).position == expected
    assert [getattr(tracker, s) for s in tracker.__slots__] == before  # asking changes nothing


def test_message_lsn_equal_to_a_commit_lsn_is_not_a_resend() -> None:
    """A non-transactional message's LSN is the end of its record, where the next commit record
    may start: dedupe by end LSN, never by commit LSN."""
    tracker = ProgressTracker(1)
    assert tracker.queued(500)  # the message: commit_lsn = end_lsn = 500
    assert tracker.queued(560)  # the transaction committing at 500
    # after a reconnect both come again
    assert not tracker.queued(500)
    assert not tracker.queued(560)
    assert tracker.queued(700)


def test_durable_and_confirmed_never_move_backwards() -> None:
    tracker = ProgressTracker(1)
    tracker.durable(0, 300)
    tracker.durable(0, 200)
    assert tracker.durable_lsn() == 300
    assert tracker.confirm(300)
    assert not tracker.confirm(200)
    assert tracker.confirmed_lsn == 300


def test_needs_a_sink() -> None:
    with pytest.raises(ValueError):
        ProgressTracker(0)


# -- the property test --------------------------------------------------------------------------


@dataclass
class Item:
    """One thing the server sends, in send order: a regular transaction, a PREPARE, or the
    COMMIT PREPARED of an earlier PREPARE (same ``gid``)."""

    kind: str  # regular | prepare | commit_prepared
    first: int
    commit: int
    end: int
    gid: int = -1


@dataclass
class Model:
    items: list[Item]
    sinks: int
    tracker: ProgressTracker = field(init=False)
    next_item: int = 0
    pos: int = 0
    held: dict[int, int] = field(default_factory=dict)  # gid -> first LSN of its PREPARE
    partial: Item | None = None  # a regular transaction being received (mid-batch await)
    handing: Item | None = None  # a regular transaction handed in parts, not yet queued
    queued: list[tuple[Item, int]] = field(default_factory=list)  # (item, first to protect)
    durable: list[int] = field(default_factory=list)
    confirmed: int = 0

    def __post_init__(self) -> None:
        self.tracker = ProgressTracker(self.sinks)
        self.durable = [0] * self.sinks
        self.tracker.session_started()

    def ceiling(self) -> int | None:
        firsts = list(self.held.values())
        if self.partial is not None:
            firsts.append(self.partial.first)
        if self.handing is not None:  # the handover's part of the ceiling
            firsts.append(self.handing.first)
        return min(firsts) if firsts else None

    def feed(self, pause: bool) -> None:
        if self.next_item >= len(self.items):
            return
        item = self.items[self.next_item]
        if item.kind == "regular":
            if pause:  # the reader awaits inside the batch, between Begin and Commit
                self.partial = item
                self.check()
                self.partial = None
            if self.tracker.queued(item.end):
                self.queued.append((item, item.commit))
            if item is self.handing:  # its last part
                self.handing = None
        elif item.kind == "prepare":
            self.held[item.gid] = item.first
        else:
            cap = self.ceiling()
            first = self.held.pop(item.gid, None)
            if first is not None and self.tracker.queued(item.end, cap):
                self.queued.append((item, first))
        self.next_item += 1
        self.pos = item.end
        self.tracker.streamed(self.pos)

    def part(self) -> None:
        """The next transaction, a regular one, is handed in parts before its Commit comes; the
        model's ceiling leaves it out, as an assembler that forgot it after a reconnect."""
        if self.next_item >= len(self.items) or self.handing is not None:
            return
        item = self.items[self.next_item]
        if item.kind == "regular" and item.commit >= self.tracker.last_queued_end:  # no resend
            self.handing = item

    def keepalive(self) -> None:
        self.tracker.keepalive(self.pos)
        self.tracker.streamed(self.pos)

    def make_durable(self, sink: int, count: int) -> None:
        ends = [item.end for item, _ in self.queued if item.end > self.durable[sink]]
        if ends:
            self.durable[sink] = ends[min(count, len(ends)) - 1]
            self.tracker.durable(sink, self.durable[sink])

    def reconnect(self) -> None:
        """The server resends from the confirmed position: a transaction whose commit record
        starts before it is skipped; a PREPARE before it is not sent again (only the Commit
        Prepared then comes)."""
        self.tracker.session_started()
        self.held.clear()
        self.partial = None
        self.next_item = next(
            (i for i, item in enumerate(self.items) if item.commit >= self.confirmed),
            len(self.items),
        )
        self.pos = self.confirmed

    def check(self) -> None:
        answer = self.tracker.confirmable(self.ceiling()).position
        assert answer >= self.confirmed, "moved backwards"
        low = min(self.durable)
        for item, protect in self.queued:
            if item.end > low:
                assert answer <= protect, (
                    f"confirmable {answer} passes {item.kind} {item} not yet durable"
                )
        for first in self.held.values():
            assert answer <= first, f"confirmable {answer} passes a held PREPARE at {first}"
        if self.partial is not None:
            assert answer <= self.partial.first
        if self.handing is not None:
            assert answer <= self.handing.first, f"confirmable {answer} passes handed parts"
        self.tracker.confirm(answer)
        self.confirmed = answer


@st.composite
def wal(draw: st.DrawFn) -> list[Item]:
    """Transactions in send order; some are PREPAREs whose COMMIT PREPARED comes later."""
    items: list[Item] = []
    open_gids: list[int] = []
    lsn = 100
    for gid in range(draw(st.integers(1, 12))):
        choice = draw(st.sampled_from(["regular", "regular", "prepare", "resolve"]))
        if choice == "resolve" and open_gids:
            g = open_gids.pop(0)
            items.append(Item("commit_prepared", lsn, lsn + 40, lsn + 60, g))
        elif choice == "prepare":
            items.append(Item("prepare", lsn, lsn + 40, lsn + 60, gid))
            open_gids.append(gid)
        else:
            items.append(Item("regular", lsn, lsn + 40, lsn + 60))
        lsn += 100
    for g in open_gids:
        items.append(Item("commit_prepared", lsn, lsn + 40, lsn + 60, g))
        lsn += 100
    return items


OPS = st.one_of(
    st.tuples(st.just("feed"), st.booleans()),
    st.tuples(st.just("keepalive")),
    st.tuples(st.just("durable"), st.integers(0, 1), st.integers(1, 3)),
    st.tuples(st.just("reconnect")),
    st.tuples(st.just("part")),
)


@settings(max_examples=400, deadline=None)
@given(items=wal(), sinks=st.integers(1, 2), ops=st.lists(OPS, max_size=60))
def test_never_passes_what_is_not_durable(items: list[Item], sinks: int, ops: list) -> None:
    """Whatever order the reader, the sinks, keepalives and reconnects come in, the confirmed
    position never moves backwards and never passes a queued transaction that is not durable in
    every sink, nor a PREPARE the assembler holds or a committed prepared transaction that is
    not durable (the server would never send its changes again), nor the start of a transaction
    handed in parts before it is queued whole and durable."""
    model = Model(items, sinks)
    for op in ops:
        match op:
            case ("feed", pause):
                model.feed(pause)
            case ("keepalive",):
                model.keepalive()
            case ("durable", sink, count):
                model.make_durable(sink % sinks, count)
            case ("reconnect",):
                model.reconnect()
            case ("part",):
                model.part()
        model.check()
    # and it gets there: drain everything, make it durable, and the end is confirmed
    while model.next_item < len(items):
        model.feed(False)
        model.check()
    for sink in range(sinks):
        model.make_durable(sink, len(items))
    model.keepalive()
    model.check()
    assert model.confirmed == model.pos
