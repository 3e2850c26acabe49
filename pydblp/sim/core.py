"""The simulation: N ranks, each running the unchanged :class:`~pydblp.collective.Collective`
over a :class:`~pydblp.sim.transport.SimTransport`, in virtual time, deterministically.

Each rank runs its program in a thread of its own, but only one thread runs at a time: the
scheduler (the thread calling :meth:`Sim.run`) hands the turn to one rank, which runs until
it waits (a receive with nothing there, a send on a full queue, :meth:`Node.compute`) and hands
the turn back.  Virtual time moves only between turns, to the next moment a rank waits for;
ranks due at the same moment run in the order they came due.  Nothing reads the real clock, so
a seed gives the same packets, drops and round records on every run.
"""

from __future__ import annotations

import copy
import dataclasses
import heapq
import itertools
import logging
import math
import threading
from collections.abc import Callable

import numpy as np

from pydblp.collective import Collective, Config, PhaseController, RoundRecord
from pydblp.sim.network import QUANTUM, Link, Network
from pydblp.sim.transport import GROUP_ADDR, SimTransport, _Arrivals, rank_addr

log = logging.getLogger(__name__)

LIMIT = 3600.0  # virtual s a run may last by default


def _baton() -> threading.Lock:
    """A turn handed between two threads: ``release`` gives it, ``acquire`` waits for it (a plain
    lock held from the start: several times cheaper to hand over than a Semaphore)."""
    lock = threading.Lock()
    lock.acquire()
    return lock


class SimError(RuntimeError):
    """The simulation cannot go on: ranks wait with nothing to wake them, or it ran past its limit."""


class _Killed(BaseException):
    """Raised in a rank's thread at its next wait once :meth:`Sim.kill` took effect (unwinds it,
    past the library's ``except Exception`` guards)."""


class _Stopped(BaseException):
    """Raised in a serving rank's thread when the run is over."""


class Node:
    """One simulated rank, handed to the program :meth:`Sim.run` runs.

    Attributes:
        rank: its rank.
        collective: its :class:`~pydblp.collective.Collective` (``idle_thread=False``).
        result: what its program returned (None until it has).
        error: what ended it early (an exception the program raised; ``"killed"``), or None.
    """

    def __init__(self, sim: Sim, rank: int, collective: Collective):
        self.sim, self.rank, self.collective = sim, rank, collective
        self.result = None
        self.error: BaseException | str | None = None
        self.state = "new"            # new, program, serving, done
        self.go = _baton()
        self.token = 0                # its latest wake-up's number (older ones are stale)
        self.wake_at = math.inf
        self.wake_fn: Callable[[], float] | None = None  # while it waits for packets: when they are there
        self.killed = False
        self.exited = False
        self.thread: threading.Thread | None = None

    @property
    def now(self) -> float:
        """Virtual time (s)."""
        return self.sim.now

    @property
    def records(self) -> list[RoundRecord]:
        return list(self.collective.records)

    def compute(self, seconds: float) -> None:
        """Spend ``seconds`` of virtual time between rounds (a training step's compute), answering
        peers meanwhile as the idle responder would."""
        end = self.sim.now + seconds
        while True:
            due = self.collective.serve()
            if self.sim.now >= end:
                return
            self.sim.wait(self.rank, end if due is None else min(end, self.sim.now + max(due, QUANTUM)),
                          self.collective.t._next)


