"""A :class:`~pydblp.transport.base.Transport` over the simulated network, in virtual time.

It keeps the real transports' contract (batches, peer ids, ``want``/``linger``, blocking
sends, counters), so the collective above runs unchanged.  Waiting (a receive's timeout or
linger, a send on a full queue) blocks the rank's thread in the scheduler
(:class:`~pydblp.sim.core.Sim`) until virtual time reaches the moment it waits for.
"""

from __future__ import annotations

import bisect
import collections
import math

import numpy as np

from pydblp import wire
from pydblp.dscp import CE, ECT0
from pydblp.sim.network import FRAME_OVERHEAD, QUANTUM
from pydblp.transport.base import Batch, Transport

GROUP_ADDR = "198.19.255.255"  # the simulated broadcast address (Collective's group)
FD_BASE = 1 << 30             # fileno(): not a descriptor, nothing polls a simulated transport


def rank_addr(rank: int) -> str:
    """Rank ``rank``'s simulated IPv4 address (198.18.0.0/15, as the testbed's)."""
    return f"198.18.{rank >> 8}.{rank & 0xFF}"


class _Arrivals:
    """Packets on their way to one rank, in arrival order: ``times`` non-decreasing."""

    __slots__ = ("times", "headers", "payload", "lengths", "src", "at", "ctrl", "ecn", "base")

    def __init__(self, times, headers, payload, lengths, src, ecn=None):
        self.times, self.headers, self.payload, self.lengths, self.src = times, headers, payload, lengths, src
        self.ecn = np.zeros(len(times), np.uint8) if ecn is None else ecn  # each packet's ECN field
        self.at = 0  # the first not taken yet
        self.ctrl = np.flatnonzero(headers["kind"] != wire.Kind.DATA)  # the control packets, by index
        self.base = 0  # its first packet's position among all queued to the receiver (queue_arrivals)


class _Hops:
    """Copies of one send's packets on their way to the switch, in the order they reach it
    (``times``, non-decreasing): each to its port ``dst``, ``size`` bytes on the wire; ``k``:
    the first not admitted yet (:meth:`pydblp.sim.core.Sim.admit`)."""

    __slots__ = ("src", "times", "dst", "size", "headers", "payload", "lengths", "ecn", "k")

    def __init__(self, src, times, dst, size, headers, payload, lengths, ecn):
        self.src, self.times, self.dst, self.size = src, times, dst, size
        self.headers, self.payload, self.lengths, self.ecn = headers, payload, lengths, ecn
        self.k = 0


