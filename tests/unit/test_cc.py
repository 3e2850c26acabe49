"""Congestion control (pydblp.collective.cc): the rate controller by hand, and in the simulator.

The simulator's switch marks CE at a queue threshold (``Network.mark``) as the testbed
fabric does; every run is deterministic, so the comparisons below are exact for a seed.
"""

import numpy as np
import pytest

from pydblp.collective import Config
from pydblp.collective.cc import BUCKET_S, CEILING_OVER, WAIT_FRAMES, Echo, Ledger, RateControl
from pydblp.collective.config import MASK32
from pydblp.sim import Link, Sim

FRAME = 1408 + 80


class Sender:
    """A rate control and the ledger that reads its echoes, as the protocol joins them."""

    def __init__(self, **kw):
        self.rc, self.ledger = RateControl(4, Config(**kw), FRAME), Ledger(4)

    def echo(self, dst, received, marked, now, sent_rate, delay=None):
        # what an echo counts was sent first (these tests give the echoes): spend up to it
        behind = ((received - self.ledger.last[dst][0]) & MASK32) - (self.ledger.sent[dst] - self.ledger.got[dst])
        if 0 < behind < 1 << 31:
            self.spend(dst, behind)
        news = self.ledger.echo(dst, received, marked)
        if news is not None:
            self.rc.echo(dst, news, now, sent_rate, delay)

    def spend(self, dst, frames):
        self.ledger.spend(dst, frames)
        self.rc.spend(dst, frames)

    def __getattr__(self, name):
        return getattr(self.rc, name)


def ctl(**kw) -> Sender:
    return Sender(**kw)


def test_the_first_echo_counts_from_zero():
    rc = ctl()
    rc.echo(0, 1000, 900, 1.0, 800e6)  # both ends' counters start at 0: 90 % marked
    assert rc.paced(0) and rc.counters["echoes"] == 1
    assert rc.rate[0] == pytest.approx(800e6 * (1 - 0.9 / 2) + 50e6)


def test_marks_pace_the_destination_and_cut_by_half_the_marked_fraction():
    rc = ctl()  # cc_gain 1: alpha is the last echo's marked fraction
    rc.echo(1, 0, 0, 0.0, None)
    rc.echo(1, 1000, 500, 0.1, 800e6)
    assert rc.paced(1) and not rc.paced(2)
    assert rc.rate[1] == pytest.approx(800e6 * (1 - 0.5 / 2) + 50e6)  # cut, and the increase every echo
    rc.echo(1, 2000, 500, 0.2, 600e6)  # clean: half way back to the rate before the cut
    assert rc.rate[1] == pytest.approx(650e6 + (800e6 - 650e6) / 2)
    rc.echo(1, 3000, 510, 0.3, 600e6)  # 1 % marked: a small cut, outgrown by the increase
    assert rc.rate[1] == pytest.approx(725e6 * (1 - 0.01 / 2) + 50e6)


def test_loss_counts_only_beside_marks():
    rc = ctl()
    rc.spend(0, 1000)
    rc.echo(0, 800, 0, 0.1, 500e6)  # 20 % lost, nothing marked: random or burst loss, left to the bound
    assert not rc.paced(0) and rc.counters["cuts"] == 0
    rc.spend(0, 1000)
    rc.echo(0, 1600, 80, 0.2, 500e6)  # 10 % of what came marked and 20 % lost: the queue overflowing
    assert rc.paced(0) and rc.alpha[0] == pytest.approx(0.1 + 0.2)
    assert rc.rate[0] == pytest.approx(500e6 * (1 - 0.3 / 2) + 50e6)


def test_the_running_fraction_weighs_echoes_by_gain():
    rc = ctl(cc_gain=0.25)
    rc.echo(0, 0, 0, 0.0, None)
    rc.echo(0, 100, 100, 0.1, 400e6)
    assert rc.alpha[0] == pytest.approx(1.0)  # starts at 1 (Linux's DCTCP)
    rc.echo(0, 200, 100, 0.2, 400e6)
    assert rc.alpha[0] == pytest.approx(0.75)


def test_clean_echoes_unpace_it_past_the_fastest_send():
    rc = ctl(cc_increase=100e6)
    rc.echo(0, 0, 0, 0.0, None)
    rc.echo(0, 10, 10, 0.1, 400e6)
    n = 0
    while rc.paced(0):
        n += 1
        rc.echo(0, 10 + 10 * n, 10, 0.1 + n, 300e6)
        assert n < 50
    assert rc.counters["unpaced"] == 1 and rc.top == 400e6
    assert rc.rate[0] == 0 and n >= 2  # (it went past CEILING_OVER x 400e6)
    assert CEILING_OVER * 400e6 < 400e6 * (1 + n)


