"""The kinds of round: what one rank holds while it runs a round, one type per kind.

:class:`Round` is what every round has: its number, tensor, bound, input and result, its
messages, timers and counters.  Each kind adds exactly the fields it uses:

* :class:`ReduceScatterRound` (``Collective.reduce_scatter``): every rank sends shard k of its
  input to rank k, which estimates the shard's mean.  No all-gather.
* :class:`GatherRound`, either of two kinds without a reduce: each shard's owner sends its own
  shard to every rank.  :class:`BroadcastRound` (``Collective.broadcast_shards``, absolute
  values; a row that does not arrive keeps this rank's own) and :class:`AllGatherRound`
  (``Collective.all_gather``, every rank's piece; a row that does not arrive is zero).
* :class:`AllreduceRound` (``Collective.allreduce``): a reduce-scatter, then an all-gather of
  the owners' estimates.  :class:`ShardedRound` (``Collective.sharded_update``) is one whose
  owners all-gather new parameter values made from their estimate.
* :class:`NeighbourRound` (``Collective.neighbours``): each rank sends its whole input to
  each neighbour and averages theirs.

Class attributes (not fields) describe a kind for the shared code: ``flag`` (its DATA's
wire flag), ``reduce`` (contributions go to owners), ``gather`` (owners send shards to all),
``missing`` (what a result row that did not arrive becomes: :mod:`~pydblp.collective.fill`
decides), ``forgiving`` (a silent peer is left out, never fails the round).  ``reduced``,
``bcast`` and ``ag_rest`` are class-level defaults where a kind has no such stage.  The
protocol (:mod:`pydblp.collective.protocol`) builds rounds and sends; these hold state and
answer what differs by kind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from pydblp.collective import estimators
from pydblp.collective.config import LINGER_MIN, LINGER_WANT, NB, RoundRecord
from pydblp.collective.messages import OutMessage


def rows_of(flat: np.ndarray, rows: np.ndarray, C: int, into: np.ndarray | None = None) -> np.ndarray:
    """The rows ``rows`` (row numbers) of ``flat`` cut in rows of ``C`` values (``flat`` holds at
    least one whole row), the last padded with zeros where ``flat`` ends inside it, gathered in one
    pass (into ``into``, (len(rows), C), when given)."""
    full = flat.size // C
    dst = np.empty((len(rows), C), np.float32) if into is None else into
    # (mode "clip": a partial row's number is past the whole rows; it is written below)
    np.take(flat[: full * C].reshape(full, C), rows, axis=0, out=dst, mode="clip")
    part = rows >= full
    if part.any():
        k = flat.size - full * C
        dst[part, :k] = flat[full * C:]
        dst[part, k:] = 0
    return dst


@dataclass(eq=False, kw_only=True)
class Round:
    """What every round of one rank has (made by ``Protocol.start*``); rows are float32, ``C``
    values each, ``T`` of them (the input padded to whole chunks)."""

    flag: ClassVar[int] = 0            # the wire flag of its DATA (NEIGHBOUR or 0)
    reduce: ClassVar[bool] = False     # contributions go to shard owners (a reduce-scatter stage)
    gather: ClassVar[bool] = False     # shard owners send their shard to every rank (an all-gather stage)
    missing: ClassVar[str | None] = None  # what a result row that did not arrive becomes (fill.Fill.rule)
    forgiving: ClassVar[bool] = False  # a silent or misfit peer is left out at the round's own deadlines
                                       # (expire), never fails it
    # defaults of kinds without the stage (plain class attributes, not fields):
    reduced = True   # this rank's own part of the result is in (no reduce stage: from the start)
    bcast = None     # no broadcast all-gather message
    ag_rest = None   # no all-gather half held back

    round: int                       # the round number on the wire (wraps at 2**32)
    tensor: int                      # the caller's tensor id
    index: int                       # this rank's round count (RoundRecord.index)
    tol: float                       # the loss bound the phase controller chose
    tol8: int                        # the same in 1/255 units, as on the wire
    phase: str                       # the controller's phase name
    x: np.ndarray | None             # (T, C) this rank's input, padded; None: read in place (an allreduce's
                                     # ``flat``: input_rows)
    y: np.ndarray                    # (T, C) the result
    t0: float                        # when it began (the protocol's clock)
    heard: np.ndarray                # per rank, when it was last heard from
    hi: np.ndarray                   # [all-gather?, src]: 1 + the highest chunk seen
    foreign0: int                    # counters["foreign"] when it began
    stats0: dict                     # the transport's stats when it began
    ce0: int = 0                     # counters["ce_received"] when it began
    ins: dict = field(default_factory=dict)    # (ag, src) -> InMessage
    outs: dict = field(default_factory=dict)   # (ag, dst) -> OutMessage
    t_timers: float = 0.0            # when timeouts were last checked
    t_alive: float = 0.0             # when dead peers were last checked
    nacks: int = 0                   # unsolicited BITMAPs sent
    repair: bool = False             # a NACK went out or a BITMAP came in this round
    misfit: dict = field(default_factory=dict)  # src -> (when, what): its first DATA that does not fit
    hello: dict = field(default_factory=dict)   # src -> when its latest HELLO came (alive, between rounds)
    needed: dict = field(default_factory=dict)  # peer -> since when the round has needed it (timers)
    watched: dict = field(default_factory=dict)  # peer -> since when it is watched: needed once busy peers join
    asked: dict = field(default_factory=dict)   # peer -> when it was last sent a HELLO with ASK

    def expected(self, now: float) -> int:
        """How many packets a receive may wait for: the data packets on their way, at most
        LINGER_WANT; 1 when fewer than LINGER_MIN are (a control packet or a message's last chunks
        go at once, and so do the replies to a NACK or a STOP).

        A message not begun (an all-gather before its owner has reduced) or stalled below its bound
        waits for someone to act, not for data: lingering for it would only hold back this rank's
        own next step.  Until this rank has reduced only its reduce-scatter counts: all-gather data
        still coming must not hold its reduce past the moment its own shard's contributions are in.
        """
        due = 0
        for inn in self.ins.values():
            # before the reduce: reduce-scatter only; after it: all-gather only (a neighbour round: all)
            if inn.ag != self.reduced and not inn.nb:
                continue
            due += inn.due(now)
            if due >= LINGER_WANT:
                return LINGER_WANT
        return due if due >= LINGER_MIN else 1

    def joined(self, q: int) -> bool:
        """Some of peer ``q``'s data of this round has come: it is in the round."""
        return any(inn.count for (_, src), inn in self.ins.items() if src == q)

    def busy(self) -> list[int]:
        """The peers whose latest news is a HELLO from between rounds (not an answer on behalf):
        alive, not in this round yet."""
        return sorted(q for q, t in self.hello.items() if t >= self.heard[q])

    def settled(self) -> bool:
        """Its messages let the round return: this rank's part is in, every message it waits for
        (all-gather or neighbour) is done or skipped, and each of its own is done or, if others
        wait for it (all-gather, neighbour), went out (every chunk it plans: ``OutMessage.out``)
        with no retransmission waiting (it then trails)."""
        return (self.reduced and all(i.done or i.skipped for i in self.ins.values() if i.ag or i.nb)
                and all(o.done or ((o.ag or o.nb) and o.out and not o.nretx) for o in self.outs.values()))

    def tensor_rows(self, first: int, n: int) -> int | np.ndarray:
        """The tensor's row numbers of the round's rows ``first .. first + n``: ``first`` (the
        first of a run in the tensor's own order) or an array (a shuffled round)."""
        return first

    def result_rows(self, rows) -> np.ndarray:
        """The finished round's result at the tensor's rows ``rows`` (indices, a slice or a mask),
        padded: once it has ended, ``y`` is the result in the tensor's order."""
        return self.y[rows]

    def input_rows(self, rows, into: np.ndarray | None = None) -> np.ndarray:
        """This rank's input, padded, at the round's rows ``rows`` (indices, a slice or a mask), in
        ``into`` when given."""
        if into is None:
            return self.x[rows]
        into[...] = self.x[rows]
        return into

    def expire(self, now: float) -> None:
        """Act on the round's own deadlines at ``now`` (a forgiving round's; none by default)."""

    def conclude(self, fill) -> None:
        """Make the result whole as the round ends (``fill``: the protocol's
        :class:`~pydblp.collective.fill.Fill`): rows that did not arrive, or the mean."""

    def reorder(self, into: np.ndarray | None = None) -> None:
        """Put ``y`` in the tensor's order (after the round's messages are done with it), in
        ``into`` when given (a round with ``out``)."""

    def began(self) -> dict:
        """Per sender, when its message began arriving, for the next neighbour round (empty but
        for a neighbour round)."""
        return {}

    def account(self, rec: RoundRecord) -> None:
        """Enter what its messages did in ``rec``: ``delivered`` per message, ``below_bound``."""
        for (ag, src), inn in self.ins.items():
            rec.delivered[f"{'ag' if ag else 'rs'}:{src}"] = inn.count / inn.n
            rec.below_bound |= not inn.done
        rec.below_bound |= not all(o.done or (o.ag and o.out) for o in self.outs.values())