class SimTransport(Transport):
    """One rank's transport in a :class:`~pydblp.sim.core.Sim` (made by it).

    Peers are registered by address: :func:`rank_addr` of a rank, or :data:`GROUP_ADDR`
    (every other rank: the broadcast all-gather's group).  Besides the usual counters,
    ``stats()["tx_control"]`` counts the control packets sent (STOP, PROBE, BITMAP).  The receiver never drops (receive
    CPU is not simulated; ``Sim(cost=...)`` charges time per packet), so ``rx_dropped`` stays 0.
    """

    kind = "sim"
    timeout_unit = 0.0  # recv waits its timeout exactly, in virtual time

    def __init__(self, sim, rank: int):
        self.sim, self.rank = sim, rank
        self.netns, self.ifname, self.queue, self.port = None, f"sim{rank}", 0, wire.DEFAULT_PORT
        self._c = dict.fromkeys(("rx_packets", "rx_bytes", "tx_packets", "tx_bytes", "rx_invalid", "rx_truncated",
                                 "rx_dropped", "rx_errors", "tx_blocked", "tx_control"), 0)
        self._dst: list[int] = []                  # peer id -> rank (-1: every other rank)
        self._peer = np.full(sim.world, -1, np.int32)  # rank -> its peer id here (-1: not registered)
        # on their way here, in the order they are taken: runs of packets, and every packet's
        # position (queued() counts them) so a linger finds the want-th without a scan
        self._rx: collections.deque[_Arrivals] = collections.deque()
        self._bases: collections.deque[int] = collections.deque()  # each run's base, as _rx
        self._ctrl: collections.deque[int] = collections.deque()   # control packets' positions
        self._queued = 0
        self._open = True

    # ---- the Transport interface -----------------------------------------
    def add_peer(self, addr, port: int = wire.DEFAULT_PORT, mac=None) -> int:
        """Register rank ``addr`` (its :func:`rank_addr`) or :data:`GROUP_ADDR`; its peer id."""
        self._check_open()
        addr = str(addr)
        if addr == GROUP_ADDR:
            rank = -1
        else:
            rank = self.sim.rank_of(addr)
        self._dst.append(rank)
        if rank >= 0 and self._peer[rank] < 0:
            self._peer[rank] = len(self._dst) - 1
        return len(self._dst) - 1

    def send(self, batch: Batch, timeout: float | None = 1.0) -> int:
        """Hand ``batch`` to this rank's uplink; waits (virtual time) up to ``timeout`` s while its
        send queue is full.  Returns how many packets were taken."""
        self._check_open()
        sim = self.sim
        k = batch.n
        if k == 0:
            return 0
        sim.charge(self.rank, k)
        sizes = batch.lengths[:k].astype(np.int64) + FRAME_OVERHEAD
        dsts = np.asarray(self._dst, np.int64)[batch.peer[:k]]
        end = math.inf if timeout is None else sim.now + timeout
        done = 0
        while True:
            taken, hops, retry = sim.network.send(self.rank, sim.now, sizes[done:], dsts[done:])
            if hops:
                self._hand(batch, done, hops, sizes)
            done += taken
            if done == k or retry > end:
                break
            self._c["tx_blocked"] += 1
            sim.wait(self.rank, max(retry, sim.now + QUANTUM))
        self._c["tx_packets"] += done
        self._c["tx_control"] += int(np.count_nonzero(batch.headers["kind"][:done] != wire.Kind.DATA))
        self._c["tx_bytes"] += int(batch.lengths[:done].sum()) + done * wire.HEADER_LEN
        return done

    def _recv(self, into: Batch, timeout, max, want, linger, copy) -> Batch:
        sim = self.sim
        cap = min(into.cap, max or into.cap)
        end = math.inf if timeout is None else sim.now + timeout
        while not self._ready(sim.now) and sim.now < end:
            sim.wait(self.rank, end, self._next)
        if want > 1 and linger > 0 and self._ready(sim.now):
            until = sim.now + linger
            sim.wait(self.rank, until, lambda: self._linger(want))
        k = self._take(into, cap, sim.now)
        if k:
            sim.charge(self.rank, k)
        return into.view(0, k)

    def tx_queued(self) -> int:
        """Bytes in this rank's send queue (not yet on the wire)."""
        return int(self.sim.network.up[self.rank].backlog(self.sim.now))

    def stats(self) -> dict:
        return dict(self._c)

    def fileno(self) -> int:
        return FD_BASE + self.rank if self._open else -1

    def close(self) -> None:
        self._open = False
        self._forget()

    def set_ect(self, on: bool) -> None:
        """Send ECN-capable packets (a port that marks, ``Network.mark``, then sets CE on them)."""
        self.ect = bool(on)

    def drop_arrivals(self) -> None:
        """Forget what is on its way here (the rank died)."""
        self._forget()

    def _forget(self) -> None:
        self._rx.clear()
        self._bases.clear()
        self._ctrl.clear()

    # ---- arrivals --------------------------------------------------------
    def _hand(self, batch: Batch, base: int, hops: list, sizes: np.ndarray) -> None:
        """Put copies of packets ``base + i`` on their way to the switch (``hops``: (i, rank,
        time it reaches the port to that rank)); the scheduler admits each at its port then."""
        n = len(hops)
        rows = base + np.fromiter((i for i, _, _ in hops), np.int64, n)
        dst = np.fromiter((d for _, d, _ in hops), np.int64, n)
        times = np.fromiter((t for _, _, t in hops), np.float64, n)
        w = int(batch.lengths[rows].max())
        self.sim.in_flight(_Hops(self.rank, times, dst, sizes[rows], batch.headers[rows].copy(),
                                 batch.payload[rows, :w].copy(), batch.lengths[rows].copy(),
                                 ECT0 if self.ect else 0))

    def arrivals(self, h: _Hops, idx: list, times: list, ce: list) -> _Arrivals:
        """The packets ``idx`` of ``h`` that a port passed, arriving at ``times`` (``ce``: marked),
        as what their receiver queues."""
        rows = np.asarray(idx, np.int64)
        ecn = np.where(np.asarray(ce, bool), CE, h.ecn).astype(np.uint8)
        return _Arrivals(np.asarray(times, np.float64), h.headers[rows], h.payload[rows], h.lengths[rows], h.src, ecn)

    def queue_arrivals(self, a: _Arrivals) -> None:
        """Packets from the network (the scheduler calls it); nothing once closed."""
        if self._open:
            a.base = self._queued
            self._queued += len(a.times)
            self._rx.append(a)
            self._bases.append(a.base)
            if len(a.ctrl):
                self._ctrl.extend((a.ctrl + a.base).tolist())

    def _next(self) -> float:
        """When the next packet arrives (inf: none is on its way)."""
        for a in self._rx:
            if a.at < len(a.times):
                return float(a.times[a.at])
        return math.inf

    def _ready(self, now: float) -> bool:
        return self._next() <= now

    def _linger(self, want: int) -> float:
        """When ``want`` packets will have arrived, or the first control packet (inf: not yet known).

        Runs are taken in order, so the packets not taken yet are the positions from the first
        run's next one on: the ``want``-th is found by its position, and so is the first control
        packet; a control packet in a run before the ``want``-th packet's counts alone, one in
        its run as the earlier of the two."""
        if not self._rx:
            return math.inf
        a0 = self._rx[0]
        taken = a0.base + a0.at
        ctrl = self._ctrl
        while ctrl and ctrl[0] < taken:
            ctrl.popleft()
        c = ctrl[0] if ctrl else -1
        p = taken + want - 1
        if p >= self._queued:  # fewer than want on their way
            return self._time_at(c)[0] if c >= 0 else math.inf
        first, run = self._time_at(p)
        if c < 0:
            return first
        tc, crun = self._time_at(c)
        return tc if crun < run else min(first, tc) if crun == run else first

    def _time_at(self, pos: int) -> tuple[float, int]:
        """The arrival time of the packet at position ``pos`` (queued, not taken) and its run's index."""
        i = bisect.bisect_right(self._bases, pos) - 1
        a = self._rx[i]
        return float(a.times[pos - a.base]), i

    def _take(self, into: Batch, cap: int, now: float) -> int:
        """Move up to ``cap`` packets that have arrived by ``now`` into ``into``."""
        k = 0
        while self._rx and k < cap:
            a = self._rx[0]
            j = min(int(np.searchsorted(a.times, now, "right")), a.at + cap - k)
            m = j - a.at
            if m > 0:
                s = slice(a.at, j)
                wire.put(into.headers[k: k + m], a.headers[s])
                w = min(into.maxlen, a.payload.shape[1])
                into.payload[k: k + m, :w] = a.payload[s, :w]
                lens = a.lengths[s]
                self._c["rx_truncated"] += int((lens > into.maxlen).sum())
                into.lengths[k: k + m] = np.minimum(lens, into.maxlen)
                into.peer[k: k + m] = self._peer[a.src]
                if into.ecn is not None:
                    into.ecn[k: k + m] = a.ecn[s]
                self._c["rx_bytes"] += int(lens.sum()) + m * wire.HEADER_LEN
                k += m
                a.at = j
            if a.at < len(a.times):
                break
            self._rx.popleft()
            self._bases.popleft()
        self._c["rx_packets"] += k
        into.n = k
        return k
