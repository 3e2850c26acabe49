"""Congestion control: a rate per destination that backs off on switches' CE marks.

Bounded loss makes a sender ignore loss within a round's bound; that is right for microbursts
and random loss, and wrong where the loss is a shared link saying "too much".  Only a mark
says the latter: a switch that marks (RFC 3168, DCTCP-style at a queue threshold) sets CE on
an ECT packet instead of dropping it.  So the sender sends ECT(0), each receiver counts, per
sender, the DATA packets it got and how many came marked, and echoes both counts, cumulative
and modulo 2**32 (as AccECN does: a lost echo loses no marks), in every STOP.

Per destination, at each echo (one a message: a round at the latest) with new packets (the
first echo counts from 0: both ends' counters start there):

- ``F`` = marked / received since the last echo, plus, when anything was marked, the share
  of the packets sent to it since the last echo that did not arrive (loss beside marks is the
  same queue overflowing: congestion; loss without a mark is left to the bound and the repair);
  ``alpha <- (1 - g) alpha + g F`` (``g``: ``Config.cc_gain``; alpha starts at 1, as Linux's
  DCTCP does, so the first mark halves).
- A paced destination's rate grows at every echo, as DCTCP's window grows every round trip:
  by ``Config.cc_increase``, and on a clean echo back toward ``peak`` by half the gap if
  that is more (BIC's binary search: a round is one echo, so recovery must not take one
  ``cc_increase`` per round), up to 1.25x the fastest any message of this rank went out
  (``top``); after ``UNPACE_AFTER`` clean echoes in a row there the destination is unpaced
  again (the link's own rate then paces it: a transport's TBF or pacer).
- Marked (``F > 0``): an unpaced destination becomes paced at the rate its last message went
  out at (bytes of it sent over the time from its first send to the STOP); then the rate is
  cut to ``rate (1 - alpha / 2)``, never below ``Config.cc_min_rate``, and the rate before the
  cut is remembered as ``peak``.  So a steady marked fraction ``F`` holds a rate ``r`` where
  ``r F / 2`` is about ``cc_increase``.
- ``Config.cc_delay`` > 0 also counts a STOP delay more than that above the least seen (the
  round trip of the message's last packets, a queue's growth) as a marked echo with ``F = 1``.

Loss that no mark and no delay go with (random loss, bursts) changes nothing: bounded loss and
repair deal with it.  A paced destination gets a token bucket of ``BUCKET_S`` of its rate (at
least ``BUCKET_FRAMES`` frames).  :class:`~pydblp.collective.protocol.Protocol` sends it only
what the tokens cover, and nothing until they cover a quantum of ``WAIT_FRAMES`` frames (or
what the message has left, if less); a sender held back sleeps until then, rounded up to
the transport's ``timeout_unit`` (poll(2)'s millisecond; the simulator's waits are exact).
So on a host a paced sender wakes about once a millisecond and hands the transport a
millisecond of its rate: a finer quantum costs a loop turn per few frames (the CPU of a
whole rank on 2 vCPUs), a coarser one is a burst that a switch marks for itself (past a
32 KiB mark, about 20 frames).  The bucket holds 2 ms so a
sender woken late keeps its rate; a destination idle longer than that (between messages)
restarts with a quantum, not a full bucket, so all senders of an incast do not open a round
with a bucket each.  Everything here is bookkeeping over times passed in.
"""

from __future__ import annotations

import collections
from typing import NamedTuple

import numpy as np

from pydblp.collective.config import MASK32, Config

