"""The transmit token bucket (:mod:`pydblp.transport.pacer`) with a clock the test moves."""

from __future__ import annotations

import numpy as np
import pytest

from pydblp.transport.pacer import Pacer

FRAME = 1000  # bytes per frame in these tests


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def pacer(rate=8e6, burst=4 * FRAME, slots=16):
    clock = Clock()
    return Pacer(rate, burst, slots, 4 * FRAME, clock), clock


def test_burst_then_line_rate():
    p, clock = pacer()  # 1 MB/s, a 4-frame bucket
    p.queued(slice(0, 10), np.full(10, FRAME), 1)
    assert p.take(0, 10) == 4  # the full bucket
    assert p.take(4, 6) == 0  # no time passed
    assert p.backlog() == pytest.approx(6 * FRAME / 1e6)
    assert p.wait(FRAME) == pytest.approx(FRAME / 1e6)
    clock.t += 0.0025  # 2500 bytes of tokens: two more frames, 500 left
    assert p.take(4, 6) == 2
    assert p.wait(FRAME) == pytest.approx(500 / 1e6)
    clock.t += 1.0  # the bucket caps at its burst: four frames, not a second's worth
    assert p.take(6, 4) == 4
    assert p.backlog() == 0.0 and p.released == p.written == 10 * FRAME


def test_waiting_frames_that_wrap_the_ring_end():
    p, clock = pacer(slots=8)
    p.queued(slice(0, 6), np.full(6, FRAME), 1)
    assert p.take(0, 6) == 4
    clock.t += 0.0021
    assert p.take(4, 2) == 2  # slots 4 and 5: 2100 bytes of tokens, 100 left
    p.queued(np.array([6, 7, 0, 1]), np.full(4, FRAME), 1)  # slots 6, 7, 0, 1
    clock.t += 0.0031  # 3200 bytes: three frames, two before the end of the ring and one after
    assert p.take(6, 4) == 3
    clock.t += 0.0011
    assert p.take(9, 1) == 1  # ring index 9 is slot 1


def test_a_frame_of_several_descriptors_goes_whole():
    p, clock = pacer(burst=4 * FRAME)
    # two frames of 3000 bytes, three descriptors each: the bucket (4000) covers the first only
    p.queued(slice(0, 6), np.array([3000, 3000]), 3)
    assert p.take(0, 6) == 3
    clock.t += 0.0019  # 1000 + 1900 < 3000: the second frame still waits
    assert p.take(3, 3) == 0
    clock.t += 0.0002
    assert p.take(3, 3) == 3


def test_unpaced_releases_everything_and_keeps_no_books():
    p, clock = pacer(rate=0, burst=None)
    p.queued(slice(0, 10), np.full(10, FRAME), 1)
    assert p.take(0, 10) == 10 and p.written == 0
    assert p.backlog() == 0.0 and p.wait(FRAME) == 0.0


def test_default_burst_and_limits():
    p, _ = pacer(rate=80e9, burst=None)  # 1 ms of 10 GB/s
    assert p.burst == 10_000_000
    p, _ = pacer(rate=1e6, burst=None)  # 1 ms of 125 kB/s is less than four frames
    assert p.burst == 4 * FRAME
    with pytest.raises(ValueError, match="rate_burst at least 4 frames"):
        pacer(burst=1500)
    with pytest.raises(ValueError, match="rate must be >= 0"):
        pacer(rate=-1)
