"""The bounded-loss collective's protocol for one rank, driven one step at a time.

:class:`Protocol` holds what a rank knows across rounds (peers, the probe timeout, trailing
all-gather messages, round records) and runs a round's steps: :meth:`~Protocol.start`,
:meth:`~Protocol.run` (send, receive, timers until the round may return),
:meth:`~Protocol.finish`.  It has no threads and no locks: :class:`~pydblp.collective.Collective`
owns one, serialises its callers and answers peers between rounds through it.  Each step takes
the time it acts at (``now``), so a test can drive it by hand.  The protocol itself (STOP, PROBE,
BITMAP, NACK, bounds, trailing messages, failure semantics) is described in docs/protocol.md.

Every kind of round shares the machinery: :meth:`~Protocol.start` (allreduce, sharded update,
shard broadcast), :meth:`~Protocol.start_reduce_scatter`, :meth:`~Protocol.start_all_gather` and
:meth:`~Protocol.start_neighbours` build one of the types of :mod:`pydblp.collective.rounds`,
whose methods answer what differs by kind; :mod:`pydblp.collective.fill` decides what missing
rows become.  (Over 700 lines: one state machine whose sending, control and timer paths serve
every kind of round.)
"""

from __future__ import annotations

import collections
import functools
import logging
import math
import struct
from collections.abc import Callable

import numpy as np

from pydblp import wire
from pydblp.collective import estimators, phase as phases, rotation
from pydblp.dscp import CE
from pydblp.collective.cc import Echo, Ledger, RateControl
from pydblp.collective.config import (AG, AG_SPLIT, ASK, BITMAP, DATA, DEAD_TICK, DRAIN_READS, DRAINED_LOOKS, F32,
                                      FINAL, HELLO, HELLO_EVERY, LINGER, MASK32, NB, PLAN_LOSS_MAX,
                                      PLAN_SHORT_KEEP, PLAN_Z, PROBE,
                                      RAW, REAL_CLOCK, RECV_BATCH, RETX, STOP, TIMER_TICK, TURN_DESTS, TURN_GAP,
                                      TXQ_DRAINED, TXQ_LIMIT, TXQ_REPAIR, CollectiveError, Config, RoundRecord)
from pydblp.collective.feedback import Residuals, inverse
from pydblp.collective.fill import Fill
from pydblp.collective.matcher import Matcher
from pydblp.collective.messages import Control, InMessage, OutMessage, stagger_first
from pydblp.collective.rounds import (AllGatherRound, AllreduceRound, BroadcastRound, GatherRound, NeighbourRound,
                                      ReduceScatterRound, Round, ShardedRound, ShardRound, rows_of)
from pydblp.transport.base import Batch, DropLog, Transport
from pydblp.wire import F_CHUNK, F_FLAGS, F_KIND, F_NCHUNKS, F_ROUND, F_SRC, F_TENSOR, F_TOL

log = logging.getLogger(__name__)
STOP_PAYLOAD = struct.Struct("!HII")  # a STOP's payload: probe timeout estimate (100 us), echo (received, CE)