def test_counters_wrap_and_an_overtaken_stop_is_ignored():
    rc = ctl()
    rc.echo(2, MASK32 - 9, MASK32 - 9, 0.0, None)  # a receiver whose counts began long before: a baseline
    assert rc.counters["echoes"] == 0 and not rc.paced(2)
    rc.echo(2, 90, MASK32 - 9, 0.1, 500e6)  # 100 new packets across the wrap, none marked
    assert rc.counters["echoes"] == 1 and not rc.paced(2)
    rc.echo(2, 50, 40, 0.2, 500e6)  # older than the last: (50 - 90) mod 2**32 is huge
    assert rc.counters["echoes"] == 1 and not rc.paced(2) and rc.ledger.last[2] == (90, MASK32 - 9)
    rc.echo(2, 190, MASK32 - 9 + 50, 0.3, 500e6)  # then half of the next 100 marked
    assert rc.counters["echoes"] == 2 and rc.counters["marks"] == 50 and rc.paced(2)


def test_the_ledger_sums_to_the_echoed_totals():
    led = Ledger(2)
    led.spend(1, 100)
    assert led.echo(1, 0, 0) == Echo(0, 0, 0)  # nothing arrived yet: the span stays open
    led.spend(1, 100)
    assert led.echo(1, 150, 3) == Echo(150, 3, 200)  # 50 lost or in flight
    led.spend(1, 100)
    assert led.echo(1, 300, 3) == Echo(150, 0, 100)  # 50 in flight arrived: -50 lost here
    assert led.echo(1, 250, 3) is None  # an overtaken STOP
    assert led.sent[1] == led.last[1][0] == 300  # all 300 arrived in the end


def test_an_old_stop_replayed_past_half_the_counter_is_not_news():
    """Echo counts are cumulative modulo 2**32: once they have moved on by 2**31, a STOP recorded
    early reads as news of ~2**31 packets, more than this rank ever sent its receiver.  It is
    ignored, the latest counts stay, and the next genuine echo is news as before."""
    led = Ledger(2)
    led.spend(1, 1000)
    assert led.echo(1, 1000, 0) == Echo(1000, 0, 1000)
    old = (1000, 0)
    for _ in range(3):  # the run goes on: 3 x 10**9 packets sent and echoed
        led.spend(1, 10**9)
        assert led.echo(1, (led.last[1][0] + 10**9) & MASK32, 0) is not None
    last = led.last[1]
    assert led.echo(1, *old) is None  # read as news of (1000 - last) mod 2**32 > 2**31 packets
    assert led.last[1] == last
    led.spend(1, 500)
    assert led.echo(1, (last[0] + 500) & MASK32, 5) == Echo(500, 5, 500)


def test_counts_that_extra_packets_moved_on_are_resynced():
    """A receiver counts duplicates and replayed DATA too: once its counts run ahead of what this
    rank sent, every later echo would read as more than was sent.  After RESYNC such echoes in
    a row the latest is a baseline, and the echoes after it are news again (before, the
    destination's echoes were ignored for good: rate and loss frozen)."""
    from pydblp.collective.cc import RESYNC

    led = Ledger(2)
    led.spend(1, 1000)
    assert led.echo(1, 990, 0) == Echo(990, 0, 1000)
    extra, total = 30, 990
    for i in range(RESYNC):  # 30 replayed packets counted; the next echoes all count them
        led.spend(1, 1000)
        total += 1000
        assert led.echo(1, total + extra, 0) is None
    led.spend(1, 1000)
    assert led.echo(1, total + extra + 995, 4) == Echo(995, 4, 1000 * (RESYNC + 1))
    assert led.loss(1) is not None


def test_a_first_echo_past_what_was_sent_is_a_baseline():
    """A receiver whose counts began before this rank's (this rank restarted): its first echo
    sets the baseline; the next one is news."""
    led = Ledger(2)
    led.spend(1, 10)
    assert led.echo(1, 5000, 7) is None
    led.spend(1, 100)
    assert led.echo(1, 5090, 9) == Echo(90, 2, 110)


def test_the_ledger_keeps_a_bounded_history_of_tiny_echoes():
    """Echoes of one packet each (a small tensor's rounds) span LOSS_SPANS * LOSS_SPAN packets only
    after 16,384 of them: the history stops at LOSS_ECHOES, and the loss still reads off it."""
    from pydblp.collective.cc import LOSS_ECHOES

    led = Ledger(2)
    for i in range(1, 3 * LOSS_ECHOES):
        led.spend(1, 10)
        led.echo(1, 9 * i, 0)  # one packet in ten lost
    assert len(led.marks[1]) == LOSS_ECHOES
    assert led.loss(1) == pytest.approx(0.1)


def test_delay_counts_as_a_mark_only_when_asked():
    for delay, paced in ((0.0, False), (0.001, True)):
        rc = ctl(cc_delay=delay)
        rc.echo(0, 0, 0, 0.0, None, delay=0.0002)
        rc.echo(0, 100, 0, 0.1, 500e6, delay=0.0003)
        assert not rc.paced(0)
        rc.echo(0, 200, 0, 0.2, 500e6, delay=0.003)  # 2.8 ms above the least seen
        assert rc.paced(0) is paced


