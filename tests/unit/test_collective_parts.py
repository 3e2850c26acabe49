"""The collective's pieces on their own: message state (OutMessage, InMessage), Round's receive
budget, and the receive path (Matcher).  No sockets: states are driven with explicit times."""

from __future__ import annotations

import numpy as np
import pytest

from pydblp import wire
from pydblp.collective.config import LINGER_MIN, LINGER_WANT, NACK_QUIET, STASH_MAX
from pydblp.collective.matcher import Matcher
from pydblp.collective.messages import InMessage, OutMessage
from pydblp.collective.rounds import AllreduceRound

C = 16  # float32 values per chunk in these tests (64-byte chunks)


def out(n=100, tol8=0, sent=None) -> OutMessage:
    o = OutMessage(False, 1, np.zeros((n, C), np.float32), np.zeros(n, np.uint8), tol8, 7, 0)
    o.sent = n if sent is None else sent
    return o


def bits(n, have) -> np.ndarray:
    b = np.zeros(n, bool)
    b[list(have)] = True
    return b


# ---- OutMessage -----------------------------------------------------------

def test_out_message_needs_all_but_its_tolerance():
    assert out(100, tol8=0).need == 100
    assert out(100, tol8=25).need == 100 - 100 * 25 // 255 == 91
    assert out(0).done  # an empty message has nothing to send


def test_bitmap_queues_only_what_went_out_and_ends_at_the_bound():
    o = out(100, tol8=25, sent=30)
    o.timeouts = 3
    assert not o.bitmap(0, bits(104, range(10)), 100.0)
    assert np.flatnonzero(o.retx).tolist() == list(range(10, 30)) and o.nretx == 20
    assert o.timeouts == 0 and o.t_heard == o.t_last == 100.0
    o.sent = 100
    assert o.bitmap(0, bits(104, range(91)), 100.1)  # 91 acknowledged: the bound
    o2 = out(100, tol8=0, sent=30)
    assert not o2.bitmap(0, np.ones(104, bool), 1.0)  # bits past what went out are not taken
    assert np.count_nonzero(o2.acked) == 30


def test_bitmap_counts_acknowledgements_across_segments():
    o = out(100, tol8=0)
    assert not o.bitmap(0, bits(50, range(50)), 1.0)
    assert not o.retx[:50].any()
    assert o.bitmap(50, bits(50, range(50)), 1.1)  # the second half's BITMAP completes it


def test_resend_numbers_retransmissions_after_the_first_sends():
    o = out(100)
    o.bitmap(0, bits(100, set(range(100)) - {3, 4, 5}), 1.0)
    assert o.resend(2, 1.5).tolist() == [3, 4] and o.nretx == 1
    assert o.seq[[3, 4]].tolist() == [100, 101] and o.t_rtx[3] == 1.5 and o.retransmits == 2
    assert o.resend(10, 1.6).tolist() == [5] and o.seq[5] == 102 and o.nretx == 0


def test_lost_waits_for_a_round_trip_before_calling_a_late_chunk_lost():
    o = out(100)
    o.t_sent_all = 1.0
    every = set(range(100))
    o.bitmap(0, bits(100, every - set(range(10, 20))), 1.01)  # no round trip known: all missing is lost
    o.resend(10, 1.02)  # 10..19 as 100..109
    o.bitmap(0, bits(100, every - set(range(15, 20))), 1.03)  # 10..14 in: rtt 10 ms; 15..19 may be coming
    assert o.rtt == pytest.approx(0.01) and o.nretx == 0
    o.bitmap(0, bits(100, every - set(range(15, 20))), 1.034)  # sent 14 ms ago, < 1.5 round trips: coming
    assert o.nretx == 0
    o.bitmap(0, bits(100, every - set(range(15, 20))), 1.036)  # 16 ms > 1.5 round trips: lost
    assert np.flatnonzero(o.retx).tolist() == list(range(15, 20))


