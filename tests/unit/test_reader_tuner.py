"""How many snapshot workers read at once (cdcd.pipeline.snapshot.ReaderTuner): one more while
it raises the rate by 5 %, else back to the best count, for good."""

from __future__ import annotations

import pytest

from cdcd.pipeline.snapshot import ReaderTuner


@pytest.mark.parametrize(
    ("most", "rates", "counts"),
    [
        # cdcd is the limit (a 2-core host): a second reader makes it slower, back to one
        (4, [900, 780, 2000], [2, 1, 1]),
        # the server is the limit: each reader adds, up to the most configured
        (4, [300, 580, 850, 1100, 1100], [2, 3, 4, 4, 4]),
        # the third adds less than 5 %: two
        (4, [300, 580, 600, 9999], [2, 3, 2, 2]),
        # a gain measured against the best, not the last window
        (4, [500, 1000, 980, 5000], [2, 3, 2, 2]),
        # one worker configured: nothing to tune
        (1, [100, 200], [1, 1]),
    ],
)
def test_readers_follow_the_rate(most: int, rates: list[float], counts: list[int]) -> None:
    tuner = ReaderTuner(most)
    assert tuner.active == 1
    assert [tuner.observe(rate) for rate in rates] == counts
    assert tuner.settled or counts[-1] < most


def test_settles_at_the_most() -> None:
    tuner = ReaderTuner(2)
    assert tuner.observe(100) == 2 and not tuner.settled
    assert tuner.observe(300) == 2 and tuner.settled
    assert tuner.observe(1) == 2  # settled: a slow window later changes nothing
