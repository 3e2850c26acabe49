"""Per-message state of the collective: what was sent, what arrived, what is lost.

:class:`OutMessage` is one shard going to one peer (its sends, retransmissions, BITMAP
answers and probes); :class:`InMessage` one shard coming from one peer (arrivals and the
receiver's unsolicited BITMAPs, NACKs); :class:`Control` a control packet waiting to go.  Every
kind of round (:mod:`pydblp.collective.rounds`) uses them.  They hold state and decide; the
protocol (:mod:`pydblp.collective.protocol`) sends.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from pydblp.collective.config import AG, LOSS_RTTS, NACK_QUIET, NB


class Control(NamedTuple):
    """A control packet waiting to be sent (``Protocol.ctrl``): about message (``round``,
    ``tensor``, ``flag``) to or from rank ``dst``."""

    round: int
    tensor: int
    kind: int      # STOP, PROBE or BITMAP (wire.Kind)
    flag: int      # the message's kind: ALLGATHER, NEIGHBOUR or 0
    dst: int
    nchunks: int   # the message's length in chunks
    tol8: int      # its tolerance, 0..254 (wire: tol)
    chunk: int = 0         # BITMAP: the first chunk its bits cover
    payload: bytes = b""   # STOP: the probe timeout estimate; BITMAP: arrival bits


def stagger_first(rank, n, world):
    """Where sender ``rank``'s staggered message of ``n`` chunks starts (``Config.stagger``);
    ``rank`` may be an array (the matcher's senders).  csrc/matcher.c computes the same."""
    return rank * n // world


class OutMessage:
    """One outgoing message: rows of a shard to one peer, in round ``rnd`` of tensor ``tensor``.

    Args:
        ag: an all-gather message (else reduce-scatter).
        dst: the receiving rank (``wire.DST_ALL`` for a broadcast all-gather's first pass).
        rows: the chunks, one float32 row each; or None with ``addrs``.
        prio: per chunk, its priority byte.
        tol8: the loss bound in 1/255 units; ``need`` chunks make it done.
        rnd: the round number.
        tensor: the tensor id.
        nb: a neighbour round's message (flag ``NEIGHBOUR``; ``ag`` is False).
        first: the chunk its first send starts at (``Config.stagger``); the sends go on to the
            end and wrap to 0, and ``sent`` counts them in that order.  0: chunk order.
        addrs: per chunk, the address of its row (uint64), read where it lies by a transport
            that reads addresses (``Transport.reads_addresses``) when it is sent; the memory must
            hold the row for as long as the message may send it.
    """

    def __init__(self, ag: bool, dst: int, rows: np.ndarray | None, prio: np.ndarray, tol8: int, rnd: int,
                 tensor: int, nb: bool = False, first: int = 0, addrs: np.ndarray | None = None):
        self.ag, self.dst, self.rows, self.prio, self.tol8, self.nb = ag, dst, rows, prio, tol8, nb
        self.addrs = addrs
        self.flag = AG if ag else NB if nb else 0  # the header flag marking its kind of message
        self.rnd, self.tensor = rnd, tensor
        self.n = len(rows) if addrs is None else len(addrs)
        self.need = self.n - self.n * tol8 // 255
        self.first = first % self.n if self.n else 0
        self.sent = 0                        # first sends made, in send order (from ``first``)
        self.plan = self.n                   # first sends it makes before it waits for an answer (set_plan)
        self.plans = False                   # it was given a plan short of n (it may have grown since)
        self.avail = self.n                  # chunks that may go out now (the rest are held back)
        self.retx = None                     # chunks queued for retransmission (made by the first BITMAP)
        self.nretx = 0
        self.acked = None                    # chunks a BITMAP said arrived (made by the first one)
        self.seq = None                      # per chunk: its latest send's number (first sends: 0..n-1, in
        self.t_rtx = None                    # send order), and when its latest retransmission went
        self.nseq = self.n                   # the next retransmission's number (both made by the first BITMAP)
        self.rtt = None                      # s from a retransmission to the BITMAP showing it in (latest)
        self.done = self.n == 0
        self.members = ()                    # broadcast all-gather: the messages whose first pass this one
                                             # sends (their own ``sent`` follows it; they never send one)
        self.trailing = False                # the round has returned; this waits for its STOP (trailing)
        self.abandoned = False               # neighbour round: its receiver was skipped (timeout); never sent again
        self.t_heard = 0.0                   # when its receiver last answered (a BITMAP); trailing: or it began
        self.t_first = None                  # when its first chunk went out
        self.t_sent_all = None
        self.t_last = 0.0
        self.probes = 0        # all probes sent
        self.t_probed = None   # when the latest went
        self.timeouts = 0      # probes sent because the timeout passed
        self.retransmits = 0
        self.used = None       # reduce-scatter, error feedback: the chunks the owner's estimate used
                               # (its FINAL BITMAP); None: not heard
        self.finals = None     # the chunks a FINAL BITMAP covered so far (the first cover is news)

    def set_plan(self, m: int) -> None:
        """Make at most ``m`` first sends (``Config.plan``).  The rest go only if a BITMAP shows
        the plan short (:meth:`extend_plan`): past them the message is out (its sender probes at
        once, and a BITMAP's answer has what is lost resent), and a chunk not sent is, to the
        receiver, one the network lost."""
        self.plan = max(0, min(self.n, m))
        self.avail = min(self.avail, self.plan)
        self.plans = self.plans or self.plan < self.n

    def extend_plan(self, k: int) -> None:
        """Plan ``k`` more first sends (at most ``n`` in all): a BITMAP showed the plan short."""
        held = self.avail < self.plan  # (an all-gather's second half held back: it stays so)
        self.plan = min(self.n, self.plan + max(0, k))
        if not held:
            self.avail = self.plan

    def top_up(self, k: int) -> None:
        """Make the next ``k`` sends what a BITMAP showed short: the first ``k`` chunks queued to
        resend (the rest stay missing: the bound does not need them), and first sends past the
        plan for what is left of ``k``."""
        if self.nretx > k:
            drop = np.flatnonzero(self.retx)[k:]
            self.retx[drop] = False
            self.nretx = k
        self.extend_plan(k - self.nretx)

    @property
    def out(self) -> bool:
        """Every first send it plans went out."""
        return self.sent >= self.plan

    def chunks(self, start: int, stop: int) -> np.ndarray:
        """The chunks of first sends ``start`` .. ``stop - 1`` (in send order)."""
        idx = np.arange(start, stop)
        if self.first:
            idx += self.first
            idx[idx >= self.n] -= self.n
        return idx

    def bitmap(self, first: int, bits: np.ndarray, now: float, wait: float = 0.0) -> bool:
        """Take in a BITMAP: ``bits`` (bool, bit i = chunk ``first + i`` arrived) at ``now``.

        Marks what arrived, queues for retransmission what is missing and lost (:meth:`lost`;
        ``wait``: how long a chunk may be on its way before a round trip is measured),
        and resets the probe back-off (the receiver answers).  Bits past what has been sent
        are ignored: a chunk not sent yet is never resent.

        Returns:
            True once the acknowledged chunks reach ``need`` (the caller ends the message).
        """
        self.t_heard = now
        if self.acked is None:
            self.acked, self.retx = np.zeros(self.n, bool), np.zeros(self.n, bool)
            self.seq, self.t_rtx = np.roll(np.arange(self.n, dtype=np.int64), self.first), np.zeros(self.n)
        bits = bits[: max(0, self.n - first)]
        seq = self.seq[first: first + len(bits)]
        bits = bits & ((seq < self.sent) | (seq >= self.n))  # a chunk not sent yet is never acked or resent
        seg = slice(first, first + len(bits))
        new = bits & ~self.acked[seg]
        self.acked[seg] |= bits
        if np.count_nonzero(self.acked) >= self.need:
            return True
        self.retx[seg] = (self.retx[seg] | self.lost(seg, new, now, wait)) & ~self.acked[seg]
        self.nretx = int(np.count_nonzero(self.retx))
        self.t_last = now
        self.timeouts = 0  # the receiver answers: the path works, probe at the base timeout again
        return False

    def lost(self, seg: slice, new: np.ndarray, now: float, wait: float = 0.0) -> np.ndarray:
        """Chunks of ``seg`` a BITMAP shows missing that are lost, not still on their way
        (``new``: the chunks it shows in for the first time).

        Packets to one peer travel one path in order, so a missing chunk sent before one
        the receiver has (by send number: first sends in send order, then each
        retransmission) is lost.  One sent after it may still wait in this host's queue or
        on the wire (a long repair queued at line rate; a probe's BITMAP overtakes it; a
        NACK sent while this rank's own pacer held the rest): it counts as lost only once it
        went out ``LOSS_RTTS`` round trips ago (the time the latest retransmission shown
        arrived took to show up) or, before a round trip is measured, ``wait`` seconds ago
        (the caller's probe timeout), else the next BITMAP decides.
        """
        seq = self.seq[seg]
        resent = seq >= self.n
        got = self.acked[seg]
        miss = ~got & (resent | (seq < self.sent))  # (chunks not sent yet lie in seg)
        shown = new & resent  # retransmissions this BITMAP shows arrived: a round-trip sample
        if shown.any():
            j = seg.start + np.flatnonzero(shown)[seq[shown].argmax()]
            self.rtt = now - self.t_rtx[j]
        top = seq[got].max() if got.any() else -1
        # a first send went out by t_sent_all (all sent) or by the message's latest send or answer
        went = np.where(resent, self.t_rtx[seg], self.t_sent_all if self.t_sent_all is not None else self.t_last)
        recent = wait if self.rtt is None else LOSS_RTTS * self.rtt
        # a message with a plan probes right behind each batch of its sends, on the same path: what
        # the answer lacks of what went before the probe is lost, not on its way
        behind = went <= self.t_probed if self.plans and self.t_probed is not None else False
        return miss & ((seq < top) | (went <= now - recent) | behind)

    def resend(self, budget: int, now: float) -> np.ndarray:
        """Take up to ``budget`` chunks queued for retransmission off the queue, numbering them
        as sent at ``now``; their indices (counted in ``retransmits``)."""
        idx = np.flatnonzero(self.retx)[:budget]
        self.retx[idx] = False
        self.nretx -= len(idx)
        self.seq[idx] = np.arange(self.nseq, self.nseq + len(idx))
        self.nseq += len(idx)
        self.t_rtx[idx] = now
        self.retransmits += len(idx)
        return idx

    def probe_wait(self, pt: float, probe_max: float) -> float:
        """Seconds after its last send or answer that this message is probed (``pt``: the probe
        timeout): backing off on repeated probes (2x .. 16x), never past ``probe_max`` (a probe is
        one packet, a lost probe or reply must not cost seconds)."""
        return min(probe_max, pt * (2 ** min(self.timeouts, 4)))

    def probe_due(self, now: float, pt: float, probe_max: float) -> bool:
        """Whether to PROBE now: every planned chunk sent, no retransmission queued, and silence
        for :meth:`probe_wait`.  Counts the probe when it is due."""
        if self.done or not self.out or self.nretx or now - self.t_last < self.probe_wait(pt, probe_max):
            return False
        self.timeouts += 1
        self.probed(now)
        return True

    def probed(self, now: float) -> None:
        """A PROBE for it goes at ``now``."""
        self.probes += 1
        self.t_probed = self.t_last = now


class InMessage:
    """One incoming message: a shard from one peer.

    Args:
        ag: an all-gather message (else reduce-scatter).
        src: the sending rank.
        mask: a view of the reduce buffer's or the result's mask marking its chunks that
            arrived (the receive path writes it; :meth:`arrived` reads the count).
        nb: a neighbour round's message (``ag`` is False).
    """

    def __init__(self, ag: bool, src: int, mask: np.ndarray, nb: bool = False):
        self.ag, self.src, self.n, self.mask, self.nb = ag, src, len(mask), mask, nb
        self.flag = AG if ag else NB if nb else 0
        self.skipped = False   # neighbour round: left out (below its bound at the round's timeout)
        self.count = 0
        self.hi = 0            # 1 + the furthest chunk seen in its sender's send order (from its ``first``)
        self.t_data = 0.0      # when a new chunk last arrived
        self.t_first = None    # when its first chunk arrived (a neighbour round's next deadline starts from it)
        self.t_nack = 0.0      # when the last unsolicited BITMAP went out
        self.nacks = 0         # unsolicited BITMAPs since a repair last got through
        self.asked = 0         # chunks missing below hi when the last one went out
        self.count_nack = 0    # count then
        self.tol8 = None       # the sender's bound, from its packets (None: none heard yet)
        self.stop_sent = False

    @property
    def tol8(self) -> int | None:
        """The sender's loss bound (1/255 units), None until a packet of it is heard."""
        return self._tol8

    @tol8.setter
    def tol8(self, tol8: int | None) -> None:
        self._tol8 = tol8
        self.need = self.n if tol8 is None else self.n - self.n * tol8 // 255  # chunks that make it done

    @property
    def done(self) -> bool:
        """Enough chunks arrived for the bound."""
        return self.count >= self.need

    def arrived(self, got: int, count: int, hi: int, now: float, tol8: int) -> int:
        """``got`` packets of this message arrived at ``now``: ``count`` chunks are in its mask now,
        ``hi`` is 1 + the highest chunk seen, ``tol8`` the bound their sender put in them (taken
        from the first packet heard).

        Returns:
            How many of the ``got`` were duplicates.
        """
        if self.tol8 is None:
            self.tol8 = tol8
        dup = got - (count - self.count)
        if count > self.count:
            if self.t_first is None:
                self.t_first = now
            self.count = count
            self.hi = hi
            self.t_data = now
            if 2 * (count - self.count_nack) >= self.asked:  # the repair got through: NACK at once again
                self.nacks = 0
        return dup

    def nack_due(self, now: float) -> bool:
        """Whether to send an unsolicited BITMAP (a NACK) now, and if so note it as sent.

        Due once the bound is out of reach even if every chunk not seen yet comes
        (``count + n - hi < need``; after a first NACK, unseen chunks count as lost too),
        after ``NACK_QUIET`` without a new chunk and, while NACKs go unanswered or are answered
        with less than half of what was missing, 2x ``NACK_QUIET`` since the last one.  Loss
        within the bound never NACKs.
        """
        if self.done or self.skipped or self.count == 0:
            return False
        tail = self.count + self.n - self.hi >= self.need  # within reach if the chunks not seen yet come
        if tail and not self.t_nack:
            return False
        if now - self.t_data < NACK_QUIET or now - self.t_nack < NACK_QUIET * (1 << min(self.nacks, 1)):
            return False
        self.t_nack = now
        self.asked, self.count_nack = (self.n if tail else self.hi) - self.count, self.count
        self.nacks += 1
        return True

    def due(self, now: float) -> int:
        """Chunks of this message on their way that a receive may wait for at ``now``: the rest of
        a stream that still flows (a chunk within ``NACK_QUIET``) and the repair a NACK asked for
        within ``NACK_QUIET``, at most what the bound still needs; 0 when done or stalled."""
        if self.done or self.skipped or now - max(self.t_data, self.t_nack) >= NACK_QUIET:
            return 0
        coming = (self.n - self.hi if self.hi else 0) + max(0, self.asked - (self.count - self.count_nack))
        return min(coming, self.need - self.count)

