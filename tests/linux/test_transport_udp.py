"""UDP transport between two namespaces over a veth pair, host program passing a 'udp' job.

The same contract as the AF_XDP tests: 100k packets bit-exact per direction
(IPv4 and IPv6), XDP counters agree with what was sent, overload is counted
not fatal, open/close leaks nothing.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from pydblp.transport import Batch
from pydblp.transport.udp import UdpTransport
from tests.helpers import ADDR, JOB_UDP, MAXLEN, N, both_ways, packets, poll_until, xsk

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns]


def udp(p, side: int, **kw) -> UdpTransport:
    return UdpTransport(p["dev"][side], netns=p["ns"][side], **kw)


@pytest.mark.parametrize("family", [4, 6])
def test_udp_bit_exact_both_directions(pair, family):
    ha, hb = pair["host"]
    with udp(pair, 0) as ua, udp(pair, 1) as ub:
        c0 = (ha.counters(), hb.counters())
        both_ways(ua, ub, family, N, job=JOB_UDP)
        c1 = (ha.counters(), hb.counters())
        for t in (ua, ub):
            s = t.stats()
            assert s["tx_packets"] == N and s["rx_packets"] == N, s
            assert s["rx_invalid"] == s["rx_truncated"] == s["rx_dropped"] == s["tx_errors"] == 0, s
        for before, after in zip(c0, c1):
            assert after["dblp_pass"] - before["dblp_pass"] == N
            assert after["redirect"] == before["redirect"]
            assert sum(after["drop"].values()) == sum(before["drop"].values())


def test_udp_receiver_falls_behind_counts_drops(pair):
    """A receiver that reads nothing while 10000 datagrams come: its 256 KiB buffer overflows,
    and every datagram is either read afterwards or counted dropped by the socket."""
    hb = pair["host"][1]
    with udp(pair, 0) as ua, udp(pair, 1, rcvbuf=256 << 10) as ub:
        pb = ua.add_peer(ADDR[4][1])
        sent = 0
        for s in range(0, 10_000, 100):
            # steps of 100, each taken by the receiving end's XDP before the next: a longer burst
            # can overflow the veth's 256-slot ring when its softirq is starved, a drop before the
            # socket that it does not count; past XDP a datagram is queued or counted dropped
            before = hb.counters()["dblp_pass"]
            sent += ua.send(packets(s, 100, 0, 1, job=JOB_UDP, peer=pb))
            assert poll_until(lambda: hb.counters()["dblp_pass"] - before >= 100, timeout=5.0), s
        assert sent == 10_000
        into = Batch.empty(4096, MAXLEN)
        got, deadline = 0, time.monotonic() + 5.0
        while got + ub.stats()["rx_dropped"] < sent and time.monotonic() < deadline:
            r = ub.recv(into, timeout=0.05)
            if len(r):
                assert (r.headers["job"] == JOB_UDP).all()
                assert np.array_equal(r.lengths, 1 + (r.headers["chunk"].astype(np.int64) * 37) % MAXLEN)
            got += len(r)
        got += len(ub.recv(into, timeout=0.05))  # nothing more: each datagram is read or dropped, once
        s = ub.stats()
        assert 0 < got < sent
        assert s["rx_dropped"] == sent - got, s


def test_udp_open_close_20x_leaks_nothing(pair):
    udp(pair, 1).close()
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        t = udp(pair, 1)
        t.close()
        assert t.closed
    assert len(os.listdir("/proc/self/fd")) == fds


@pytest.mark.parametrize("kind", ["udp", "xsk-kernel-tx"])
def test_tx_queued_counts_what_waits_in_the_qdisc(pair, kind):
    """``tx_queued`` is the socket's send queue: behind an 8 Mbit/s TBF, 300 datagrams (~220 KB,
    over 0.2 s of link) are mostly still queued right after ``send``, and the queue is empty once
    they are out, every one received.  The collective keeps it short in rounds that repair."""
    from pydblp import net

    ns, dev = pair["ns"][0], pair["dev"][0]
    tbf = {"rate": 1_000_000, "burst": 6000, "latency": 2_000_000}  # bytes/s, bytes, us
    with net.ipr(ns) as ip:
        ip.tc("add", "tbf", ip.link_lookup(ifname=dev)[0], 0x10000, **tbf)
    try:
        with (udp(pair, 0) if kind == "udp" else xsk(pair, 0, tx="kernel")) as ta, udp(pair, 1) as ub:
            pb = ta.add_peer(ADDR[4][1], ub.port)
            assert ta.tx_queued() == 0
            assert ta.send(packets(0, 300, 0, 1, job=JOB_UDP, peer=pb)) == 300
            assert ta.tx_queued() > 150_000  # (counted as socket memory: a little over the bytes)
            into, got, deadline = Batch.empty(4096, MAXLEN), 0, time.monotonic() + 5.0
            while (got < 300 or ta.tx_queued()) and time.monotonic() < deadline:
                got += len(ub.recv(into, timeout=0.05))
            assert got == 300 and ta.tx_queued() == 0
    finally:
        with net.ipr(ns) as ip:
            ip.tc("del", "tbf", ip.link_lookup(ifname=dev)[0], 0x10000, **tbf)


@pytest.mark.parametrize("gro", [False, True], ids=["recvmmsg", "gro-read"])
@pytest.mark.parametrize("family", [4, 6])
def test_udp_ecn_across_the_host_program(pair, family, gro):
    """ECN through the host program and a veth pair: with ``set_ect`` every datagram arrives ECT(0)
    (``ecn`` 2 in every row; 0 with it off), and packets a plain socket sends marked CE (what a
    switch would write; a veth marks nothing) arrive as 3, each on its own row; read by recvmmsg
    and by the GRO read (UDP_GRO on the socket: the veth's GRO is off, so one datagram a message)."""
    import socket

    from pydblp import net

    with udp(pair, 0) as ua, udp(pair, 1, gro=gro) as ub:
        assert ub.gro is gro
        pb = ua.add_peer(ADDR[family][1], ub.port)
        into = Batch.empty(4096, MAXLEN)
        for start, ect in ((0, True), (2000, False)):
            ua.set_ect(ect)
            assert ua.send(packets(start, 2000, 0, 1, job=JOB_UDP, peer=pb)) == 2000
            got = []
            for _ in range(50):
                r = ub.recv(into, timeout=0.2)
                got += zip(r.headers["chunk"].tolist(), r.ecn.tolist())
                if len(got) >= 2000:
                    break
            assert sorted(c for c, _ in got) == list(range(start, start + 2000))
            assert {e for _, e in got} == {2 if ect else 0}
        marked = packets(5000, 40, 0, 1, job=JOB_UDP)
        fam = socket.AF_INET if family == 4 else socket.AF_INET6
        with net.in_netns(pair["ns"][0]), socket.socket(fam, socket.SOCK_DGRAM) as s:
            for i in range(40):
                if family == 4:
                    s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, 3 if i % 3 else 2)
                else:
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS, 3 if i % 3 else 2)
                s.sendto(marked.headers[i].tobytes() + marked.payload[i, : marked.lengths[i]].tobytes(),
                         (ADDR[family][1], ub.port))
        got = []
        for _ in range(50):
            r = ub.recv(into, timeout=0.2)
            got += zip(r.headers["chunk"].tolist(), r.ecn.tolist())
            if len(got) >= 40:
                break
        assert sorted(got) == [(5000 + i, 3 if i % 3 else 2) for i in range(40)]
        assert ub.stats()["rx_invalid"] == 0
