"""The bounded-loss collective's public face: :class:`Collective`, one per rank.

It runs rounds of the protocol (:class:`~pydblp.collective.protocol.Protocol`, described in
docs/protocol.md) for one caller at a time, and between rounds answers peers from a thread of
its own.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
import select
import threading
from collections.abc import Callable

import numpy as np

from pydblp.collective.config import (IDLE_GRACE, REAL_CLOCK, RECV_BATCH, TENSOR_AGREE, TENSOR_WARM_UP,
                                     CollectiveError, Config, RoundRecord)
from pydblp.collective.protocol import Protocol
from pydblp.collective.timer import Alarm
from pydblp.transport.base import Transport, TransportError

log = logging.getLogger(__name__)

CLOSE_JOIN = 5.0  # s close() waits for the idle responder before leaving the transport to it


def warm_up_args(size, rounds) -> tuple[int, int]:
    """:meth:`Collective.warm_up`'s arguments checked, as ints; ValueError naming the one that is
    wrong (for callers that check before handing the call to another thread)."""
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"warm_up: size is a number of values, 1 or more, not {size!r}")
    if isinstance(rounds, bool) or not isinstance(rounds, (int, np.integer)) or rounds < 0:
        raise ValueError(f"warm_up: rounds is a count, 0 or more, not {rounds!r}")
    return int(size), int(rounds)


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
    sleeps while nothing arrives and no probe or HELLO is due, and is never woken by
    rounds that follow each other within ``IDLE_GRACE`` (2 ms).  While peers
    wait for this rank in a round it has not begun (the caller is busy: an
    evaluation, a checkpoint) it tells them 16 times a ``peer_timeout`` that it
    is alive (HELLO), so they wait for it up to ``Config.join_timeout`` instead
    of failing at ``peer_timeout``.  :meth:`close` ends it.

    Round records: :attr:`records` keeps the latest ``Config.records_max`` (4096 by default;
    older ones are dropped, so memory stays flat over any number of rounds); ``Config.on_record``
    is handed every record as its round ends.
    """

    def __init__(self, transport: Transport, rank: int, world: int, peers: list, config: Config | None = None,
                 group: tuple | None = None, clock: Callable[[], float] = REAL_CLOCK, idle_thread: bool = True):
        """Args:
            transport: an open transport; the collective owns it from now on (:meth:`close`).
            rank: this rank, 0..world-1.
            world: the number of ranks, 1..65535.
            peers: per rank, ``(addr, port)`` or ``(addr, port, mac)``.
            config: the knobs (default ``Config()``).
            group: the broadcast all-gather's address (see above).
            clock: the protocol's "now" (seconds, monotonic; default the real clock).
            idle_thread: answer peers between rounds from a thread of this collective's own
                (default).  False: no thread; whoever owns the collective calls :meth:`serve`
                between rounds, from the thread that runs them (:mod:`pydblp.sim` does, in
                virtual time).

        Raises ValueError naming what is wrong (a knob, the rank, world, peer list, group, a
        closed transport) before any peer is registered; OSError if the idle responder's
        timer or thread cannot be made.
        """
        self.protocol = p = Protocol(transport, rank, world, peers, config, group, clock)
        self.cfg, self.t, self.rank, self.world, self.C = p.cfg, p.t, p.rank, p.world, p.C
        self.controller = p.controller
        self.records: collections.deque[RoundRecord] = p.records  # the latest rounds' (Config.records_max)
        self.counters: dict[str, int] = p.counters
        self._closing = False
        self._owners_g = False               # G is the owners' pieces, summed in end_step: a sharded
                                             # update ran, or a reduce-scatter was observed
        self._poll_lock = threading.Lock()   # whoever holds it owns the transport
        self._state = threading.Lock()       # guards the hand-off's flags below (no reliance on the GIL)
        self._running = False                # a round runs or is about to take the lock
        self._serving = False                # the idle responder polls the transport
        self._idle_done = False              # the idle responder has returned
        self._close_late = False             # close() found it stuck: it releases what it uses as it returns
        self._idle_error: BaseException | None = None  # what ended the idle responder, raised by the next round
        self.hello = True  # it will run more rounds: peers waiting for it hear it is alive (HELLO); its owner
                           # sets False once it will not (closing, or failed for good)
        self._idler = None
        if not idle_thread:
            return
        self._alarm = Alarm()                # starts the idle responder IDLE_GRACE after a round
        self._wake = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)  # ends its poll
        self._idler = threading.Thread(target=self._idle_main, name=f"pydblp-idle-{rank}", daemon=True)
        try:
            self._idler.start()
        except BaseException:
            self._alarm.close()
            os.close(self._wake)
            raise
        self._alarm.set(IDLE_GRACE)

    # ---- public ----------------------------------------------------------
    def set_layers(self, tensor: int, classes: np.ndarray | None) -> None:
        """Give tensor ``tensor`` its chunks' priority classes for ``Config(priority="layer")``
        (:func:`~pydblp.collective.estimators.layer_classes`; None forgets them).  Call it between
        rounds, from the thread that runs them; a round uses what was given when it started.

        Raises:
            ValueError: a class outside 1..7.
        """
        if classes is None:
            self.protocol.layers.pop(tensor, None)
            return
        c = np.asarray(classes, np.uint8)
        if len(c) and (c.min() < 1 or c.max() > 7):
            raise ValueError("layer classes must be 1..7 (0 is kept for control packets)")
        self.protocol.layers[tensor] = c

    @property
    def index(self) -> int:
        """Rounds this rank has finished."""
        return self.protocol.index

    @property
    def round(self) -> int:
        """The last round's number on the wire (wraps at 2**32)."""
        return self.protocol.round

    @property
    def probe_timeout(self) -> float:
        """The probe timeout in use (s): the median of every rank's latest own estimate.

        Each rank adapts its estimate to the STOP delays it measures and
        carries it in every STOP it sends, so all ranks converge on one
        value (OptiReduce-style agreement) instead of each acting alone.
        """
        return self.protocol.probe_timeout

    @property
    def trailing(self) -> int:
        """All-gather messages of finished rounds still waiting for their STOP (a snapshot)."""
        return sum(not o.done for o in list(self.protocol.trail.values()))

    def state_dict(self) -> dict:
        """What a collective resuming this one's run needs to go on as it would: the round counter
        and number (the shuffle's permutation, ``Config.order``, is drawn from the round number;
        ``Schedule`` and a ``Dblp`` that observes every round decide on the index), the phase
        controller's state (:meth:`PhaseController.state_dict`) and what the fills carry across
        rounds (fill "stale": each tensor's last result; fill "carry": the rows cut from an owner's
        all-gather, applied in its next round; ``Config.error_feedback``: each tensor's rows its
        last round's estimates left out, sent in its next).  Numbers, dicts and numpy arrays (copies); no
        torch (``pydblp.torch.State.state_dict`` gives tensors, for ``torch.save``).

        Call it between rounds, from the thread that runs them.  Not kept: round records,
        counters, the probe timeout estimate (learned again within a few rounds) and trailing
        all-gather messages (they belong to this transport's peers).
        """
        p = self.protocol
        return {"rank": self.rank, "world": self.world, "round": p.round, "index": p.index,
                "controller": self.controller.state_dict(), "fill": p.fill.state_dict(),
                "residual": p.residuals.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state`` (:meth:`state_dict` of this rank's collective in an earlier run of
        the job): the next round takes the round number after the saved one's.

        Only before this collective's first round; every rank loads its own before any rank begins
        a round (e.g. load, then a barrier): a peer's packets of a round past this rank's counter
        by more than ``STASH_AHEAD`` are not kept, and a round that misses them repairs (or, within
        its bound, tolerates) their loss.  The controller must be of the saved one's kind.

        Raises:
            RuntimeError: a round has begun.
            ValueError: ``state`` is another rank's or world's, or another controller kind's.
        """
        if (state["rank"], state["world"]) != (self.rank, self.world):
            raise ValueError(f"the state of rank {state['rank']} of {state['world']} given to rank {self.rank} "
                             f"of {self.world}: each rank loads its own")
        with self._poll_lock:  # (the idle responder reads the round number)
            p = self.protocol
            if p.index or p.round or self._round_begun():
                raise RuntimeError("load_state_dict after a round began: load before the first round")
            self.controller.load_state_dict(state["controller"])
            p.fill.load_state_dict(state["fill"])
            p.residuals.load_state_dict(state.get("residual", {}))
            p.round, p.index = int(state["round"]), int(state["index"])

    def allreduce(self, x: np.ndarray, tensor: int = 0, op: str = "mean", exact: bool = False,
                  out: np.ndarray | None = None) -> np.ndarray:
        """Return the estimated mean (or sum, ``op="sum"``) of ``x`` over all ranks.

        Same shape as ``x``, float32.  ``exact``: the round's bound is 0 whatever the phase
        controller says (every message is repaired whole) and the controller is not shown it:
        for values that are not gradients.  ``out``: a float32 C-contiguous array of ``x``'s size
        (``x`` itself: in place, as Gloo's ``all_reduce``) the result is written to and returned;
        default a new array.  Raises :class:`CollectiveError` when a needed peer is silent for
        ``peer_timeout`` (``out`` then holds anything).
        """
        if op not in ("mean", "sum"):
            raise ValueError("op must be mean or sum")
        if out is not None and not (isinstance(out, np.ndarray) and out.dtype == np.float32
                                    and out.flags.c_contiguous and out.flags.writeable and out.size == np.size(x)):
            raise ValueError(f"out: a writeable C-contiguous float32 array of {np.size(x)} values (x's size)")
        if exact:
            res = self._round(x, start=lambda p, flat: p.start(flat, tensor, True, exact=True, out=out), out=out)
            return self._sum_or_mean(res, op)
        part = []  # the vector G is measured on, when not the whole result

        def mine(st):  # the rows of my shard: my exact estimate, whatever the all-gather left elsewhere
            v = self._own_rows(st)
            if v is not None:
                part.append(v)

        def fresh(st):  # consistent: the rows this round delivered (every rank holds the same ones)
            if not st.have.all():
                rows = np.flatnonzero(st.have)
                rows = rows if st.perm is None else st.perm[rows]
                scale = np.float32(np.sqrt(len(st.have) / max(len(rows), 1)))
                part.append(st.result_rows(rows).reshape(-1) * scale)

        # What the controller measures G on: the result where every rank holds the same one; but
        # when a consistent round left rows to the stale fill (Config.allgather_bound), only the
        # rows it delivered, a uniform sample of the shuffled tensor scaled up to the whole (last
        # round's rows are not this gradient: their noise would read as a change of regime); and
        # when ranks' fills differ, or with fill "carry" (the result mixes in rows cut from earlier
        # rounds), the shard this rank owns, before anything carried was added (end_step sums the
        # ranks' norms).
        # (A controller that does not count steps has no end_step to agree in: it sees the result.)
        start = lambda p, flat: p.start(flat, tensor, True, out=out)  # noqa: E731
        if not self.controller.observes:  # (static, schedule: nothing to measure)
            return self._sum_or_mean(self._round(x, start=start, out=out), op)
        if self._shared_g():
            done, shared = fresh, True
        elif getattr(self.controller, "steps", None) is None:
            done, shared = None, True
        else:
            done, shared = mine, False
        res = self._round(x, start=start, done=done, out=out)
        seen = part[0] if part else res if shared else np.zeros(0, np.float32)
        self.controller.observe(self.index - 1, seen)
        return self._sum_or_mean(res, op)

    def _sum_or_mean(self, out: np.ndarray, op: str) -> np.ndarray:
        """A round's mean as ``op`` asks: scaled to the sum in place (``out`` is the caller's
        own array, fresh from the round: no second copy)."""
        if op == "sum":
            out *= np.float32(self.world)
        return out

    def warm_up(self, size: int, rounds: int = 2) -> None:
        """Run ``rounds`` exact allreduce rounds of ``size`` zeros that nothing reads, before the
        rounds that count.

        A process's first rounds cost up to twice a later one of the same size, and take up to
        three times as long: the kernel's socket buffers and caches, the transport's rings and
        this collective's scratch are used for the first time (the main job on the testbed's
        AF_XDP path, 4.2-4.5 MB rounds: 24-51 ms of CPU and 68-102 ms each for the first two,
        15-21 ms and 27-51 ms later).  A job whose first rounds are on its critical path (DDP's
        first step hands the comm hook a model under 25 MiB as one bucket, once the backward
        is done) pays it there; Gloo's sockets have carried DDP's initial broadcast of the
        parameters by then.

        Collective: every rank calls it at the same point between rounds, with the same
        arguments.  The rounds use their own tensor id (``TENSOR_WARM_UP``), are recorded like
        any round (:attr:`records`, ``Config.on_record``) and are not shown to the phase
        controller; afterwards nothing is kept for that id but the scratch every tensor id
        shares.

        Args:
            size: values per round: the largest tensor the job's rounds will carry (DDP's first
                bucket: the model's gradient, up to ``bucket_cap_mb``).
            rounds: how many (default 2; 0 does nothing).

        Raises:
            ValueError: ``size`` below 1 or ``rounds`` below 0.
            CollectiveError: as :meth:`allreduce`.
        """
        size, rounds = warm_up_args(size, rounds)
        x = np.zeros(size, np.float32)
        try:
            for _ in range(rounds):
                self.allreduce(x, tensor=TENSOR_WARM_UP, exact=True, out=x)
        finally:
            self.protocol.forget(TENSOR_WARM_UP)

    def sharded_update(self, grad: np.ndarray, params: np.ndarray, update, tensor: int = 0) -> np.ndarray:
        """One training step's round of a sharded optimizer (ZeRO-1 style): reduce-scatter the
        gradients, let each shard's owner turn its shard's mean into new parameter values, and
        all-gather those values.  Returns this rank's new ``params`` (float32, ``params``' shape).

        The all-gather carries parameters, not gradients: without ``Config.consistent`` it
        tolerates loss within the round's bound like the reduce-scatter, and a row that does not
        arrive keeps this rank's value from ``params`` (the parameter server's semantics in DBLP
        and MLT: a lost parameter keeps its previous value).  A replica then lags its shard owner
        by the rows it missed, and the next round that delivers a row makes it the owner's again:
        ranks differ by at most the updates of the rows each missed in a row, never a random walk.
        With ``Config.consistent`` the all-gather is repaired whole and every rank ends with the
        owners' values.

        The step is one round and closes the controller's step (``count_steps``/``end_step``):
        DBLP's G is the norm of the step's mean gradient, the owners' estimates before their
        update, summed over ranks in ``end_step``'s one-chunk round on a measured step.

        Args:
            grad: this rank's gradient, flat (float32).
            params: this rank's parameters, the same size; the values all ranks started from
                must be identical (e.g. a broadcast from rank 0).
            update: ``update(rows, mean, values) -> new``, called once per round on the owner
                (on the collective's thread): ``rows`` are the shard's chunk rows (row i holds
                elements ``i * C .. i * C + C - 1`` of the flat tensor, ``C`` = :attr:`C`; the
                last row is padded with zeros), ``mean`` and ``values`` (len(rows), C) their
                estimated mean gradient and their values in ``params`` (an owner's own rows are
                always current: it never loses them); it returns their new values, the same
                shape.  It keeps whatever optimizer state it needs for those rows (an owner gets
                the same rows every round: the shuffle stays within shards).
            tensor: the tensor id.

        Raises ValueError for sizes that differ or ``Config.allgather_bound`` (a parameter's
        all-gather cut would leave it stale on every rank, its owner too); :class:`CollectiveError`
        as :meth:`allreduce`.
        """
        if self.cfg.allgather_bound:
            raise ValueError("sharded_update all-gathers parameters: use Config(allgather_bound=False)")
        g = np.ascontiguousarray(grad, np.float32).reshape(-1)
        p = np.ascontiguousarray(params, np.float32).reshape(-1)
        if g.size != p.size:
            raise ValueError(f"grad has {g.size} values, params {p.size}: give one of each per parameter")
        self._owners_g = True
        self.controller.count_steps()
        own = []
        out = self._round(g, start=lambda pr, flat: pr.start(flat, tensor, True, base=p, update=update),
                          done=lambda st: own.append(self._own_rows(st)))
        self.controller.observe(self.index - 1, own[0] if own[0] is not None else np.zeros(0, np.float32))
        self.end_step()
        return out.reshape(np.shape(params))

    def _own_rows(self, st) -> np.ndarray | None:
        """The owner's estimate of its shard's mean (before anything carried was added, before a
        sharded update), flat; None for a rank that owns no shard.  For a controller that sums it
        over steps (``Dblp(g_over="window")``) in the tensor's row order, so the rows line up;
        else in any order (only its norm is used).  The round has finished: its result ``y`` is
        in the tensor's order, the estimate kept apart (``own``) in the round's."""
        if st.my_shard is None:
            return None
        a, b = st.bounds[st.my_shard]
        if st.own is None:
            return st.result_rows(slice(a, b)).reshape(-1)
        v = st.own
        if st.perm is not None and getattr(self.controller, "window", False):
            v = v[np.argsort(st.perm[a:b])]
        return v.reshape(-1)

    def _shared_g(self) -> bool:
        """Every rank measures G on the same vector (the result, or the rows a round delivered)."""
        return self.cfg.consistent and self.cfg.fill != "carry" and not self._owners_g

    def end_step(self) -> None:
        """Close a training step for a controller that counts steps (``pydblp.torch``'s hook calls
        it after each step's last round).  Without ``Config.consistent`` every rank observed only
        the shard it owns; on a measured step their squared norms are summed over ranks first, in a
        one-chunk round (a message of one chunk is never short of its bound: repaired whole), so
        every rank's controller decides on the same G.  Raises :class:`CollectiveError` as a round does.
        """
        part = self.controller.measuring()
        if self._shared_g() or part is None:  # (identical results: every rank measured the same G)
            self.controller.end_step()
            return
        total = self._round(np.array([part], np.float32), start=lambda p, flat: p.start(flat, TENSOR_AGREE, True))
        self.controller.end_step(float(total[0]) * self.world)

    def broadcast_shards(self, x: np.ndarray, tensor: int = 0) -> np.ndarray:
        """Every rank gets shard k of ``x`` from its owner k (an all-gather of absolute values).

        Used for bounded-drift parameter broadcast (Weintraub et al.): a chunk
        that does not arrive keeps this rank's own value, so ranks drift by
        at most what one missed broadcast leaves, never a random walk.
        Same bound, STOP/PROBE and failure semantics as :meth:`allreduce`.
        """
        return self._round(x, start=lambda p, flat: p.start(flat, tensor, False))

    def reduce_scatter(self, x: np.ndarray, tensor: int = 0, op: str = "mean", exact: bool = False,
                       observe: bool = False) -> np.ndarray:
        """This rank's piece of the estimated mean (or sum, ``op="sum"``) of ``x`` over all ranks.

        ``x`` (any shape, float32, ``world * s`` values on every rank) is cut in ``world`` pieces
        in its flat order: rank k gets the estimated mean of values ``k * s .. (k + 1) * s - 1``,
        flat, float32, ``s`` values (``torch.distributed.reduce_scatter_tensor``'s layout).  On the
        wire piece k is rank k's shard of ``max(1, ceil(s / C))`` chunk rows (the last padded with
        zeros), whatever ``Config.mode``, so with ``s`` a multiple of :attr:`C` the shards are the
        transpose allreduce's.  Rows are sent in the round's shuffled order (``Config.order``) and
        the owner puts them back: the result is in ``x``'s order.

        It is an allreduce's first half (:class:`~pydblp.collective.rounds.ReduceScatterRound`):
        messages with flag 0, the round's loss bound, STOP/PROBE/BITMAP/NACK repair above it and
        the configured estimator over the contributions that arrived, so no value is missing from
        the result.  Every rank must call it in the same order as the other collectives, with the
        same size.

        ``exact``: the round's bound is 0 whatever the phase controller says.  ``observe``: the
        phase controller is shown this rank's piece (a gradient's, e.g. FSDP's reduce-scatter):
        each rank sees only its own, so a step's G is summed over ranks in :meth:`end_step` (the
        caller counts steps).  Without it the controller is not shown the round.

        Raises ValueError for a size not divisible by the world or a bad ``op``;
        :class:`CollectiveError` as :meth:`allreduce` (a needed peer silent for ``peer_timeout``,
        data that does not fit).
        """
        if op not in ("mean", "sum"):
            raise ValueError("op must be mean or sum")
        size = int(np.size(x))
        if size % self.world:
            raise ValueError(f"reduce_scatter of {size} values over {self.world} ranks: give a multiple of the world")
        s = size // self.world
        piece = []

        def done(st):  # my shard's rows, in the tensor's order once the round has finished
            a, b = st.bounds[st.my_shard]
            piece.append(st.y[a:b].reshape(-1)[:s].copy())

        self._round(x, start=lambda p, flat: p.start_reduce_scatter(flat, tensor, exact), done=done)
        if observe:
            self._owners_g = True
            self.controller.observe(self.index - 1, piece[0])
        return piece[0] * np.float32(self.world) if op == "sum" else piece[0]

    def all_gather(self, shard: np.ndarray, tensor: int = 0, exact: bool = False) -> np.ndarray:
        """The concatenation of every rank's ``shard``, rank 0's first: flat, float32,
        ``world * shard.size`` values (``torch.distributed.all_gather_into_tensor``'s layout).

        Every rank gives a piece of the same size ``s``.  On the wire rank k's piece is its shard
        of ``max(1, ceil(s / C))`` chunk rows (the last padded with zeros), sent to every rank as
        an all-gather message (flag ``ALLGATHER``), as :meth:`broadcast_shards` sends shards
        (:class:`~pydblp.collective.rounds.AllGatherRound`).  With ``Config.consistent`` (the
        default) every message is repaired whole and every rank ends with the same result;
        without it loss within the round's bound is tolerated and a value that does not arrive
        is 0 (this rank has no value of its own for it).  A piece's owner always has its own.
        Every rank must call it in the same order as the other collectives, with the same size (a
        piece of another number of chunk rows fails the round as data that does not fit).  Values
        are copied, never computed on: any bit pattern arrives as it was sent.  ``exact``: the
        round's bound is 0 whatever the phase controller says (every message repaired whole).

        Raises :class:`CollectiveError` as :meth:`allreduce` (a needed peer silent for
        ``peer_timeout``, data that does not fit).
        """
        s = int(np.size(shard))
        out = []

        def done(st):  # rank k's rows are rows k * R .. (k + 1) * R - 1; its piece their first s values
            out.append(st.y.reshape(self.world, -1)[:, :s].reshape(-1).copy())

        self._round(shard, start=lambda p, flat: p.start_all_gather(flat, tensor, exact), done=done)
        return out[0]

    def neighbours(self, x: np.ndarray, peers: list[int], weights: list[float], tensor: int = 0,
                   timeout=None) -> tuple[np.ndarray, list[int]]:
        """One neighbour (gossip) round: send ``x`` whole to each rank in ``peers``, average theirs.

        Returns ``(y, arrived)``: ``y`` (same shape as ``x``, float32) is per chunk
        ``(w_self x + sum_j w_j x_j) / (w_self + sum_j w_j)`` over the neighbours ``j`` whose
        message reached its bound and whose chunk arrived (``w_self = 1 - sum(weights)``), and
        ``arrived`` lists those neighbours.  Loss within the round's tolerance (the phase
        controller's, as for :meth:`allreduce`) is tolerated, above it repaired (STOP, PROBE,
        BITMAP and NACK as in an allreduce, one message per neighbour and direction, flag
        ``NEIGHBOUR``).

        A neighbour whose message is below its bound ``timeout`` seconds after the round began
        (later for one that may still be waiting out a dead peer of its own in the previous
        neighbour round: see ``Protocol.start_neighbours``) is left out of this round (not in
        ``arrived``; partial chunks unused; this rank's own message to it abandoned) and never
        raises: dead or slow neighbours cost one timeout per round, and one whose packets
        arrive in a later round is taken in again.

        The round takes the next number of the collective's one round counter: every rank
        must call :meth:`allreduce`, :meth:`broadcast_shards` and :meth:`neighbours` in the same
        order, each rank calling this even with no peers this round.  The topology must be
        symmetric (``j`` in ``i``'s peers exactly when ``i`` is in ``j``'s).

        Args:
            x: this rank's tensor (the same size on every rank).
            peers: distinct ranks other than this one.
            weights: one per peer, each >= 0, summing to at most 1.
            tensor: the tensor id (as in :meth:`allreduce`).
            timeout: seconds a neighbour has, from the start of the round, in [0,
                ``Config.peer_timeout``) (default: half of it); or one such per peer (0: only
                what is already here or arrives at once, for a neighbour thought dead).

        Raises ValueError for bad peers, weights or timeout; :class:`CollectiveError` only
        when the collective is closed.
        """
        peers = [int(r) for r in peers]
        if len(set(peers)) != len(peers) or any(not 0 <= r < self.world or r == self.rank for r in peers):
            raise ValueError(f"peers {peers}: give distinct ranks in 0..{self.world - 1}, not this rank ({self.rank})")
        w = [float(v) for v in weights]
        if len(w) != len(peers) or any(not v >= 0 for v in w) or sum(w) > 1 + 1e-6:
            raise ValueError(f"weights {weights}: give one weight >= 0 per peer, summing to at most 1 "
                             "(this rank's own weight is 1 - sum)")
        timeout = self.cfg.peer_timeout / 2 if timeout is None else timeout
        per = [float(t) for t in timeout] if np.ndim(timeout) else [float(timeout)] * len(peers)
        if len(per) != len(peers) or not all(0 <= t < self.cfg.peer_timeout for t in per):
            raise ValueError(f"timeout {timeout}: use seconds in [0, Config.peer_timeout = {self.cfg.peer_timeout}), "
                             "one number or one per peer")
        arrived = []

        def start(p, flat):
            return p.start_neighbours(flat, tensor, peers, w, per)

        def done(st):
            arrived.extend(st.taken())

        y = self._round(x, start=start, done=done)
        return y, arrived

    def close(self) -> bool:
        """Stop answering peers and close the transport.

        Peers still probing for the last round's STOPs, or waiting for a
        retransmission of this rank's trailing all-gather, then time out:
        close only after every rank has finished (``pydblp.torch.State.close``
        waits for every rank's close in the rendezvous store first).

        Returns:
            True once the transport is closed; False when the idle responder is still inside
            a transport call after ``CLOSE_JOIN`` seconds: the transport then closes when that
            call returns, and nothing it uses (the data plane's sockets, UMEM, host program)
            may be closed before.
        """
        if self._closing:
            if not self._close_late:
                self.t.close()
            return not self._close_late
        self._closing = True
        if self._idler is None:
            self.t.close()
            return True
        self._alarm.set(1e-9)
        os.eventfd_write(self._wake, 1)
        self._idler.join(timeout=CLOSE_JOIN)
        with self._state:
            self._close_late = not self._idle_done
        if self._close_late:  # stuck in a transport call: never close what it is using under it
            log.warning("rank %d: the idle responder is still in a transport call after %.0f s; the "
                        "transport closes when it returns", self.rank, CLOSE_JOIN)
            return False
        self._release()
        return True

    def _release(self) -> None:
        """Close the idle responder's timer and wake descriptor, then the transport."""
        self._alarm.close()
        os.close(self._wake)
        self.t.close()

    def _round(self, x: np.ndarray, start, done=None, out: np.ndarray | None = None) -> np.ndarray:
        """Run one round that ``start(protocol, flat)`` begins; ``done(round)`` sees it before the
        state is released.  The result is ``out`` when given (``start`` passed it to the round,
        which writes it there as it finishes), else the round's own array."""
        if self._closing:
            raise CollectiveError("collective is closed")
        if self._idle_error is not None:
            raise CollectiveError(f"the transport failed between rounds: {self._idle_error}") from self._idle_error
        flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        p = self.protocol
        with self._state:  # (the idle responder sets _serving, then reads _running, under the same lock)
            self._running = True
            serving = self._serving
        if self._idler is not None:
            self._alarm.set(0)
            if serving:
                os.eventfd_write(self._wake, 1)
        with self._poll_lock:  # the idle responder leaves its poll at once; a receive of its runs to the end
            try:
                st = start(p, flat)
                try:
                    p.run(st)
                except TransportError as e:  # the transport cannot go on (e.g. peers hold another job key)
                    raise CollectiveError(str(e)) from e
                finally:
                    p.finish(st)
                if done is not None:
                    done(st)
            finally:
                with self._state:
                    self._running = False
                if self._idler is not None:
                    self._alarm.set(IDLE_GRACE)
        if out is not None:  # (the round wrote its result there as it finished)
            return out
        return st.y.reshape(-1)[: flat.size].reshape(np.shape(x))

    def _idle_loop(self) -> None:
        """Between rounds: answer probes for the finished round, keep the next round's packets.

        A receiver's STOP can be lost after it has finished; the sender then
        probes, and someone must answer even if this rank's caller is busy
        computing (or done).  This thread sleeps on an alarm that a round sets
        for IDLE_GRACE as it ends and clears as the next begins: back-to-back
        rounds keep the transport and never wake it (packets wait in the ring
        meanwhile).  Once the alarm fires it takes what has arrived and polls
        the transport and the wake descriptor, and leaves when a round begins,
        which writes the wake descriptor: a round waits at most for one receive
        that has already begun, never for a poll.

        Hand-offs, none of which rely on the GIL: ``_poll_lock`` owns the
        transport and the protocol's state (this thread takes it without
        blocking, serves, reads when it must wake next, and lets go before it
        polls); ``_state`` guards the flags a round and this thread exchange
        (``_running``, ``_serving``, ``_idle_done``, ``_close_late``).
        """
        p = self.protocol
        fd, wake = self.t.fileno(), self._wake
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.register(wake, select.POLLIN)
        while True:
            self._alarm.wait()
            with self._state:
                self._serving = True
            try:
                while not self._closing and not self._round_begun():
                    if not self._poll_lock.acquire(blocking=False):
                        continue  # a round has begun
                    try:  # everything the round's thread also touches is read holding the lock
                        if self._round_begun():
                            continue
                        self._serve()
                        backlog = self.t.tx_backlog()  # a pacing transport releases its queue in receives
                        due = p.idle_due(p.clock(), self.hello)  # a trailing message's probe or resends, HELLOs
                    finally:
                        self._poll_lock.release()
                    waits = (([max(1, int(backlog * 1000))] if backlog > 0 else [])
                             + ([math.ceil(due * 1000)] if due is not None else []))
                    ready = poller.poll(min(waits) if waits else None)
                    if any(f == wake for f, _ in ready):
                        with contextlib.suppress(BlockingIOError):
                            os.eventfd_read(wake)
            except Exception as e:  # e.g. TransportError: peers hold another job key
                log.warning("rank %d: idle responder stopped: %s", self.rank, e)
                self._idle_error = e
                return
            finally:
                with self._state:
                    self._serving = False
            if self._closing:
                return

    def serve(self) -> float | None:
        """Between rounds, without an idle thread (``idle_thread=False``): take in what has
        arrived (keeping the next round's packets, answering late probes), send what trailing
        all-gather messages were asked to resend, and the answers.  Call it whenever the
        transport is readable and when the time it returns has passed.

        While :attr:`hello` is set (this rank will run more rounds) peers already waiting for it
        in one hear that it is alive (HELLO; they wait up to ``Config.join_timeout``); once it is
        cleared they find this rank gone at their ``peer_timeout``.

        Returns:
            Seconds until this collective needs to act again (a trailing message's probe, a
            HELLO), or None if nothing does (only an arriving packet does).

        Raises:
            CollectiveError: the collective is closed.
            TransportError: the transport cannot go on (e.g. peers hold another job key).
        """
        if self._idler is not None:
            raise RuntimeError("this collective answers peers from its own thread: serve() is for idle_thread=False")
        if self._closing:
            raise CollectiveError("collective is closed")
        self._serve()
        return self.protocol.idle_due(self.protocol.clock(), self.hello)

    def _serve(self) -> None:
        """Take in what has arrived, serve trailing messages, tell waiting peers this rank is
        alive (:attr:`hello`), send the answers (whoever holds the transport between rounds)."""
        p = self.protocol
        while p.take(None, 0.0) >= RECV_BATCH:
            pass
        if p.trail:
            p.serve_trail(p.clock())
        if self.hello:
            p.hello(p.clock())
        p.flush_ctrl()

    def _round_begun(self) -> bool:
        with self._state:
            return self._running

    def _idle_main(self) -> None:
        """The idle responder's thread: :meth:`_idle_loop`, then what a late :meth:`close` left."""
        try:
            self._idle_loop()
        finally:
            with self._state:
                self._idle_done = True
                late = self._close_late
            if late:
                self._release()