@dataclass(eq=False, kw_only=True)
class ShardRound(Round):
    """A round over shards: the tensor's ``T`` chunk rows are cut into ``bounds`` (one (first, end)
    row range per shard; shard k belongs to rank k)."""

    bounds: list                     # per shard, its rows (first, end)
    my_shard: int | None             # the shard this rank owns (None: none, a parameter server's client)


@dataclass(eq=False, kw_only=True)
class Inbox:
    """Where whole messages from several ranks land, one slot each (an owner's contributions, a
    neighbour round's neighbours): ``rbuf`` masked by ``rmask``."""

    rbuf: np.ndarray | None = None   # (slots, rows, C)
    rmask: np.ndarray | None = None  # (slots, rows) which rows arrived
    rflat: np.ndarray | None = None  # rbuf as rows slot * rows + chunk
    rmflat: np.ndarray | None = None # rmask likewise

    def open_inbox(self, buf: np.ndarray) -> None:
        """Take ``buf`` (slots, rows, C) as the inbox, nothing arrived."""
        self.rbuf = buf
        self.rmask = np.zeros(buf.shape[:2], bool)
        self.rflat, self.rmflat = buf.reshape(-1, buf.shape[2]), self.rmask.reshape(-1)


@dataclass(eq=False, kw_only=True)
class ReduceScatterRound(ShardRound, Inbox):
    """Reduce-scatter: the owner of a shard gets every rank's rows of it (its inbox, by source
    rank) and estimates their mean into ``y``'s rows of the shard.  The result is that shard
    alone (``Collective.reduce_scatter``); no row is ever missing from it."""

    reduce: ClassVar[bool] = True
    reduced: bool                    # this rank's own shard is in y (True from the start without one)
    perm: np.ndarray | None = None   # order "shuffle": x and y row i is the tensor's row perm[i] (None: the
                                     # tensor's own order); finish puts y back in the tensor's order
    out: np.ndarray | None = None    # the caller's result array, flat (``allreduce(out=)``), or None; y is
                                     # then scratch, and finish writes the result there (Protocol.finish)
    signs: np.ndarray | None = None  # Config.rotate: the round's sign per row (x is rotated; the owner
                                     # rotates its estimate back), else None
    feedback: bool = False           # Config.error_feedback: owners send FINAL BITMAPs; finish keeps what
                                     # their estimates left out
    flat: np.ndarray | None = None   # an allreduce that reads its shuffled input where it lies: the caller's
                                     # array, flat (x is None; its messages send rows from there by address).
                                     # In place (``out`` is it) a row is overwritten only once its owner's
                                     # all-gather brings it, when that owner is done with this rank's
                                     # contribution, or as the round ends; else None

    def tensor_rows(self, first: int, n: int) -> int | np.ndarray:
        return first if self.perm is None else self.perm[first: first + n]

    def input_rows(self, rows, into: np.ndarray | None = None) -> np.ndarray:
        if self.flat is None:
            return super().input_rows(rows, into)
        return rows_of(self.flat, self.perm[rows], self.y.shape[1], into)

    def reorder(self, into: np.ndarray | None = None) -> None:
        """Make ``y`` the result in the tensor's order: in ``into`` ((T, C), memory the caller holds)
        when given, for a round in the tensor's own order (a shuffled allreduce with ``out`` writes
        its ``result`` there as it goes); else a fresh array where shuffled (the round's messages
        keep their order)."""
        if into is not None:
            np.copyto(into, self.y)
            self.y = into
        elif self.perm is not None:
            back = np.empty_like(self.y)
            back[self.perm] = self.y
            self.y = back

    def estimated(self, a: int, b: int) -> None:
        """The owner's estimate of its shard (rows ``a..b`` of ``y``) is in: a kind that sends
        something else makes it here."""


