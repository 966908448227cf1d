"""The replication protocol's read coalescing: a small read pauses reading only while the
walsender writes without a break (a run of quick reads), never after a quiet spell."""

from __future__ import annotations

import asyncio

import pytest

from cdcd.replication import transport as t


class FakeTransport:
    def __init__(self) -> None:
        self.paused = False
        self.pauses = 0

    def pause_reading(self) -> None:
        assert not self.paused
        self.paused = True
        self.pauses += 1

    def resume_reading(self) -> None:
        assert self.paused
        self.paused = False


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(t, "perf_counter", c)
    return c


def _protocol(loop: asyncio.AbstractEventLoop) -> tuple[t.ReplicationProtocol, FakeTransport]:
    protocol = t.ReplicationProtocol(loop)
    fake = FakeTransport()
    protocol.connection_made(fake)  # type: ignore[arg-type]
    protocol.coalesce = True
    return protocol, fake


def test_reads_after_quiet_spells_wake_the_consumer_at_once(clock: Clock) -> None:
    async def main() -> None:
        protocol, fake = _protocol(asyncio.get_running_loop())
        for _ in range(20):
            clock.now += 0.001  # a live transaction every millisecond
            waiting = asyncio.ensure_future(protocol.wait_data())
            await asyncio.sleep(0)
            protocol.data_received(b"x" * 500)
            await asyncio.wait_for(waiting, 0.5)
            assert not fake.paused
        assert fake.pauses == 0 and protocol.pauses == 0

    asyncio.run(main())


def test_a_run_of_quick_small_reads_pauses_then_resumes(clock: Clock) -> None:
    async def main() -> None:
        protocol, fake = _protocol(asyncio.get_running_loop())
        clock.now += 1.0
        protocol.data_received(b"x" * 1000)  # after a quiet spell
        for _ in range(t.QUICK_READS - 1):
            clock.now += t.QUICK_GAP / 4
            protocol.data_received(b"x" * 1000)
            assert not fake.paused
        clock.now += t.QUICK_GAP / 4
        protocol.data_received(b"x" * 1000)  # the QUICK_READS-th quick read in a row
        assert fake.paused and protocol.pauses == 1
        waiting = asyncio.ensure_future(protocol.wait_data())
        await asyncio.sleep(0)
        assert fake.paused  # the consumer does not resume reading during the pause
        await asyncio.wait_for(waiting, 1.0)  # woken when the pause ends
        assert not fake.paused
        assert bytes(protocol.raw) == b"x" * 1000 * (t.QUICK_READS + 1)
        # the read right after the pause continues the run: it pauses again
        clock.now += t.QUICK_GAP / 4
        protocol.data_received(b"y" * 1000)
        assert fake.paused and protocol.pauses == 2
        await asyncio.sleep(t.COALESCE_SECONDS * 5)
        assert not fake.paused

    asyncio.run(main())


def test_large_reads_and_the_non_streaming_phase_never_pause(clock: Clock) -> None:
    async def main() -> None:
        protocol, fake = _protocol(asyncio.get_running_loop())
        for _ in range(10):
            clock.now += t.QUICK_GAP / 4
            protocol.data_received(b"x" * t.SMALL_READ)
        assert fake.pauses == 0
        protocol.coalesce = False  # before START_REPLICATION
        for _ in range(10):
            clock.now += t.QUICK_GAP / 4
            protocol.data_received(b"x")
        assert fake.pauses == 0

    asyncio.run(main())
