"""Bounded-loss allreduce over a :class:`~pydblp.transport.Transport`.

One :class:`Collective` per rank.  Every rank calls :meth:`Collective.allreduce`
with a tensor of the same size in the same order; each call is one *round*.

Transpose allreduce (``mode="tar"``, default): the tensor is cut into chunks
of ``chunk_bytes``; chunk rows are split into ``world`` shards and shard k
belongs to rank k.  Reduce-scatter: every rank sends shard k straight to
rank k.  The owner estimates the mean (``zero`` or ``unbiased``) and sends
the result to every rank (all-gather).  Every packet crosses one hop.
Parameter server (``mode="ps"``): one shard, owned by rank 0.  With
``Config(allgather="broadcast")`` an owner sends its all-gather's first pass
once, to ``Collective``'s ``group`` address (destination ``wire.DST_ALL``), and
the switch replicates it; every receiver's bound, STOP, BITMAPs and
retransmissions stay its own, as below.

Completion (DBLP): a message of n chunks with tolerance ``tol`` (1/255
units in the header) is done once ``n - floor(n * tol / 255)`` chunks have
arrived; the receiver then sends STOP (once: a lost STOP holds no round, see
below; its sender probes a probe timeout later and gets another).  Nothing is
waited for past the bound, but chunks
already received when the owner reduces or the round ends are used too (a
receive without waiting takes them in first).  A sender that has sent
everything and heard no STOP within the probe timeout sends PROBE (then backs off:
2x, 4x, ... up to 16x, never past ``probe_max``); the receiver answers
STOP (done) or BITMAP (LSB-first, bit i = chunk i); the sender retransmits
what is missing and lost, not what is still on its way (RACK-style: a chunk
sent before one that arrived, or sent ``LOSS_RTTS`` measured round trips
ago; see ``_Out.lost``).  Receivers do not wait for the probe when they already know
the bound is out of reach (more chunks below the highest one seen are missing
than the tolerance allows): after ``NACK_QUIET`` (2 ms) without a new chunk
they send the BITMAP unasked, and again after each further 2 ms of silence,
at least 4 ms after the previous one while repairs do not get through (a
burst still eating them), until the bound is reached: once NACKed, a message's
chunks not seen yet count as missing too (a lost tail); a sender never
retransmits a chunk it has not sent yet.  Loss within
the bound never triggers one.  All-gather data from an owner also ends the sender's
reduce-scatter message to it (the owner has reduced, so it needs nothing
more).  Loss within the bound is tolerated, loss above it is always
repaired.  Control packets travel at prio 0 over the same transport.

A round returns once this rank's result is in (every all-gather message to it
reached its bound), its reduce-scatter messages are done, and its own all-gather
has gone out whole, without waiting for that all-gather's STOPs (as a TCP send
returns before its data is acknowledged; the wait was the STOP's trip back
often behind the receiver's own queued data: 1.2 ms of a 20 ms 1 MiB round
in the testbed, bench/README.md).  An
all-gather message not acknowledged yet *trails*, on a copy of its rows (the
caller owns the result): this rank keeps answering its BITMAPs, probing it at
the probe timeout and taking its STOP, in the next round's loop or, between
rounds, in the idle responder.  A trailing message ends with its STOP (or a
BITMAP showing its bound reached), or is dropped once its receiver has been
silent for ``peer_timeout`` (counted in ``trail_dropped``: a live receiver
answers every probe).  A probe for a round this rank finished before the last
one gets a STOP (it is done; the record of it is gone).  So a lost STOP costs
no round time: an all-gather's trails, and a reduce-scatter message also ends
with its owner's all-gather, which its sender's round waits for anyway (a
STOP used to go out twice, when a lost one held its sender's round for a probe
timeout; with one copy, 5 ABBA pairs at 1 MiB, clean and at 1 % loss, measured
the same, at 0.3 ms less CPU a rank and round).

The probe timeout is agreed across ranks (OptiReduce-style): each rank
estimates it from the STOP delays it measures (3 x delay + 1 ms, smoothed,
within ``probe_min``..``probe_max``), every STOP carries the sender's
estimate (2-byte payload, units of 100 us), and each rank uses the median
of the latest estimates of all ranks (:attr:`Collective.probe_timeout`).

The loop: each turn sends up to ``burst`` data packets (control first),
receives, and checks timeouts every ``TIMER_TICK`` (dead peers every
``DEAD_TICK``).  A transport that paces itself to a line rate
(:meth:`Transport.tx_backlog`) is handed no more data while it holds
``TXQ_LIMIT`` of it, so a STOP never queues behind a long backlog (and in a
round that repairs loss, a NACK or BITMAP having gone either way, an owner
with a reduce-scatter message of its own not yet done hands over the second
half of its all-gather ``AG_SPLIT`` after the first: a retransmission asked
for meanwhile does not wait behind the whole message in the link's queue).  In
such a round the kernel's send queue (:meth:`Transport.tx_queued`: a UDP
socket's, qdisc included) gets no more data while it holds ``TXQ_REPAIR``
(512 KiB, ~4 ms at 1 Gbit/s), so the repairs a burst makes necessary never
wait behind tens of ms of data, retransmissions the burst ate included (only
then: in a clean round it would cost loop turns and nothing waits).  While
``LINGER_MIN`` or more data packets are on their way (the rest of a stream
that flows, a repair asked for), a receive waits up to ``LINGER`` for them (at
most ``LINGER_WANT``): a stream at line rate arrives in slices, and each
receive has a fixed cost.  A message not begun or stalled is not waited for.

Failure semantics:

* Loss: never raises.  Rounds wait for the bound unless ``deadline`` is set;
  then a round may end below it, which is reported in its
  :class:`RoundRecord` (``below_bound``), never silently.
* A dead or unreachable peer: if a peer the round still needs sends nothing
  for ``peer_timeout`` seconds, :meth:`allreduce` raises
  :class:`CollectiveError` naming the rank.  The collective stays usable
  for a later round only if the peer comes back; tear it down otherwise.
  One that dies after this rank's round returned leaves a trailing
  all-gather message unacknowledged: it is dropped after ``peer_timeout``
  (``trail_dropped``), never raised; the next round raises as above.
* A peer whose data for the round does not fit this rank's (another
  ``chunk_bytes``, tensor size or tensor order: a configuration or caller
  error) keeps probing but can never complete it: once nothing it sent has fit
  for ``peer_timeout`` seconds, :meth:`allreduce` raises
  :class:`CollectiveError` naming the rank and what differs.
* Packets of other jobs, duplicates and late packets of finished rounds are
  ignored and counted (``counters``; so are the retransmissions and probes of
  trailing messages, which no round's record holds); packets of the next round are kept
  until it starts.  Malformed packets never reach here (the transport
  validates them).

Payload: float32 little-endian, ``chunk_bytes / 4`` values per chunk (the
last chunk zero-padded).
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import select
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from pydblp import wire
from pydblp.collective import estimators, phase as phases
from pydblp.wire import (F_CHUNK, F_DST, F_DTYPE, F_FLAGS, F_JOB, F_KIND, F_LEN, F_NCHUNKS, F_ROUND, F_SRC, F_TENSOR,
                         F_TOL)
from pydblp.transport.base import Batch, Transport

# plain ints: numpy compares an array with an IntEnum member ~4x slower than with an int
DATA, PROBE, BITMAP, STOP = (int(k) for k in (wire.Kind.DATA, wire.Kind.PROBE, wire.Kind.BITMAP, wire.Kind.STOP))
RAW, F32 = int(wire.Dtype.RAW), int(wire.Dtype.F32)
AG = int(wire.Flag.ALLGATHER)
DST_ALL = wire.DST_ALL
RETX = int(wire.Flag.RETX)
TAG = int(wire.Flag.TAG)
FEW = 8  # packets up to which a received batch is sorted one by one in Python
MASK32 = 0xFFFFFFFF
STASH_MAX = 65536  # packets of the next round kept before it starts
RECV_BATCH = 2048  # packets taken from the transport per receive call
DRAIN_READS = 8  # receives at most when taking in what has already arrived (a bound was reached)
NACK_QUIET = 0.002  # s of silence from a sender before a receiver that cannot reach the bound NACKs
IDLE_GRACE = 0.002  # s without a round before the idle responder serves the transport
LINGER, LINGER_WANT = 0.002, 256  # receive coalescing while a data stream trickles in
LINGER_MIN = 16  # fewer data packets due than this: a receive takes what is there
TIMER_TICK = 0.0005  # s between checks of the NACK, probe and peer timeouts
DEAD_TICK = 0.02  # s between dead-peer checks (peer_timeout is seconds)
TXQ_LIMIT = 0.002  # s of data a pacing transport may hold before more is handed to it (TCP small queues)
TXQ_REPAIR = 512 << 10  # bytes in the kernel's send queue past which a round that repairs hands it no more
LOSS_RTTS = 1.5  # round trips after which a retransmission still missing from a BITMAP counts as lost
AG_SPLIT = 0.0025  # s an owner holds back the second half of its all-gather in a round that repairs


_libc = ctypes.CDLL(None, use_errno=True)
_libc.timerfd_settime.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
CLOCK_MONOTONIC, TFD_CLOEXEC = 1, 0o2000000


def _checked(rc: int, call: str) -> int:
    """``rc`` of a libc call, or its errno as an OSError naming ``call``."""
    if rc < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{call}: {os.strerror(e)}")
    return rc


class _Alarm:
    """A one-shot timer a thread sleeps on (a timerfd): setting or clearing it wakes no one."""

    def __init__(self):
        self.fd = _checked(_libc.timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC), "timerfd_create")
        self._spec = (ctypes.c_int64 * 4)()  # struct itimerspec: interval (s, ns) 0, expiry (s, ns)

    def set(self, after: float) -> None:
        """Fire ``after`` seconds from now; 0 clears it (an expiry not yet waited for is dropped)."""
        self._spec[2], self._spec[3] = divmod(round(after * 1e9), 10**9)
        _checked(_libc.timerfd_settime(self.fd, 0, self._spec, None), "timerfd_settime")

    def wait(self) -> None:
        """Sleep until it fires."""
        os.read(self.fd, 8)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


CHUNK_MAX = 8000  # Config.check's bound
ALLGATHERS = ("unicast", "broadcast")


def link_chunk_bytes(mtu: int) -> int:
    """The largest ``Config.chunk_bytes`` a link of ``mtu`` carries in one datagram, over IPv4 or
    IPv6: ``mtu`` less the IPv6, UDP and DBLP headers, rounded down to a multiple of 64 bytes, at
    most 8000.  MTU 1500 gives the default 1408; MTU 9000 gives 8000.  Raises ValueError below 144.
    """
    least = 64 + wire.DATAGRAM_OVERHEAD
    if mtu < least:
        raise ValueError(f"mtu {mtu}: a DBLP chunk of 64 bytes needs an MTU of at least {least}")
    return min(CHUNK_MAX, (mtu - wire.DATAGRAM_OVERHEAD) // 64 * 64)


class CollectiveError(RuntimeError):
    """A round cannot complete: a peer is dead or unreachable, or the inputs disagree."""


@dataclass
class Config:
    """Knobs of a collective; every rank must use the same mode, chunk size and job."""

    job: int = 1
    mode: str = "tar"                # "tar" (transpose allreduce) or "ps" (parameter server, rank 0)
    estimator: str = "unbiased"      # "zero" (sum/N) or "unbiased" (sum/arrived)
    fill: str = "stale"              # all-gather misses: "stale" or "local"
    allgather: str = "unicast"       # "unicast" (a copy per rank) or "broadcast" (one copy to the
                                     # Collective's group address; the network replicates it)
    priority: str = "magnitude"      # "magnitude", "position" or "none"
    phase: object = "static:0"       # a PhaseController or "static:TOL" / "dblp[:P_LOW]"
    chunk_bytes: int | None = 1408   # payload per packet (fits MTU 1500 over IPv4 and IPv6); None:
                                     # pydblp.torch.State picks the links' size (link_chunk_bytes)
    deadline: float | None = None    # seconds; a round may end below the bound only if set
                                     # (owners stop waiting for contributions at half of it)
    peer_timeout: float = 10.0       # a needed peer silent this long fails the round
    probe_min: float = 0.002         # probe timeout bounds (s); it adapts to measured STOP delays
    probe_max: float = 0.05
    burst: int = 1024                # packets sent per loop turn before draining receive; what every
                                     # sender has in flight must fit the receivers' rings (there is no
                                     # pacing): AF_XDP's 16384 receive frames by default

    def check(self) -> None:
        """Raise ValueError naming the first knob out of range (a :class:`Collective` checks its
        config before it registers any peer; ``pydblp.torch`` before it opens anything)."""
        for name, value, allowed in (("mode", self.mode, ("tar", "ps")),
                                     ("estimator", self.estimator, estimators.ESTIMATORS),
                                     ("fill", self.fill, estimators.FILLS),
                                     ("allgather", self.allgather, ALLGATHERS),
                                     ("priority", self.priority, estimators.PRIORITIES)):
            if value not in allowed:
                raise ValueError(f"{name} {value!r}: use {', '.join(allowed)}")
        if self.chunk_bytes is None:
            raise ValueError("chunk_bytes None: give a size (pydblp.torch.State.from_process_group picks one "
                             "from the links' MTU; link_chunk_bytes(mtu) computes it)")
        if self.chunk_bytes % 4 or not 64 <= self.chunk_bytes <= CHUNK_MAX:
            raise ValueError(f"chunk_bytes {self.chunk_bytes}: use a multiple of 4 in 64..{CHUNK_MAX}")
        if not 1 <= self.job <= 0xFFFFFFFF:
            raise ValueError(f"job {self.job}: use 1..{0xFFFFFFFF} (0 marks no job on the wire)")
        for name, value in (("peer_timeout", self.peer_timeout), ("probe_min", self.probe_min),
                            ("deadline", 1.0 if self.deadline is None else self.deadline)):
            if not value > 0:
                raise ValueError(f"{name} {value}: use a positive number of seconds")
        if self.probe_max < self.probe_min:
            raise ValueError(f"probe_max {self.probe_max} is below probe_min {self.probe_min}")
        if self.burst < 1:
            raise ValueError(f"burst {self.burst}: use 1 or more packets")
        phases.make(self.phase)  # a bad phase spec or tolerance

    def check_group(self, group) -> None:
        """Raise ValueError unless ``group`` (Collective's) is given exactly when ``allgather`` is
        "broadcast"."""
        if (self.allgather == "broadcast") != (group is not None):
            raise ValueError("allgather 'broadcast' needs group=(address, port): an address every rank receives "
                             "(the subnet's broadcast address)" if group is None else
                             "group is used only with Config(allgather='broadcast')")


@dataclass
class RoundRecord:
    index: int
    round: int
    tensor: int
    tol: float
    phase: str
    latency: float
    delivered: dict = field(default_factory=dict)   # "rs:<src>" / "ag:<src>" -> fraction received
    min_delivered: float = 1.0
    # retransmits and probes: of this round's messages while it ran; a trailing message's after
    # it returned are in counters["trail_retransmits"] and ["trail_probes"]
    retransmits: int = 0    # chunks resent
    probes: int = 0
    nacks: int = 0          # unsolicited BITMAPs this rank sent as a receiver
    bytes_sent: int = 0
    bytes_received: int = 0
    below_bound: bool = False


class _Out:
    """One outgoing message: rows of a shard to one peer, in round ``rnd`` of tensor ``tensor``."""

    def __init__(self, ag: bool, dst: int, rows: np.ndarray, prio: np.ndarray, tol8: int, rnd: int, tensor: int):
        self.ag, self.dst, self.rows, self.prio, self.tol8 = ag, dst, rows, prio, tol8
        self.rnd, self.tensor = rnd, tensor
        self.n = len(rows)
        self.need = self.n - self.n * tol8 // 255
        self.sent = 0
        self.avail = self.n                  # chunks that may go out now (the rest are held back)
        self.retx = None                     # chunks queued for retransmission (made by the first BITMAP)
        self.nretx = 0
        self.acked = None                    # chunks a BITMAP said arrived (made by the first one)
        self.seq = None                      # per chunk: its latest send's number (first sends: 0..n-1, in
        self.t_rtx = None                    # chunk order), and when its latest retransmission went
        self.nseq = self.n                   # the next retransmission's number (both made by the first BITMAP)
        self.rtt = None                      # s from a retransmission to the BITMAP showing it in (latest)
        self.done = self.n == 0
        self.members = ()                    # broadcast all-gather: the messages whose first pass this one
                                             # sends (their own ``sent`` follows it; they never send one)
        self.trailing = False                # the round has returned; this waits for its STOP (Collective._trail)
        self.t_heard = 0.0                   # when its receiver last answered (a BITMAP); trailing: or it began
        self.t_sent_all = None
        self.t_last = 0.0
        self.probes = 0        # all probes sent
        self.timeouts = 0      # probes sent because the timeout passed
        self.retransmits = 0

    def lost(self, seg: slice, new: np.ndarray, now: float) -> np.ndarray:
        """Chunks of ``seg`` a BITMAP shows missing that are lost, not still on their way
        (``new``: the chunks it shows in for the first time).

        Packets to one peer travel one path in order, so a missing chunk sent before one
        the receiver has (by send number: first sends in chunk order, then each
        retransmission) is lost.  One sent after it may still wait in this host's queue or
        on the wire (a long repair queued at line rate; a probe's BITMAP overtakes it): it
        counts as lost only once it went out ``LOSS_RTTS`` round trips ago (the time the latest
        retransmission shown arrived took to show up), else the next BITMAP decides.
        Without a measured round trip yet, everything missing counts.
        """
        seq = self.seq[seg]
        resent = seq >= self.n
        got = self.acked[seg]
        miss = ~got
        shown = new & resent  # retransmissions this BITMAP shows arrived: a round-trip sample
        if shown.any():
            j = seg.start + np.flatnonzero(shown)[seq[shown].argmax()]
            self.rtt = now - self.t_rtx[j]
        if self.rtt is None:
            return miss
        top = seq[got].max() if got.any() else -1
        went = np.where(resent, self.t_rtx[seg], self.t_sent_all if self.t_sent_all is not None else now)
        return miss & ((seq < top) | (went <= now - LOSS_RTTS * self.rtt))


class _In:
    """One incoming message: a shard from one peer; ``mask`` (a view of the reduce buffer's or the
    result's mask) marks its chunks that arrived."""

    def __init__(self, ag: bool, src: int, mask: np.ndarray):
        self.ag, self.src, self.n, self.mask = ag, src, len(mask), mask
        self.count = 0
        self.hi = 0            # 1 + the highest chunk seen (senders send in chunk order)
        self.t_data = 0.0      # when a new chunk last arrived
        self.t_nack = 0.0      # when the last unsolicited BITMAP went out
        self.nacks = 0         # unsolicited BITMAPs since a repair last got through
        self.asked = 0         # chunks missing below hi when the last one went out
        self.count_nack = 0    # count then
        self.tol8 = None       # the sender's bound, from its packets (None: none heard yet)
        self.stop_sent = False

    @property
    def tol8(self) -> int | None:
        return self._tol8

    @tol8.setter
    def tol8(self, tol8: int | None) -> None:
        self._tol8 = tol8
        self.need = self.n if tol8 is None else self.n - self.n * tol8 // 255  # chunks that make it done

    @property
    def done(self) -> bool:
        return self.count >= self.need


class _Round:
    """State of one round; its attributes are set by ``Collective._start``."""


class Collective:
    """Bounded-loss allreduce for one rank.

    ``peers[r]`` is ``(addr, port)`` or ``(addr, port, mac)`` of rank r (this
    rank's own entry is ignored).  Not thread-safe: one caller at a time.

    ``group``: with ``Config.allgather="broadcast"`` (and only then), ``(addr, port)`` or
    ``(addr, port, mac)`` that reaches every rank at once: an IPv4 subnet broadcast address
    (``198.19.255.255`` in the testbed's 198.18.0.0/15; MAC ``ff:ff:ff:ff:ff:ff``) on one
    L2 segment whose switch replicates it.  An owner then sends its all-gather's first pass
    once, to ``group``, with destination ``wire.DST_ALL``, instead of once per rank: a third
    of the all-gather's bytes on its link with 4 ranks (what each rank receives is unchanged,
    so this serves a parameter server, ``mode="ps"``, far more than a transpose allreduce).
    Each receiver's bound, STOP, BITMAPs and retransmissions stay its own (unicast), so loss
    on one receiver's port costs only it.

    Between rounds a thread of its own (``pydblp-idle-<rank>``) answers peers'
    late probes, serves the last rounds' trailing all-gather messages
    (retransmissions asked for, probes) and keeps the next round's packets; it
    sleeps while nothing arrives and no probe is due, and is never woken by
    rounds that follow each other within ``IDLE_GRACE`` (2 ms).  :meth:`close`
    ends it.
    """

    def __init__(self, transport: Transport, rank: int, world: int, peers: list, config: Config | None = None,
                 group: tuple | None = None):
        self.cfg = config or Config()
        c = self.cfg
        c.check()
        c.check_group(group)
        if not 1 <= world <= 0xFFFF:
            raise ValueError(f"world {world}: use 1..65535")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank}: use 0..{world - 1} (world {world})")
        if len(peers) != world:
            raise ValueError(f"{len(peers)} peers for world {world}: give one (address, port) per rank")
        if transport.closed:
            raise ValueError("the transport is closed: give the collective an open one (it closes it itself)")
        self.t, self.rank, self.world = transport, rank, world
        self.C = c.chunk_bytes // 4
        self.controller = phases.make(c.phase)
        self._pid = np.full(world, -1, np.int32)
        for r, p in enumerate(peers):
            if r != rank:
                addr, port, *mac = p
                self._pid[r] = transport.add_peer(addr, port, mac[0] if mac else None)
        self._gid = -1  # the group's peer id (broadcast all-gather)
        if group is not None:
            addr, port, *mac = group
            self._gid = transport.add_peer(addr, port, mac[0] if mac else None)
        self._rx = Batch.empty(RECV_BATCH, max(c.chunk_bytes, 64))
        self._txbuf = np.empty((0, c.chunk_bytes), np.uint8)
        self._txh = wire.empty_batch(0)
        self._txlens = self._txpeer = np.empty(0, np.int32)
        self.round = 0
        self.index = 0
        self.records: list[RoundRecord] = []
        self.counters = dict.fromkeys(("foreign", "late", "duplicate", "stashed", "stash_full", "bad_payload",
                                       "tx_short", "trail_retransmits", "trail_probes", "trail_dropped"), 0)
        self._last: dict[int, np.ndarray] = {}   # tensor id -> previous result rows (stale fill)
        self._bufs: dict[tuple, np.ndarray] = {}  # (name, tensor id) -> scratch reused across rounds
        self._prev = None                         # (round, {(ag, src): _In}) answers late probes
        self._trail: dict[tuple, _Out] = {}        # (round, ag, dst) -> all-gather message not yet acknowledged
        self._stash: list[tuple] = []             # packets of the next round
        self._probe_timeout = 0.005
        self._tx_wait = None                      # s to wait for the transport's queue to drain
        self._timeouts: list = [None] * world     # each rank's latest estimate (s), from its STOPs
        self._ctrl: list[tuple] = []
        self._qmask = self._qtmp = None           # _match's header word mask and scratch (made once)
        self._qvals = self._qrec = None           # _match's expected words (the round's, see _qval)
        self._closing = False
        self._poll_lock = threading.Lock()   # whoever holds it owns the transport
        self._running = False                # a round runs or is about to take the lock
        self._serving = False                # the idle responder polls the transport
        self._alarm = _Alarm()               # starts the idle responder IDLE_GRACE after a round
        self._wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)  # ends its poll
        self._idler = threading.Thread(target=self._idle_loop, name=f"pydblp-idle-{rank}", daemon=True)
        try:
            self._idler.start()
        except BaseException:
            self._alarm.close()
            os.close(self._wake)
            raise
        self._alarm.set(IDLE_GRACE)

    # ---- public ----------------------------------------------------------
    def allreduce(self, x: np.ndarray, tensor: int = 0, op: str = "mean") -> np.ndarray:
        """Return the estimated mean (or sum, ``op="sum"``) of ``x`` over all ranks.

        Same shape as ``x``, float32.  Raises :class:`CollectiveError` when a
        needed peer is silent for ``peer_timeout``.
        """
        if op not in ("mean", "sum"):
            raise ValueError("op must be mean or sum")
        out = self._round(x, tensor, reduce=True)
        self.controller.observe(self.index - 1, out)
        return out * np.float32(self.world) if op == "sum" else out

    def broadcast_shards(self, x: np.ndarray, tensor: int = 0) -> np.ndarray:
        """Every rank gets shard k of ``x`` from its owner k (an all-gather of absolute values).

        Used for bounded-drift parameter broadcast (Weintraub et al.): a chunk
        that does not arrive keeps this rank's own value, so ranks drift by
        at most what one missed broadcast leaves, never a random walk.
        Same bound, STOP/PROBE and failure semantics as :meth:`allreduce`.
        """
        return self._round(x, tensor, reduce=False)

    def close(self) -> None:
        """Stop answering peers and close the transport.

        Peers still probing for the last round's STOPs, or waiting for a
        retransmission of this rank's trailing all-gather, then time out:
        close only after every rank has finished (``pydblp.torch.State.close``
        barriers first).
        """
        if not self._closing:
            self._closing = True
            self._alarm.set(1e-9)
            os.eventfd_write(self._wake, 1)
            self._idler.join(timeout=5)
            if not self._idler.is_alive():  # (else it is stuck in a transport call: leave its fds)
                self._alarm.close()
                os.close(self._wake)
        self.t.close()

    def _round(self, x: np.ndarray, tensor: int, reduce: bool) -> np.ndarray:
        if self._closing:
            raise CollectiveError("collective is closed")
        flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        self._running = True
        self._alarm.set(0)
        if self._serving:
            os.eventfd_write(self._wake, 1)
        with self._poll_lock:  # the idle responder leaves its poll at once; a receive of its runs to the end
            try:
                st = self._start(flat, tensor, reduce)
                try:
                    self._run(st)
                finally:
                    self._finish(st)
            finally:
                self._running = False
                self._alarm.set(IDLE_GRACE)
        return st.y.reshape(-1)[: flat.size].reshape(np.shape(x))

    def _idle_loop(self) -> None:
        """Between rounds: answer probes for the finished round, keep the next round's packets.

        A receiver's STOP can be lost after it has finished; the sender then
        probes, and someone must answer even if this rank's caller is busy
        computing (or done).  This thread sleeps on an alarm that a round sets
        for IDLE_GRACE as it ends and clears as the next begins: back-to-back
        rounds keep the transport and never wake it (packets wait in the ring
        meanwhile).  Once the alarm fires it polls the transport and the wake
        descriptor, takes what arrives (the lock hands the transport over), and
        leaves when a round begins, which writes the wake descriptor: a round
        waits at most for one receive that has already begun, never for a poll.
        """
        fd, wake = self.t.fileno(), self._wake
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.register(wake, select.POLLIN)
        while True:
            self._alarm.wait()
            self._serving = True  # (set before _running is read: _round reads them the other way round)
            try:
                while not self._closing and not self._running:
                    backlog = self.t.tx_backlog()  # a pacing transport releases its queue in receives
                    due = self._trail_due(time.monotonic())  # a trailing message's probe or retransmissions
                    waits = (([max(1, int(backlog * 1000))] if backlog > 0 else [])
                             + ([math.ceil(due * 1000)] if due is not None else []))
                    ready = poller.poll(min(waits) if waits else None)
                    if any(f == wake for f, _ in ready):
                        with contextlib.suppress(BlockingIOError):
                            os.eventfd_read(wake)
                        continue
                    if not self._poll_lock.acquire(blocking=False):
                        continue  # a round has begun
                    try:
                        if not self._running:
                            while self._take(None, 0.0) >= RECV_BATCH:
                                pass
                            if self._trail:
                                self._serve_trail(time.monotonic())
                            self._flush_ctrl()
                    finally:
                        self._poll_lock.release()
            finally:
                self._serving = False
            if self._closing:
                return

    # ---- round set-up ----------------------------------------------------
    def _start(self, flat: np.ndarray, tensor: int, reduce: bool = True) -> _Round:
        st = _Round()
        st.reduce = reduce
        st.bcast = None  # broadcast all-gather: the message that sends its first pass to every rank
        self.round = (self.round + 1) & MASK32
        st.round, st.tensor, st.index = self.round, tensor, self.index
        st.tol = self.controller.tol(self.index)
        st.tol8 = min(254, int(st.tol * 255))
        st.phase = self.controller.phase()
        T = max(1, -(-flat.size // self.C))
        st.x = self._scratch("x", tensor, (T, self.C))
        st.x.reshape(-1)[: flat.size] = flat
        st.x.reshape(-1)[flat.size:] = 0  # the last chunk's padding
        nsh = self.world if self.cfg.mode == "tar" else 1
        st.bounds = [(k * T // nsh, (k + 1) * T // nsh) for k in range(nsh)]
        st.owner = {k: k for k in range(nsh)} if nsh > 1 else {0: 0}
        me = self.rank
        st.my_shard = me if me < nsh else None
        st.y = np.empty_like(st.x)  # every row is written: own shard, all-gather, or _finish's fill
        st.have = np.zeros(T, bool)  # result rows in (own shard, all-gather); the all-gather masks are its slices
        st.ins: dict[tuple[bool, int], _In] = {}
        st.outs: dict[tuple[bool, int], _Out] = {}
        st.reduced = st.my_shard is None
        if st.my_shard is not None and not reduce:  # broadcast: my shard is my own values
            a, b = st.bounds[st.my_shard]
            st.y[a:b] = st.x[a:b]
            self._start_allgather(st)
        elif st.my_shard is not None:
            a, b = st.bounds[st.my_shard]
            st.rbuf = self._scratch("rbuf", tensor, (self.world, b - a, self.C))  # masked by rmask
            st.rmask = np.zeros((self.world, b - a), bool)
            st.rbuf[me] = st.x[a:b]
            st.rmask[me] = True
            st.rflat, st.rmflat = st.rbuf.reshape(-1, self.C), st.rmask.reshape(-1)  # row src * n + chunk
            for src in range(self.world):
                if src != me:
                    st.ins[(False, src)] = _In(False, src, st.rmask[src])
        st.hi = np.zeros((2, self.world), np.intp)  # [all-gather?, src]: 1 + the highest chunk seen
        st.ag_first = np.zeros(self.world, np.intp)  # owner k's first result row
        st.ag_n = np.full(self.world, -1, np.int64)  # chunks in owner k's all-gather message to me (-1: none)
        for k, (a, b) in enumerate(st.bounds):
            if k == st.my_shard:
                continue
            st.ins[(True, k)] = _In(True, k, st.have[a:b])
            st.ag_first[k], st.ag_n[k] = a, b - a
            if not reduce:
                continue
            rows = st.x[a:b]
            st.outs[(False, k)] = _Out(False, k, rows, self._prio(rows, a, T), st.tol8, st.round, tensor)
        for key, inn in list(st.ins.items()):
            if inn.n == 0:
                del st.ins[key]
        st.qval = self._qval(st)
        st.t0 = time.monotonic()
        st.t_timers = st.t_alive = st.t0
        st.nacks = 0
        st.repair = False  # a NACK went out or a BITMAP came in this round
        st.ag_rest = None  # when the all-gather's held-back half may go (None: nothing held)
        st.heard = np.full(self.world, st.t0)
        st.misfit = {}  # src -> (when, what): its first DATA of this round that does not fit this rank's
        st.foreign0 = self.counters["foreign"]
        st.stats0 = self.t.stats()
        stash, self._stash = self._stash, []
        for hdr, pay, lens in stash:
            self._process(st, hdr, pay, lens, st.t0)
        return st

    def _scratch(self, name: str, tensor: int, shape: tuple) -> np.ndarray:
        """A float32 buffer kept across rounds (no allocation or page faults per round); contents stale."""
        key = (name, tensor)
        buf = self._bufs.get(key)
        if buf is None or buf.shape != shape:
            buf = self._bufs[key] = np.empty(shape, np.float32)
        return buf

    def _prio(self, rows: np.ndarray, first: int, total: int) -> np.ndarray:
        return estimators.chunk_priority(rows, self.cfg.priority, first, total)

    # ---- the loop --------------------------------------------------------
    def _run(self, st: _Round) -> None:
        cfg = self.cfg
        while True:
            now = time.monotonic()
            late = cfg.deadline is not None and now - st.t0 > cfg.deadline / 2
            if not st.reduced and (late or all(st.ins[(False, s)].done for s in range(self.world)
                                               if (False, s) in st.ins)):
                self._drain(st)
                self._reduce(st)  # with a deadline, owners stop waiting at half of it
            busy = self._send_some(st, now)
            self._flush_ctrl()
            if self._complete(st) or (cfg.deadline is not None and now - st.t0 > cfg.deadline):
                self._drain(st)  # (past the deadline: below the bound; _finish fills the gaps and reports it)
                self._flush_ctrl()
                return
            want = 1 if busy else self._expected(st, now)
            self._take(st, 0.0 if busy else self._tx_wait or 0.002, want, LINGER if want > 1 else 0.0)
            now = time.monotonic()
            if now - st.t_timers >= TIMER_TICK:  # timeouts are milliseconds: no need to check every turn
                st.t_timers = now
                self._timers(st, now)

    def _drain(self, st: _Round) -> None:
        """Take in what has already arrived, without waiting.

        A message is done at its bound, and nothing is waited for past it,
        but chunks that are already here when the owner reduces or the round
        ends still count: the estimate and the all-gather use every chunk
        received, not just the first ``need``.  One receive takes what is
        queued; another follows only while they come back at least half full
        (a queue longer than a batch), at most DRAIN_READS: a stream still
        arriving at line rate is not waited for.
        """
        for _ in range(DRAIN_READS):
            if self._take(st, 0.0) < RECV_BATCH // 2:
                return

    def _take(self, st: _Round | None, timeout: float, want: int = 1, linger: float = 0.0) -> int:
        """Receive one batch and handle it (``st`` None: between rounds); how many packets came.

        The transport may lend its own buffers (``copy=False``): ``_process``
        is done with them before the next receive (the stash copies what it keeps).
        """
        b = self.t.recv(self._rx, timeout=timeout, want=want, linger=linger, copy=False)
        if b.n:
            self._process(st, b.headers[: b.n], b.payload[: b.n], b.lengths[: b.n], time.monotonic())
        return b.n

    def _expected(self, st: _Round, now: float) -> int:
        """How many packets a receive may wait for: the data packets on their way, at most
        LINGER_WANT; 1 when fewer than LINGER_MIN are (a control packet or a message's last chunks
        go at once, and so do the replies to a NACK or a STOP).

        On their way: the rest of a stream that has begun and still flows (a chunk within
        ``NACK_QUIET``), and the repair a NACK asked for within ``NACK_QUIET``.  A message not
        begun (an all-gather before its owner has reduced) or stalled below its bound waits for
        someone to act, not for data: lingering for it would only hold back this rank's own next
        step (its reduce once its reduce-scatter is in, its answers).  Until this rank has reduced
        only its reduce-scatter counts: all-gather data still coming must not hold its reduce past
        the moment its own shard's contributions are in.
        """
        due = 0
        for inn in st.ins.values():
            # (before the reduce: reduce-scatter messages only; after it: all-gather ones only)
            if inn.done or inn.ag != st.reduced or now - max(inn.t_data, inn.t_nack) >= NACK_QUIET:
                continue
            coming = (inn.n - inn.hi if inn.hi else 0) + max(0, inn.asked - (inn.count - inn.count_nack))
            due += min(coming, inn.need - inn.count)
            if due >= LINGER_WANT:
                return LINGER_WANT
        return due if due >= LINGER_MIN else 1

    def _complete(self, st: _Round) -> bool:
        """This rank's result is in (every all-gather message to it reached its bound), its reduce-scatter
        messages are done, its own all-gather has gone out whole, no retransmission it was asked for
        waits, and the transport holds no paced backlog: the round may return.  All-gather messages
        not yet acknowledged then trail (see ``_finish``)."""
        return (st.reduced and all(i.done for i in st.ins.values() if i.ag)
                and all(o.done or (o.ag and o.sent == o.n and not o.nretx) for o in st.outs.values())
                and self.t.tx_backlog() <= 0)

    def _reduce(self, st: _Round) -> None:
        """Owner: estimate the shard's mean and start the all-gather."""
        a, b = st.bounds[st.my_shard]
        st.y[a:b] = estimators.reduce_mean(st.rbuf, st.rmask, self.cfg.estimator, scratch=True)
        self._start_allgather(st)

    def _start_allgather(self, st: _Round) -> None:
        a, b = st.bounds[st.my_shard]
        st.have[a:b] = True
        st.reduced = True
        prio = self._prio(st.y[a:b], a, len(st.y))
        # a round that repairs, while a reduce-scatter message of mine may still need retransmissions
        # (the last owner to reduce has none left: all of it goes at once)
        split = st.reduce and st.repair and any(not o.done for (ag, _), o in st.outs.items() if not ag)
        members = []
        for dst in range(self.world):
            if dst != self.rank and b > a:
                o = st.outs[(True, dst)] = _Out(True, dst, st.y[a:b], prio, st.tol8, st.round, st.tensor)
                members.append(o)
        first = members
        if self._gid >= 0 and members:  # one first pass to the group; each member only follows it
            bc = st.bcast = _Out(True, DST_ALL, st.y[a:b], prio, st.tol8, st.round, st.tensor)
            bc.members = members
            for o in members:
                o.avail = 0
            first = [bc]
        if split:
            for o in first:
                o.avail = o.n // 2
            st.ag_rest = time.monotonic() + AG_SPLIT

    # ---- sending ---------------------------------------------------------
    def _send_some(self, st: _Round, now: float) -> bool:
        """Send up to ``burst`` data packets in one batch, retransmissions first, with waiting control packets.

        Returns True if more wait.  The budget is shared fairly across the
        messages still sending, so no destination waits behind another.
        Nothing is sent while the transport holds more than ``TXQ_LIMIT`` of
        paced data (``Transport.tx_backlog``): a control packet queued next
        then waits at most that long; nor, in a round that repairs, while the
        kernel's send queue holds more than ``TXQ_REPAIR`` (``Transport.tx_queued``).
        ``_tx_wait`` says how long to wait.
        """
        self._tx_wait = None
        bc = st.bcast
        if st.ag_rest is not None and now >= st.ag_rest:  # the all-gather's second half may go
            st.ag_rest = None
            for o in (st.outs.values() if bc is None else (bc,)):  # (a broadcast's members follow it)
                o.avail = o.n
        active = [o for o in st.outs.values() if not o.done and (o.sent < o.avail or o.nretx)]
        if bc is not None and bc.sent < bc.avail and not all(o.done for o in bc.members):
            active.append(bc)
        if self._trail:  # retransmissions an earlier round's trailing all-gather was asked for
            active += [o for o in self._trail.values() if not o.done and o.nretx]
        if not active:
            if st.ag_rest is not None:
                self._tx_wait = max(0.0005, st.ag_rest - now)
            return False
        backlog = self.t.tx_backlog()
        if backlog > TXQ_LIMIT:  # a pacing transport holds enough: STOPs and PROBEs must not queue behind more
            self._tx_wait = min(0.002, max(0.001, backlog - TXQ_LIMIT / 2))
            return False
        if st.repair and self.t.tx_queued() > TXQ_REPAIR:  # a retransmission asked for next must not wait long
            self._tx_wait = 0.001
            return False
        share = max(1, self.cfg.burst // len(active))
        parts = []
        for o in active:
            budget = share
            if o.nretx:
                idx = self._resend(o, budget, now)
                parts.append((o, idx, RETX))
                budget -= len(idx)
            if o.sent < o.avail and budget > 0:
                idx = np.arange(o.sent, min(o.avail, o.sent + budget))
                o.sent += len(idx)
                parts.append((o, idx, 0))
                if o.sent == o.n:
                    o.t_sent_all = now
            o.t_last = now
        if bc is not None:
            for o in bc.members:  # they went out with the group's copy
                if o.sent < bc.sent:
                    o.sent = o.avail = bc.sent
                    o.t_last = now
                    o.t_sent_all = bc.t_sent_all
        self._send_batch(st, parts)
        more = any(o.sent < o.avail or o.nretx for o in active)
        if not more and st.ag_rest is not None:
            self._tx_wait = max(0.0005, st.ag_rest - now)
        return more

    def _resend(self, o: _Out, budget: int, now: float) -> np.ndarray:
        """Take up to ``budget`` of ``o``'s chunks queued for retransmission off its queue; their indices."""
        idx = np.flatnonzero(o.retx)[:budget]
        o.retx[idx] = False
        o.nretx -= len(idx)
        o.seq[idx] = np.arange(o.nseq, o.nseq + len(idx))
        o.nseq += len(idx)
        o.t_rtx[idx] = now
        o.retransmits += len(idx)
        if o.trailing:
            self.counters["trail_retransmits"] += len(idx)
        return idx

    def _send_batch(self, st: _Round | None, parts: list) -> None:
        """One batch: the control packets waiting, then DATA ``parts`` ((message, chunk indices, flags)).

        One transport call (one kick) per loop turn, control first: a STOP
        never waits behind data.
        """
        ctrl, self._ctrl = self._ctrl, []
        nc = len(ctrl)
        k = nc + sum(len(idx) for _, idx, _ in parts)
        if k == 0:
            return
        width = self.C * 4
        if self._txbuf.shape[0] < k:  # kept across calls: the transport's set-up for them is reused too
            self._txbuf = np.empty((k, width), np.uint8)
            self._txh = wire.empty_batch(k)
            self._txlens = np.empty(k, np.int32)
            self._txpeer = np.empty(k, np.int32)
        payload = self._txbuf[:k]  # the transport copies it out before send() returns
        h = self._txh[:k]  # every field but magic and version is written below
        lens = self._txlens[:k]
        lens[:] = width
        peer = self._txpeer[:k]
        for i, (rnd, tensor, kind, ag, dst, n, tol8, chunk, pl) in enumerate(ctrl):
            h[i] = (wire.MAGIC, wire.VERSION, kind, self.cfg.job, rnd, tensor, self.rank, dst, 0,
                    RAW, chunk, max(n, 1), len(pl), tol8, AG if ag else 0)
            payload[i, : len(pl)] = np.frombuffer(pl, np.uint8)
            lens[i] = len(pl)
            peer[i] = self._pid[dst]
        if parts:
            rnd, tensor = (st.round, st.tensor) if st is not None else (parts[0][0].rnd, parts[0][0].tensor)
            d = h[nc:]
            d["kind"] = DATA
            d["job"] = self.cfg.job
            d["round"] = rnd
            d["tensor"] = tensor
            d["src"] = self.rank
            d["dtype"] = F32
            d["len"] = width
            i = nc
            for o, idx, flags in parts:
                j = i + len(idx)
                h["dst"][i:j] = o.dst
                h["prio"][i:j] = o.prio[idx]
                h["chunk"][i:j] = idx
                h["nchunks"][i:j] = o.n
                h["tol"][i:j] = o.tol8
                h["flags"][i:j] = flags | (AG if o.ag else 0)
                if o.rnd != rnd:  # a trailing message of an earlier round
                    h["round"][i:j], h["tensor"][i:j] = o.rnd, o.tensor
                lo = int(idx[0])
                rows = o.rows[lo: lo + len(idx)] if int(idx[-1]) - lo + 1 == len(idx) else o.rows[idx]
                payload[i:j] = rows.view(np.uint8)
                peer[i:j] = self._gid if o.dst == DST_ALL else self._pid[o.dst]
                i = j
        self._send(Batch(h, payload, lens, peer, k))

    def _send(self, batch: Batch) -> None:
        sent = self.t.send(batch, timeout=1.0)
        if sent < len(batch):  # the ring or socket stayed full: the loss machinery repairs it
            self.counters["tx_short"] += len(batch) - sent

    def _ctrl_packet(self, st_round: int, tensor: int, kind: int, ag: bool, dst: int, n: int,
                     tol8: int, chunk: int = 0, payload: bytes = b"") -> None:
        if kind == STOP:  # every STOP carries this rank's probe timeout estimate, in 100 us units
            payload = min(0xFFFF, round(self._probe_timeout * 1e4)).to_bytes(2, "big")
        self._ctrl.append((st_round, tensor, kind, ag, dst, n, tol8, chunk, payload))

    def _flush_ctrl(self) -> None:
        """Send the control packets waiting (a loop turn with no data to send)."""
        if self._ctrl:
            self._send_batch(None, [])

    # ---- receiving -------------------------------------------------------
    def _qval(self, st: _Round) -> np.ndarray:
        """What every DATA packet of round ``st`` for this rank has in its header under
        ``_qmask`` (magic, version, kind, job, round, tensor, destination, dtype, payload length,
        no tag), as native 64-bit words, four per packet, for ``RECV_BATCH`` packets."""
        if self._qmask is None:
            m = np.zeros(1, wire.HEADER_DTYPE)
            for f in ("magic", "version", "kind", "job", "round", "tensor", "dst", "dtype", "len"):
                if f != "dst" or self._gid < 0:  # (broadcast all-gather: _match checks dst on its own)
                    m[f] = np.iinfo(wire.HEADER_DTYPE[f]).max
            m["flags"] = int(wire.Flag.TAG)
            self._qmask = np.tile(m.view(np.uint64), RECV_BATCH)
            self._qtmp = np.empty_like(self._qmask)
            v = self._qrec = np.zeros(1, wire.HEADER_DTYPE)
            v["magic"], v["version"], v["kind"], v["job"] = wire.MAGIC, wire.VERSION, DATA, self.cfg.job
            v["dst"], v["dtype"], v["len"] = self.rank, F32, self.C * 4
            self._qvals = np.tile(v.view(np.uint64), RECV_BATCH)
        v = self._qrec
        v["round"], v["tensor"] = st.round, st.tensor
        self._qvals[1::4] = v.view(np.uint64)[1]  # only the word with round and tensor changes
        return self._qvals

    def _match(self, st: _Round, h: np.ndarray):
        """Which packets of ``h`` are DATA of round ``st`` for this rank (of this job, tensor,
        dtype and chunk size; sources unchecked): True for all of them (the usual batch, in three
        numpy calls on the headers' 64-bit words), else a bool per packet (None: ``h`` is not
        laid out for it).  With a broadcast all-gather, all-gather DATA to ``DST_ALL`` is for
        this rank too."""
        k = 4 * len(h)
        if k > len(self._qmask) or not h.flags.c_contiguous:
            return None
        t = self._qtmp[:k]
        np.bitwise_and(h.view(np.uint64), self._qmask[:k], out=t)
        eq = t == st.qval[:k]
        if self._gid >= 0:
            d = h["dst"]
            mine = (d == self.rank) | ((d == DST_ALL) & ((h["flags"] & AG) != 0))
            if eq.all() and mine.all():
                return True
            return eq.reshape(-1, 4).all(axis=1) & mine
        return True if eq.all() else eq.reshape(-1, 4).all(axis=1)

    def _process(self, st: _Round | None, h: np.ndarray, pay: np.ndarray, lens: np.ndarray,
                 now: float) -> None:
        """Handle received packets; ``st`` None means between rounds (idle responder).

        This round's DATA for this rank is matched in numpy and absorbed; a few packets, and
        whatever else a batch holds (control packets, other rounds, other jobs), are sorted
        one by one in Python.
        """
        rest = None  # rows for the one-by-one path (None: all)
        if st is not None and len(h) > FEW:
            m = self._match(st, h)
            if m is True:
                self._absorb(st, h, pay, None, now)
                return
            if m is not None:
                rows = m.nonzero()[0]
                if len(rows):
                    self._absorb(st, wire.take(h, rows), pay, rows, now)
                rest = (~m).nonzero()[0]
        self._sort(st, h, pay, lens, rest, now)

    def _sort(self, st: _Round | None, h, pay, lens, rows, now: float) -> None:
        """``_process`` packet by packet for rows ``rows`` of a batch (None: all of them)."""
        fields = (h if rows is None else wire.take(h, rows)).tolist()
        rows = range(len(h)) if rows is None else rows.tolist()
        me, W, job, width = self.rank, self.world, self.cfg.job, self.C * 4
        base = self.round if st is None else st.round  # between rounds: the finished one
        nxt, prev = (base + 1) & MASK32, (base - 1) & MASK32
        data, keep, ctrl = [], [], []
        foreign = late = bad = 0
        for i, f in zip(rows, fields):
            kind, rnd, src = f[F_KIND], f[F_ROUND], f[F_SRC]
            if (f[F_JOB] != job or src >= W or src == me
                    or (f[F_DST] != me and not (f[F_DST] == DST_ALL and kind == DATA and f[F_FLAGS] & AG))):
                foreign += 1
            elif rnd == nxt:
                keep.append(i)
                if st is not None:
                    st.heard[src] = now  # a peer already in the next round is alive
            elif st is None:  # (base: the finished round)
                if kind != DATA:  # a probe for it, a STOP or BITMAP for a trailing message
                    ctrl.append((f, i, False))
                elif rnd == base:
                    late += 1
            elif rnd == base:
                st.heard[src] = now
                if kind != DATA:
                    ctrl.append((f, i, True))
                elif (f[F_TENSOR] == st.tensor and f[F_DTYPE] == F32 and f[F_LEN] == width
                      and not f[F_FLAGS] & TAG):
                    data.append(i)
                else:
                    bad += 1
                    if src not in st.misfit:
                        kind = "" if f[F_DTYPE] == F32 else f" of dtype {f[F_DTYPE]}"
                        st.misfit[src] = (now, f"tensor {f[F_TENSOR]}, {f[F_LEN]}-byte chunks{kind}"
                                               f"{', tagged' if f[F_FLAGS] & TAG else ''} where this rank is at "
                                               f"tensor {st.tensor} with {width}-byte float32 chunks")
            elif kind != DATA:  # of an earlier round: a late probe, a STOP or BITMAP for a trailing message
                if rnd == prev:
                    st.heard[src] = now
                ctrl.append((f, i, False))
            elif rnd == prev:
                st.heard[src] = now
                late += 1
        c = self.counters
        c["foreign"] += foreign
        c["late"] += late
        c["bad_payload"] += bad
        if keep:
            self._keep(h, pay, lens, np.array(keep))
        if data:
            rows = np.array(data)
            self._absorb(st, wire.take(h, rows), pay, rows, now)
        for f, i, current in ctrl:
            self._control(st, f, pay[i, : lens[i]], now, current)

    def _keep(self, h, pay, lens, rows) -> None:
        """Stash packets ``rows`` of the next round (bounded: beyond it the loss machinery repairs)."""
        room = STASH_MAX - sum(len(x[0]) for x in self._stash)
        if room < len(rows):
            self.counters["stash_full"] += len(rows) - max(room, 0)
            rows = rows[: max(room, 0)]
        if len(rows):
            self._stash.append((wire.take(h, rows), pay[rows].copy(), lens[rows].copy()))
            self.counters["stashed"] += len(rows)

    def _absorb(self, st: _Round, h, pay, prow, now: float) -> None:
        """Take DATA packets of this round for this rank into the round: headers ``h``, payloads
        ``pay[prow]`` (``chunk_bytes`` each; ``prow`` None: ``pay``'s first rows).  A packet
        from no peer rank (this one, or past the world) is counted in ``foreign``.

        Payload bytes are read once, straight into the reduce buffer or the result, at the rows
        the header names (a duplicate writes the same bytes again); arrival counts come from the
        masks.  A packet whose chunk count does not match its message's (a rank with another
        tensor size) is dropped and counted in ``bad_payload``.
        """
        W = self.world
        src = h["src"].astype(np.intp)
        per = np.bincount(src, minlength=W)
        if len(per) > W or per[self.rank]:
            ok = (src < W) & (src != self.rank)
            self.counters["foreign"] += int(np.count_nonzero(~ok))
            prow = (np.arange(len(h)) if prow is None else prow)[ok]
            h, src = h[ok], src[ok]
            per = np.bincount(src, minlength=W)
        chunk = h["chunk"].astype(np.intp)
        ag = h["flags"] & AG
        nag = int(np.count_nonzero(ag))
        touched = []
        if nag and nag < len(h) and prow is None:
            prow = np.arange(len(h))
        if nag < len(h) and st.my_shard is not None and not st.reduced:  # contributions to my shard
            if nag:
                rs = (ag == 0).nonzero()[0]
                self._absorb_rs(st, h[rs], pay, prow[rs], src[rs], chunk[rs], np.bincount(src[rs], minlength=W),
                                now, touched)
            else:
                self._absorb_rs(st, h, pay, prow, src, chunk, per, now, touched)
        if nag:  # all-gather results from shard owners
            if nag < len(h):
                sel = ag.nonzero()[0]
                h, prow, src, chunk = h[sel], prow[sel], src[sel], chunk[sel]
                per = np.bincount(src, minlength=W)
            ok = h["nchunks"] == st.ag_n[src]  # (-1 for a rank that owns no shard for me)
            if not ok.all():
                h, prow, src, chunk, per = self._drop_bad(st, h, prow, src, chunk, ok, st.ag_n[src], now)
            row = st.ag_first[src] + chunk
            st.y[row] = self._chunks(pay, prow)
            st.have[row] = True
            np.maximum.at(st.hi[1], src, chunk + 1)
            hi = st.hi[1].tolist()
            for k, got in enumerate(per.tolist()):
                if not got:
                    continue
                inn = st.ins[(True, k)]
                rs_out = st.outs.get((False, k))
                if rs_out is not None and not rs_out.done:
                    rs_out.done = True  # owner k is all-gathering: it is done with our contribution
                self._arrived(st, inn, h, src, got, int(np.count_nonzero(inn.mask)), hi[k], now)
                touched.append(inn)
        for inn in touched:
            if inn.done and not inn.stop_sent:
                self._ctrl_packet(st.round, st.tensor, STOP, inn.ag, inn.src, inn.n, inn.tol8 or 0)
                inn.stop_sent = True

    def _absorb_rs(self, st: _Round, h, pay, prow, src, chunk, per, now: float, touched: list) -> None:
        """``_absorb`` for reduce-scatter packets (to my shard, not reduced yet)."""
        n = st.rmask.shape[1]
        ok = h["nchunks"] == n
        if not ok.all():
            h, prow, src, chunk, per = self._drop_bad(st, h, prow, src, chunk, ok, n, now)
        row = src * n + chunk
        st.rflat[row] = self._chunks(pay, prow)
        st.rmflat[row] = True
        np.maximum.at(st.hi[0], src, chunk + 1)
        hi = st.hi[0].tolist()
        count = st.rmask.sum(axis=1).tolist()
        for r, got in enumerate(per.tolist()):
            if not got:
                continue
            inn = st.ins[(False, r)]
            self._arrived(st, inn, h, src, got, count[r], hi[r], now)
            touched.append(inn)

    def _chunks(self, pay: np.ndarray, prow) -> np.ndarray:
        """Payloads ``pay[prow]`` (None: the first rows) as float32 chunks: a view, or one gather."""
        return (pay[:, : self.C * 4] if prow is None else pay[prow, : self.C * 4]).view(np.float32)

    def _drop_bad(self, st: _Round, h, prow, src, chunk, ok, want, now: float):
        """Keep the packets ``ok`` marks (the rest carry another chunk count than ``want``, this
        rank's for their message: counted in ``bad_payload``, their senders noted as misfits)."""
        bad = (~ok).nonzero()[0]
        self.counters["bad_payload"] += len(bad)
        i = int(bad[0])  # (one sender noted a call: the others keep sending, and are noted later)
        if int(src[i]) not in st.misfit:
            w = want[i] if np.ndim(want) else want
            st.misfit[int(src[i])] = (now, f"messages of {int(h['nchunks'][i])} chunks where this rank's have "
                                           f"{int(w)} (another tensor size)")
        prow = (np.arange(len(h)) if prow is None else prow)[ok]
        src = src[ok]
        return h[ok], prow, src, chunk[ok], np.bincount(src, minlength=self.world)

    def _arrived(self, st: _Round, inn: _In, h, src, got: int, count: int, hi: int, now: float) -> None:
        """Update ``inn`` after ``got`` packets of it (among headers ``h`` from sources ``src``)
        arrived: ``count`` chunks are in its mask now, ``hi`` is 1 + the highest chunk seen; the
        sender's bound comes from its first packet, and the sender is heard."""
        if inn.tol8 is None:
            inn.tol8 = int(h["tol"][(src == inn.src).argmax()])
        st.heard[inn.src] = now
        self.counters["duplicate"] += got - (count - inn.count)
        if count > inn.count:
            inn.count = count
            inn.hi = hi
            inn.t_data = now
            if 2 * (count - inn.count_nack) >= inn.asked:  # the repair got through: NACK at once again
                inn.nacks = 0

    def _control(self, st: _Round | None, f: tuple, payload: np.ndarray, now: float, current: bool) -> None:
        """Handle a control packet: header fields ``f`` (a record as a tuple), its payload."""
        ag = bool(f[F_FLAGS] & AG)
        src, kind, rnd, tensor = f[F_SRC], f[F_KIND], f[F_ROUND], f[F_TENSOR]
        if kind == PROBE:
            ins = st.ins if current else (self._prev[1] if self._prev and self._prev[0] == rnd else None)
            # (st is None between rounds: then current is False and _prev answers)
            inn = ins.get((ag, src)) if ins is not None else None
            if inn is None:
                if not current and self._forgotten(st, rnd):  # finished before the last round: done
                    self._ctrl_packet(rnd, tensor, STOP, ag, src, f[F_NCHUNKS], f[F_TOL])
                return
            if inn.tol8 is None:
                inn.tol8 = f[F_TOL]
            if inn.done:
                self._ctrl_packet(rnd, tensor, STOP, ag, src, inn.n, inn.tol8)
                inn.stop_sent = True
            else:
                self._bitmap(rnd, tensor, inn)
            return
        if kind == STOP and len(payload) >= 2:
            self._timeouts[src] = int.from_bytes(payload[:2].tobytes(), "big") / 1e4
        o = st.outs.get((ag, src)) if current else self._trail.get((rnd, ag, src))
        if o is None or o.done:
            return
        if kind == STOP:
            self._out_done(o, now)
        elif kind == BITMAP:
            if current:
                st.repair = True
            o.t_heard = now
            first = f[F_CHUNK]
            bits = np.unpackbits(payload, bitorder="little").astype(bool)
            bits = bits[: max(0, min(o.n, o.sent) - first)]  # never resend what has not gone out yet
            if o.acked is None:
                o.acked, o.retx = np.zeros(o.n, bool), np.zeros(o.n, bool)
                o.seq, o.t_rtx = np.arange(o.n, dtype=np.int64), np.zeros(o.n)
            seg = slice(first, first + len(bits))
            new = bits & ~o.acked[seg]
            o.acked[seg] |= bits
            if np.count_nonzero(o.acked) >= o.need:
                self._out_done(o, now)
            else:
                o.retx[seg] = (o.retx[seg] | o.lost(seg, new, now)) & ~o.acked[seg]
                o.nretx = int(np.count_nonzero(o.retx))
                o.t_last = now
                o.timeouts = 0  # the receiver answers: the path works, probe at the base timeout again

    def _forgotten(self, st: _Round | None, rnd: int) -> bool:
        """Round ``rnd`` is one this rank finished before the last one (whose record ``_prev``
        keeps): two or more before the one it runs (``st``), or between rounds one or more before
        the finished one.  Round numbers wrap at 2**32."""
        age = (self.round - rnd) & MASK32
        return (1 if st is None else 2) <= age < 1 << 31

    def _bitmap(self, rnd: int, tensor: int, inn: _In) -> None:
        """Queue BITMAP packets with ``inn``'s arrival bits (one per ``chunk_bytes`` of bits)."""
        bits = np.packbits(inn.mask, bitorder="little").tobytes()
        step = self.cfg.chunk_bytes
        for off in range(0, len(bits), step):
            self._ctrl_packet(rnd, tensor, BITMAP, inn.ag, inn.src, inn.n, inn.tol8,
                              chunk=off * 8, payload=bits[off: off + step])

    def _nacks(self, st: _Round, now: float) -> None:
        """Receiver-driven repair: NACK a message that can no longer reach its bound.

        Once ``count + (n - hi) < need`` the bound is out of reach even if
        every chunk not yet seen arrives (senders send in chunk order, so
        chunks below ``hi`` are lost): after ``NACK_QUIET`` without a new
        chunk the receiver sends an unsolicited BITMAP of the whole message,
        and the sender retransmits every gap among the chunks it has sent at
        once instead of waiting for its probe timeout.  Once a message has
        been NACKed, the chunks not seen yet count as lost too: the sender
        has been asked for all it sent, and what its repair left missing
        after the silence (a lost tail, a repair half eaten) is asked for
        again, where waiting for the tail cost the sender's probe timeout
        (tens of ms) in burst rounds.  The next NACK needs
        the same silence and, while NACKs go unanswered or are answered with
        less than half of what was missing (a burst still eating the repair),
        2x ``NACK_QUIET`` since the last one: the interval backs off once, the
        silence does not (a silence of 8 ms after a burst's last trickle held
        the repair back that long; an interval of 8 ms, the first NACK after
        a burst).  Loss within the bound never NACKs.
        """
        for inn in st.ins.values():
            if inn.done or inn.count == 0 or (not inn.ag and st.reduced):
                continue
            tail = inn.count + inn.n - inn.hi >= inn.need  # within reach if the chunks not seen yet come
            if tail and not inn.t_nack:
                continue
            if now - inn.t_data < NACK_QUIET or now - inn.t_nack < NACK_QUIET * (1 << min(inn.nacks, 1)):
                continue
            self._bitmap(st.round, st.tensor, inn)
            st.repair = True
            inn.t_nack = now
            inn.asked, inn.count_nack = (inn.n if tail else inn.hi) - inn.count, inn.count
            inn.nacks += 1
            st.nacks += 1

    def _out_done(self, o: _Out, now: float) -> None:
        o.done = True
        if o.t_sent_all is not None and o.timeouts == 0:
            delay = now - o.t_sent_all
            self._probe_timeout = min(self.cfg.probe_max, max(self.cfg.probe_min,
                                      0.8 * self._probe_timeout + 0.2 * (3 * delay + 0.001)))

    @property
    def probe_timeout(self) -> float:
        """The probe timeout in use (s): the median of every rank's latest own estimate.

        Each rank adapts its estimate to the STOP delays it measures and
        carries it in every STOP it sends, so all ranks converge on one
        value (OptiReduce-style agreement) instead of each acting alone.
        """
        self._timeouts[self.rank] = self._probe_timeout
        known = sorted(t for t in self._timeouts if t is not None)
        mid = len(known) // 2
        return known[mid] if len(known) % 2 else (known[mid - 1] + known[mid]) / 2

    def _probe_wait(self, o: _Out, pt: float) -> float:
        """Seconds after its last send or answer that ``o`` is probed (``pt``: the probe timeout):
        backing off on repeated probes, but never past probe_max (a probe is one packet, a lost
        probe or reply must not cost seconds)."""
        return min(self.cfg.probe_max, pt * (2 ** min(o.timeouts, 4)))

    def _probes(self, outs, now: float) -> None:
        """PROBE each of ``outs`` that has sent everything, has no retransmission queued and has
        heard nothing for its probe wait."""
        pt = None
        for o in outs:
            if o.done or o.sent < o.n or o.nretx:
                continue
            if pt is None:
                pt = self.probe_timeout
            if now - o.t_last >= self._probe_wait(o, pt):
                self._ctrl_packet(o.rnd, o.tensor, PROBE, o.ag, o.dst, o.n, o.tol8)
                o.probes += 1
                o.timeouts += 1
                o.t_last = now
                if o.trailing:
                    self.counters["trail_probes"] += 1

    def _timers(self, st: _Round, now: float) -> None:
        """NACKs and probes due (every TIMER_TICK), a dead peer (every DEAD_TICK)."""
        self._nacks(st, now)
        self._probes(st.outs.values(), now)
        if self._trail:
            self._trail_timers(now)
        if now - st.t_alive < DEAD_TICK:
            return
        st.t_alive = now
        needed = {o.dst for o in st.outs.values() if not o.done}
        needed |= {i.src for i in st.ins.values() if not i.done and (i.ag or not st.reduced)}
        if needed:
            # name the peer silent longest: one that stalled because of it went quiet later
            r = min(needed, key=lambda q: (st.heard[q], q))
            if now - st.heard[r] > self.cfg.peer_timeout:
                foreign = self.counters["foreign"] - st.foreign0
                raise CollectiveError(
                    f"rank {self.rank}: rank {r} sent nothing for {self.cfg.peer_timeout:.1f} s in round "
                    f"{st.index} (tensor {st.tensor}): peer dead or unreachable"
                    + (f" ({foreign} packets of another job or for another rank came meanwhile: every rank "
                       f"must use the same Config.job, world and peer list)" if foreign else ""))
        for q, (since, what) in st.misfit.items():
            # alive (it probes) but nothing it sent fits: the round can never complete
            if now - since > self.cfg.peer_timeout and not any(i.count for (_, s), i in st.ins.items() if s == q):
                raise CollectiveError(
                    f"rank {self.rank}: rank {q}'s data in round {st.index} does not fit for "
                    f"{self.cfg.peer_timeout:.1f} s: {what}.  Every rank must use the same Config "
                    f"(chunk_bytes) and call allreduce with tensors of the same size in the same order")

    # ---- trailing all-gather messages ------------------------------------
    def _trail_timers(self, now: float) -> None:
        """Forget trailing messages that are done, drop those whose receiver has been silent for
        ``peer_timeout`` (dead: a live one answers every probe), probe those due."""
        for key, o in list(self._trail.items()):
            if o.done:
                del self._trail[key]
            elif now - o.t_heard > self.cfg.peer_timeout:
                del self._trail[key]
                self.counters["trail_dropped"] += 1
        self._probes(self._trail.values(), now)

    def _trail_due(self, now: float) -> float | None:
        """Seconds until a trailing message needs this rank (a probe due; 0: retransmissions wait),
        None if none does.  Read by the idle responder before it sleeps, without the lock: a
        snapshot, at worst a wake-up early or late by one probe."""
        due, pt = None, None
        for o in list(self._trail.values()):
            if o.done:
                continue
            if o.nretx:
                return 0.0
            if pt is None:
                pt = self.probe_timeout
            t = o.t_last + self._probe_wait(o, pt) - now
            due = t if due is None else min(due, t)
        return None if due is None else max(0.0, due)

    def _serve_trail(self, now: float) -> None:
        """Between rounds: send what trailing messages were asked to resend (``burst`` packets at
        most; the rest on the next call), then their timers."""
        parts, budget = [], self.cfg.burst
        for o in self._trail.values():
            if not o.done and o.nretx and budget > 0:
                idx = self._resend(o, budget, now)
                parts.append((o, idx, RETX))
                budget -= len(idx)
                o.t_last = now
        if parts:
            self._send_batch(None, parts)
        self._trail_timers(now)

    # ---- round end -------------------------------------------------------
    def _finish(self, st: _Round) -> None:
        missing = ~st.have
        if missing.any():
            last = self._last.get(st.tensor)
            if st.reduce and self.cfg.fill == "stale" and last is not None and last.shape == st.y.shape:
                st.y[missing] = last[missing]
            else:
                st.y[missing] = st.x[missing]
        if st.reduce and self.cfg.fill == "stale":  # only the stale fill reads it
            last = self._last.get(st.tensor)  # a snapshot: the caller owns st.y and may change it
            if last is None or last.shape != st.y.shape:
                last = self._last[st.tensor] = np.empty_like(st.y)
            np.copyto(last, st.y)
        self._prev = (st.round, st.ins)
        self._trail_from(st)
        s1 = self.t.stats()
        rec = RoundRecord(index=st.index, round=st.round, tensor=st.tensor, tol=st.tol8 / 255,
                          phase=st.phase, latency=time.monotonic() - st.t0)
        for (ag, src), inn in st.ins.items():
            rec.delivered[f"{'ag' if ag else 'rs'}:{src}"] = inn.count / inn.n
            rec.below_bound |= not inn.done
        rec.min_delivered = min(rec.delivered.values(), default=1.0)
        rec.retransmits = sum(o.retransmits for o in st.outs.values())
        rec.probes = sum(o.probes for o in st.outs.values())
        rec.nacks = st.nacks
        rec.below_bound |= not all(o.done or (o.ag and o.sent == o.n) for o in st.outs.values())
        rec.bytes_sent = s1.get("tx_bytes", 0) - st.stats0.get("tx_bytes", 0)
        rec.bytes_received = s1.get("rx_bytes", 0) - st.stats0.get("rx_bytes", 0)
        self.records.append(rec)
        self.index += 1

    def _trail_from(self, st: _Round) -> None:
        """Keep the round's all-gather messages that went out whole but are not acknowledged yet:
        they trail, on a copy of their rows (the caller owns the result now), until their STOP."""
        for key in [k for k, o in self._trail.items() if o.done]:
            del self._trail[key]
        pending = [o for o in st.outs.values() if o.ag and not o.done and o.sent == o.n]
        if not pending:
            return
        rows = pending[0].rows  # (every all-gather message of a round carries the same rows: my shard)
        keep = self._scratch("trail", st.tensor, rows.shape)
        old = None
        for o in self._trail.values():  # an earlier round's messages still on this buffer keep a copy of their own
            if o.rows is keep:
                old = keep.copy() if old is None else old
                o.rows = old
        np.copyto(keep, rows)
        now = time.monotonic()
        for o in pending:
            o.rows, o.trailing, o.t_heard = keep, True, now
            self._trail[(o.rnd, o.ag, o.dst)] = o