@dataclass(eq=False, kw_only=True)
class GatherRound(ShardRound):
    """All-gather: each shard's owner sends its shard of ``y`` to every rank; ``have`` marks the
    result rows in (its own shard's from the start)."""

    gather: ClassVar[bool] = True
    missing: ClassVar[str | None] = "local"
    have: np.ndarray                 # (T,) result rows in; the all-gather messages' masks are views
    ag_first: np.ndarray             # per owner, its first result row
    ag_n: np.ndarray                 # per owner, chunks of its all-gather message to me (-1: none)
    bcast: OutMessage | None = None  # broadcast all-gather: the message sending its first pass to all

    result = None    # (plain class attributes: only an allreduce writes its result in place; see there)
    tail = None

    def conclude(self, fill) -> None:
        fill.missing_rows(self)

    def put(self, rows: np.ndarray, values) -> None:
        """Write result rows ``rows`` (the round's row numbers, or a mask over them): into ``y``."""
        self.y[rows] = values


@dataclass(eq=False, kw_only=True)
class BroadcastRound(GatherRound):
    """``Collective.broadcast_shards``: shard k of rank k's input goes to every rank; a row that
    does not arrive keeps this rank's own value."""


@dataclass(eq=False, kw_only=True)
class AllGatherRound(GatherRound):
    """``Collective.all_gather``: every rank's piece (its own shard, padded to whole rows) goes to
    every rank; a row that does not arrive is zero (this rank has no value of its own for it)."""

    missing: ClassVar[str | None] = "zero"