def test_a_chunk_sent_before_one_that_arrived_is_lost_at_once():
    o = out(100)
    o.t_sent_all = 1.0
    o.bitmap(0, bits(100, set(range(100)) - {10, 11}), 1.01)
    o.resend(10, 1.02)  # 10 as 100, 11 as 101
    o.bitmap(0, bits(100, set(range(100)) - {10, 11}), 1.021)  # nothing new: no round trip yet
    o.retx[:] = False
    o.nretx = 0
    o.bitmap(0, bits(100, set(range(100)) - {10}), 1.022)  # 11 (sent after 10) arrived: 10 is lost
    assert np.flatnonzero(o.retx).tolist() == [10]


def test_probe_wait_backs_off_to_16x_never_past_probe_max():
    o = out(10)
    waits = []
    for t in range(6):
        o.timeouts = t
        waits.append(o.probe_wait(0.001, 1.0))
    assert waits == pytest.approx([0.001, 0.002, 0.004, 0.008, 0.016, 0.016])
    o.timeouts = 4
    assert o.probe_wait(0.01, 0.05) == 0.05


def test_probe_due_only_once_everything_went_and_the_wait_passed():
    o = out(10, sent=5)
    o.t_last = 1.0
    assert not o.probe_due(2.0, 0.01, 0.05)  # still sending
    o.sent = 10
    assert not o.probe_due(1.005, 0.01, 0.05)
    assert o.probe_due(1.011, 0.01, 0.05) and (o.probes, o.timeouts, o.t_last) == (1, 1, 1.011)
    assert not o.probe_due(1.025, 0.01, 0.05)  # backed off to 20 ms
    assert o.probe_due(1.032, 0.01, 0.05)
    o.nretx = 1
    assert not o.probe_due(9.0, 0.01, 0.05)  # a retransmission is queued: send it, do not probe


# ---- InMessage ------------------------------------------------------------

def test_in_message_need_follows_the_senders_bound():
    inn = InMessage(False, 1, np.zeros(100, bool))
    assert inn.tol8 is None and inn.need == 100
    inn.tol8 = 51
    assert inn.need == 100 - 100 * 51 // 255 == 80
    inn.count = 80
    assert inn.done


def test_arrived_counts_duplicates_and_takes_the_bound_once():
    inn = InMessage(False, 1, np.zeros(100, bool))
    assert inn.arrived(got=10, count=10, hi=10, now=1.0, tol8=25) == 0
    assert inn.tol8 == 25 and (inn.count, inn.hi, inn.t_data) == (10, 10, 1.0)
    assert inn.arrived(got=5, count=12, hi=12, now=1.1, tol8=99) == 3  # 3 of 5 were already in
    assert inn.tol8 == 25  # the first packet's bound stays
    assert inn.arrived(got=2, count=12, hi=12, now=1.2, tol8=25) == 2 and inn.t_data == 1.1


def _lossy(lost=range(30, 70), n=100, tol8=12) -> InMessage:
    inn = InMessage(False, 1, np.zeros(n, bool))
    got = [c for c in range(n) if c not in set(lost)]
    inn.mask[got] = True
    inn.arrived(len(got), len(got), n, 100.0, tol8)
    return inn


def test_nack_only_once_the_bound_is_out_of_reach():
    inn = _lossy(lost=range(96, 100))  # 96 of 100 in, need 96: done
    assert inn.done and not inn.nack_due(101.0)
    inn = InMessage(False, 1, np.zeros(100, bool))
    inn.arrived(50, 50, 50, 100.0, 12)  # 0..49 in, 50..99 may still come
    assert not inn.nack_due(101.0)


def test_nack_after_quiet_then_backs_off_its_interval_not_the_silence():
    inn = _lossy()  # 60 of 100 in (need 96): out of reach
    assert not inn.nack_due(100.0 + NACK_QUIET / 2)
    assert inn.nack_due(100.0 + NACK_QUIET * 1.25)
    t1 = inn.t_nack
    assert (inn.nacks, inn.asked, inn.count_nack) == (1, 40, 60)
    assert not inn.nack_due(t1 + NACK_QUIET * 1.5)  # the interval is 2x after a first NACK
    inn.arrived(2, 62, 100, t1 + NACK_QUIET, 12)  # a thin repair: the backoff stays
    assert inn.nacks == 1
    assert not inn.nack_due(t1 + NACK_QUIET * 1.75)  # quiet only 0.75x since the trickle
    assert inn.nack_due(t1 + NACK_QUIET * 2.1)  # quiet 1.1x, interval 2.1x
    inn.arrived(30, 92, 100, inn.t_nack + 0.001, 12)  # most of it came: NACK at the base interval again
    assert inn.nacks == 0


