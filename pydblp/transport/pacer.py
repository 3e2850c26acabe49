"""A token bucket that releases queued frames of a transmit ring at a line rate.

AF_XDP transmit bypasses the qdisc (copy mode hands each frame straight to
the driver), so a TBF on the device never sees it.  :class:`Pacer` stands in
for one: frames are written to the ring at once, but the producer index the
kernel sees advances only as far as the bucket's tokens cover.  It keeps, per
ring slot, the cumulative byte count at the end of the frame written there,
so finding how many waiting frames the tokens cover is a binary search, not
a sum per call.  All descriptors of one frame carry the frame's end, so a
frame spanning several descriptors is released whole.

Pure bookkeeping over ring indices: no syscalls, a clock passed in.
"""

from __future__ import annotations

import time

import numpy as np


class Pacer:
    """Token bucket over the slots of a transmit ring of ``slots`` descriptors.

    Args:
        rate: bits per second; 0 leaves the ring unpaced (everything is released).
        burst: bucket size in bytes; None: 1 ms of ``rate``, at least ``min_burst``.
        slots: descriptors in the ring (a power of two).
        min_burst: the smallest bucket accepted (four frames: the testbed's TBF).
        clock: seconds, monotonic (``time.monotonic``; tests pass their own).

    Raises:
        ValueError: ``rate`` < 0 or ``burst`` < ``min_burst``.
    """

    def __init__(self, rate: float, burst: int | None, slots: int, min_burst: int, clock=time.monotonic):
        if rate < 0 or (burst is not None and burst < min_burst):
            raise ValueError(f"rate must be >= 0 bits/s and rate_burst at least 4 frames ({min_burst} bytes)")
        self.rate = float(rate)
        self.Bps = self.rate / 8  # bytes per second; 0: unpaced
        self.burst = burst or max(min_burst, int(self.Bps / 1000))
        self.clock = clock
        self.tokens, self.t_tok = float(self.burst), clock()
        self.written = self.released = 0  # frame bytes queued and released so far
        self.cum = np.zeros(slots, np.int64)  # per slot: ``written`` once its frame was queued
        self.mask = slots - 1

    def queued(self, slots, lens: np.ndarray, k) -> None:
        """Account frames of ``lens`` bytes just written at ring ``slots``.

        Args:
            slots: the ring slots of their descriptors (a slice or an index array).
            lens: bytes of each frame.
            k: descriptors per frame: an int, or one count per frame.
        """
        if not self.Bps:
            return
        c = np.cumsum(lens)
        c += self.written
        self.cum[slots] = np.repeat(c, k) if np.ndim(k) or k > 1 else c
        self.written = int(c[-1])

    def take(self, start: int, waiting: int) -> int:
        """Of ``waiting`` descriptors from ring index ``start``, how many the tokens release now.

        Refills the bucket to now and spends the released frames' bytes.
        Unpaced: all of them.
        """
        if not self.Bps:
            return waiting
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.t_tok) * self.Bps)
        self.t_tok = now
        limit = self.released + int(self.tokens)
        i0 = start & self.mask
        head = min(waiting, self.mask + 1 - i0)
        cum = self.cum
        k = int(np.searchsorted(cum[i0: i0 + head], limit, side="right"))
        if k == head < waiting:  # the waiting frames wrap around the ring's end
            k += int(np.searchsorted(cum[: waiting - head], limit, side="right"))
        if k:
            done = int(cum[(start + k - 1) & self.mask])
            self.tokens -= done - self.released
            self.released = done
        return k

    def backlog(self) -> float:
        """Seconds until every queued frame is released (0 when unpaced or none waits)."""
        if not self.Bps or self.written == self.released:
            return 0.0
        return (self.written - self.released - self.tokens) / self.Bps

    def wait(self, frame_bytes: int) -> float:
        """Seconds until the tokens cover a next frame of ``frame_bytes`` (as of the last refill)."""
        if not self.Bps:
            return 0.0
        return max(0.0, (frame_bytes - self.tokens) / self.Bps)