@dataclass(eq=False, kw_only=True)
class AllreduceRound(ReduceScatterRound, GatherRound):
    """Allreduce: a reduce-scatter, then each owner all-gathers its estimate; a row that does not
    arrive (or, ``Config.allgather_bound``, is cut) becomes what ``Config.fill`` says."""

    missing: ClassVar[str | None] = "policy"
    ag_rest: float | None = None     # when the all-gather's held-back half may go (None: nothing held)
    own: np.ndarray | None = None    # owner, fill "carry" or a sharded update: its shard's estimate of this
                                     # step's mean gradient alone (what the controller measures)
    result: np.ndarray | None = None  # a shuffled round with ``out``: the result in the tensor's order, the
                                      # caller's array itself as rows (its whole rows: (T - 1, C) when the
                                      # last is partial, which goes to ``tail``).  All-gather rows are
                                      # written there as they arrive (the round's row i at row perm[i]),
                                      # the own shard and the fill as the round ends (conclude): no pass to
                                      # reorder the result.  None: every row goes to y, and reorder() puts
                                      # y in order
    tail: np.ndarray | None = None    # (1, C) scratch: the tensor's partial last row while the round runs
                                      # (``result`` has whole rows only), copied into ``out`` as it ends

    def put(self, rows: np.ndarray, values) -> None:
        if self.result is None:
            super().put(rows, values)
            return
        at = self.perm[rows]
        last = at == len(self.result)  # (the partial row, when there is one: past result's rows)
        if self.tail is None or not last.any():
            self.result[at] = values
            return
        keep = ~last
        if np.ndim(values):
            self.tail[0] = values[last][0]
            self.result[at[keep]] = values[keep]
        else:
            self.tail[0] = values
            self.result[at[keep]] = values

    def conclude(self, fill) -> None:
        fill.missing_rows(self)  # (first: it may read the input in place, where the result goes)
        if self.result is not None and self.my_shard is not None:  # the own shard's rows, but those the
            a, b = self.bounds[self.my_shard]                     # all-gather cut (filled alike above)
            rows = slice(a, b) if self.have[a:b].all() else a + np.flatnonzero(self.have[a:b])
            self.put(rows, self.y[rows])

    def result_rows(self, rows) -> np.ndarray:
        if self.tail is None or self.y is not self.result:
            return self.y[rows]
        return rows_of(self.out, np.arange(len(self.have))[rows], self.result.shape[1])  # (y: whole rows only)

    def reorder(self, into: np.ndarray | None = None) -> None:
        if self.result is None:
            super().reorder(into)
            return
        if self.tail is not None:  # (the rest is in order there already: conclude wrote it)
            flat = self.out.reshape(-1)
            k = flat.size - self.result.size
            flat[flat.size - k:] = self.tail[0, :k]
        self.y = self.result