ALPHA0 = 1.0          # alpha before the first echo (Linux's DCTCP starts at 1: the first mark halves)
CEILING_OVER = 1.25   # a paced destination's rate stays below this x the fastest send (``top``) ...
UNPACE_AFTER = 32     # ... and it is unpaced again after this many clean echoes in a row there
BUCKET_S = 0.002      # a paced destination's token bucket holds this many s of its rate ...
BUCKET_FRAMES = 16    # ... and at least this many frames
WAIT_FRAMES = 8       # a sender held back waits until this many frames are covered (its quantum)
BASE_DRIFT = 1 / 64   # a STOP delay above the least seen raises that least by this share of the gap
LOSS_SPAN = 4096      # the path's loss estimate: the worse of the latest echoes spanning this many packets
LOSS_SPANS = 4        # sent to it and of those spanning this many times as many (a steadier figure); known
LOSS_SEEN = 512       # once they span this many
LOSS_ECHOES = 1024    # and at most this many echoes kept per destination (tiny messages: one packet each)
WAIT_MARGIN = 1e-6    # s a paced wait adds: at now + wait the clock's rounding must not leave the
                      # tokens a hair short of the quantum, which would wake the caller for nothing
RESYNC = 3            # echoes in a row counting more than was sent before the latest is a baseline


class Echo(NamedTuple):
    """What one echo tells that the previous one did not, from one destination."""

    got: int   # DATA packets that arrived
    ce: int    # of them, CE-marked
    sent: int  # DATA packets sent to it over the same span (0 while nothing new arrives: the span
               # stays open until something does)


class Ledger:
    """Per destination rank: the DATA packets this rank sent it, and what its STOPs' echoes say
    arrived.  The echoed counts are cumulative modulo 2**32 and start at 0 on both ends, so a lost
    echo loses nothing and one overtaken by a newer STOP is recognised and ignored.

    :class:`RateControl` reads marks from it; a loss-following bound (``Dblp(high="loss")``) reads
    ``sent - got``, the packets the network lost, and a message's plan (``Config.plan``) the path's
    :meth:`loss`.  Per destination, what :meth:`echo` returns sums to the echoed total, so a packet
    in flight at one echo counts as lost there and as arrived at the next: over many echoes the
    difference is the loss.
    """

    def __init__(self, world: int):
        self.last = [(0, 0)] * world         # the latest echo's (received, marked): both ends start at 0
        self.heard = [False] * world          # an echo came from it
        self.sent = [0] * world               # DATA frames sent to it (sent) ...
        self.sent_echoed = [0] * world        # ... and as of its latest echo with news
        self.got = [0] * world                # DATA frames its echoes say arrived, in all
        self.past = [0] * world               # echoes in a row counting more than was sent (resync)
        self.marks: list[collections.deque] = [collections.deque(maxlen=LOSS_ECHOES) for _ in range(world)]
        # per echo with news: (sent, got) then, over the latest LOSS_SPANS * LOSS_SPAN sent and the echo
        # before them, LOSS_ECHOES at most (echoes of a packet or two would otherwise keep 16,384)

    def loss(self, dst: int) -> float | None:
        """The share of the DATA sent to ``dst`` lately that did not arrive, in [0, 1]; None while
        the echoes kept span fewer than ``LOSS_SEEN`` packets sent.  The worse of two figures:
        between the latest echo and the last one at least ``LOSS_SPAN`` packets before it (it
        follows a change), and between the latest and the oldest kept, ``LOSS_SPANS`` times as
        many (steadier).  Packets in flight at either end of a span (a message still going out
        to the same rank, a pacer's queue: a few hundred) count as lost or as arrived there, an
        error of several % on a short span: hence the longer one, and the worse of the two."""
        m = self.marks[dst]
        if len(m) < 2 or m[-1][0] - m[0][0] < LOSS_SEEN:
            return None
        last = m[-1]
        worst = 0.0
        for i in range(len(m) - 2, -1, -1):
            if last[0] - m[i][0] >= LOSS_SPAN or i == 0:
                worst = 1.0 - (last[1] - m[i][1]) / (last[0] - m[i][0])
                break
        worst = max(worst, 1.0 - (last[1] - m[0][1]) / (last[0] - m[0][0]))
        return min(1.0, max(0.0, worst))

    def spend(self, dst: int, frames: int) -> None:
        """``frames`` DATA packets went to ``dst``."""
        self.sent[dst] += frames

    def echo(self, dst: int, received: int, marked: int) -> Echo | None:
        """A STOP from ``dst`` echoing its cumulative counts of this rank's DATA packets
        (``received``, of them ``marked`` CE): what is new since the latest echo, or None when
        nothing is (a first echo from a receiver whose counts began before this rank's: a
        baseline; an older STOP overtaken by a newer one; counts past what this rank has sent
        it: an old STOP replayed once the counts have moved on by 2**31, read modulo 2**32 as
        news, ignored and the latest counts kept).

        A receiver counts every DATA packet from this rank, duplicates and replays too, so its
        counts can also run ahead of what was sent for good: after ``RESYNC`` such echoes in a
        row (a replayed STOP comes between genuine ones, which break the row) the latest is
        taken as a baseline, and later echoes are news from it."""
        prev = self.last[dst]
        got = (received - prev[0]) & MASK32
        if got >= 1 << 31 and self.heard[dst]:
            return None  # overtaken: nothing new, and not the latest counts
        if self.heard[dst] and self.got[dst] + got > self.sent[dst]:
            self.past[dst] += 1  # more arrived than was ever sent: not this run's latest counts,
            if self.past[dst] < RESYNC:  # or counts that extra packets moved on
                return None
            self.past[dst] = 0
            self.last[dst] = (received & MASK32, marked & MASK32)
            return None
        self.past[dst] = 0
        first = not self.heard[dst]
        self.last[dst], self.heard[dst] = (received & MASK32, marked & MASK32), True
        if got >= 1 << 31 or (first and got > self.sent[dst]):
            return None
        if got == 0:
            return Echo(0, 0, 0)
        sent, self.sent_echoed[dst] = self.sent[dst] - self.sent_echoed[dst], self.sent[dst]
        self.got[dst] += got
        m = self.marks[dst]
        if not m:
            m.append((self.sent[dst] - sent, self.got[dst] - got))  # (the first span starts at 0 on both ends)
        m.append((self.sent[dst], self.got[dst]))
        while len(m) > 2 and self.sent[dst] - m[1][0] >= LOSS_SPANS * LOSS_SPAN:
            m.popleft()
        return Echo(got, min((marked - prev[1]) & MASK32, got), sent)