def test_due_counts_the_stream_still_flowing_and_the_repair_asked_for():
    inn = InMessage(False, 1, np.zeros(100, bool))
    inn.arrived(40, 40, 40, 100.0, 0)
    assert inn.due(100.001) == 60  # chunks 40..99 still coming
    assert inn.due(100.0 + NACK_QUIET * 1.01) == 0  # stalled
    inn = _lossy(tol8=0)
    inn.nack_due(100.0 + NACK_QUIET * 1.25)
    assert inn.due(inn.t_nack + 0.0001) == 40  # the repair asked for


# ---- Round ----------------------------------------------------------------

def _round(**kw) -> AllreduceRound:
    T = 200
    args = dict(round=1, tensor=0, index=0, tol=0.0, tol8=0, phase="static", x=np.zeros((T, C)),
                y=np.zeros((T, C)), have=np.zeros(T, bool), bounds=[(0, 100), (100, 200)], my_shard=0,
                reduced=False, t0=0.0, heard=np.zeros(2), hi=np.zeros((2, 2), np.intp), ag_first=np.zeros(2, np.intp),
                ag_n=np.full(2, -1, np.int64), foreign0=0, stats0={})
    args.update(kw)
    return AllreduceRound(**args)


def test_round_expected_counts_only_the_phase_it_is_in_and_bounds_it():
    st = _round()
    rs, ag = InMessage(False, 1, np.zeros(100, bool)), InMessage(True, 1, np.zeros(100, bool))
    st.ins = {(False, 1): rs, (True, 1): ag}
    rs.arrived(60, 60, 60, 1.0, 0)
    ag.arrived(50, 50, 50, 1.0, 0)
    assert st.expected(1.001) == 40  # reduce-scatter only, before the reduce
    st.reduced = True
    assert st.expected(1.001) == 50  # all-gather only, after it
    ag.count = ag.hi = 100 - (LINGER_MIN - 1)
    assert st.expected(1.001) == 1  # fewer than LINGER_MIN: a receive takes what is there
    big = InMessage(True, 1, np.zeros(10 * LINGER_WANT, bool))
    big.arrived(1, 1, 1, 1.0, 0)
    st.ins[(True, 1)] = big
    assert st.expected(1.001) == LINGER_WANT


def test_round_fields_are_declared():
    st = _round()
    assert st.ins == {} and st.outs == {} and st.misfit == {} and st.bcast is None and st.nacks == 0
    assert _round().ins is not st.ins  # each round its own


# ---- Matcher --------------------------------------------------------------

class Owner:
    """A Round of rank 0 of 2 that owns shard 0 (100 chunks) and awaits shard 1's all-gather."""

    def __init__(self, tol8=0):
        self.counters = dict.fromkeys(("foreign", "late", "duplicate", "stashed", "stash_full", "bad_payload",
                                              "stray"), 0)
        self.m = Matcher(0, 2, job=1, chunk_bytes=C * 4, broadcast=False, counters=self.counters)
        T = 200
        st = self.st = _round(round=7, tensor=3, tol8=tol8, x=np.zeros((T, C), np.float32),
                              y=np.zeros((T, C), np.float32))
        st.open_inbox(np.zeros((2, 100, C), np.float32))
        st.ins[(False, 1)] = InMessage(False, 1, st.rmask[1])
        st.ins[(True, 1)] = InMessage(True, 1, st.have[100:200])
        st.ag_first[1], st.ag_n[1] = 100, 100
        self.m.begin(st)

    def headers(self, chunks, kind=wire.Kind.DATA, ag=False, src=1, rnd=7, tensor=3, job=1, nchunks=100):
        h = wire.empty_batch(len(chunks))
        h["kind"], h["job"], h["round"], h["tensor"], h["src"], h["dst"] = kind, job, rnd, tensor, src, 0
        h["flags"] = wire.Flag.ALLGATHER if ag else 0
        h["chunk"], h["nchunks"], h["tol"], h["len"], h["dtype"] = chunks, nchunks, self.st.tol8, C * 4, wire.Dtype.F32
        return h

    def feed(self, h, now=1.0, values=None):
        n = len(h)
        pay = np.zeros((n, C), np.float32) if values is None else values
        return self.m.process(self.st, h, pay.view(np.uint8), np.full(n, C * 4, np.int32), now, self.st.round)