@dataclass(eq=False, kw_only=True)
class ShardedRound(AllreduceRound):
    """``Collective.sharded_update``: an allreduce of gradients whose owners all-gather new values
    of their shard (``update``); a row that does not arrive keeps this rank's value (``base``)."""

    missing: ClassVar[str | None] = "base"
    base: np.ndarray                 # (T, C) this rank's values, in the round's row order (as x)
    update: Callable                 # owner's (rows, mean, values) -> its shard's new values

    def estimated(self, a: int, b: int) -> None:
        self.own = self.y[a:b].copy()
        rows = np.arange(a, b) if self.perm is None else self.perm[a:b]
        self.y[a:b] = self.update(rows, self.own, self.base[a:b])


@dataclass(eq=False, kw_only=True)
class NeighbourRound(Round, Inbox):
    """``Collective.neighbours``: this rank's whole input goes to each neighbour; their messages
    land in the inbox, by slot; the result is the weighted mean over what arrived."""

    flag: ClassVar[int] = NB
    forgiving: ClassVar[bool] = True
    peers: list                      # the neighbours, by slot (the inbox's first axis)
    weights: np.ndarray              # per slot, the neighbour's weight (this rank's own: 1 - sum)
    slot: np.ndarray                 # per rank, its slot (-1: not a neighbour this round)
    until: np.ndarray                # per slot, when that neighbour is left out if its message is
                                     # still below its bound (inf: decided)

    def expire(self, now: float) -> None:
        """Leave out every neighbour past its deadline (``until``) whose message is below its bound
        (its chunks are not used) and abandon this rank's message to it, as well as one that has
        not gone out whole or waits for retransmissions (no probes, no repair past the timeout).
        Once every neighbour is in or left out the round may return."""
        if not len(self.until) or now < self.until.min():
            return
        for k, r in enumerate(self.peers):
            if now < self.until[k]:
                continue
            inn, o = self.ins[(False, r)], self.outs[(False, r)]
            if not inn.done:
                inn.skipped = True
            if not o.done and (inn.skipped or not o.out or o.nretx):
                o.done = o.abandoned = True
            self.until[k] = np.inf

    def taken(self) -> list[int]:
        """The neighbours whose message reached its bound in time (their chunks count)."""
        return [r for r in self.peers if self.ins[(False, r)].done and not self.ins[(False, r)].skipped]

    def conclude(self, fill) -> None:
        """The weighted mean over this rank and the neighbours taken in, per chunk over the chunks
        that arrived (the skipped count for nothing)."""
        taken = np.array([self.ins[(False, r)].done and not self.ins[(False, r)].skipped for r in self.peers], bool)
        estimators.neighbour_mean(self.x, 1.0 - float(self.weights.sum()), self.rbuf,
                                  self.rmask & taken[:, None], self.weights, self.y)

    def began(self) -> dict:
        return {r: i.t_first for (_, r), i in self.ins.items() if i.t_first is not None}

    def account(self, rec: RoundRecord) -> None:
        for r in self.peers:
            inn = self.ins[(False, r)]
            rec.delivered[f"nb:{r}"] = inn.count / inn.n
            if inn.skipped:
                rec.left_out.append(r)
            rec.below_bound |= not inn.done and not inn.skipped  # (a deadline ended it)

