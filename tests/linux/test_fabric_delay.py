"""A delaying queue on a live testbed: ``Testbed.queue(delay=True)`` holds frames in a TBF on
the switch port, behind the fabric's virtual queue, which still decides marks and drops.

The queue drains at 500 bytes/s (4 kbit/s): its TBF passes 2000 bytes at once (``DELAY_BURST_S``
of the rate: two 1000-byte frames) and then one frame each 2 s, and the virtual queue's backlog
only grows over the milliseconds the datagrams take to send.  So which datagrams arrive CE-marked
and which are dropped follows from byte positions, not timing (as in test_fabric_ecn.py: with
mark 8500 and buffer 20500, datagrams 0..7 unmarked, 8..19 CE, 20.. dropped by the virtual
queue), and which ones wait is bounded by the rate: at most one more every 2 s.
"""

from __future__ import annotations

import contextlib
import struct

import pytest

from pydblp.testbed import Testbed, TestbedError
from pydblp.testbed.core import DELAY_BURST_S
from tests.helpers import unique_name
from tests.linux.test_fabric_ecn import (BUFFER, CE, DROPPED, ECT0, FRAME, MARK, MARKED, PAYLOAD, UNMARKED,
                                         received, receiver, send, tos_of, udp)

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns]

RATE = 4000                                  # bits/s: 500 bytes/s
BURST = int(RATE / 8 * DELAY_BURST_S)        # 2000 bytes: two frames pass at once
ADMITTED = (*UNMARKED, *MARKED)
NUDGE = 1000


@pytest.fixture(scope="module")
def tb(fabric_prog):
    with Testbed(workers=2, name=unique_name("dly"), prog=fabric_prog) as t:
        yield t


def test_the_queue_holds_what_its_burst_does_not_cover(clean):
    tb = clean
    tb.queue(RATE, buffer=BUFFER, thresholds=[0] * 8, port="w1", mark=MARK, delay=True)
    assert tb.stats()["w1"]["config"]["queue"]["delay"] is True
    assert tb.delay_stats("w0") == {}  # only the port asked for
    rx = receiver(tb)
    try:
        send(tb, rx.getsockname(), lambda i: ECT0)
        first = tos_of(rx)
        held = tb.delay_stats("w1")
        # the virtual queue decided marks and drops as it does without delay ...
        s = tb.stats()["w1"]
        assert s["mark"]["packets"] == len(MARKED) and s["tail"]["packets"] == len(DROPPED)
        # ... and the port's queue holds what its burst did not cover: the first ones arrived,
        # in order, and the rest wait (one frame leaves each 2 s)
        assert set(first) == set(range(len(first))) and BURST // FRAME <= len(first) < len(ADMITTED), first
        assert held["backlog"] > 0 and held["drops"] == 0, held
        # a faster queue lets the held frames go: every admitted datagram arrives once, as marked
        # (the TBF looks at its rate again when a frame comes: one more, sequence number NUDGE)
        tb.queue("1gbit", buffer=BUFFER, thresholds=[0] * 8, port="w1", mark=MARK, delay=True)
        with contextlib.closing(udp(tb, "w0", ECT0)) as tx:
            tx.sendto(struct.pack("!I", NUDGE) + bytes(PAYLOAD - 4), rx.getsockname())
        later = tos_of(rx)
    finally:
        rx.close()
    assert later.pop(NUDGE) == ECT0 and not set(first) & set(later)
    assert {**first, **later} == {i: ECT0 if i in UNMARKED else CE for i in ADMITTED}
    assert tb.delay_stats("w1")["backlog"] == 0


def test_too_slow_for_a_frame_is_refused(clean):
    tb = clean
    with pytest.raises(TestbedError, match="cannot pass a 1514-byte frame: use a rate of 3028 bit/s or more"):
        tb.queue(800, buffer=BUFFER, port="w1", delay=True)
    assert "queue" not in tb.stats()["w1"]["config"] and tb.delay_stats("w1") == {}


def test_clear_and_a_plain_queue_remove_the_qdisc(clean):
    tb = clean
    tb.queue(RATE, buffer=BUFFER, thresholds=[0] * 8, port="w1", delay=True)
    assert tb.delay_stats("w1") != {}
    tb.queue(RATE, buffer=BUFFER, thresholds=[0] * 8, port="w1")  # the same queue without delay
    assert tb.delay_stats("w1") == {}
    assert tb.stats()["w1"]["config"]["queue"]["delay"] is False
    tb.queue(RATE, buffer=BUFFER, port=None, delay=True)
    assert all(tb.delay_stats(p) for p in ("w0", "w1"))
    tb.clear()
    assert tb.delay_stats("w0") == {} and tb.delay_stats("w1") == {}
    # no delay: frames are forwarded by XDP at once, whatever the (slow) rate
    tb.queue(RATE, buffer=BUFFER, thresholds=[0] * 8, port="w1", mark=MARK)
    assert sorted(received(tb)) == list(ADMITTED)


def test_cli_delay(clean):
    """``dblp fault queue --delay``: the line printed says so and the port gets its TBF."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tb = clean
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    r = subprocess.run([sys.executable, "-m", "pydblp.cli", "fault", "queue", "--testbed", tb.name, "--port", "w1",
                        "--rate", "100mbit", "--buffer", "64k", "--mark", "16k", "--delay"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "delaying queue rate 100mbit" in r.stdout, r.stderr
    assert tb.stats()["w1"]["config"]["queue"]["delay"] is True and tb.delay_stats("w1")["backlog"] == 0