def test_match_takes_a_whole_batch_of_this_rounds_data_at_once():
    o = Owner()
    h = o.headers(list(range(20)))
    assert o.m.match(h) is True
    h["tensor"][3] = 4
    m = o.m.match(h)
    assert m.tolist() == [i != 3 for i in range(20)]


def test_data_lands_in_the_reduce_buffer_and_the_bound_sends_one_stop():
    o = Owner()
    vals = np.arange(20 * C, dtype=np.float32).reshape(20, C)
    res = o.feed(o.headers(list(range(20))), values=vals)
    inn = o.st.ins[(False, 1)]
    assert inn.count == 20 and inn.hi == 20 and res.stops == [] and res.control == []
    np.testing.assert_array_equal(o.st.rbuf[1, :20], vals)
    res = o.feed(o.headers(list(range(20, 100))))
    assert res.stops == [inn] and inn.stop_sent
    res = o.feed(o.headers([5, 6]))  # duplicates: counted, no second STOP
    assert res.stops == [] and o.counters["duplicate"] == 2


def test_allgather_data_fills_the_result():
    o = Owner()
    vals = np.ones((10, C), np.float32)
    o.feed(o.headers(list(range(10)), ag=True), values=vals)
    assert o.st.have[100:110].all() and not o.st.have[110:].any()
    np.testing.assert_array_equal(o.st.y[100:110], vals)
    assert o.st.ins[(True, 1)].count == 10


def test_strays_are_counted_the_next_round_stashed_and_control_handed_back():
    o = Owner()
    h = np.concatenate([o.headers([0], job=2), o.headers([0, 1], rnd=8), o.headers([0], rnd=6),
                        o.headers([0], kind=wire.Kind.PROBE), o.headers([0], src=0)]).astype(wire.HEADER_DTYPE)
    res = o.feed(h)
    assert o.counters["foreign"] == 2  # another job, and this rank's own
    assert o.counters["late"] == 1 and o.counters["stashed"] == 2
    assert [(f[wire.F_KIND], current) for f, _, current in res.control] == [(wire.Kind.PROBE, True)]
    nxt = _round(round=8, tensor=3)
    (hdr, pay, lens), = o.m.begin(nxt)
    assert hdr["round"].tolist() == [8, 8] and o.m.begin(nxt) == []


def test_a_misfit_is_dropped_counted_and_named():
    o = Owner()
    o.feed(o.headers(list(range(12)), nchunks=50))  # another tensor size: 50 chunks, not 100
    assert o.counters["bad_payload"] == 12 and o.st.ins[(False, 1)].count == 0
    assert "messages of 50 chunks where this rank's have 100" in o.st.misfit[1][1]
    o2 = Owner()
    o2.feed(o2.headers([0], tensor=4))
    assert o2.counters["bad_payload"] == 1 and "tensor 4" in o2.st.misfit[1][1]


def test_the_stash_is_bounded():
    o = Owner()
    o.m.stash.append((o.headers([0]).repeat(STASH_MAX - 1), None, None))
    o.m._stashed = STASH_MAX - 1  # (the count _keep keeps of what it stashed)
    o.feed(o.headers([0, 1, 2], rnd=8))
    assert o.counters["stashed"] == 1 and o.counters["stash_full"] == 2