class Sim:
    """``world`` ranks on a simulated switch (see the module docstring).

    Args:
        world: ranks, 1..65535.
        config: every rank's :class:`~pydblp.collective.Config` (default ``Config()``); a phase
            controller given as an object is copied for each rank.
        link: every rank's :class:`~pydblp.sim.network.Link`, or one per rank.
        seed: the network's random draws (loss); the only source of randomness.
        cost: virtual s a rank spends per packet it sends or receives (its CPU; default 0:
            only the links take time).
        limit: virtual s after which :meth:`run` gives up (SimError).
        tick: interrupt coalescing (s): a rank waiting for packets wakes at the next multiple
            of ``tick`` after one arrives, with all that arrived by then (0, the default: at
            each arrival).  A rank's turn costs CPU here in proportion to its messages, so
            at hundreds of ranks a tick of tens of microseconds keeps a run to minutes.

    With ``Config(allgather="broadcast")`` the collectives get the simulated group address
    (a copy to every other rank at the switch).  The faults are the network's: ``sim.network.loss(0.1)``, ``.ge(...)``, ``.burst(...)``
    (:class:`~pydblp.sim.network.Network`); :meth:`kill` ends a rank.
    """

    def __init__(self, world: int, config: Config | None = None, link: Link | list | None = None, seed: int = 0,
                 cost: float = 0.0, limit: float = LIMIT, tick: float = 0.0):
        if not 1 <= world <= 0xFFFF:
            raise ValueError(f"world {world}: use 1..65535")
        if not cost >= 0:
            raise ValueError(f"cost {cost}: use seconds per packet >= 0")
        if not tick >= 0:
            raise ValueError(f"tick {tick}: use seconds >= 0")
        self.world, self.cost, self.limit, self.tick = world, cost, limit, tick
        self.now = 0.0
        self.network = Network(world, link, seed)
        self._hop = min(lk.latency for lk in self.network.links)  # the shortest hop (s)
        self._addr = {rank_addr(r): r for r in range(world)}
        self._heap: list = []   # ranks' turns and kills: (time, seq, rank, token)
        self._ports: list = []  # sends on their way to the switch: (time of the next, seq, hops)
        self._seq = itertools.count()
        self._back = _baton()
        self._kills: list[tuple[float, int]] = []
        self._programs = world  # programs not ended yet
        cfg = config or Config()
        group = (GROUP_ADDR, 0) if cfg.allgather == "broadcast" else None
        peers = [(rank_addr(r), 0) for r in range(world)]
        self.nodes: list[Node] = []
        for r in range(world):
            t = SimTransport(self, r)
            own = cfg  # a controller given as an object is a copy per rank, as in separate processes
            if isinstance(cfg.phase, PhaseController):
                own = dataclasses.replace(cfg, phase=copy.deepcopy(cfg.phase))
            col = Collective(t, r, world, peers, own, group=group, clock=self.clock, idle_thread=False)
            self.nodes.append(Node(self, r, col))

    def clock(self) -> float:
        """The collectives' clock: virtual s."""
        return self.now

    def rank_of(self, addr: str) -> int:
        r = self._addr.get(addr)
        if r is None:
            raise ValueError(f"{addr}: not a simulated rank's address (rank_addr(r), r < {self.world})")
        return r

    def kill(self, rank: int, at: float) -> None:
        """Rank ``rank`` dies at virtual time ``at``: from then it sends and hears nothing, and its
        program ends (``Node.error == "killed"``).  Call before :meth:`run`."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank}: use 0..{self.world - 1}")
        self._kills.append((at, rank))

    # ---- the scheduler -----------------------------------------------------
    def wait(self, rank: int, until: float, wake: Callable[[], float] | None = None) -> None:
        """In rank ``rank``'s thread: hand the turn back until virtual time ``until``, or until
        ``wake()`` (re-read as packets are queued for it) says so, if sooner."""
        node = self.nodes[rank]
        node.wake_fn = wake
        at = until if wake is None else min(until, self._coalesce(wake()))
        self._schedule(node, at)
        self._back.release()
        node.go.acquire()
        if node.killed:
            raise _Killed
        if node.state == "done":
            raise _Stopped

    def charge(self, rank: int, packets: int) -> None:
        """In rank ``rank``'s thread: spend ``cost`` per packet (nothing with cost 0)."""
        if self.cost:
            self.wait(rank, self.now + packets * self.cost)
        elif self.nodes[rank].killed:
            raise _Killed

    def in_flight(self, h) -> None:
        """Packets of a send on their way to the switch (a :class:`~pydblp.sim.transport._Hops`):
        each is admitted at its port when the clock reaches the moment it gets there
        (:meth:`_admit`), in time order with every other send's and before any rank's turn
        due later."""
        heapq.heappush(self._ports, (float(h.times[0]), next(self._seq), h))

    def _admit(self, horizon: float) -> None:
        """Admit packets at their ports in the order they reach the switch, from the earliest on
        its way, up to ``horizon`` (the next rank's turn) and while none of them could meet a
        packet sent in reaction to one already admitted (those reach the switch a hop's latency
        after the first arrival at the soonest); then queue what passed at its receivers, in
        the order it passed (runs of one send each)."""
        ports, net = self._ports, self.network
        first = math.inf  # the first arrival, plus the shortest hop
        got: dict[int, list] = {}  # receiver -> runs [hops, [index], [arrival], [CE]], in admission order
        started = False
        while ports:
            t0, _, h = ports[0]
            if t0 > horizon or (started and t0 >= first):
                break
            heapq.heappop(ports)
            until = min(horizon, ports[0][0] if ports else math.inf)
            times, dst, size, ect = h.times, h.dst, h.size, bool(h.ecn)
            k, n = h.k, len(times)
            while k < n:
                tk = float(times[k])
                if tk > until or (started and tk >= first):
                    break
                started = True  # (the clock stays: a receiver wakes when its packets arrive)
                d = int(dst[k])
                passed = net.admit(d, tk, int(size[k]), ect)
                if passed is not None:
                    runs = got.setdefault(d, [])
                    if not runs or runs[-1][0] is not h:
                        runs.append((h, [], [], []))
                    _, idx, at, ce = runs[-1]
                    idx.append(k)
                    at.append(passed[0])
                    ce.append(passed[1])
                    first = min(first, passed[0] + self._hop)
                k += 1
            h.k = k
            if k < n:
                heapq.heappush(ports, (float(times[k]), next(self._seq), h))
        for d, runs in got.items():
            for h, idx, at, ce in runs:
                self.arrive(d, self.nodes[d].collective.t.arrivals(h, idx, at, ce))

    def arrive(self, rank: int, a: _Arrivals) -> None:
        """Queue packets at ``rank`` (the scheduler calls it, as a port passes them); wake it if it
        waits for them."""
        node = self.nodes[rank]
        if node.killed:
            return
        node.collective.t.queue_arrivals(a)
        if node.wake_fn is not None:
            at = self._coalesce(node.wake_fn())
            if at < node.wake_at:
                self._schedule(node, at)

    def _coalesce(self, at: float) -> float:
        """When a rank waiting for packets that arrive at ``at`` wakes (``tick``)."""
        if not self.tick or at == math.inf:
            return at
        w = math.ceil(at / self.tick) * self.tick
        return w if w >= at else w + self.tick  # (the product can land a float step below at: then
        # the rank would wake before its packets, find none, and wait again at the same instant forever)

    def _schedule(self, node: Node, at: float) -> None:
        node.token += 1
        node.wake_at = at
        if at < math.inf:
            heapq.heappush(self._heap, (max(at, self.now), next(self._seq), node.rank, node.token))

    def _turn(self, node: Node) -> None:
        """Let ``node``'s thread run until it waits or ends."""
        node.wake_fn = None
        node.wake_at = math.inf
        node.go.release()
        self._back.acquire()

    def run(self, program: Callable[[Node], object]) -> list[Node]:
        """Run ``program(node)`` on every rank until every program has returned (or raised, or its
        rank was killed) and the network is quiet (no packet on its way, no trailing message
        waiting); the nodes, with results, errors and round records.

        A program that raises ends its rank as a dead process would (it sends and hears nothing
        more); the others go on.  Raises SimError when ranks wait with nothing that could wake
        them, or virtual time passes ``limit``.
        """
        for at, r in self._kills:  # first: a kill due at the same moment as a turn comes before it
            heapq.heappush(self._heap, (at, next(self._seq), r, -1))
        for r, node in enumerate(self.nodes):
            node.thread = threading.Thread(target=self._main, args=(node, program), name=f"sim-{r}", daemon=True)
            node.thread.start()
            self._schedule(node, 0.0)
        try:
            self._loop()
        finally:
            self._stop()
        return self.nodes

    def _loop(self) -> None:
        heap, ports, nodes = self._heap, self._ports, self.nodes
        while True:
            if ports and (not heap or ports[0][0] <= heap[0][0]):  # packets reach the switch first
                self._admit(heap[0][0] if heap else math.inf)
                continue
            if not heap:
                waiting = [n.rank for n in nodes if n.state == "program"]
                if waiting:
                    raise SimError(f"ranks {waiting} wait at {self.now:.6f} s with nothing to wake them")
                return
            t, _, r, token = heapq.heappop(heap)
            node = nodes[r]
            if t > self.limit:
                raise SimError(f"virtual time passed the limit ({self.limit} s) with ranks "
                               f"{[n.rank for n in nodes if n.state in ('new', 'program')]} still running")
            self.now = t
            if token == -1:  # a kill
                if node.state != "done":
                    node.killed = True
                    self.network.dead[r] = True
                    node.collective.t.drop_arrivals()
                    self._turn(node)  # it unwinds (_Killed) and ends
                continue
            if token != node.token or node.state == "done":
                continue
            self._turn(node)
            if not self._programs and self._quiet():
                return

    def _quiet(self) -> bool:
        """No packet on its way to a live rank, no trailing message waiting."""
        if self._ports:  # (some on their way to the switch)
            return False
        for n in self.nodes:
            if n.state == "done":
                continue
            if n.collective.t._next() < math.inf or n.collective.trailing:
                return False
        return True

    def _main(self, node: Node, program) -> None:
        """A rank's thread: its program, then answering peers until the run is over."""
        node.go.acquire()
        try:
            if node.killed:
                raise _Killed
            if node.state == "done":
                raise _Stopped
            node.state = "program"
            node.result = program(node)
            node.state = "serving"
            self._programs -= 1
            node.collective.hello = False  # (it runs no more rounds)
            while True:
                due = node.collective.serve()
                self.wait(node.rank, math.inf if due is None else self.now + max(due, QUANTUM),
                          node.collective.t._next)
        except _Stopped:
            pass
        except BaseException as e:  # killed, or the program failed: the rank dies as a process would
            node.error = "killed" if node.killed else e
            self.network.dead[node.rank] = True
            node.collective.t.drop_arrivals()
            if node.error != "killed":
                log.info("sim rank %d ended at %.6f s: %r", node.rank, self.now, e)
        finally:
            if node.state in ("new", "program"):
                self._programs -= 1
            node.state = "done"
            node.exited = True
            node.wake_fn = None
            self._back.release()

    def _stop(self) -> None:
        """End every rank's thread (each raises _Stopped at its wait) and close the collectives."""
        for node in self.nodes:
            if node.thread is not None and not node.exited:
                node.state = "done"
                node.go.release()
                self._back.acquire()
        for node in self.nodes:
            if node.thread is not None:
                node.thread.join()
            node.collective.close()