def test_the_token_bucket_lets_the_rate_through():
    rc = ctl()
    rc.echo(0, 0, 0, 0.0, None)
    rc.echo(0, 100, 100, 1.0, 100e6)  # paced at 50 Mbit/s
    rate = rc.rate[0]
    sent, t = 0, 1.0
    while t < 2.0:
        k = rc.allowed(0, t)
        rc.spend(0, k)
        sent += k
        t += max(rc.wait(0), 1e-4)
    assert sent * FRAME * 8 == pytest.approx(rate, rel=0.05)


def test_an_idle_destination_restarts_with_a_quantum_not_a_full_bucket():
    """Between messages the bucket would fill: every sender of an incast would open the next round
    with a bucket's burst at once.  Idle longer than the bucket's time, it restarts with a quantum;
    sending steadily, the bucket holds BUCKET_S of the rate, so a sender woken late keeps it."""
    rc = ctl()
    rc.echo(0, 0, 0, 0.0, None)
    rc.echo(0, 100, 100, 1.0, 2e9)  # paced: 1 Gbit/s after the cut
    rate = rc.rate[0]
    assert rc._bucket(0) == pytest.approx(rate / 8 * BUCKET_S)
    rc.spend(0, rc.allowed(0, 1.0))
    assert rc.allowed(0, 1.0 + BUCKET_S / 2) == int(rate / 8 * BUCKET_S / 2 // FRAME)  # steady: what accrued
    rc.spend(0, rc.allowed(0, 1.0 + BUCKET_S / 2))
    assert rc.allowed(0, 1.5) == WAIT_FRAMES  # idle half a second: one quantum


@pytest.mark.parametrize("kw, says", [
    ({"cc": "dctcp"}, "cc 'dctcp': use ecn, off"),
    ({"cc_gain": 0}, "cc_gain 0: use a weight in (0, 1]"),
    ({"cc_increase": -1}, "cc_increase -1: use a positive rate"),
    ({"cc_min_rate": 0}, "cc_min_rate 0: use a positive rate"),
    ({"cc_delay": -0.1}, "cc_delay -0.1: use seconds >= 0"),
])
def test_bad_knobs_are_refused_in_one_line(kw, says):
    with pytest.raises(ValueError) as e:
        Config(**kw).check()
    assert says in str(e.value) and "\n" not in str(e.value)


def incast(cc: str, steps: int = 8, loss: float = 0.0, mark: int = 32 << 10):
    """Three workers' parameter-server rounds into rank 0's port (256 KiB, marking at ``mark``)."""
    sim = Sim(4, Config(job=1, mode="ps", cc=cc), link=Link("1gbit", latency=20e-6, queue=256 << 10), seed=3)
    if mark:
        sim.network.mark(mark)
    if loss:
        sim.network.loss(loss)

    first = {}

    def program(node):
        x = np.full(1 << 18, node.rank + 1.0, np.float32)
        out = None
        for step in range(steps):
            out = node.collective.allreduce(x)
            if step == 0 and node.rank == 0:  # the first round goes before any echo: drops as without
                first["tail"] = sim.network.drops["tail"]
            node.compute(0.002)
        return out

    nodes = sim.run(program)
    sim.tail_after_first = sim.network.drops["tail"] - first["tail"]
    assert [n.error for n in nodes] == [None] * 4
    for n in nodes:  # static:0 rounds are exact whatever the rates
        np.testing.assert_array_equal(n.result, np.full(1 << 18, 2.5, np.float32))  # the mean
    return sim, nodes


def test_incast_with_marks_drops_far_less():
    off, _ = incast("off")
    on, nodes = incast("ecn")
    assert off.network.marks == 0 < on.network.marks
    # seed 3: 4305 against 11919 tail drops.  (The simulated port serves senders in the order they
    # hand packets in, so the first sender of a round is never marked and never paced: its
    # packets fill the queue the others' marks come from.  The testbed's port interleaves.)
    assert on.network.drops["tail"] * 2 <= off.network.drops["tail"]
    assert on.tail_after_first * 2 <= off.tail_after_first  # once echoes come
    assert any(n.collective.protocol.cc.paced(0) for n in nodes[1:])
    got = nodes[0].collective.protocol.counters["ce_received"]  # the server's port is the one marking
    assert got > 0 and sum(r.ce_received for r in nodes[0].records) == got
    assert max(r.paced for n in nodes[1:] for r in n.records) == 1  # (each worker paces its one destination)


def test_loss_without_marks_never_slows_a_sender():
    sim, nodes = incast("ecn", loss=0.05, mark=0)
    assert sim.network.drops["loss"] > 0 and sim.network.marks == 0
    for n in nodes:
        cc = n.collective.protocol.cc
        assert not cc.rate.any() and cc.counters["cuts"] == 0 and cc.counters["echoes"] > 0


def test_a_mark_threshold_above_the_queue_is_refused():
    sim = Sim(2, Config(job=1), link=Link("1gbit", queue=64 << 10))
    with pytest.raises(ValueError, match="above port 0's queue"):
        sim.network.mark(128 << 10, port=0)