class Protocol:
    """One rank's side of the collective (see the module docstring).

    Args:
        transport: an open transport; :class:`Collective` closes it.
        rank: this rank, 0..world-1.
        world: the number of ranks, 1..65535.
        peers: per rank, ``(addr, port)`` or ``(addr, port, mac)`` (this rank's own is ignored).
        config: the knobs (checked here: ValueError names the first one out of range).
        group: the broadcast all-gather's address (only with ``Config.allgather="broadcast"``).
        clock: what "now" is, in seconds (monotonic): every timer, timeout and record of the
            protocol reads it (default: the real clock; a simulation passes its own).

    Raises ValueError for a bad rank, world, peer list, config or a closed transport, before
    any peer is registered.
    """

    def __init__(self, transport: Transport, rank: int, world: int, peers: list, config: Config | None = None,
                 group: tuple | None = None, clock: Callable[[], float] = REAL_CLOCK):
        self.clock = clock  # every "now" of the protocol: seconds, monotonic
        self.cfg = c = config or Config()
        c.check()
        self.layers: dict[int, np.ndarray] = {}  # tensor -> class per chunk (priority "layer")
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
        self._txaddr = np.empty(0, np.uint64)
        self._txh = wire.empty_batch(0)
        self._txrows = np.empty(0, np.uint64)  # per row of _txbuf, its address
        self._txat = (0, 0)                    # the addresses of _txh and _txaddr
        self._txlens = self._txpeer = np.empty(0, np.int32)
        self.round = 0    # the last round's number on the wire (wraps at 2**32)
        self.index = 0    # rounds finished
        self.records: collections.deque[RoundRecord] = collections.deque(maxlen=c.records_max)
        self.counters = dict.fromkeys(("foreign", "late", "duplicate", "stashed", "stash_full", "bad_payload",
                                       "tx_short", "trail_retransmits", "trail_probes", "trail_dropped",
                                       "stray", "rx_errors", "ce_received", "fed_back", "planned", "plans_short",
                                       "hellos_sent", "hellos"), 0)
        self._drop_log = DropLog(log, f"rank {rank}")  # batches take dropped on an error
        self.matcher = Matcher(rank, world, c.job, c.chunk_bytes, self._gid >= 0, self.counters, stagger=c.stagger)
        self.ctrl: list[Control] = []             # control packets queued, sent first in the next batch
        self.trail: dict[tuple, OutMessage] = {}  # (round, ag, dst) -> all-gather message not yet acknowledged
        self.timeouts: list = [None] * world      # each rank's latest probe timeout estimate (s), from its STOPs;
                                                  # this rank's own is :attr:`estimate`
        self.estimate = min(c.probe_max, max(c.probe_min, 0.005))  # within the configured bounds
        self.tx_wait = None                       # s to wait for the transport's queue to drain (send_some)
        self.pkt_s = 0.0                          # s a data packet adds to a pacing transport's backlog
        self._drained = 0                         # looks in a row that found a full turn out of the host
        self._turn = (0, -1.0)                    # (packets, when) of the last turn that sent data
        self.fill = Fill(c, self.C)               # what missing result rows become, and what it keeps for that
        self._bufs: dict[tuple, np.ndarray] = {}  # (name, tensor id or None) -> scratch reused across rounds
        self.residuals = Residuals()              # what the last rounds' estimates left out (Config.error_feedback)
        self._prev = None                         # (round, {(ag, src): InMessage}) answers late probes
        self._began: tuple[int, dict] = (0, {})   # (last round, {rank: when its message began arriving}: a
                                                  # neighbour round's, Round.began; empty after other kinds)
        self.frame = c.chunk_bytes + wire.DATAGRAM_OVERHEAD  # bytes a DATA packet takes on the wire (at most)
        self.cc = RateControl(world, c, self.frame) if c.cc == "ecn" else None  # per destination's rate
        # what STOPs' echoes say arrived of this rank's DATA, per destination: for the rate control,
        # a bound that follows the network's loss and the plans (the job's ranks share these
        # settings, so each counts what its peers will read)
        self.ledger = Ledger(world) if self.cc is not None or self.controller.hears_loss or c.plan != "off" else None
        self.rx_from = np.zeros(world + 1, np.int64)  # per sender: DATA received from it (late ones too;
        self.ce_from = np.zeros(world + 1, np.int64)  # [world]: no rank's) and those that came CE-marked:
                                                  # both echoed in STOPs, cumulative
        self._rx_at, self._ce_at = self.rx_from.ctypes.data, self.ce_from.ctypes.data
        self._others = [r for r in range(world) if r != rank]  # a broadcast all-gather's destinations
        self._short = [0.0] * world  # per destination: the loss a plan that fell short saw (_top_up), less by
                                     # PLAN_SHORT_KEEP at each plan since
        # HELLO: between rounds, this rank tells peers already waiting for it in a round that it is alive
        self._idle_since = clock()   # when its last round ended (or it was made)
        self._hello_at = self._idle_since + c.peer_timeout / HELLO_EVERY  # the next HELLOs may go
        self._hello_seq = 0          # HELLOs sent: each carries the next number
        self._hello_heard = [0] * world  # per rank, the highest number of its HELLOs taken (a replay is not news)
        if self.cc is not None:
            transport.set_ect(True)
            if not transport.ect:
                log.info("rank %d: the %s transport cannot send ECN-capable packets: congestion control "
                         "reacts to no switch's marks", rank, transport.kind)

    @property
    def estimate(self) -> float:
        """This rank's own probe timeout estimate (s), from the STOP delays it measures; every STOP
        it sends carries it."""
        return self.timeouts[self.rank]

    @estimate.setter
    def estimate(self, value: float) -> None:
        self.timeouts[self.rank] = value

    @property
    def probe_timeout(self) -> float:
        """The probe timeout in use (s): the median of every rank's latest own estimate.

        Each rank adapts its estimate to the STOP delays it measures and carries it in every
        STOP it sends, so all ranks converge on one value (OptiReduce-style agreement).
        """
        known = sorted(t for t in self.timeouts if t is not None)
        mid = len(known) // 2
        return known[mid] if len(known) % 2 else (known[mid - 1] + known[mid]) / 2

    # ---- round set-up ----------------------------------------------------
    def start(self, flat: np.ndarray, tensor: int, reduce: bool = True, base: np.ndarray | None = None,
              update=None, exact: bool = False, out: np.ndarray | None = None) -> ShardRound:
        """Begin a round on ``flat`` (float32, this rank's input) for tensor id ``tensor``: an
        allreduce (:class:`~pydblp.collective.rounds.AllreduceRound`), or with ``reduce`` False a
        broadcast of shards (:class:`~pydblp.collective.rounds.BroadcastRound`).  A sharded update
        (``Collective.sharded_update``, :class:`~pydblp.collective.rounds.ShardedRound`) also gives
        ``base`` (float32, ``flat``'s size: this rank's values, what an all-gather row that does not
        arrive keeps) and ``update(rows, mean, values)`` (an owner's new values for its shard's
        chunk rows, in the tensor's order, from their estimated mean and current values).  Shards:
        one per rank (``Config.mode`` "tar") or one, rank 0's ("ps").  Takes in the packets of it
        that were stashed; sends nothing yet.  ``exact``: the round's bound is 0 whatever the
        controller says (every message repaired whole).  ``out`` (an allreduce of whole rows: float32,
        ``flat``'s size, C-contiguous; may be ``flat`` itself): where the result goes, instead of a
        fresh array (:meth:`ReduceScatterRound.reorder`)."""
        T = max(1, -(-flat.size // self.C))
        nsh = self.world if self.cfg.mode == "tar" else 1
        put = functools.partial(_pad, flat)
        if not reduce:
            return self._start_gather(BroadcastRound, tensor, T, nsh, put, exact)
        if update is None:
            return self._start_reduce(AllreduceRound, tensor, T, nsh, put, exact=exact, flat=flat, out=out)
        return self._start_reduce(ShardedRound, tensor, T, nsh, put, base=functools.partial(_pad, base),
                                  update=update, exact=exact)

    def start_reduce_scatter(self, flat: np.ndarray, tensor: int, exact: bool = False) -> ReduceScatterRound:
        """Begin a reduce-scatter (:class:`~pydblp.collective.rounds.ReduceScatterRound`) of ``flat``
        (float32, ``world * s`` values): piece k (values ``k * s .. (k + 1) * s - 1``) goes to rank
        k, which estimates the pieces' mean.  Each piece is a shard of ``R = max(1, ceil(s / C))``
        rows (its last row padded with zeros): rank k's shard is rows ``k * R .. (k + 1) * R - 1``,
        whatever ``Config.mode``.  The caller checked the size."""
        s = flat.size // self.world
        R = max(1, -(-s // self.C))

        def put(into: np.ndarray) -> None:
            v = into.reshape(self.world, R * self.C)
            v[:, :s] = flat.reshape(self.world, s)
            v[:, s:] = 0

        return self._start_reduce(ReduceScatterRound, tensor, self.world * R, self.world, put, exact=exact)

    def start_all_gather(self, flat: np.ndarray, tensor: int, exact: bool = False) -> AllGatherRound:
        """Begin an all-gather (:class:`~pydblp.collective.rounds.AllGatherRound`) of ``flat``
        (float32, this rank's piece of ``s`` values; every rank gives the same size): rank k's
        piece is the shard of rows ``k * R .. (k + 1) * R - 1`` (``R = max(1, ceil(s / C))``, its
        last row padded with zeros), whatever ``Config.mode``."""
        R = max(1, -(-flat.size // self.C))
        me = self.rank
        return self._start_gather(AllGatherRound, tensor, self.world * R, self.world,
                                  lambda into: _pad(flat, into[me * R: (me + 1) * R]), exact)

    def _start_reduce(self, kind: type[ReduceScatterRound], tensor: int, T: int, nsh: int,
                      put: Callable[[np.ndarray], None], base: Callable | None = None,
                      update: Callable | None = None, exact: bool = False,
                      flat: np.ndarray | None = None, out: np.ndarray | None = None) -> ReduceScatterRound:
        """Begin a round of ``kind`` (a reduce-scatter, alone or followed by an all-gather) on ``T``
        rows cut into ``nsh`` shards; ``put(rows)`` writes this rank's input into ``rows`` (T, C)
        in the tensor's order (``base`` likewise its values, for a sharded update).  ``flat``: the
        input ``put`` writes, given when the round may read it in place (never written during the
        round; what outlives it is copied: :meth:`_trail_from`).  ``out``: where the result goes as
        the round finishes (flat, ``flat``'s size; may be ``flat`` itself), else None: a fresh array."""
        bounds = self._bounds(T, nsh)
        self._check_message(tensor, -(-T // nsh))  # (the largest shard's rows)
        rnd = self._next_round()
        perm = self._order(rnd, tensor, T, bounds)
        cfg = self.cfg
        # an allreduce's shuffled input read where it lies: each message sends its rows from the
        # caller's array (the transport reads addresses), with no pass to put them in order
        inplace = (kind.gather and base is None and perm is not None and flat is not None and self.t.reads_addresses
                   and (exact or not cfg.rotate))
        x = None if inplace else self._take_input(tensor, T, perm, put, flat)
        relax = self._relax(rnd, tensor, x, perm, bounds, flat) if not exact else {}
        x = relax.pop("x", x)
        more = {"flat": flat} if inplace else {}
        if base is not None:  # (in the round's row order, as x)
            held = self._scratch("basein", tensor, (T, self.C))
            base(held)
            more = dict(base=held if perm is None else np.take(held, perm, axis=0, mode="clip",
                                                               out=self._scratch("base", tensor, (T, self.C))),
                        update=update)
        if kind.gather:
            more.update(self._gather_fields(T))
        me = self.rank
        my = me if me < nsh else None
        # y is scratch where reorder() makes the caller's result: the round's own ("yr", shuffled: the
        # result is made elsewhere) or the tensor's ("y", in order: handed to the stale fill)
        y = (self._scratch("yr", tensor, (T, self.C)) if perm is not None
             else self._scratch("y", tensor, (T, self.C)) if out is not None else None)
        fields = self._fields(rnd, tensor, x, exact, y)
        if kind.gather and perm is not None and out is not None:  # (the all-gather writes there through perm)
            full = out.size // self.C
            more["result"] = out[: full * self.C].reshape(full, self.C)
            if full < T:  # (the partial last row: in scratch until the round ends)
                more["tail"] = self._scratch("ytail", tensor, (1, self.C))
        st = kind(**fields, bounds=bounds, my_shard=my, reduced=my is None, perm=perm, out=out, **relax, **more)
        if my is not None:
            a, b = bounds[my]
            st.open_inbox(self._scratch("rbuf", tensor, (self.world, b - a, self.C)))  # row src * n + chunk
            st.input_rows(slice(a, b), into=st.rbuf[me])
            st.rmask[me] = True
            for src in range(self.world):
                if src != me:
                    st.ins[(False, src)] = InMessage(False, src, st.rmask[src])
        addrs, sq = self._in_place(st) if inplace else (None, None)
        for k in self._rotated(len(bounds)):
            a, b = bounds[k]
            if k == my:
                continue
            if inplace:
                prio = self._prio(st, None, a, None if sq is None else sq[a:b], b - a)
                o = OutMessage(False, k, None, prio, st.tol8, rnd, tensor, first=self._first(b - a), addrs=addrs[a:b])
            else:
                rows = x[a:b]
                o = OutMessage(False, k, rows, self._prio(st, rows, a), st.tol8, rnd, tensor, first=self._first(b - a))
            self._plan(o)
            st.outs[(False, k)] = o
        if kind.gather:
            self._expect_gather(st)
        return self._begin(st)

    def _in_place(self, st: ReduceScatterRound) -> tuple[np.ndarray, np.ndarray | None]:
        """For a round that reads its input where it lies (``st.flat``): per round row, the address
        of its input row (the last, padded row: a scratch copy) and, for magnitude priorities, its
        squared norm (None for others)."""
        flat, perm, C = st.flat, st.perm, self.C
        T = len(perm)
        full = flat.size // C
        addrs = np.uint64(flat.ctypes.data) + perm.astype(np.uint64) * np.uint64(C * 4)
        tail = None
        if full < T:  # (the tensor's last row is partial: sent from a padded copy)
            tail = rows_of(flat, np.array([T - 1]), C, into=self._scratch("tail", st.tensor, (1, C)))
            addrs[perm == T - 1] = np.uint64(tail.ctypes.data)
        fed = self.residuals.rows(st.tensor, (T, C)) if st.feedback else ()
        patch = None
        if len(fed):  # (the rows with a residual go from a copy that adds it)
            patch = self.residuals.sent(st.tensor, flat, (T, C), fed,
                                        into=self._scratch("patch", st.tensor, (len(fed), C)))
            addrs[inverse(perm)[fed]] = (np.uint64(patch.ctypes.data)
                                         + np.arange(len(fed), dtype=np.uint64) * np.uint64(C * 4))
        if self.cfg.priority != "magnitude":
            return addrs, None
        rows = flat[: full * C].reshape(full, C)
        by_row = np.empty(T)
        by_row[:full] = np.einsum("ij,ij->i", rows, rows)
        if tail is not None:
            by_row[T - 1] = float(np.dot(tail[0], tail[0]))
        if patch is not None:
            by_row[fed] = np.einsum("ij,ij->i", patch, patch)
        return addrs, by_row[perm]

    def _take_input(self, tensor: int, T: int, perm: np.ndarray | None, put: Callable, flat: np.ndarray | None):
        """The round's x: ``T`` rows of this rank's input in the round's order, in one pass at most.

        Whole rows and the tensor's order: ``flat`` itself.  Shuffled: one take from ``flat``'s
        whole rows, the last (padded) row put where the permutation sends it.  Otherwise ``put``
        into scratch (and a take from there)."""
        C = self.C
        whole = flat is not None and flat.size == T * C
        if perm is None and whole:
            return flat.reshape(T, C)
        x = self._scratch("x", tensor, (T, C))
        if perm is not None and flat is not None and T > 1:
            return rows_of(flat, perm, C, into=x)
        into = x if perm is None else self._scratch("xin", tensor, (T, C))
        put(into)
        if perm is not None:
            np.take(into, perm, axis=0, out=x, mode="clip")
        return x

    def _relax(self, rnd: int, tensor: int, x: np.ndarray | None, perm: np.ndarray | None, bounds: list,
               flat: np.ndarray | None) -> dict:
        """A reduce round's relaxations of its input ``x`` (the round's row order; None: read in
        place, where :meth:`_in_place` adds the residual): add the rows the tensor's last round
        left out (``Config.error_feedback``), then rotate each shard (``Config.rotate``).  Returns
        the round's fields for them (with ``x``, now scratch, when it changed): ``signs``, the
        rotation's, and ``feedback``."""
        cfg = self.cfg
        if not (cfg.error_feedback or cfg.rotate):
            return {}
        out = {"feedback": True} if cfg.error_feedback else {}
        if x is None:
            return out
        writes = cfg.rotate or (cfg.error_feedback and len(self.residuals.rows(tensor, x.shape)))
        if writes and flat is not None and np.shares_memory(x, flat):  # (the caller's own array: never written)
            given, x = x, self._scratch("x", tensor, x.shape)
            np.copyto(x, given)
        out["x"] = x
        if cfg.error_feedback:
            self.residuals.add_into(tensor, x, perm)
        if cfg.rotate:
            s = out["signs"] = rotation.signs(rnd, tensor, len(x))
            for a, b in bounds:
                rotation.rotate(x, a, b, cfg.rotate, s)
        return out

    def _feed_back(self, st: ReduceScatterRound) -> None:
        """Error feedback as round ``st`` ends: keep, in the tensor's order, the rows of this rank's
        contributions the owners' FINAL BITMAPs say their estimates left out (rotated back), as
        they went (input plus the residual they carried); a message whose FINAL BITMAP never came
        counts as used whole (nothing is counted twice)."""
        C = self.C
        T = len(st.perm) if st.x is None else len(st.x)
        rows, vals = [], []
        for (ag, k), o in st.outs.items():
            if ag or o.used is None or o.used.all():
                continue
            a, b = st.bounds[k]
            lost = ~o.used
            at = np.arange(a, b) if st.perm is None else st.perm[a:b]
            if st.signs is None:  # the rows left out, as they went
                rows.append(at[lost])
                if st.x is not None:
                    vals.append(st.x[a:b][lost])
            else:  # a lost rotated row is part of every row of its block: rotate the shard's back
                left = np.zeros((b - a, C), np.float32)
                left[lost] = st.x[a:b][lost]
                rotation.rotate(left, 0, b - a, self.cfg.rotate, st.signs[a:b], inverse=True)
                rows.append(at)
                vals.append(left)
            self.counters["fed_back"] += int(np.count_nonzero(lost))
        rows = np.concatenate(rows) if rows else np.empty(0, np.intp)
        if st.x is None:  # (read in place)
            vals = self.residuals.sent(st.tensor, st.flat, (T, C), rows)
        else:
            vals = np.concatenate(vals) if vals else np.empty((0, C), np.float32)
        self.residuals.renew(st.tensor, (T, C), rows, vals)

    def _start_gather(self, kind: type[GatherRound], tensor: int, T: int, nsh: int,
                      put: Callable[[np.ndarray], None], exact: bool = False) -> GatherRound:
        """Begin a round of ``kind`` (an all-gather alone) on ``T`` rows cut into ``nsh`` shards;
        ``put(rows)`` writes this rank's input into ``rows`` (T, C): its own shard goes out at once."""
        bounds = self._bounds(T, nsh)
        self._check_message(tensor, -(-T // nsh))  # (the largest shard's rows)
        rnd = self._next_round()
        x = self._scratch("x", tensor, (T, self.C))
        put(x)
        me = self.rank
        st = kind(**self._fields(rnd, tensor, x, exact), bounds=bounds, my_shard=me if me < nsh else None,
                  **self._gather_fields(T))
        if st.my_shard is not None:  # my shard is my own values
            a, b = st.bounds[st.my_shard]
            st.y[a:b] = st.x[a:b]
            self._start_allgather(st)
        self._expect_gather(st)
        return self._begin(st)

    def start_neighbours(self, flat: np.ndarray, tensor: int, peers: list[int], weights: list[float],
                         timeouts: list[float]) -> NeighbourRound:
        """Begin a neighbour round on ``flat`` (float32, this rank's input): send it whole to each of
        ``peers`` and take in theirs (weights: one per peer; this rank's own is ``1 - sum``).  Takes
        in the packets of it that were stashed; sends nothing yet.  The caller checked the arguments.

        A neighbour whose message is below its bound ``timeout`` s (its entry of ``timeouts``)
        from now is left out, or, if the previous round was a neighbour round whose message from
        it began arriving at ``t``, ``timeout`` s after ``max(now, t + timeout)``: that neighbour
        may still be waiting out a dead peer of its own in that round (up to ``timeout``), and a
        live neighbour late only for that is not left out.
        """
        T = max(1, -(-flat.size // self.C))
        self._check_message(tensor, T)
        rnd = self._next_round()
        x = self._scratch("x", tensor, (T, self.C))
        _pad(flat, x)
        fields = self._fields(rnd, tensor, x)
        t0 = fields["t0"]
        K = len(peers)
        slot = np.full(self.world, -1, np.intp)
        slot[peers] = np.arange(K)
        last, began = self._began
        began = began if last == (rnd - 1) & MASK32 else {}
        until = np.array([max(t0, began[r] + w) + w if r in began else t0 + w for r, w in zip(peers, timeouts)])
        st = NeighbourRound(**fields, peers=list(peers), weights=np.asarray(weights, np.float64), slot=slot,
                            until=until)
        st.open_inbox(self._scratch("nbuf", tensor, (K, T, self.C)))  # row slot * T + chunk
        prio = self._prio(st, x, 0)
        for k, r in enumerate(peers):
            st.ins[(False, r)] = InMessage(False, r, st.rmask[k], nb=True)
            st.outs[(False, r)] = OutMessage(False, r, x, prio, st.tol8, rnd, tensor, nb=True, first=self._first(T))
        return self._begin(st)

    def _first(self, n: int) -> int:
        """Where this rank's reduce-scatter and neighbour messages of ``n`` chunks start
        (``Config.stagger``; the receiver's matcher counts them from there too)."""
        return stagger_first(self.rank, n, self.world) if self.cfg.stagger else 0

    def _check_message(self, tensor: int, chunks: int) -> None:
        """Raise ValueError, before the round is numbered, for what the wire cannot carry: a
        tensor id past its 16 bits, or a message of more chunks than its 24."""
        if not 0 <= tensor <= 0xFFFF:
            raise ValueError(f"tensor id {tensor}: use 0..65535")
        if chunks > wire.MAX_NCHUNKS:
            raise ValueError(f"a message of {chunks} chunks: the wire carries at most {wire.MAX_NCHUNKS}; "
                             f"use a larger Config.chunk_bytes (now {self.cfg.chunk_bytes}) or split the tensor")

    def _next_round(self) -> int:
        """The next round's number on the wire (wraps at 2**32)."""
        self.round = (self.round + 1) & MASK32
        return self.round

    def _fields(self, rnd: int, tensor: int, x: np.ndarray | None, exact: bool = False,
                y: np.ndarray | None = None) -> dict:
        """What every round begins with (:class:`~pydblp.collective.rounds.Round`'s fields): round
        ``rnd`` of ``tensor`` on input ``x`` (None: read in place), at the controller's bound (0 if
        ``exact``), from now; ``y``: the result's buffer (default a new one, ``x``'s shape)."""
        tol = 0.0 if exact else self.controller.tol(self.index)
        t0 = self.clock()
        return dict(round=rnd, tensor=tensor, index=self.index, tol=tol, tol8=min(254, int(tol * 255)),
                    phase=self.controller.phase(), x=x,
                    y=np.empty_like(x) if y is None else y,  # every row is written: own shard, all-gather,
                                                              # arrivals or the fill
                    t0=t0, heard=np.full(self.world, t0), hi=np.zeros((2, self.world), np.intp),
                    foreign0=self.counters["foreign"], ce0=self.counters["ce_received"], stats0=self.t.stats(),
                    t_timers=t0, t_alive=t0)

    def _gather_fields(self, T: int) -> dict:
        """An all-gather's fields (:class:`~pydblp.collective.rounds.GatherRound`) on ``T`` rows."""
        return dict(have=np.zeros(T, bool), ag_first=np.zeros(self.world, np.intp),
                    ag_n=np.full(self.world, -1, np.int64))

    @staticmethod
    def _bounds(T: int, nsh: int) -> list[tuple[int, int]]:
        """``T`` rows cut into ``nsh`` shards: per shard, its rows (first, end)."""
        return [(k * T // nsh, (k + 1) * T // nsh) for k in range(nsh)]

    def _expect_gather(self, st: GatherRound) -> None:
        """The all-gather messages ``st`` waits for: from each other shard's owner, the rows of its
        shard that its all-gather carries (:meth:`Fill.sent_rows`)."""
        for k, (a, b) in enumerate(st.bounds):
            if k != st.my_shard:
                e = a + self.fill.sent_rows(st, b - a)
                st.ins[(True, k)] = InMessage(True, k, st.have[a:e])
                st.ag_first[k], st.ag_n[k] = a, e - a

    def _begin(self, st: Round) -> Round:
        """Match ``st`` from now on and take in its stashed packets."""
        for key, inn in list(st.ins.items()):
            if inn.n == 0:
                del st.ins[key]
        for hdr, pay, lens in self.matcher.begin(st):
            self.process(st, hdr, pay, lens, st.t0)
        return st

    def _scratch(self, name: str, tensor: int, shape: tuple) -> np.ndarray:
        """A float32 buffer kept across rounds (no allocation or page faults per round); contents
        stale.  One per tensor id, but one for all of them where nothing outlives the round
        (``ROUND_SCRATCH``: rounds run one at a time).  A new shape that fits in the memory of
        the one kept reuses it: DDP rebuilds its buckets after the first step, and their
        buffers' pages stay mapped."""
        key = (name, None if name in ROUND_SCRATCH else tensor)
        buf = self._bufs.get(key)
        if buf is None or buf.shape != shape:
            n = int(np.prod(shape))
            mem = buf
            while mem is not None and isinstance(mem.base, np.ndarray):
                mem = mem.base  # (the array that owns the memory)
            if mem is not None and mem.dtype == np.float32 and mem.flags.c_contiguous and mem.size >= n:
                buf = mem.reshape(-1)[:n].reshape(shape)
            else:
                buf = np.empty(shape, np.float32)
            self._bufs[key] = buf
        return buf

    def forget(self, tensor: int) -> None:
        """Drop what this rank keeps across rounds for ``tensor``: its fills' rows, its own
        scratch (a trailing message keeps the rows it holds), its layer classes.  Between rounds."""
        self.fill.forget(tensor)
        for key in [k for k in self._bufs if k[1] == tensor]:
            del self._bufs[key]
        self.layers.pop(tensor, None)

    def _prio(self, st: Round, rows: np.ndarray | None, first: int, sq: np.ndarray | None = None,
              n: int | None = None) -> np.ndarray:
        """The priority of ``rows``, the round's rows ``first..``: by the tensor's own row numbers.
        Rows read in place: ``rows`` None, their number ``n`` and squared norms ``sq`` instead."""
        n = len(rows) if rows is not None else n
        return estimators.chunk_priority(rows, self.cfg.priority, st.tensor_rows(first, n), len(st.y),
                                         self.layers.get(st.tensor), sq=sq, n=n)

    def _order(self, rnd: int, tensor: int, T: int, bounds: list) -> np.ndarray | None:
        """Order "shuffle": the round's permutation of the tensor's ``T`` rows within each shard
        (``bounds``), the same on every rank (drawn from the round and tensor numbers, which all
        ranks share); else None.

        Messages go out, are cut at their bound and lose bursts in send order: in the tensor's
        own order every relaxed round would drop the same tail rows, whose mean then never
        includes the other ranks (and whose stale fill is never refreshed).  Shards keep their
        tensor rows, so an owner holds the same rows every round (fill "carry" relies on it)."""
        if self.cfg.order != "shuffle" or T < 2:
            return None
        rng = np.random.Generator(np.random.PCG64((rnd, tensor)))
        return np.concatenate([a + rng.permutation(b - a) for a, b in bounds])

    # ---- the loop --------------------------------------------------------
    def run(self, st: Round) -> None:
        """Run round ``st`` until it may return (:meth:`complete`) or its deadline passes.

        Each turn sends up to ``burst`` data packets (control first), receives, and checks
        timeouts every ``TIMER_TICK``.  Raises CollectiveError for a dead or misfit peer.
        """
        cfg = self.cfg
        while True:
            now = self.clock()
            late = cfg.deadline is not None and now - st.t0 > cfg.deadline / 2
            if not st.reduced and (late or all(st.ins[(False, s)].done for s in range(self.world)
                                               if (False, s) in st.ins)):
                self.drain(st)
                self.reduce(st)  # with a deadline, owners stop waiting at half of it
            busy = self.send_some(st, now)
            self.flush_ctrl()
            if self.complete(st) or (cfg.deadline is not None and now - st.t0 > cfg.deadline):
                self.drain(st)  # (past the deadline: below the bound; finish fills the gaps and reports it)
                self.flush_ctrl()
                return
            want = 1 if busy else st.expected(now)
            self.take(st, 0.0 if busy else self.tx_wait or 0.002, want, LINGER if want > 1 else 0.0)
            now = self.clock()
            if now - st.t_timers >= TIMER_TICK:  # timeouts are milliseconds: no need to check every turn
                st.t_timers = now
                self.timers(st, now)

    def drain(self, st: Round) -> None:
        """Take in what has already arrived, without waiting.

        A message is done at its bound, and nothing is waited for past it, but chunks that are
        already here when the owner reduces or the round ends still count: the estimate and
        the all-gather use every chunk received, not just the first ``need``.  One receive
        takes what is queued; another follows only while they come back at least half full (a
        queue longer than a batch), at most DRAIN_READS: a stream still arriving at line rate
        is not waited for.
        """
        for _ in range(DRAIN_READS):
            if self.take(st, 0.0) < RECV_BATCH // 2:
                return

    def take(self, st: Round | None, timeout: float, want: int = 1, linger: float = 0.0) -> int:
        """Receive one batch and handle it (``st`` None: between rounds); how many packets came.

        The transport may lend its own buffers (``copy=False``): :meth:`process` is done with
        them before the next receive (the stash copies what it keeps).
        """
        b = self.t.recv(self._rx, timeout=timeout, want=want, linger=linger, copy=False)
        if b.n:
            if self.ledger is not None:
                self._count_rx(b)
            try:
                self.process(st, b.headers[: b.n], b.payload[: b.n], b.lengths[: b.n], self.clock())
            except Exception as e:  # what arrives never ends a round: drop the batch, repair as loss
                self.counters["rx_errors"] += 1
                self._drop_log(e, self.counters["rx_errors"])
        return b.n

    def _count_rx(self, b: Batch) -> None:
        """Count ``b``'s DATA packets per sender, and those that arrived CE-marked (echoed in
        STOPs).  Every DATA packet counts, those the round takes and those it drops as late or
        duplicate alike: the sender compares the count with the DATA it sent, and what is missing
        was lost."""
        h = b.headers[: b.n]
        lib = self.matcher.lib  # (csrc/matcher.c's loops; None: the Python path)
        if (lib is not None and h.dtype == wire.HEADER_DTYPE and h.flags.c_contiguous
                and (b.ecn is None or (b.ecn.dtype == np.uint8 and b.ecn.flags.c_contiguous))):
            ce = lib.dblp_count_data(h.ctypes.data, b.n, None if b.ecn is None else b.ecn.ctypes.data,
                                           self.world, self._rx_at, self._ce_at)
            self.counters["ce_received"] += ce
            return
        data = h["kind"] == DATA
        src = np.where(data, np.minimum(h["src"], self.world), self.world)
        self.rx_from += np.bincount(src, minlength=self.world + 1)
        if b.ecn is None:
            return
        ce = (b.ecn[: b.n] == CE) & data
        if ce.any():
            self.ce_from += np.bincount(src[ce], minlength=self.world + 1)
            self.counters["ce_received"] += int(np.count_nonzero(ce))

    def process(self, st: Round | None, h: np.ndarray, pay: np.ndarray, lens: np.ndarray, now: float) -> None:
        """Handle received packets (``st`` None: between rounds): data goes into the round
        (:class:`~pydblp.collective.matcher.Matcher`), STOPs for messages that reached their
        bound are queued, control packets answered."""
        out = self.matcher.process(st, h, pay, lens, now, self.round if st is None else st.round)
        for inn in out.stops:
            self._ctrl_packet(st.round, st.tensor, STOP, inn.flag, inn.src, inn.n, inn.tol8 or 0)
        for f, payload, current in out.control:
            self.control(st, f, payload, now, current)

    def complete(self, st: Round) -> bool:
        """The round may return: its messages are settled (:meth:`Round.settled`: this rank's part
        is in, every all-gather or neighbour message to it reached its bound or was skipped, its
        reduce-scatter messages are done, its all-gather or neighbour messages went out whole or
        were abandoned, no retransmission it was asked for waits) and the transport holds no paced
        backlog.  Messages not yet acknowledged then trail (see :meth:`finish`)."""
        return st.settled() and self.t.tx_backlog() <= 0

    def reduce(self, st: ReduceScatterRound) -> None:
        """Owner: estimate the shard's mean and, in a round with an all-gather, turn it into what
        that sends (:meth:`ReduceScatterRound.estimated`) and start it."""
        a, b = st.bounds[st.my_shard]
        if st.feedback:  # (before the estimate: it zeroes what did not arrive) what the estimate uses
            for src in self._others:
                self._final(st, src)
        estimators.reduce_mean(st.rbuf, st.rmask, self.cfg.estimator, scratch=True, out=st.y[a:b],
                               own=self.rank)
        if st.signs is not None:
            rotation.rotate(st.y, a, b, self.cfg.rotate, st.signs, inverse=True)
        st.reduced = True
        if st.gather:
            st.estimated(a, b)
            self._start_allgather(st)

    def _start_allgather(self, st: GatherRound) -> None:
        """Owner: send its shard of ``y`` to every rank (the rows :meth:`Fill.sent_rows` says)."""
        a, end = st.bounds[st.my_shard]
        b = a + self.fill.sent_rows(st, end - a)  # (the rest: filled alike on every rank)
        self.fill.carry(st, a, end, b - a)
        st.have[a:b] = True
        prio = self._prio(st, st.y[a:b], a)
        tol8 = 0 if self.cfg.consistent else st.tol8  # consistent: every rank gets what is sent whole
        # a round that repairs, while a reduce-scatter message of mine may still need retransmissions
        # (the last owner to reduce has none left: all of it goes at once)
        split = st.reduce and st.repair and any(not o.done for (ag, _), o in st.outs.items() if not ag)
        members = []
        for dst in self._rotated(self.world):
            if dst != self.rank and b > a:
                o = st.outs[(True, dst)] = OutMessage(True, dst, st.y[a:b], prio, tol8, st.round, st.tensor)
                members.append(o)
        first = members
        if self._gid >= 0 and members:  # one first pass to the group; each member only follows it
            bc = st.bcast = OutMessage(True, wire.DST_ALL, st.y[a:b], prio, tol8, st.round, st.tensor)
            bc.members = members
            for o in members:
                o.avail = 0
            first = [bc]
        else:  # (a broadcast's first pass goes whole: its receivers' paths differ)
            for o in members:
                self._plan(o)
        if split:
            for o in first:
                o.avail = min(o.plan, o.n // 2)
            st.ag_rest = self.clock() + AG_SPLIT

    def _rotated(self, n: int) -> list[int]:
        """``range(n)`` from this rank's successor on: each rank's messages go out in its own order,
        so ranks in step send to different ranks at a time, not all to rank 0 first (an incast at
        its switch port)."""
        return [(self.rank + 1 + i) % n for i in range(n)]

    # ---- sending ---------------------------------------------------------
    @property
    def keeps_up(self) -> bool:
        """The path took ``DRAINED_LOOKS`` full turns in a row as fast as they were handed over
        (:meth:`send_some` then sends larger turns)."""
        return self._drained >= DRAINED_LOOKS

    @property
    def link_bound(self) -> bool:
        """The link, not this host, sets the pace: the transport paces (``pkt_s``: what a packet
        costs its pacer), or it reports a send queue that full turns do not drain (not
        :attr:`keeps_up`).  ``Config.plan`` "auto" plans messages only then."""
        return self.pkt_s > 0 or (self.t.reports_tx_queue and not self.keeps_up)

    def _plan(self, o: OutMessage) -> None:
        """Give ``o`` a plan (``Config.plan``): the first sends whose arrivals meet its bound on
        the path's measured loss ``p`` (:meth:`Ledger.loss`), with ``PLAN_Z`` standard deviations
        to spare: ``(need + z sqrt(need p / (1 - p)) + 1) / (1 - p)``.  No plan (every chunk
        goes) while the loss is not measured, above ``PLAN_LOSS_MAX``, where that is ``n`` or more,
        or (``auto``) where the link is not the bottleneck or the rate control paces ``o.dst``
        (its sends follow the controller's rate, and a shared queue's loss comes in bursts that
        the margin does not cover)."""
        how = self.cfg.plan
        if how == "off" or o.need >= o.n:
            return
        if how == "auto" and (not self.link_bound or (self.cc is not None and self.cc.paced(o.dst))):
            return
        p = self.ledger.loss(o.dst)
        if p is None:
            return
        p, self._short[o.dst] = max(p, self._short[o.dst]), self._short[o.dst] * PLAN_SHORT_KEEP
        if p > PLAN_LOSS_MAX:
            return
        m = (o.need + PLAN_Z * math.sqrt(o.need * p / (1 - p)) + 1) / (1 - p)
        if m < o.n:
            o.set_plan(math.ceil(m))
            self.counters["planned"] += 1

    def _top_up(self, o: OutMessage) -> None:
        """A BITMAP showed ``o``'s plan short by ``d`` chunks: its next sends (what it lost, then
        first sends past the plan) are as many as make the arrivals cover ``d`` the way a plan
        covers ``need``, at the worse of the path's loss and what this message lost so far."""
        got = int(np.count_nonzero(o.acked))
        d = o.need - got
        if d <= 0:
            return
        self.counters["plans_short"] += 1
        p = max(self.ledger.loss(o.dst) or 0.0, 1.0 - got / max(1, o.sent + o.retransmits))
        self._short[o.dst] = max(self._short[o.dst], p)  # (the estimate lags a loss that grew: the next plans
        p = min(p, PLAN_LOSS_MAX)                        # to this rank start from this, PLAN_SHORT_KEEP less each)
        o.top_up(math.ceil((d + PLAN_Z * math.sqrt(d * p / (1 - p)) + 1) / (1 - p)))

    def send_some(self, st: Round, now: float) -> bool:
        """Send up to ``burst`` data packets in one batch, retransmissions first, with waiting control packets.

        Returns True if more wait.  The budget is shared fairly across the messages still
        sending, so no destination waits behind another.  Nothing is sent while the transport
        holds more than ``TXQ_LIMIT`` of paced data (``Transport.tx_backlog``): a control packet
        queued next then waits at most that long; nor, in a round that repairs, while the
        kernel's send queue holds more than ``TXQ_REPAIR`` (``Transport.tx_queued``).
        :attr:`tx_wait` says how long to wait.
        """
        self.tx_wait = None
        bc = st.bcast
        if st.ag_rest is not None and now >= st.ag_rest:  # the all-gather's second half may go
            st.ag_rest = None
            for o in (st.outs.values() if bc is None else (bc,)):  # (a broadcast's members follow it)
                o.avail = o.plan
        active = [o for o in st.outs.values() if not o.done and (o.sent < o.avail or o.nretx)]
        if bc is not None and bc.sent < bc.avail and not all(o.done for o in bc.members):
            active.append(bc)
        if self.trail:  # what an earlier round's trailing all-gather was asked for (or its plan grew by)
            active += [o for o in self.trail.values() if not o.done and (o.nretx or o.sent < o.avail)]
        if not active:
            if st.ag_rest is not None:
                self.tx_wait = max(0.0005, st.ag_rest - now)
            return False
        backlog = self.t.tx_backlog()
        if backlog > TXQ_LIMIT:  # a pacing transport holds enough: STOPs and PROBEs must not queue behind more
            self.tx_wait = min(0.002, max(0.001, backlog - TXQ_LIMIT / 2))
            return False
        if st.repair and self.t.tx_queued() > TXQ_REPAIR:  # a retransmission asked for next must not wait long
            self.tx_wait = 0.001
            return False
        total = self.cfg.burst
        if self.pkt_s:  # a pacing transport: hand it about TXQ_LIMIT of data a turn, not a whole burst
            total = min(total, max(len(active), int(TXQ_LIMIT / self.pkt_s)))
        elif self.t.reports_tx_queue:
            k, t = self._turn
            if 2 * k >= total and now - t < TURN_GAP:  # soon after a full turn: is it out of the host?
                self._drained = self._drained + 1 if self.t.tx_queued() <= TXQ_DRAINED else 0
                self._turn = (0, t)  # (each turn is looked at once)
            if self.keeps_up:  # no link limit (loopback, veths, a NIC faster than this CPU): larger turns,
                # each destination at most a burst, as a parameter server's receiver gets from each sender
                total *= min(len(active), TURN_DESTS)
        share = max(1, total // len(active))
        parts = []
        cc = self.cc
        paced = cc is not None and cc.rate.any()
        held, wait = set(), None  # messages the rate control holds back now, and how long for
        ended = []  # messages with a plan whose last send (first or again) goes in this batch: a PROBE follows
        for o in active:
            budget = share
            if paced:
                budget, w = self._paced(o, budget, now)
                if w is not None:
                    held.add(id(o))
                    wait = w if wait is None else min(wait, w)
                    continue
            self._sends(o, budget, now, parts, ended)
            o.t_last = now
        if bc is not None:
            for o in bc.members:  # they went out with the group's copy
                if o.sent < bc.sent:
                    o.sent = o.avail = bc.sent
                    o.t_last = now
                    o.t_sent_all = bc.t_sent_all
        self._send_batch(st, parts)
        self._probe_behind(ended, now)
        k = sum(len(idx) for _, idx, _ in parts)
        if k:
            self._turn = (k, now)
        grown = self.t.tx_backlog() - backlog
        if k >= 16 and grown > 0:  # what a packet costs the pacer: learnt, the protocol has no rate
            self.pkt_s = grown / k
        more = any((o.sent < o.avail or o.nretx) and id(o) not in held for o in active)
        if not more and held:  # the rate control holds the rest back: sleep until its tokens cover a
            # quantum, in the transport's unit (poll(2)'s ms): a shorter timeout would not sleep at all
            unit, wait = self.t.timeout_unit, max(wait, 50e-6)
            self.tx_wait = math.ceil(wait / unit - 1e-9) * unit if unit else wait
        elif not more and st.ag_rest is not None:
            self.tx_wait = max(0.0005, st.ag_rest - now)
        return more

    def _paced(self, o: OutMessage, budget: int, now: float) -> tuple[int, float | None]:
        """What the rate control lets ``o`` send now, of ``budget``: ``(frames, None)``, or
        ``(0, seconds)`` while its destinations' tokens cover less than a quantum."""
        cc = self.cc
        dsts = self._others if o.dst == wire.DST_ALL else (o.dst,)
        allowed = min(cc.allowed(d, now) for d in dsts)
        left = o.avail - o.sent + o.nretx
        if allowed < cc.quantum(left):
            return 0, max(cc.wait(d, left) for d in dsts)
        return min(budget, allowed), None

    def _sends(self, o: OutMessage, budget: int, now: float, parts: list, ended: list) -> int:
        """Queue ``o``'s next sends in ``parts``, at most ``budget``: what it was asked to resend,
        then first sends up to ``avail``.  Counts them to the ledger and the rate control, and
        notes ``o`` in ``ended`` when they are the last it has to send and it has a plan (a PROBE
        follows them).  Returns how many."""
        sent = 0
        if o.nretx:
            idx = self._resend(o, budget, now)
            parts.append((o, idx, RETX))
            sent = len(idx)
        if o.sent < o.avail and budget > sent:
            idx = o.chunks(o.sent, min(o.avail, o.sent + budget - sent))
            if o.t_first is None:
                o.t_first = now
            o.sent += len(idx)
            parts.append((o, idx, 0))
            sent += len(idx)
            if o.out:
                o.t_sent_all = now
        if sent:
            if o.plans and o.out and not o.nretx:
                ended.append(o)
            if self.ledger is not None:
                for d in (self._others if o.dst == wire.DST_ALL else (o.dst,)):
                    self.ledger.spend(d, sent)
                    if self.cc is not None:
                        self.cc.spend(d, sent)
        return sent

    def _resend(self, o: OutMessage, budget: int, now: float) -> np.ndarray:
        idx = o.resend(budget, now)
        if o.trailing:
            self.counters["trail_retransmits"] += len(idx)
        return idx

    def _send_batch(self, st: Round | None, parts: list) -> None:
        """One batch: the control packets waiting, then DATA ``parts`` ((message, chunk indices, flags)).

        One transport call (one kick) per loop turn, control first: a STOP never waits behind data.
        """
        ctrl, self.ctrl = self.ctrl, []
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
            self._txaddr = np.empty(k, np.uint64)
            self._txrows = np.uint64(self._txbuf.ctypes.data) + np.arange(k, dtype=np.uint64) * np.uint64(width)
            self._txat = (self._txh.ctypes.data, self._txaddr.ctypes.data)
        payload = self._txbuf[:k]  # the transport copies it out before send() returns
        # a transport that reads payloads where they are (Transport.reads_addresses) gets the
        # rows' addresses instead of a copy: the tensor's bytes are read once, by the send
        addr = self._txaddr[:k] if self.t.reads_addresses else None
        h = self._txh[:k]  # every field but magic and version is written below
        lens = self._txlens[:k]
        lens[:] = width
        peer = self._txpeer[:k]
        for i, c in enumerate(ctrl):
            pl = c.payload
            h[i] = (wire.MAGIC, wire.VERSION, c.kind, self.cfg.job, c.round, c.tensor, self.rank, c.dst, 0,
                    RAW, c.chunk, max(c.nchunks, 1), len(pl), c.tol8, c.flag)
            payload[i, : len(pl)] = np.frombuffer(pl, np.uint8)
            lens[i] = len(pl)
            peer[i] = self._pid[c.dst]
        if parts:
            rnd, tensor = (st.round, st.tensor) if st is not None else (parts[0][0].rnd, parts[0][0].tensor)
            lib = self.matcher.lib  # (C: a part's chunk numbers int64, its message's priorities uint8 and addresses
            if lib is not None and not all(  # uint64, all contiguous)
                    idx.dtype == np.int64 and idx.flags.c_contiguous and o.prio.dtype == np.uint8
                    and o.prio.flags.c_contiguous
                    and (o.addrs is None or (o.addrs.dtype == np.uint64 and o.addrs.flags.c_contiguous))
                    for o, idx, _ in parts):
                lib = None
            if lib is None:
                d = h[nc:]
                d["kind"] = DATA
                d["job"] = self.cfg.job
                d["round"] = rnd
                d["tensor"] = tensor
                d["src"] = self.rank
                d["dtype"] = F32
                d["len"] = width
            i = nc
            h0, a0 = self._txat
            for o, idx, flags in parts:
                j = i + len(idx)
                r = o.rows  # (alive through the send below)
                # the payloads are read where they lie: at the addresses made for a transport that reads
                # them (o.addrs), or at their rows' (float32 rows, any row stride)
                lies = o.addrs is not None or (addr is not None and r.strides[1] == 4)
                if lib is not None:  # every field of the part's headers, and those addresses, in one call
                    at = o.addrs is None and lies
                    lib.dblp_data_headers(h0 + i * wire.HEADER_LEN, j - i, idx.ctypes.data, o.prio.ctypes.data,
                                          self.cfg.job, o.rnd, o.tensor, self.rank, o.dst, o.n, width, o.tol8,
                                          flags | o.flag, a0 + 8 * i if lies else None,
                                          None if o.addrs is None else o.addrs.ctypes.data,
                                          r.ctypes.data if at else 0, r.strides[0] if at else 0)
                else:
                    h["dst"][i:j] = o.dst
                    h["prio"][i:j] = o.prio[idx]
                    h["chunk"][i:j] = idx
                    h["nchunks"][i:j] = o.n
                    h["tol"][i:j] = o.tol8
                    h["flags"][i:j] = flags | o.flag
                    if o.rnd != rnd:  # a trailing message of an earlier round
                        h["round"][i:j], h["tensor"][i:j] = o.rnd, o.tensor
                    if o.addrs is not None:
                        addr[i:j] = o.addrs[idx]
                    elif lies:
                        addr[i:j] = np.uint64(r.ctypes.data) + idx.astype(np.uint64) * np.uint64(r.strides[0])
                if not lies:  # a copy of its rows in the payload buffer
                    lo = int(idx[0])
                    rows = r[lo: lo + len(idx)] if int(idx[-1]) - lo + 1 == len(idx) else r[idx]
                    payload[i:j] = rows.view(np.uint8)
                    if addr is not None:
                        addr[i:j] = self._txrows[i:j]
                peer[i:j] = self._gid if o.dst == wire.DST_ALL else self._pid[o.dst]
                i = j
        if addr is not None and nc:  # control payloads are in payload's rows
            addr[:nc] = self._txrows[:nc]
        if self.cfg.spread and len(parts) > 1 and self.link_bound:
            order = spread_order([len(idx) for _, idx, _ in parts], self.cfg.spread) + nc
            # (the headers as opaque 32-byte records: a structured array's gather is ~25x slower)
            for a in (h.view(_RECORD), peer, payload if addr is None else addr):
                a[nc:] = a[order]
        sent = self.t.send(Batch(h, payload, lens, peer, k, addr), timeout=1.0)
        if sent < k:  # the ring or socket stayed full: the loss machinery repairs it
            self.counters["tx_short"] += k - sent

    def _ctrl_packet(self, st_round: int, tensor: int, kind: int, flag: int, dst: int, n: int,
                     tol8: int, chunk: int = 0, payload: bytes = b"") -> None:
        """Queue a control packet about a message whose kind ``flag`` marks (AG, NB or 0)."""
        if kind == STOP:  # every STOP carries this rank's probe timeout estimate, in 100 us units, and the
            # echo: packets received from dst and how many of them came CE-marked, both cumulative
            payload = STOP_PAYLOAD.pack(min(0xFFFF, round(self.estimate * 1e4)),
                                        int(self.rx_from[dst]) & MASK32, int(self.ce_from[dst]) & MASK32)
        self.ctrl.append(Control(st_round, tensor, kind, flag, dst, n, tol8, chunk, payload))

    def flush_ctrl(self) -> None:
        """Send the control packets waiting (a loop turn with no data to send)."""
        if self.ctrl:
            self._send_batch(None, [])

    # ---- control packets -------------------------------------------------
    def control(self, st: Round | None, f: tuple, payload: np.ndarray, now: float, current: bool) -> None:
        """Handle a control packet: header fields ``f`` (a record as a tuple), its payload, at
        ``now``; ``current``: of round ``st`` (else of an earlier one; ``st`` None between rounds).

        A probe for a message of a round that is over (this rank ended it at its deadline, or
        below a message's bound), or for a neighbour message this rank skipped, is answered with
        STOP: nothing more of it will be used.  A control packet whose NEIGHBOUR flag does not match its message's
        (ranks calling rounds in different orders) is ignored."""
        flag = f[F_FLAGS] & (AG | NB)
        ag = bool(flag & AG)
        src, kind, rnd, tensor = f[F_SRC], f[F_KIND], f[F_ROUND], f[F_TENSOR]
        if kind == HELLO:
            if not f[F_FLAGS] & ASK:
                self._hello(st, src, payload, now, current)
            elif current and st.busy():
                # a peer in this round asks, and this rank waits in it for one busy between rounds:
                # waiting on its behalf, it says HELLO too (else it says nothing: two ranks that wait
                # only for each other must not keep each other alive)
                self._hello_seq += 1
                self._ctrl_packet(st.round, st.tensor, HELLO, 0, src, 1, 0,
                                  payload=wire.HELLO_PAYLOAD.pack(self._hello_seq, 0))
            return
        if kind == PROBE:
            ins = st.ins if current else (self._prev[1] if self._prev and self._prev[0] == rnd else None)
            # (st is None between rounds: then current is False and _prev answers)
            inn = ins.get((ag, src)) if ins is not None else None
            if inn is None or inn.flag != flag:
                if inn is None and not current and self._forgotten(st, rnd):  # finished before the last round
                    self._ctrl_packet(rnd, tensor, STOP, flag, src, f[F_NCHUNKS], f[F_TOL])
                else:
                    self.counters["stray"] += 1
                return
            if inn.tol8 is None:
                inn.tol8 = f[F_TOL]
            # a round that is over takes nothing more (its late chunks are dropped): STOP, whatever
            # it holds of the message (a BITMAP would ask for retransmissions it never takes)
            if inn.done or inn.skipped or not current:
                self._ctrl_packet(rnd, tensor, STOP, flag, src, inn.n, inn.tol8)
                inn.stop_sent = True
            else:
                self._bitmap(rnd, tensor, inn)
            return
        echo = est = None
        if kind == STOP and len(payload) >= 2:  # (within the bounds this rank holds its own to: a
            # peer's 0 would make the median 0, a probe at every timer)
            c = self.cfg
            est = min(c.probe_max, max(c.probe_min, int.from_bytes(payload[:2].tobytes(), "big") / 1e4))
            if len(payload) >= STOP_PAYLOAD.size and self.ledger is not None:
                echo = self._echo(src, *STOP_PAYLOAD.unpack(payload[: STOP_PAYLOAD.size].tobytes())[1:])
        if kind == BITMAP and f[F_FLAGS] & FINAL:  # what an owner's estimate used of my contribution
            o = st.outs.get((False, src)) if current and not flag else None
            if o is None:  # (the round is over: its feedback was taken as used whole)
                self.counters["stray"] += 1
                return
            bits = np.unpackbits(payload, bitorder="little").astype(bool)[: max(0, o.n - f[F_CHUNK])]
            span = slice(f[F_CHUNK], f[F_CHUNK] + len(bits))
            if o.used is None:
                o.used, o.finals = np.ones(o.n, bool), np.zeros(o.n, bool)
            if not o.finals[span].all():  # news the first time a FINAL covers a chunk; a repeat (or
                o.finals[span] = True     # a replay) is not, as for a BITMAP
                st.heard[src] = now
            o.used[span] = bits
            return
        o = st.outs.get((ag, src)) if current else self.trail.get((rnd, ag, src))
        if o is None or o.done or o.flag != flag:  # (a STOP or BITMAP for no message still sending)
            if echo is not None and self.cc is not None:  # (the counts are cumulative: any STOP's are
                # news; a message the owner's all-gather ended, as a parameter server's, gets its STOP only now)
                self.cc.echo(src, echo, now, self._sent_rate(o, now) if o is not None else None)
            self.counters["stray"] += 1
            return
        # A peer is heard (alive, for peer_timeout) on news only: a STOP that ends a live message,
        # a BITMAP that acknowledges a chunk for the first time.  Probes and repeated answers are
        # not news; a replay of them would keep a dead peer alive.
        if kind == STOP:
            if current:
                st.heard[src] = now
            if est is not None:  # (only from a STOP that ends a live message: an old one, replayed,
                self.timeouts[src] = est  # would set any estimate a peer ever sent)
            if echo is not None and self.cc is not None:
                delay = now - o.t_sent_all if o.t_sent_all is not None and o.timeouts == 0 else None
                self.cc.echo(src, echo, now, self._sent_rate(o, now), delay)
            self._out_done(o, now)
        elif kind == BITMAP:
            acked = 0 if o.acked is None else int(np.count_nonzero(o.acked))
            if current:
                st.repair = True
            done = o.bitmap(f[F_CHUNK], np.unpackbits(payload, bitorder="little").astype(bool), now,
                            self.probe_timeout)
            if current and (done or int(np.count_nonzero(o.acked)) > acked):
                st.heard[src] = now
            if done:
                self._out_done(o, now)
            elif o.plans:
                self._top_up(o)

    def _hello(self, st: Round | None, src: int, payload: np.ndarray, now: float, current: bool) -> None:
        """A HELLO from ``src``: alive, busy between rounds, not yet in round ``st`` (or, with 0 ms
        out of rounds, an answer to this rank's ask from a peer in the round that waits there for a
        busy one: alive only).  News only about the current round and with a number above any taken
        from ``src`` (a replay is not): the peer is heard (not taken for dead), and the round waits
        for a busy one up to ``Config.join_timeout`` (:meth:`timers`)."""
        if current and len(payload) >= wire.HELLO_PAYLOAD.size:
            seq, out = wire.HELLO_PAYLOAD.unpack(payload[: wire.HELLO_PAYLOAD.size].tobytes())
            if seq > self._hello_heard[src]:
                self._hello_heard[src] = seq
                # busy: out of rounds (0 ms: an answer on behalf of a busy rank, from a peer in the
                # round, alive but not busy), unless its data of this round came already (in this
                # batch, handled first, or before: a HELLO sent just before it joined, reordered)
                if out and not st.joined(src):
                    st.hello[src] = now
                st.heard[src] = now
                self.counters["hellos"] += 1
                return
        self.counters["stray"] += 1

    def _echo(self, src: int, received: int, marked: int) -> Echo | None:
        """Read a STOP's echo from ``src`` into the ledger; the phase controller hears the loss."""
        news = self.ledger.echo(src, received, marked)
        if news is not None and news.got and self.controller.hears_loss:
            self.controller.observe_loss(news.sent, news.sent - news.got)
        return news

    def _sent_rate(self, o: OutMessage, now: float) -> float | None:
        """Bits/s message ``o`` went out at: its bytes sent over the time from its first send to now."""
        span = now - o.t_first if o.t_first is not None else 0.0
        return o.sent * self.frame * 8 / span if span > 0 else None

    def _forgotten(self, st: Round | None, rnd: int) -> bool:
        """Round ``rnd`` is one this rank finished before the last one (whose record ``_prev``
        keeps): two or more before the one it runs (``st``), or between rounds one or more before
        the finished one.  Round numbers wrap at 2**32."""
        age = (self.round - rnd) & MASK32
        return (1 if st is None else 2) <= age < 1 << 31

    def _bitmap(self, rnd: int, tensor: int, inn: InMessage) -> None:
        """Queue BITMAP packets with ``inn``'s arrival bits (one per ``chunk_bytes`` of bits)."""
        bits = np.packbits(inn.mask, bitorder="little").tobytes()
        step = self.cfg.chunk_bytes
        for off in range(0, len(bits), step):
            self._ctrl_packet(rnd, tensor, BITMAP, inn.flag, inn.src, inn.n, inn.tol8,
                              chunk=off * 8, payload=bits[off: off + step])

    def _final(self, st: ReduceScatterRound, src: int) -> None:
        """Owner, error feedback: tell ``src`` which of its chunks the estimate uses (BITMAP, flag
        FINAL; twice, as a lost copy costs the sender the round's feedback)."""
        bits = np.packbits(st.rmask[src], bitorder="little").tobytes()
        n = len(st.rmask[src])
        step = self.cfg.chunk_bytes
        for _ in range(2):
            for off in range(0, len(bits), step):
                self._ctrl_packet(st.round, st.tensor, BITMAP, FINAL, src, n, st.tol8, chunk=off * 8,
                                  payload=bits[off: off + step])

    def _out_done(self, o: OutMessage, now: float) -> None:
        o.done = True
        if o.t_sent_all is not None and o.timeouts == 0:
            delay = now - o.t_sent_all
            self.estimate = min(self.cfg.probe_max, max(self.cfg.probe_min,
                                0.8 * self.estimate + 0.2 * (3 * delay + 0.001)))

    # ---- timers ----------------------------------------------------------
    def nacks(self, st: Round, now: float) -> None:
        """Receiver-driven repair: queue an unsolicited BITMAP for each message of ``st`` that can
        no longer reach its bound and is due (:meth:`InMessage.nack_due`).  A reduce-scatter
        message no longer matters once this rank has reduced."""
        for inn in st.ins.values():
            if (inn.ag or inn.nb or not st.reduced) and inn.nack_due(now):
                self._bitmap(st.round, st.tensor, inn)
                st.repair = True
                st.nacks += 1

    def _probes(self, outs, now: float) -> None:
        """PROBE each of ``outs`` that has sent everything, has no retransmission queued and has
        heard nothing for its probe wait.  A message with a plan that heard nothing for the probe
        timeout since its probe (the probe or its answer lost) sends the rest of its chunks instead."""
        pt = None
        for o in outs:
            if o.done or not o.out or o.nretx:
                continue
            if pt is None:
                pt = self.probe_timeout
            if o.plans and o.plan < o.n and o.t_probed is not None and o.t_heard < o.t_probed <= now - pt:
                o.extend_plan(o.n)
                self.counters["plans_short"] += 1
                continue
            if o.probe_due(now, pt, self.cfg.probe_max):
                self._ctrl_packet(o.rnd, o.tensor, PROBE, o.flag, o.dst, o.n, o.tol8)
                if o.trailing:
                    self.counters["trail_probes"] += 1

    def timers(self, st: Round, now: float) -> None:
        """NACKs and probes due (every TIMER_TICK), a dead peer (every DEAD_TICK).

        Raises CollectiveError for a needed peer silent for ``peer_timeout``, or one alive whose
        data has not fit this round for as long.  A forgiving round (``Round.forgiving``: a
        neighbour round) never raises: it leaves such peers out at its own deadlines
        (:meth:`Round.expire`).
        """
        self.nacks(st, now)
        self._probes(st.outs.values(), now)
        if self.trail:
            self._trail_timers(now)
        st.expire(now)
        if st.forgiving:
            return
        if now - st.t_alive < DEAD_TICK:
            return
        st.t_alive = now
        # Peers whose silence is their own: one this rank probes (a live one answers every probe),
        # one owing its own data (a contribution to this rank's shard, a shard it broadcasts).  An
        # owner's all-gather in an allreduce may instead wait for a third rank's contribution, so
        # such a peer is judged only when no peer of the first kind is needed: else a rank killed
        # while still sending would go unnamed, and each survivor would name the other, silent
        # since its own data went out.
        waiting = [i for i in st.ins.values() if not i.done]
        owing = {i.src for i in waiting if (not st.reduce if i.ag else not st.reduced)}
        needed = {o.dst for o in st.outs.values() if not o.done} | owing
        if not needed:
            needed = {i.src for i in waiting if i.ag}
        needed -= st.misfit.keys()  # (it sends, what does not fit: judged below, with a clearer error)
        watched = set()
        if needed and needed <= set(st.busy()):
            # Every peer the round waits for now is busy between rounds.  The peers it needs once
            # they join (an allreduce's owners, for their all-gather) are watched meanwhile: asked,
            # a live one answers on the busy ones' behalf, so one that dies during the wait is
            # named at peer_timeout, not only once the busy ones join (or at join_timeout).
            watched = {i.src for i in waiting} - needed - st.misfit.keys()
        # A peer's silence counts from its last news or from when it became needed (or watched),
        # the later: one with nothing to say while the round waited for another (a peer busy
        # between rounds, which says HELLO) is not silent for that wait.  Watching is timed apart:
        # a watched peer that becomes needed once the busy ones join starts afresh.
        quiet = {}
        for since, peers in ((st.needed, needed), (st.watched, watched)):
            for q in [q for q in since if q not in peers]:
                del since[q]
            for q in peers:
                quiet[q] = now - max(st.heard[q], since.setdefault(q, now))
        judged = needed | watched
        self._ask(st, quiet, now)
        if judged:
            # name the peer silent longest: one that stalled because of it went quiet later
            r = min(judged, key=lambda q: (-quiet[q], st.heard[q], q))
            if quiet[r] > self.cfg.peer_timeout:
                foreign = self.counters["foreign"] - st.foreign0
                # (several at once: e.g. a round after the one a rank died in, where a survivor that
                # gave up on that round is as silent as the dead rank; this rank cannot tell them apart)
                also = sorted(q for q in judged if q != r and quiet[q] > self.cfg.peer_timeout)
                raise CollectiveError(
                    f"rank {self.rank}: rank {r} sent nothing for {self.cfg.peer_timeout:.1f} s in round "
                    f"{st.index} (tensor {st.tensor}): peer dead or unreachable"
                    + (f" (also silent as long: rank{'s' if len(also) > 1 else ''} "
                       f"{', '.join(map(str, also[:8]))}{f' and {len(also) - 8} more' if len(also) > 8 else ''})"
                       if also else "")
                    + (f" ({foreign} packets of another job or for another rank came meanwhile: every rank "
                       f"must use the same Config.job, world and peer list)" if foreign else ""))
            if st.hello and now - st.t0 > self.cfg.join_timeout:
                # alive (its latest news is a HELLO: it is between rounds) but not in this one
                busy = [q for q in st.busy() if q in needed]
                if busy:
                    raise CollectiveError(
                        f"rank {self.rank}: rank{'s' if len(busy) > 1 else ''} {', '.join(map(str, busy[:8]))}"
                        f"{f' and {len(busy) - 8} more' if len(busy) > 8 else ''} alive but not in round "
                        f"{st.index} (tensor {st.tensor}) after {self.cfg.join_timeout:g} s (Config.join_timeout): "
                        f"busy between rounds for longer, or calling collectives in another order or fewer of them")
        for q, (since, what) in st.misfit.items():
            # alive (it probes) but a message of its that this round needs has not moved for
            # peer_timeout while what it sends does not fit (all of it, or one message's only, as
            # an all-gather of another length): the round can never complete
            if now - since > self.cfg.peer_timeout and any(
                    not (i.done or i.skipped) and now - i.t_data > self.cfg.peer_timeout
                    for (_, s), i in st.ins.items() if s == q):
                raise CollectiveError(
                    f"rank {self.rank}: rank {q}'s data in round {st.index} does not fit for "
                    f"{self.cfg.peer_timeout:.1f} s: {what}.  Every rank must use the same Config "
                    f"(chunk_bytes) and call allreduce with tensors of the same size in the same order")

    # ---- trailing all-gather messages ------------------------------------
    def _trail_timers(self, now: float) -> None:
        """Forget trailing messages that are done, drop those whose receiver has been silent for
        ``peer_timeout`` (dead: a live one answers every probe), probe those due."""
        for key, o in list(self.trail.items()):
            if o.done:
                del self.trail[key]
            elif now - o.t_heard > self.cfg.peer_timeout:
                del self.trail[key]
                self.counters["trail_dropped"] += 1
        self._probes(self.trail.values(), now)

    def trail_due(self, now: float) -> float | None:
        """Seconds until a trailing message needs this rank (a probe due; 0: retransmissions wait),
        None if none does.  Read by whoever holds the transport (a round, or the idle responder
        holding ``Collective._poll_lock``) before it sleeps."""
        due, pt = None, None
        paced = self.cc is not None and self.cc.rate.any()
        for o in list(self.trail.values()):
            if o.done:
                continue
            if o.nretx or o.sent < o.avail:
                if self.t.tx_backlog() > TXQ_LIMIT:  # (as serve_trail holds back)
                    t = 0.001
                elif paced and (w := self._paced(o, 1, now)[1]) is not None:
                    t = w
                else:
                    return 0.0
                due = t if due is None else min(due, t)
                continue
            if pt is None:
                pt = self.probe_timeout
            t = o.t_last + o.probe_wait(pt, self.cfg.probe_max) - now
            due = t if due is None else min(due, t)
        return None if due is None else max(0.0, due)

    # ---- between rounds: HELLO ---------------------------------------------
    def hello(self, now: float) -> None:
        """Between rounds, once this rank has been out of rounds ``peer_timeout / HELLO_EVERY``
        (and as often after): a HELLO to each peer whose packets of a round to come it holds (a
        peer waiting for it there would take it for dead at its ``peer_timeout``).  Each carries
        the next number of this rank's HELLOs (a replay is no news) and the ms since its last
        round.  Whoever holds the transport between rounds calls it if this rank will run more
        rounds; it queues, :meth:`flush_ctrl` sends."""
        if now < self._hello_at:
            return
        self._hello_at = now + self.cfg.peer_timeout / HELLO_EVERY
        waiting = self.matcher.waiting(self.round)
        out = min(MASK32, max(1, int((now - self._idle_since) * 1000)))  # (0: an answer on behalf)
        for src, (rnd, tensor) in sorted(waiting.items()):
            self._hello_seq += 1
            self._ctrl_packet(rnd, tensor, HELLO, 0, src, 1, 0, payload=wire.HELLO_PAYLOAD.pack(self._hello_seq, out))
        self.counters["hellos_sent"] += len(waiting)

    def _ask(self, st: Round, quiet: dict, now: float) -> None:
        """HELLO with flag ASK, every ``peer_timeout / HELLO_EVERY``, to each needed or watched
        peer quiet that long (``quiet``): one busy between rounds stashes it and so answers with
        HELLOs, though this rank had sent it nothing of the round (it waits for the peer's
        contribution first: a parameter server, or an owner whose peer holds no rows); a peer in
        the round answers on a busy one's behalf (:meth:`control`).  Never news."""
        every = self.cfg.peer_timeout / HELLO_EVERY
        for q, t in quiet.items():
            if t > every and now - st.asked.get(q, -math.inf) >= every:
                st.asked[q] = now
                self._hello_seq += 1
                self._ctrl_packet(st.round, st.tensor, HELLO, ASK, q, 1, 0,
                                  payload=wire.HELLO_PAYLOAD.pack(self._hello_seq, 0))

    def idle_due(self, now: float, hello: bool = True) -> float | None:
        """Seconds until this rank needs to act between rounds (0: now): a trailing message's probe
        or retransmissions (:meth:`trail_due`), or, with ``hello``, HELLOs while a peer's packets
        of a round to come wait here (:meth:`hello`); None if nothing does (only an arriving
        packet does)."""
        due = self.trail_due(now)
        if hello and self.matcher.stash:
            t = max(0.0, self._hello_at - now)
            due = t if due is None else min(due, t)
        return due

    def serve_trail(self, now: float) -> None:
        """Between rounds: send what trailing messages were asked to resend, and the first sends a
        BITMAP grew their plans by (``burst`` packets at most; the rest on the next call), then
        their timers.  Held back as a round's sends are: while a pacing transport holds more
        than ``TXQ_LIMIT``, and to what the rate control allows each destination
        (:meth:`trail_due` says when to call again)."""
        parts, budget, ended = [], self.cfg.burst, []
        if self.t.tx_backlog() > TXQ_LIMIT:
            budget = 0
        paced = self.cc is not None and self.cc.rate.any()
        for o in self.trail.values():
            if not o.done and budget > 0:
                b = budget
                if paced:
                    b, w = self._paced(o, budget, now)
                    if w is not None:
                        continue
                k = self._sends(o, b, now, parts, ended)
                if k:
                    budget -= k
                    o.t_last = now
        if parts:
            self._send_batch(None, parts)
        self._probe_behind(ended, now)
        self._trail_timers(now)

    def _probe_behind(self, ended: list, now: float) -> None:
        """PROBE each message of ``ended`` (with a plan: its last send queued went in the batch just
        sent); the next batch carries them, behind the data on its path."""
        for o in ended:
            o.probed(now)
            self._ctrl_packet(o.rnd, o.tensor, PROBE, o.flag, o.dst, o.n, o.tol8)

    # ---- round end -------------------------------------------------------
    def finish(self, st: Round) -> RoundRecord:
        """End round ``st``: make its result whole (:meth:`Round.conclude`: the fill of missing rows,
        or a neighbour round's mean), keep what late probes and trailing messages need, record it
        (:attr:`records`, ``Config.on_record``)."""
        if getattr(st, "feedback", False):
            self._feed_back(st)
        st.conclude(self.fill)
        self._prev = (st.round, st.ins)
        self._began = (st.round, st.began())
        self._trail_from(st)  # (copies the rows its messages still need: y may be replaced now)
        out = getattr(st, "out", None)
        if out is None:
            st.reorder()
            self.fill.keep(st)
        elif getattr(st, "result", None) is not None:  # shuffled: written into out as it ran (and the
            st.reorder()                                # partial last row now)
            self.fill.keep(st, out)
        else:  # the caller's array: the result in the tensor's order there, in one pass
            T, C = st.y.shape
            if out.size == T * C:  # whole rows: straight into it
                st.reorder(out.reshape(T, C))
                self.fill.keep(st)
            else:  # y (scratch) in the tensor's order, its values copied out, itself kept as it is
                key = ("y", st.tensor)
                st.reorder()
                np.copyto(out, st.y.reshape(-1)[: out.size])
                spare = self.fill.keep(st, give=True)
                if self.fill.stale.get(st.tensor) is st.y:  # the stale fill holds that scratch now
                    if spare is None:
                        self._bufs.pop(key, None)
                    else:
                        self._bufs[key] = spare
        s1 = self.t.stats()
        rec = RoundRecord(index=st.index, round=st.round, tensor=st.tensor, tol=st.tol8 / 255,
                          phase=st.phase, latency=self.clock() - st.t0)
        st.account(rec)
        rec.min_delivered = min(rec.delivered.values(), default=1.0)
        rec.retransmits = sum(o.retransmits for o in st.outs.values())
        rec.probes = sum(o.probes for o in st.outs.values())
        rec.nacks = st.nacks
        rec.bytes_sent = s1.get("tx_bytes", 0) - st.stats0.get("tx_bytes", 0)
        rec.bytes_received = s1.get("rx_bytes", 0) - st.stats0.get("rx_bytes", 0)
        rec.ce_received = self.counters["ce_received"] - st.ce0
        if self.cc is not None:
            rec.paced = int(np.count_nonzero(self.cc.rate))
        if st.forgiving:  # (a misfit fails any other round)
            for q, (_, what) in st.misfit.items():
                log.warning("rank %d: neighbour %d's data in round %d did not fit: %s", self.rank, q, st.index, what)
        self.records.append(rec)
        self.index += 1
        self._idle_since = now = self.clock()
        self._hello_at = now + self.cfg.peer_timeout / HELLO_EVERY
        if self.cfg.on_record is not None:
            self.cfg.on_record(rec)
        return rec

    def _trail_from(self, st: Round) -> None:
        """Keep the round's all-gather messages that went out whole but are not acknowledged yet:
        they trail, on a copy of their rows (the caller owns the result now), until their STOP."""
        for key in [k for k, o in self.trail.items() if o.done]:
            del self.trail[key]
        pending = [o for o in st.outs.values() if (o.ag or o.nb) and not o.done and o.out]
        if not pending:
            return
        rows = pending[0].rows  # (every all-gather message of a round carries the same rows, my shard;
                                # every neighbour message its round's input)
        keep = self._scratch("trail", st.tensor, rows.shape)
        old: dict[int, np.ndarray] = {}  # an earlier round's messages still on this memory keep a copy of their own
        for o in self.trail.values():      # (their rows may be a view of another shape: _scratch reuses memory)
            if np.may_share_memory(o.rows, keep):
                if id(o.rows) not in old:
                    old[id(o.rows)] = o.rows.copy()
                o.rows = old[id(o.rows)]
        np.copyto(keep, rows)
        now = self.clock()
        for o in pending:
            o.rows, o.trailing, o.t_heard = keep, True, now
            self.trail[(o.rnd, o.ag, o.dst)] = o


# Scratch that no round leaves behind (an input or result in the round's order, an owner's inbox,
# a padded row): shared by every tensor id, so a job's memory for them is its largest round's, not the sum
# over its buckets.  What outlives a round stays per tensor id: "y" (handed to the stale fill),
# "trail" (rows of trailing all-gather messages).
ROUND_SCRATCH = frozenset({"x", "xin", "yr", "ytail", "rbuf", "nbuf", "basein", "base", "tail", "patch"})


_RECORD = np.dtype((np.void, wire.HEADER_LEN))


def spread_order(sizes: list[int], run: int) -> np.ndarray:
    """The order of a send batch's data packets, parts of ``sizes`` packets laid out one after the
    other, that takes up to ``run`` packets of each part in turn (``Config.spread``); each part's
    own packets keep their order."""
    key = np.concatenate([np.arange(n) // run * len(sizes) + p for p, n in enumerate(sizes)])
    return np.argsort(key, kind="stable")


def _pad(flat: np.ndarray, into: np.ndarray) -> None:
    """Write ``flat`` into ``into``'s first values and zero the rest (the last chunk's padding)."""
    v = into.reshape(-1)
    v[: flat.size] = flat
    v[flat.size:] = 0
