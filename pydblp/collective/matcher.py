"""The receive path: sorts a received batch into a round's messages.

:class:`Matcher` takes the packets one receive returned and

* absorbs this round's DATA for this rank: payloads go straight into the round's reduce
  buffer (a neighbour round's: the neighbours' buffer) or result, masks and
  :class:`~pydblp.collective.messages.InMessage` counts follow;
* stashes the next rounds' packets (bounded) until their round starts: the next one's (an
  allreduce's peers are at most one round ahead), and in neighbour rounds, where a rank that
  fell behind lags more, up to ``STASH_AHEAD`` rounds ahead;
* hands control packets (PROBE, STOP, BITMAP) back to the caller, which answers them;
* counts and drops the rest (``foreign``, ``late``, ``duplicate``, ``bad_payload``, ...).

It never sends: what a batch made due (STOPs for messages that reached their bound, control
packets to answer) is returned.  The usual batch, all of it this round's DATA, is matched in
three numpy calls on the headers' 64-bit words; a few packets and whatever else a batch holds
are sorted one by one in Python.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np

from pydblp import native as native_mod
from pydblp import wire
from pydblp.collective.config import (AG, DATA, F32, FEW, HELLO, MASK32, NB, PROBE, RECV_BATCH, STASH_AHEAD,
                                      STASH_MAX)
from pydblp.collective.messages import InMessage, stagger_first
from pydblp.collective.rounds import NeighbourRound, ReduceScatterRound, Round
from pydblp.wire import (DST_ALL, F_DST, F_DTYPE, F_FLAGS, F_JOB, F_KIND, F_LEN, F_ROUND, F_SRC, F_TENSOR,
                         FLAG_TAG)


def _declare(lib: ctypes.CDLL) -> None:
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    u32 = ctypes.c_uint32
    lib.dblp_absorb.argtypes = [p, i64, p, i64, p, p, i, i64, i64, i64, i, p, p, i64, i, i, p, p, i64, p, p, p, p, p,
                                p, p, p, p, u32, u32, u32]
    lib.dblp_absorb.restype = i64
    lib.dblp_count_data.argtypes = [p, i64, p, i64, p, p]
    lib.dblp_count_data.restype = i64
    lib.dblp_data_headers.argtypes = [p, i64, p, p, u32, u32, u32, u32, u32, u32, u32, u32, u32, p, p, ctypes.c_uint64,
                                      i64]
    lib.dblp_data_headers.restype = None


def _addr(a: np.ndarray) -> int:
    """The address of ``a``'s first byte."""
    return a.ctypes.data


def native_lib() -> ctypes.CDLL | None:
    """csrc/matcher.c's loops (:mod:`pydblp.native`), or None: the pure-Python path."""
    return native_mod.load("matcher", _declare, what="a received batch matched and scattered in numpy calls, not one C call")


@dataclass
class Sorted:
    """What one batch made due: messages that reached their bound and need a STOP (marked as
    sent), and control packets to handle as ``(header fields, payload, current)`` (``current``:
    of the round running, else of an earlier one)."""

    stops: list = field(default_factory=list)
    control: list = field(default_factory=list)