class RateControl:
    """The rate of each destination rank (see the module docstring).

    Args:
        world: ranks.
        config: the collective's (``cc_gain``, ``cc_increase``, ``cc_min_rate``, ``cc_delay``).
        frame: bytes a DATA packet takes on the wire (the token bucket's unit).
    """

    def __init__(self, world: int, config: Config, frame: int):
        self.g, self.increase, self.min_rate = config.cc_gain, config.cc_increase, config.cc_min_rate
        self.delay = config.cc_delay
        self.frame = frame
        self.rate = np.zeros(world)           # bits/s; 0: not paced
        self.peak = np.zeros(world)           # bits/s: the rate before the latest cut
        self.top = 0.0                        # bits/s: the fastest any message of this rank went out
        self.alpha = np.full(world, ALPHA0)
        self.tokens = np.zeros(world)         # bytes
        self.t_tok = np.zeros(world)
        self.clean = [0] * world              # clean echoes in a row at the cap
        self.base = np.full(world, np.inf)    # least STOP delay seen (s)
        self.counters = dict.fromkeys(("echoes", "marked_echoes", "marks", "cuts", "unpaced"), 0)

    def paced(self, dst: int) -> bool:
        return bool(self.rate[dst])

    def echo(self, dst: int, news: Echo, now: float, sent_rate: float | None, delay: float | None = None) -> None:
        """A STOP from ``dst`` whose echo :meth:`Ledger.echo` read as ``news``, when it came, the
        rate (bits/s) the message it ends went out at (None: unknown), and its delay (s from the
        message's last send; None: not measured)."""
        if sent_rate:
            self.top = max(self.top, sent_rate)
        late = False
        if delay is not None and self.delay:
            base = self.base[dst]
            late = delay - base > self.delay
            self.base[dst] = delay if delay < base else base + (delay - base) * BASE_DRIFT
        if news.got == 0:  # nothing new
            if late:
                self._update(dst, 1.0, now, sent_rate)
            return
        f = news.ce / news.got
        if news.ce and news.sent > news.got:  # marked, and lost some: the same queue overflowing
            f = min(1.0, f + (news.sent - news.got) / news.sent)
        self.counters["echoes"] += 1
        self.counters["marks"] += news.ce
        self._update(dst, 1.0 if late else f, now, sent_rate)

    def _update(self, dst: int, f: float, now: float, sent_rate: float | None) -> None:
        self.alpha[dst] = (1 - self.g) * self.alpha[dst] + self.g * f
        if f > 0:
            self.counters["marked_echoes"] += 1
            if not self.rate[dst]:
                if not sent_rate:
                    return  # no rate to start from: the next marked echo sets one
                self.rate[dst] = max(sent_rate, self.min_rate)
                self.tokens[dst], self.t_tok[dst] = self._bucket(dst), now
            self.peak[dst] = self.rate[dst]
            self.rate[dst] = max(self.min_rate, self.rate[dst] * (1 - self.alpha[dst] / 2))
            self.counters["cuts"] += 1
            self.rate[dst] = min(self.rate[dst] + self.increase, self._cap())  # (DCTCP: the window
            self.clean[dst] = 0                                                  # grows anyway)
        elif self.rate[dst]:
            self.rate[dst] = min(self.rate[dst] + max(self.increase, (self.peak[dst] - self.rate[dst]) / 2),
                                 self._cap())
            self.clean[dst] = self.clean[dst] + 1 if self.rate[dst] >= self._cap() else 0
            if self.clean[dst] >= UNPACE_AFTER:
                self.rate[dst] = 0.0
                self.counters["unpaced"] += 1

    def _cap(self) -> float:
        return max(CEILING_OVER * self.top, self.min_rate)

    def _bucket(self, dst: int) -> float:
        return max(BUCKET_FRAMES * self.frame, self.rate[dst] / 8 * BUCKET_S)

    def allowed(self, dst: int, now: float) -> int:
        """Frames ``dst`` may be sent now (refills its bucket; a large number when not paced)."""
        rate = self.rate[dst]
        if not rate:
            return 1 << 30
        gap = now - self.t_tok[dst]
        tokens = min(self._bucket(dst), self.tokens[dst] + gap * rate / 8)
        if gap > BUCKET_S:  # idle, between messages: it restarts with a quantum, not a full bucket
            tokens = min(tokens, WAIT_FRAMES * self.frame)
        self.tokens[dst], self.t_tok[dst] = tokens, now
        return int(tokens // self.frame)

    def spend(self, dst: int, frames: int) -> None:
        """``frames`` DATA packets went to ``dst`` (out of its tokens)."""
        if self.rate[dst]:
            self.tokens[dst] -= frames * self.frame

    def quantum(self, left: int) -> int:
        """Frames a paced destination is sent at once, of ``left`` waiting: ``WAIT_FRAMES``, or all
        of them if fewer.  Fewer tokens than that hold the message back (:meth:`wait`), so a paced
        sender hands the transport quanta, not the frame or two its tokens grow by in a loop turn."""
        return max(1, min(WAIT_FRAMES, left))

    def wait(self, dst: int, left: int = WAIT_FRAMES) -> float:
        """Seconds (from the last :meth:`allowed`) until ``dst`` may be sent a quantum of ``left``
        frames waiting (:meth:`quantum`)."""
        rate = self.rate[dst]
        if not rate:
            return 0.0
        want = min(self.quantum(left) * self.frame, self._bucket(dst))
        short = want - self.tokens[dst]
        return short * 8 / rate + WAIT_MARGIN if short > 0 else 0.0

    def state(self) -> dict:
        """Per destination rank: ``rate`` (bits/s; 0 not paced) and ``alpha``; and the counters."""
        return {"rate": self.rate.tolist(), "alpha": self.alpha.tolist(), **self.counters}
