"""The simulated network: a switch with one port per rank, in virtual time.

Each rank has an *uplink* (its NIC and the wire to the switch) and the switch a *port* to it
(the downlink).  A packet sent at ``t`` waits in the rank's send queue (FIFO, ``Link.rate``,
at most ``Link.queue`` bytes: a sender blocks when it is full, as a UDP socket does), reaches
the switch ``Link.latency`` after it left, meets the port's faults (:class:`Faults`, the
testbed fabric's: microburst windows, Bernoulli loss, Gilbert-Elliott) and the port's queue
(``Link.rate``, drop-tail at ``Link.queue`` bytes: incast loss), and arrives ``Link.latency``
after it left the port.

Two steps, so that a port sees packets in the order they reach the switch: :meth:`Network.send`
puts a sender's packets on its uplink and says when each reaches the switch (a *hop*);
:meth:`Network.admit` decides a hop at the port when the simulation's clock reaches that
moment (the scheduler, :class:`~pydblp.sim.core.Sim`, keeps the hops in time order with the
ranks' turns): faults, drop-tail, the CE mark, and the arrival time.  Two senders' packets
then interleave at a port as they would on a switch, and a port's backlog holds only what has
reached it.  A port serves in order, so each rank receives the packets of one sender in the
order they were sent, at non-decreasing times (with no rate limit too: a port then serves in
no time, but in that order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from pydblp import units, wire

FRAME_OVERHEAD = 14 + 20 + 8 + wire.HEADER_LEN  # Ethernet, IPv4, UDP and DBLP headers on a payload
QUANTUM = 1e-9  # virtual s a rank waits at least for a moment it was told is due (one computed as
                # now, or closer than the clock's resolution, must still let time move)
CAUSES = ("burst", "loss", "ge", "tail", "dead")  # why the network dropped a packet (Network.drops)


@dataclass
class Link:
    """A rank's link to the switch, both ways (its uplink and the switch's port to it).

    Args:
        rate: bits/s, a number or e.g. ``"1gbit"`` (0: no limit, packets take no time).
        latency: one-way propagation delay of each hop (s): rank to switch, switch to rank.
        queue: bytes each queue (the rank's send queue, the switch port's) holds.
    """

    rate: float | str = "1gbit"
    latency: float = 25e-6
    queue: int = 1 << 20

    def __post_init__(self):
        self.rate = units.rate(self.rate)
        if not self.latency >= 0:
            raise ValueError(f"latency {self.latency}: use seconds >= 0")
        if not self.queue >= 2048:
            raise ValueError(f"queue {self.queue}: use at least 2048 bytes (one frame)")


@dataclass
class Burst:
    """A microburst: drop ``ratio`` of packets reaching the port within ``duration`` s of
    ``start`` (virtual s), repeating every ``every`` s (``count`` windows; None: forever)."""

    start: float
    duration: float
    ratio: float = 1.0
    every: float | None = None
    count: int | None = None

    def active(self, t: float) -> bool:
        off = t - self.start
        if off < 0:
            return False
        if self.every:
            k = int(off // self.every)
            if self.count is not None and k >= self.count:
                return False
            off -= k * self.every
        elif self.count is not None and self.count < 1:
            return False
        return off < self.duration


@dataclass
class Faults:
    """A switch port's faults, applied in the testbed fabric's order: burst window, Bernoulli
    loss, Gilbert-Elliott (good->bad ``p``, bad->good ``r`` per packet; drop ``loss_bad`` /
    ``loss_good`` per state)."""

    loss: float = 0.0
    ge: tuple[float, float, float, float] | None = None  # (p, r, loss_bad, loss_good)
    bursts: list[Burst] = field(default_factory=list)
    ge_bad: bool = False

    def drop(self, t: float, rng: np.random.Generator) -> str | None:
        """The cause that drops a packet reaching the port at ``t`` (None: it passes)."""
        for b in self.bursts:
            if b.active(t) and (b.ratio >= 1 or rng.random() < b.ratio):
                return "burst"
        if self.loss and rng.random() < self.loss:
            return "loss"
        if self.ge is not None:
            p, r, bad, good = self.ge
            self.ge_bad = (rng.random() >= r) if self.ge_bad else (rng.random() < p)
            if rng.random() < (bad if self.ge_bad else good):
                return "ge"
        return None


class Queue:
    """A FIFO served at ``rate`` bits/s holding at most ``cap`` bytes (``rate`` 0: no limit)."""

    def __init__(self, rate: float, cap: int):
        self.rate, self.cap = rate, cap
        self.free = 0.0  # when what it holds has left

    def backlog(self, t: float) -> float:
        """Bytes it holds at ``t``."""
        return max(0.0, self.free - t) * self.rate / 8 if self.rate else 0.0

    def put(self, t: float, size: int) -> float | None:
        """Enqueue a ``size``-byte packet at ``t``: when it has left, or None if it does not fit
        (drop-tail; an empty queue always takes one)."""
        if not self.rate:
            return t
        wait = self.free - t
        if wait > 0 and wait * self.rate / 8 + size > self.cap + 0.5:  # (half a byte: float rounding)
            return None
        self.free = max(self.free, t) + size * 8 / self.rate
        return self.free


class Network:
    """The switch, its ports and the ranks' links (see the module docstring).

    Args:
        world: ranks, 1..65535.
        link: every rank's link (a :class:`Link`), or one per rank.
        seed: the faults' random draws (one generator: results depend on it only).
    """

    def __init__(self, world: int, link: Link | list[Link] | None = None, seed: int = 0):
        links = link if isinstance(link, list) else [link or Link()] * world
        if len(links) != world:
            raise ValueError(f"{len(links)} links for world {world}: give one Link, or one per rank")
        self.world = world
        self.links = links
        self.up = [Queue(lk.rate, lk.queue) for lk in links]
        self.port = [Queue(lk.rate, lk.queue) for lk in links]
        self.faults = [Faults() for _ in range(world)]
        self.dead = np.zeros(world, bool)
        self.last = np.zeros(world)  # per port, the latest arrival time it gave (arrivals never reorder)
        self.rng = np.random.default_rng(seed)
        self.drops = {c: 0 for c in CAUSES}   # packets dropped, by cause, all ports
        self.delivered = 0
        self.mark_at = [0] * world            # per port: CE-mark threshold in bytes (0: no marking)
        self.marks = 0                        # packets marked CE, all ports

    def _ports(self, port) -> list[int]:
        if port is None:
            return list(range(self.world))
        ports = [port] if isinstance(port, (int, np.integer)) else list(port)
        for k in ports:
            if not 0 <= k < self.world:
                raise ValueError(f"port {k}: use a rank in 0..{self.world - 1} (the port to that rank)")
        return ports

    def loss(self, p: float, port=None) -> None:
        """Bernoulli loss ``p`` on packets to ``port`` (a rank, a list of them; None: all)."""
        if not 0 <= p <= 1:
            raise ValueError(f"loss {p}: use a probability in [0, 1]")
        for k in self._ports(port):
            self.faults[k].loss = p

    def ge(self, p: float, r: float, loss_bad: float = 1.0, loss_good: float = 0.0, port=None) -> None:
        """Gilbert-Elliott loss on packets to ``port`` (as ``Fabric.ge``; ``p`` 0 turns it off)."""
        if p and not r > 0:
            raise ValueError("ge r must be > 0 (r = 0 would stay in the bad state forever)")
        for k in self._ports(port):
            self.faults[k].ge = (p, r, loss_bad, loss_good) if p else None

    def burst(self, start: float, duration: float, ratio: float = 1.0, every: float | None = None,
              count: int | None = None, port=None) -> None:
        """Add a microburst on packets to ``port`` (see :class:`Burst`; times in virtual s)."""
        if duration < 0 or start < 0:
            raise ValueError("burst start and duration must be >= 0")
        if every is not None and every < duration:
            raise ValueError(f"burst period ({every} s) must be at least the duration ({duration} s)")
        for k in self._ports(port):
            self.faults[k].bursts.append(Burst(start, duration, ratio, every, count))

    def mark(self, threshold: int, port=None) -> None:
        """Mark ECN-capable packets CE at ``port``'s queue (a rank, a list of them; None: all)
        once it would hold more than ``threshold`` bytes with the packet (DCTCP's step marking,
        as the testbed fabric's ``Fabric.queue(mark=)``); 0 turns it off.  Packets that are not
        ECN-capable meet the drop-tail queue as before."""
        if not 0 <= threshold:
            raise ValueError(f"mark threshold {threshold}: use bytes >= 0 (0: no marking)")
        for k in self._ports(port):
            if threshold and threshold > self.links[k].queue:
                raise ValueError(f"mark threshold {threshold} is above port {k}'s queue ({self.links[k].queue} "
                                 "bytes): a packet would be dropped before it is marked; use a smaller one")
            self.mark_at[k] = int(threshold)

    def send(self, src: int, now: float, sizes: np.ndarray, dsts: np.ndarray) -> tuple[int, list, float]:
        """Hand rank ``src``'s packets (bytes on the wire, and each one's destination rank; -1:
        every other rank) to its uplink at ``now``.

        Returns ``(taken, hops, retry)``: how many were taken (a prefix: the send queue was
        full for the next); ``(packet, rank, time)`` of each copy, the moment it reaches the
        switch's port to that rank, in non-decreasing time (each is then :meth:`admit`-ted
        there, at that moment); when the next would fit (inf when all were taken).
        """
        q, lk = self.up[src], self.links[src]
        hops = []
        for i in range(len(sizes)):
            size, dst = int(sizes[i]), int(dsts[i])
            left = q.put(now, size)
            if left is None:
                return i, hops, max(now, q.free - (q.cap - size) * 8 / q.rate)
            at_switch = left + lk.latency
            for d in (range(self.world) if dst < 0 else (dst,)):
                if d != src or dst >= 0:
                    hops.append((i, d, at_switch))
        return len(sizes), hops, math.inf

    def admit(self, d: int, t: float, size: int, ect: bool = False) -> tuple[float, bool] | None:
        """A ``size``-byte packet reaching the switch's port to rank ``d`` at ``t`` (no earlier than
        any packet admitted there before; ``ect``: ECN-capable): its arrival time and whether it
        was marked CE, or None (dropped, counted in :attr:`drops`)."""
        if self.dead[d]:
            self.drops["dead"] += 1
            return None
        cause = self.faults[d].drop(t, self.rng)
        if cause is None:
            q = self.port[d]
            ce = bool(ect and self.mark_at[d] and q.backlog(t) + size > self.mark_at[d])
            left = q.put(t, size)
            if left is not None:
                self.delivered += 1
                self.marks += ce
                t = self.last[d] = max(self.last[d], left + self.links[d].latency)
                return t, ce
            cause = "tail"
        self.drops[cause] += 1
        return None