class Matcher:
    """Sorts received packets for one rank.

    Args:
        rank: this rank.
        world: the number of ranks.
        job: the job id packets must carry.
        chunk_bytes: the payload of a DATA packet.
        broadcast: all-gather DATA may come to ``wire.DST_ALL`` (a broadcast all-gather).
        counters: the collective's counters, updated in place.
        stagger: senders start their reduce-scatter and neighbour messages at chunk
            ``src * n // world`` (``Config.stagger``): a message's progress is counted from there.
    """

    def __init__(self, rank: int, world: int, job: int, chunk_bytes: int, broadcast: bool, counters: dict,
                 native: bool | None = None, stagger: bool = False):
        self.rank, self.world, self.job, self.broadcast = rank, world, job, broadcast
        self.stagger = stagger
        self.lib = native_mod.choose(native, None if native is False else native_lib(), "matcher")  # (None: Python)
        self.native = self.lib is not None
        self._got = np.zeros((3, 2 * world), np.int64)  # the compiled absorb's counts, bounds, rows
        self._rest = np.zeros(RECV_BATCH, np.int64)
        self._rest_ahead = np.zeros(RECV_BATCH, bool)  # (per row of _rest: one _sort stashes)
        self._fixed = (*(_addr(a) for a in (self._got[1], self._got[0], self._got[2])), _addr(self._rest),
                       _addr(self._rest_ahead), job)
        self._addrs = None  # (round, reduced yet, its arrays' addresses): see _absorb_native
        self.C = chunk_bytes // 4
        self.counters = counters
        self.stash: list[tuple] = []  # packets of the next round: (headers, payloads, lengths)
        self._stashed = 0             # packets in it
        self._probes: set[tuple] = set()  # (src, round, tensor, flags) of the PROBEs (and HELLOs) in it
        self._seen: set[int] = set()  # round << 32 | tensor << 16 | src of the messages of rounds to come seen
        m = np.zeros(1, wire.HEADER_DTYPE)  # the header bits every DATA packet for this rank shares
        for f in ("magic", "version", "kind", "job", "round", "tensor", "dst", "dtype", "len"):
            if f != "dst" or not broadcast:  # (broadcast all-gather: match checks dst on its own)
                m[f] = np.iinfo(wire.HEADER_DTYPE[f]).max
        m["flags"] = FLAG_TAG | NB  # (NB: a neighbour round's DATA never matches an allreduce round, nor the reverse)
        self._mask = np.tile(m.view(np.uint64), RECV_BATCH)
        self._tmp = np.empty_like(self._mask)
        v = self._rec = np.zeros(1, wire.HEADER_DTYPE)
        v["magic"], v["version"], v["kind"], v["job"] = wire.MAGIC, wire.VERSION, DATA, job
        v["dst"], v["dtype"], v["len"] = rank, F32, self.C * 4
        self._vals = np.tile(v.view(np.uint64), RECV_BATCH)
        self._mask_vals = (_addr(self._mask), _addr(self._vals))

    def begin(self, st: Round) -> list[tuple]:
        """Match round ``st`` from now on; returns (and forgets) the packets stashed (this round's;
        those of later rounds go back to the stash when they are processed)."""
        v = self._rec
        v["round"], v["tensor"] = st.round, st.tensor
        v["flags"] = st.flag
        self._vals[1::4] = v.view(np.uint64)[1]  # only the words with round and tensor, and flags, change
        self._vals[3::4] = v.view(np.uint64)[3]
        stash, self.stash = self.stash, []
        self._stashed = 0
        self._probes.clear()
        self._seen = {k for k in self._seen if 0 < ((k >> 32) - st.round) & MASK32 <= STASH_AHEAD}
        return stash

    def match(self, h: np.ndarray):
        """Which packets of ``h`` are DATA of the round :meth:`begin` named, for this rank (of this
        job, tensor, dtype and chunk size; sources unchecked): True for all of them, else a bool per
        packet (None: ``h`` is not laid out for it).  With a broadcast all-gather, all-gather DATA
        to ``DST_ALL`` is for this rank too."""
        k = 4 * len(h)
        if k > len(self._mask) or not h.flags.c_contiguous:
            return None
        t = self._tmp[:k]
        np.bitwise_and(h.view(np.uint64), self._mask[:k], out=t)
        eq = t == self._vals[:k]
        if self.broadcast:
            d = h["dst"]
            mine = (d == self.rank) | ((d == DST_ALL) & ((h["flags"] & AG) != 0))
            if eq.all() and mine.all():
                return True
            return eq.reshape(-1, 4).all(axis=1) & mine
        return True if eq.all() else eq.reshape(-1, 4).all(axis=1)

    def process(self, st: Round | None, h: np.ndarray, pay: np.ndarray, lens: np.ndarray, now: float,
                base: int) -> Sorted:
        """Sort received packets: headers ``h``, payloads ``pay``, lengths ``lens``, at ``now``.

        Args:
            st: the round running, or None between rounds.
            base: the round running, or between rounds the last one finished.

        Returns:
            The STOPs and control packets the batch made due (see :class:`Sorted`).
        """
        out = Sorted()
        rest = ahead = None  # rows for the one-by-one path (None: all), and which of them to stash
        fast = st is not None and len(h) > FEW
        if fast and self.lib is not None and not st.flag & NB:
            taken = self._absorb_native(st, h, pay, now, out)
            if taken is not None:
                rest, ahead = taken
                fast = False
                if not len(rest):
                    return out
        if fast:
            m = self.match(h)
            if m is True:
                self.absorb(st, h, pay, None, now, out)
                return out
            if m is not None:
                rows = m.nonzero()[0]
                if len(rows):
                    self.absorb(st, wire.take(h, rows), pay, rows, now, out)
                rest = (~m).nonzero()[0]
        self._sort(st, h, pay, lens, rest, now, base, out, ahead)
        return out

    def _absorb_native(self, st: Round, h, pay, now: float, out: Sorted) -> tuple | None:
        """:meth:`absorb` of the packets :meth:`match` takes, in compiled code; the rows it did not
        take (for :meth:`_sort`) and which of them :meth:`_sort` stashes (:meth:`_ahead`'s), or None
        when the batch holds something only :meth:`absorb` handles (then nothing was taken: the
        whole batch goes the Python way)."""
        n = len(h)
        if n > len(self._rest) or not h.flags.c_contiguous or pay.strides[1] != 1:
            return None
        W = self.world
        got, hi, tol = self._got
        got[:] = 0
        tol[:] = -1
        hi[:] = st.hi.reshape(-1)
        rs = not st.reduced
        # (addresses of the round's arrays, once a round and stage: .ctypes.data costs ~0.7 us a call)
        if self._addrs is None or self._addrs[0] is not st or self._addrs[1] != rs:
            gather = st.gather
            self._addrs = (st, rs, (
                int(self.broadcast), self.rank, W, self.C * 4, int(not rs),
                _addr(st.rflat) if rs else None, _addr(st.rmflat) if rs else None,
                st.rmask.shape[1] if rs else 0, int(self.stagger), int(gather),
                _addr(st.y if st.result is None else st.result) if gather else None,
                _addr(st.perm) if gather and st.result is not None else None,
                len(st.result) if gather and st.tail is not None else -1,
                _addr(st.tail) if gather and st.tail is not None else None,
                _addr(st.have) if gather else None,
                _addr(st.ag_first) if gather else None, _addr(st.ag_n) if gather else None,
                *self._fixed))
        k = self.lib.dblp_absorb(_addr(h), n, _addr(pay), pay.strides[0], *self._mask_vals, *self._addrs[2],
                                  st.round, STASH_AHEAD)
        if k < 0:
            return None
        st.hi[:] = hi.reshape(2, W)
        touched = []
        per = got[:W].tolist()
        if any(per):
            count = st.rmask.sum(axis=1).tolist()
            h0 = st.hi[0].tolist()
            for r, g in enumerate(per):
                if g:
                    inn = st.ins[(False, r)]
                    self._credit(st, inn, int(tol[r]), g, count[r], h0[r], now)
                    touched.append(inn)
        per = got[W:].tolist()
        if any(per):
            h1 = st.hi[1].tolist()
            for r, g in enumerate(per):
                if g:
                    inn = st.ins[(True, r)]
                    rs_out = st.outs.get((False, r))
                    if rs_out is not None and not rs_out.done:
                        rs_out.done = True  # owner r is all-gathering: it is done with our contribution
                    self._credit(st, inn, int(tol[W + r]), g, int(np.count_nonzero(inn.mask)), h1[r], now)
                    touched.append(inn)
        for inn in touched:
            if inn.done and not inn.stop_sent:
                inn.stop_sent = True
                out.stops.append(inn)
        return self._rest[:k].copy(), self._rest_ahead[:k].copy()

    def _sort(self, st: Round | None, h, pay, lens, rows, now: float, base: int, out: Sorted,
              ahead: np.ndarray | None = None) -> None:
        """:meth:`process` packet by packet for rows ``rows`` of a batch (None: all of them).

        Packets of a round to come from a peer (what a rank ahead of this one sends: most of what
        the compiled absorb leaves) are told apart first, in numpy calls or by the compiled absorb
        (``ahead``, per row of ``rows``), and stashed in order; the loop below would stash each of
        them alike, one by one."""
        if ahead is not None and rows is not None and ahead.all():  # (all of them, the usual case when peers
            self._keep(h, pay, lens, rows, st, now)                  # run ahead: stashed, nothing to sort)
            return
        sel = h if rows is None else wire.take(h, rows)
        rows = np.arange(len(h)) if rows is None else rows
        keep = []
        if ahead is None and len(sel) > FEW:
            ahead = self._ahead(sel, base)
        if ahead is not None and ahead.any():
            keep = rows[ahead].tolist()
            rest = (~ahead).nonzero()[0]
            sel, rows = wire.take(sel, rest), rows[rest]
        fields = sel.tolist()
        rows = rows.tolist()
        me, W, job, width = self.rank, self.world, self.job, self.C * 4
        prev = (base - 1) & MASK32
        data, ctrl = [], []
        foreign = late = bad = stray = 0
        for i, f in zip(rows, fields):
            kind, rnd, src = f[F_KIND], f[F_ROUND], f[F_SRC]
            if (f[F_JOB] != job or src >= W or src == me
                    or (f[F_DST] != me and not (f[F_DST] == DST_ALL and kind == DATA and f[F_FLAGS] & AG))):
                foreign += 1
            elif 0 < ((rnd - base) & MASK32) <= STASH_AHEAD:  # a round to come
                keep.append(i)
            elif st is None:  # (base: the finished round)
                if kind != DATA:  # a probe for it, a STOP or BITMAP for a trailing message
                    ctrl.append((f, i, False))
                elif rnd == base:
                    late += 1
                else:
                    stray += 1
            elif rnd == base:
                if kind != DATA:
                    ctrl.append((f, i, True))
                elif (f[F_TENSOR] == st.tensor and f[F_DTYPE] == F32 and f[F_LEN] == width
                      and not f[F_FLAGS] & FLAG_TAG and (f[F_FLAGS] & NB) == st.flag):
                    data.append(i)
                else:
                    bad += 1
                    if src not in st.misfit:
                        kind = "" if f[F_DTYPE] == F32 else f" of dtype {f[F_DTYPE]}"
                        nb = "neighbour" if f[F_FLAGS] & NB else "allreduce"
                        mine = "neighbour" if st.flag & NB else "allreduce"
                        st.misfit[src] = (now, f"{nb} round, tensor {f[F_TENSOR]}, {f[F_LEN]}-byte chunks{kind}"
                                               f"{', tagged' if f[F_FLAGS] & FLAG_TAG else ''} where this rank is in a "
                                               f"{mine} round at tensor {st.tensor} with {width}-byte float32 chunks")
            elif kind != DATA:  # of an earlier round: a late probe, a STOP or BITMAP for a trailing message
                ctrl.append((f, i, False))
            elif rnd == prev:
                late += 1
            else:  # DATA of a round long finished, or too far ahead to keep
                stray += 1
        c = self.counters
        c["foreign"] += foreign
        c["late"] += late
        c["stray"] += stray
        c["bad_payload"] += bad
        if keep:
            self._keep(h, pay, lens, np.array(keep), st, now)
        if data:
            rows = np.array(data)
            self.absorb(st, wire.take(h, rows), pay, rows, now, out)
        out.control += [(f, pay[i, : lens[i]], current) for f, i, current in ctrl]

    def _ahead(self, h, base: int) -> np.ndarray:
        """Which packets of ``h`` the loop in :meth:`_sort` stashes: of this job, from a peer rank,
        to this rank (or all-gather DATA to all), of a round 1..STASH_AHEAD past ``base``."""
        dst, kind = h["dst"], h["kind"]
        to_me = (dst == self.rank) | ((dst == DST_ALL) & (kind == DATA) & ((h["flags"] & AG) != 0))
        d = (h["round"].astype(np.int64) - base) & MASK32
        src = h["src"]
        return (h["job"] == self.job) & (src < self.world) & (src != self.rank) & to_me & (d > 0) & (d <= STASH_AHEAD)

    def waiting(self, base: int) -> dict[int, tuple[int, int]]:
        """The peers whose packets of a round to come are stashed (they are in a round this rank,
        last in round ``base``, has not begun), each with the (round, tensor) farthest from
        ``base``: the one it is in (it sent the nearer ones' packets before it left them)."""
        if not self.stash:
            return {}
        h = np.concatenate([x[0] for x in self.stash])
        d = (h["round"].astype(np.int64) - base) & MASK32
        order = np.lexsort((-d, h["src"]))  # by sender, then farthest first
        src = h["src"][order]
        first = np.flatnonzero(np.r_[True, src[1:] != src[:-1]])
        near = order[first]
        return {int(s): (int(r), int(t)) for s, r, t in
                zip(h["src"][near], h["round"][near], h["tensor"][near])}

    def _keep(self, h, pay, lens, rows, st: Round | None, now: float) -> None:
        """Stash packets ``rows`` of rounds to come (bounded: beyond it the loss machinery repairs).
        A PROBE (or a HELLO asking) is kept once per message: a peer waiting for this rank probes
        it every ``probe_max`` for as long as this rank is busy, and one answer serves them all
        (the others count as duplicates).

        A peer already in a round to come is alive: round ``st`` (if any) hears it at the first
        packet of each of its messages there, not again: a replayed packet (a keyed job's tags
        verify on a replay) must not keep a peer that has since died alive."""
        if st is not None:
            self._heard_ahead(st, h, rows, now)
        kinds = h["kind"][rows]
        probes = rows[(kinds == PROBE) | (kinds == HELLO)]
        if len(probes):
            again = []
            for i, key in zip(probes.tolist(), zip(*(h[f][probes].tolist() for f in ("src", "round", "tensor", "flags")))):
                if key in self._probes:
                    again.append(i)
                self._probes.add(key)
            if again:
                self.counters["duplicate"] += len(again)
                rows = rows[~np.isin(rows, again)]
        room = STASH_MAX - self._stashed
        if room < len(rows):
            self.counters["stash_full"] += len(rows) - max(room, 0)
            rows = rows[: max(room, 0)]
        if len(rows):
            self.stash.append((wire.take(h, rows), pay[rows], lens[rows]))  # (gathers: copies already)
            self._stashed += len(rows)
            self.counters["stashed"] += len(rows)

    def _heard_ahead(self, st: Round, h, rows, now: float) -> None:
        """Round ``st`` hears the senders of packets ``rows`` (of rounds to come) whose message
        (round, tensor, sender) this rank has not seen before."""
        keys = np.unique((h["round"][rows].astype(np.uint64) << np.uint64(32))
                         | (h["tensor"][rows].astype(np.uint64) << np.uint64(16)) | h["src"][rows])
        new = [k for k in keys.tolist() if k not in self._seen]
        if new:
            if len(self._seen) < STASH_MAX:  # (bounded, as the stash is: forged rounds and tensors)
                self._seen.update(new)
            st.heard[[k & 0xFFFF for k in new]] = now

    def absorb(self, st: Round, h, pay, prow, now: float, out: Sorted) -> None:
        """Take DATA packets of round ``st`` for this rank into it: headers ``h``, payloads
        ``pay[prow]`` (``chunk_bytes`` each; ``prow`` None: ``pay``'s first rows).  A packet
        from no peer rank (this one, or past the world) is counted in ``foreign``.

        Payload bytes are read once, straight into the reduce buffer or the result, at the rows
        the header names (a duplicate writes the same bytes again); arrival counts come from the
        masks.  A packet whose chunk count does not match its message's (a rank with another
        tensor size) is dropped and counted in ``bad_payload``.  Messages that reach their bound
        are added to ``out.stops``.
        """
        W = self.world
        src = h["src"].astype(np.intp)
        per = np.bincount(src, minlength=W)
        if st.flag & NB:
            self._absorb_nb(st, h, pay, prow, src, per, now, out)
            return
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
        if nag < len(h) and not st.reduced:  # contributions to my shard (not reduced: it owns one)
            if nag:
                rs = (ag == 0).nonzero()[0]
                self._absorb_rs(st, h[rs], pay, prow[rs], src[rs], chunk[rs], np.bincount(src[rs], minlength=W),
                                now, touched)
            else:
                self._absorb_rs(st, h, pay, prow, src, chunk, per, now, touched)
        if nag and not st.gather:  # (a round without an all-gather: a peer in another kind of round)
            self._drop_unexpected(st, h, ag, now)
        elif nag:  # all-gather results from shard owners
            if nag < len(h):
                sel = ag.nonzero()[0]
                h, prow, src, chunk = h[sel], prow[sel], src[sel], chunk[sel]
                per = np.bincount(src, minlength=W)
            ok = h["nchunks"] == st.ag_n[src]  # (-1 for a rank that owns no shard for me)
            if not ok.all():
                h, prow, src, chunk, per = self._drop_bad(st, h, prow, src, chunk, ok, st.ag_n[src], now)
            row = st.ag_first[src] + chunk
            st.put(row, self._chunks(pay, prow))
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
                inn.stop_sent = True
                out.stops.append(inn)

    def _drop_unexpected(self, st: Round, h, ag, now: float) -> None:
        """Drop all-gather DATA (``ag`` marks it among headers ``h``) in a round that has no
        all-gather: counted in ``bad_payload``, the first sender noted as a misfit."""
        rows = ag.nonzero()[0]
        self.counters["bad_payload"] += len(rows)
        src = int(h["src"][rows[0]])
        if src not in st.misfit:
            st.misfit[src] = (now, f"all-gather data where this rank is in a round without one (tensor {st.tensor})")

    def _absorb_nb(self, st: NeighbourRound, h, pay, prow, src, per, now: float, out: Sorted) -> None:
        """:meth:`absorb` for a neighbour round: each neighbour's message goes to its slot of the
        neighbours' buffer.  A packet from a rank that is not a neighbour this round (or past the
        world) is counted in ``foreign``."""
        W = self.world
        if len(per) > W:
            ok = src < W
            self.counters["foreign"] += int(np.count_nonzero(~ok))
            prow = (np.arange(len(h)) if prow is None else prow)[ok]
            h, src = h[ok], src[ok]
        slot = st.slot[src]
        if (slot < 0).any():
            ok = slot >= 0
            self.counters["foreign"] += int(np.count_nonzero(~ok))
            prow = (np.arange(len(h)) if prow is None else prow)[ok]
            h, src, slot = h[ok], src[ok], slot[ok]
        per = np.bincount(src, minlength=W)
        chunk = h["chunk"].astype(np.intp)
        n = st.rmask.shape[1]
        ok = h["nchunks"] == n
        if not ok.all():
            h, prow, src, chunk, per = self._drop_bad(st, h, prow, src, chunk, ok, n, now)
            slot = st.slot[src]
        for inn in self._store(st, h, pay, prow, src, slot, st.slot, chunk, per, n, now):
            if inn.done and not inn.stop_sent:
                inn.stop_sent = True
                out.stops.append(inn)

    def _absorb_rs(self, st: ReduceScatterRound, h, pay, prow, src, chunk, per, now: float, touched: list) -> None:
        """:meth:`absorb` for reduce-scatter packets (to my shard, not reduced yet)."""
        n = st.rmask.shape[1]
        ok = h["nchunks"] == n
        if not ok.all():
            h, prow, src, chunk, per = self._drop_bad(st, h, prow, src, chunk, ok, n, now)
        touched += self._store(st, h, pay, prow, src, src, np.arange(self.world), chunk, per, n, now)

    def _store(self, st: Round, h, pay, prow, src, slot, slot_of, chunk, per, n: int, now: float) -> list:
        """Write arrived chunks into ``st.rbuf`` (row ``slot * n + chunk``; ``slot_of[r]``: sender
        r's slot), mark them, and account them to their messages; the messages that advanced."""
        row = slot * n + chunk
        st.rflat[row] = self._chunks(pay, prow)
        st.rmflat[row] = True
        sent = (chunk - stagger_first(src, n, self.world)) % n if self.stagger else chunk  # in send order
        np.maximum.at(st.hi[0], src, sent + 1)
        hi = st.hi[0].tolist()
        count = st.rmask.sum(axis=1).tolist()
        advanced = []
        for r, got in enumerate(per.tolist()):
            if not got:
                continue
            inn = st.ins[(False, r)]
            self._arrived(st, inn, h, src, got, count[slot_of[r]], hi[r], now)
            advanced.append(inn)
        return advanced

    def _chunks(self, pay: np.ndarray, prow) -> np.ndarray:
        """Payloads ``pay[prow]`` (None: the first rows) as float32 chunks: a view, or one gather."""
        return (pay[:, : self.C * 4] if prow is None else pay[prow, : self.C * 4]).view(np.float32)

    def _drop_bad(self, st: Round, h, prow, src, chunk, ok, want, now: float):
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

    def _arrived(self, st: Round, inn: InMessage, h, src, got: int, count: int, hi: int, now: float) -> None:
        """Update ``inn`` after ``got`` packets of it (among headers ``h`` from sources ``src``)
        arrived: its sender is heard, duplicates are counted."""
        tol8 = int(h["tol"][(src == inn.src).argmax()]) if inn.tol8 is None else inn.tol8
        self._credit(st, inn, tol8, got, count, hi, now)

    def _credit(self, st: Round, inn: InMessage, tol8: int, got: int, count: int, hi: int, now: float) -> None:
        """:meth:`_arrived` with the bound of the first packet from ``inn``'s sender, ``tol8``.
        Its sender is heard only when a chunk is new: a duplicate (or a replayed packet) of a
        peer that has since died must not keep it alive past ``peer_timeout``."""
        dup = inn.arrived(got, count, hi, now, tol8)
        self.counters["duplicate"] += dup
        if got > dup:
            st.heard[inn.src] = now
