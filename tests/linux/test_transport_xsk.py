"""AF_XDP transport between two namespaces over a veth pair, host program in native mode.

Bit-exact delivery of 100k packets per direction (IPv4 and IPv6), crossing
with the UDP transport (the kernel checks our IPv6 UDP checksums), socket
statistics against XDP counters, a receiver that falls behind (pressure and
bounded shedding), and 20 open/close cycles that leak nothing.
"""

from __future__ import annotations

import os
import socket
import time

import numpy as np
import pytest

from pydblp import net, wire
from pydblp.transport import Batch, xsk_native
from pydblp.transport.udp import UdpTransport
from pydblp.transport.xsk import XskTransport
from tests.helpers import (ADDR, JOB, JOB_UDP, MAC, MAXLEN, N, Checker, both_ways, foreign_xskmap, make_pair,
                           needs_native, packets, poll_until, transfer, xsk)

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns]


@pytest.mark.vm
@pytest.mark.parametrize("family", [4, 6])
def test_xsk_bit_exact_both_directions(pair, family):
    ha, hb = pair["host"]
    with xsk(pair, 0) as ta, xsk(pair, 1) as tb:
        assert not ta.zerocopy  # veth: copy mode
        c0 = (ha.counters(), hb.counters())
        both_ways(ta, tb, family, N)
        assert ta.flush() and tb.flush()
        c1 = (ha.counters(), hb.counters())
        for t in (ta, tb):
            s = t.stats()
            assert s["tx_packets"] == N and s["rx_packets"] == N, s
            assert s["rx_invalid"] == s["rx_truncated"] == s["tx_busy_drops"] == 0, s
            assert s["rx_dropped"] == s["rx_ring_full"] == s["rx_invalid_descs"] == s["tx_invalid_descs"] == 0, s
            assert s["tx_outstanding"] == 0
        for before, after in zip(c0, c1):
            assert after["redirect"] - before["redirect"] == N
            assert after["nosock"] == before["nosock"]
            assert sum(after["drop"].values()) == sum(before["drop"].values())
            assert sum(after["shed"]) == sum(before["shed"])


def test_recv_without_copy_lends_the_umem_frames(pair):
    """copy=False: payload rows are the UMEM frames themselves (no copy into ``into``), intact,
    and each call hands the previous call's frames back to the kernel: 20x the ring's frames
    pass through a 512-frame UMEM."""
    with xsk(pair, 0) as ta, xsk(pair, 1, rx_frames=512) as tb:
        pb = ta.add_peer(ADDR[4][1])
        into = Batch.empty(4096, MAXLEN)
        transfer(ta, tb, pb, 20 * 512, src=0, dst=1, step=128, into=into, copy=False)
        assert ta.send(packets(0, 100, 0, 1, JOB, pb)) == 100
        deadline, r = time.monotonic() + 5, into.view(0, 0)
        while len(r) == 0 and time.monotonic() < deadline:
            r = tb.recv(into, timeout=0.2, copy=False)
        assert len(r) and not np.shares_memory(r.payload, into.payload)
        assert np.shares_memory(r.headers, into.headers)
        s = tb.stats()
        assert s["rx_packets"] == 20 * 512 + len(r) and s["rx_dropped"] == s["rx_ring_full"] == 0, s


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=needs_native(
    "xsk", xsk_native.load_lib() is not None))], ids=["python", "c"])
def test_xsk_mixed_families_in_one_batch(pair, native):
    """IPv4 and IPv6 frames interleaved in every batch: receive's general path (not the one-layout
    one) on the Python path; the compiled path takes every frame the same way."""
    total = 20_000
    with xsk(pair, 0) as ta, xsk(pair, 1, native=native) as tb:
        p4, p6 = ta.add_peer(ADDR[4][1]), ta.add_peer(ADDR[6][1])
        a4, a6 = tb.add_peer(ADDR[4][0]), tb.add_peer(ADDR[6][0])
        chk = Checker(total, 0, 1)
        into = Batch.empty(4096, MAXLEN)
        got = 0
        short = []  # what the one-layout path made of each batch (None: handed to the general path)
        if not native:
            run = tb._recv_run
            tb._recv_run = lambda *a: short.append(run(*a)) or short[-1]
        for start in range(0, total, 200):
            b = packets(start, 200, 0, 1, JOB, p4)
            b.peer[1::2] = p6
            assert ta.send(b, timeout=5) == 200
            deadline = time.monotonic() + 5
            while got < start + 200 and time.monotonic() < deadline:
                r = tb.recv(into, timeout=0.2)
                fam6 = r.headers["chunk"] % 2 == 1
                assert (r.peer == np.where(fam6, a6, a4)).all()  # sender told apart by family
                got += chk.add(r)
            assert got == start + 200
        assert (chk.seen == 1).all()
        assert tb.stats()["rx_invalid"] == 0
        assert native or short.count(None) >= len(short) // 2 > 0


@pytest.mark.parametrize("family", [4, 6])
def test_xsk_and_udp_interoperate(pair, family):
    """AF_XDP frames into a kernel UDP socket (which verifies the IPv6 UDP checksum) and back."""
    a, b = pair["ns"]
    total = 20_000
    with xsk(pair, 0) as ta, UdpTransport("vb", netns=b) as ub:
        transfer(ta, ub, ta.add_peer(ADDR[family][1]), total, 0, 1, job=JOB_UDP)
        # the UDP socket saw no checksum errors: every one arrived (transfer asserts it)
        transfer(ub, ta, ub.add_peer(ADDR[family][0]), total, 1, 0, job=JOB)
        assert ub.stats()["rx_dropped"] == 0


def _send_stepwise(tx, batch: Batch, host, step: int = 100) -> int:
    """Send ``batch`` in steps, each taken by the receiving end's XDP program ``host`` (redirected
    or shed) before the next: a longer burst can overflow the veth's 256-slot ring when its
    softirq is starved, a drop before the program that nobody counts.  Returns what was sent."""
    def seen() -> int:
        c = host.counters()
        return c["redirect"] + sum(c["shed"])

    sent = 0
    for start in range(0, len(batch), step):
        before = seen()
        n = tx.send(batch.view(start, start + step), timeout=2)
        assert tx.flush()
        sent += n
        assert poll_until(lambda: seen() - before >= n, timeout=5.0), f"step at {start} not taken in"
    return sent


def test_receiver_falls_behind_pressure_and_bounded_shedding(pair):
    ha, hb = pair["host"]
    with xsk(pair, 0) as ta, xsk(pair, 1, rx_frames=512) as tb:
        pb = ta.add_peer(ADDR[4][1])
        # 1. nobody receives: the 512-slot ring fills, the kernel drops the rest and counts it
        sent = _send_stepwise(ta, packets(0, 5000, 0, 1, peer=pb), hb)
        s = tb.stats()
        assert s["rx_ring_used"] == 512
        assert s["rx_ring_full"] + s["rx_dropped"] >= sent - 512, s
        # 2. a receive that finds the ring full publishes pressure 1000 to the program
        r = tb.recv(Batch.empty(1, MAXLEN))
        assert len(r) == 1 and hb.pressure == 1000
        # 3. under pressure, prio 7 packets are shed, never beyond floor(nchunks * tol / 255)
        nchunks, tol = 1000, 51  # bound: 200
        shed0 = hb.counters()["shed"][7]
        bt = packets(0, 600, 0, 1, peer=pb)
        bt.headers["prio"], bt.headers["nchunks"], bt.headers["tol"] = 7, nchunks, tol
        bt.headers["round"], bt.headers["tensor"] = 999_999, 3
        bt.headers["chunk"] = np.arange(600)
        assert _send_stepwise(ta, bt, hb) == 600
        shed = hb.counters()["shed"][7] - shed0
        assert shed == nchunks * tol // 255 == hb.shed_count(JOB, 999_999, 3, 0)
        # 4. draining: everything that arrived is intact, pressure falls back to 0
        into = Batch.empty(4096, MAXLEN)
        got = 1
        for _ in range(10):
            r = tb.recv(into, timeout=0.05)
            got += len(r)
            if len(r):
                assert (r.headers["job"] == JOB).all()
        tb.recv(into)
        assert hb.pressure == 0
        assert got <= 512 + 1
        assert tb.stats()["rx_invalid"] == 0
    assert hb.pressure == 0


def _fds():
    return len(os.listdir("/proc/self/fd"))


def _maps():
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def test_open_close_20x_leaks_nothing(pair):
    a, b = pair["ns"]
    hb = pair["host"][1]
    xsk(pair, 1).close()  # warm-up: imports, numpy caches
    fds, maps = _fds(), _maps()
    t0 = time.monotonic()
    retries = 0
    for i in range(20):  # no pause: a quick rebind meets EBUSY and retries
        paced = i % 2 == 1  # every other one closes with frames still waiting for tokens
        t = xsk(pair, 1, rx_frames=1024, tx_frames=1024, rate=10e6 if paced else 0)
        assert t.fileno() >= 0
        retries += t.bind_retries
        if paced:
            assert t.send(packets(0, 100, 1, 0, JOB, t.add_peer(ADDR[4][0]))) == 100
            assert t.stats()["tx_waiting"] > 0
        t.close()
        assert t.closed and t._leaked == 0
    assert time.monotonic() - t0 < 30
    print(f"20 open/close cycles: {retries} EBUSY retries")
    assert _fds() == fds
    assert _maps() == maps
    # the XSKMAP entry is gone: a valid xsk-job packet finds no socket and is passed up
    c0 = hb.counters()
    with net.in_netns(a), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.sendto(wire.encode(wire.Header(job=JOB, src=0, dst=1)), (ADDR[4][1], wire.DEFAULT_PORT))
    deadline = time.monotonic() + 2
    while hb.counters()["nosock"] == c0["nosock"] and time.monotonic() < deadline:
        time.sleep(0.01)
    c1 = hb.counters()
    assert c1["nosock"] == c0["nosock"] + 1 and c1["redirect"] == c0["redirect"]


@pytest.mark.vm
@pytest.mark.parametrize("family", [4, 6])
def test_kernel_transmit_to_af_xdp_receive(pair, family):
    """tx="kernel": the AF_XDP socket receives, a UDP socket on the same device transmits;
    both directions bit-exact, counters from both sockets; the UDP socket closes with the transport
    and a rate for the tx ring is refused."""
    with pytest.raises(ValueError, match="qdisc paces"):
        xsk(pair, 0, tx="kernel", rate=1e9)
    fds = _fds()
    with xsk(pair, 0, tx="kernel") as ta, xsk(pair, 1, tx="kernel") as tb:
        assert ta.tx_frames == 64  # the idle tx ring keeps a token share of the UMEM
        both_ways(ta, tb, family, 20_000)
        for t in (ta, tb):
            s = t.stats()
            assert s["tx_packets"] == s["rx_packets"] == 20_000, s
            assert s["tx_kicks"] == 0 and s["tx_outstanding"] == 0, s  # the AF_XDP tx ring stayed idle
            assert s["rx_dropped"] == s["rx_invalid"] == 0, s
    assert _fds() == fds


def test_errors_are_clear(pair):
    a, b = pair["ns"]
    with pytest.raises(OSError, match="no interface 'nope'"):
        XskTransport("nope", netns=a)
    with xsk(pair, 1) as t:
        with pytest.raises(OSError, match="already bound|another AF_XDP socket"):
            xsk(pair, 1, bind_timeout=0.2)
        with pytest.raises(ValueError, match="add_peer"):
            t.send(packets(0, 3, 1, 0, peer=4))
    with pytest.raises(ValueError, match="rate_burst at least 4 frames"):
        xsk(pair, 1, rate=1e9, rate_burst=1500)
    with pytest.raises(OSError, match="closed"):
        t.recv()


def _drain(rx, chk: Checker, total: int, timeout: float = 10.0) -> None:
    into = Batch.empty(4096, MAXLEN)
    deadline = time.monotonic() + timeout
    got = 0
    while got < total and time.monotonic() < deadline:
        got += chk.add(rx.recv(into, timeout=0.05))
    assert (chk.seen == 1).all(), f"missing {int((chk.seen == 0).sum())}, duplicated {int((chk.seen > 1).sum())}"


@pytest.mark.parametrize("release", ["flush", "recv"])
def test_rate_paces_transmit_like_a_line(pair, release):
    """AF_XDP bypasses qdiscs; ``rate`` holds frames in the tx ring and lets them go at the line rate.

    send() returns once the frames are queued; the kernel gets them no faster
    than ``rate_burst + rate * t`` bytes by time t, released by flush() or by
    the recv() calls a receive loop makes anyway; every frame arrives intact.
    """
    rate, n = 100e6, 2000  # 100 Mbit/s: ~2.9 MB of frames take ~0.23 s
    with xsk(pair, 0, rate=rate) as ta, xsk(pair, 1) as tb:
        pb = ta.add_peer(ADDR[4][1])
        b = packets(0, n, 0, 1, JOB, pb)
        frames = b.lengths[:n].astype(np.int64) + wire.HEADER_LEN + 14 + 20 + 8
        frame_bytes = int(frames.sum())
        t0 = time.monotonic()
        assert ta.send(b, timeout=5) == n
        waiting, backlog = ta.stats()["tx_waiting"], ta.tx_backlog()
        t1 = time.monotonic()
        # by t1 the bucket let out at most rate_burst + rate * (t1 - t0) bytes, frames in order:
        # the rest is queued behind it, not sent yet, and the backlog is their time at the rate
        out = ta.rate_burst + rate / 8 * (t1 - t0)
        assert waiting >= n - int(np.searchsorted(np.cumsum(frames), out, side="right"))
        assert max(0.0, frame_bytes - out) / (rate / 8) <= backlog <= frame_bytes / (rate / 8)
        if release == "flush":
            assert ta.flush(timeout=10)
        else:  # a receive loop with nothing to receive drains it as well
            deadline = time.monotonic() + 10
            while ta.stats()["tx_outstanding"] and time.monotonic() < deadline:
                assert len(ta.recv(timeout=0.05)) == 0
                ta._reclaim()
        dt = time.monotonic() - t0
        s = ta.stats()
        assert s["tx_outstanding"] == s["tx_waiting"] == 0 and s["tx_held"] > 0, s
        assert ta.tx_backlog() == 0.0
        assert dt >= (frame_bytes - ta.rate_burst) / (rate / 8), f"{frame_bytes} bytes in {dt:.3f} s"
        _drain(tb, Checker(n, 0, 1), n)


def test_recv_coalesces_a_trickle_into_one_batch(pair):
    """want/linger: fewer than ``want`` frames in the ring -> recv waits up to ``linger``; frames
    arriving meanwhile come back in the same batch, still bit-exact."""
    import threading

    with xsk(pair, 0) as ta, xsk(pair, 1) as tb:
        pb = ta.add_peer(ADDR[4][1])
        assert ta.send(packets(0, 10, 0, 1, JOB, pb)) == 10
        later = threading.Timer(0.05, lambda: ta.send(packets(10, 10, 0, 1, JOB, pb)))
        later.start()
        try:
            got = tb.recv(Batch.empty(256, MAXLEN), timeout=1.0, want=20, linger=0.5)
        finally:
            later.join()
        chk = Checker(20, 0, 1)
        assert chk.add(got) == 20 and (chk.seen == 1).all()


def test_a_control_packet_ends_a_linger(pair):
    """As over UDP: a control packet (any kind but DATA) wants an answer, so a lingering recv
    returns once one came, not at the linger's end.  The host program counts the control packets
    it redirects (HostMaps.control_seen, read through mmap); DATA does not move the count."""
    import threading

    with xsk(pair, 0) as ta, xsk(pair, 1) as tb:
        pb = ta.add_peer(ADDR[4][1])
        count = tb._ctrl_count()
        assert ta.send(packets(0, 3, 0, 1, JOB, pb)) == 3
        stop = packets(3, 1, 0, 1, JOB, pb)
        stop.headers["kind"] = wire.Kind.STOP
        later = threading.Timer(0.05, lambda: ta.send(stop))
        later.start()
        t = time.monotonic()
        try:
            got = tb.recv(Batch.empty(256, MAXLEN), timeout=1.0, want=50, linger=2.0)  # 3 DATA in the ring
        finally:
            later.join()
        assert time.monotonic() - t < 1.0, "waited out the linger"
        assert tb._ctrl_count() == count + 1
        kinds = got.headers["kind"].tolist()
        if int(wire.Kind.STOP) not in kinds:  # (the STOP came after the ring was read)
            kinds += tb.recv(Batch.empty(256, MAXLEN), timeout=1.0).headers["kind"].tolist()
        assert sorted(kinds) == [int(wire.Kind.DATA)] * 3 + [int(wire.Kind.STOP)]
        # a control packet already in the ring before a recv: no linger at all
        assert ta.send(stop) == 1 and ta.send(packets(4, 1, 0, 1, JOB, pb)) == 1
        assert poll_until(lambda: tb.stats()["rx_ring_used"] >= 2, timeout=5.0)  # both in the ring
        t = time.monotonic()
        got = tb.recv(Batch.empty(256, MAXLEN), timeout=1.0, want=50, linger=2.0)
        assert len(got) == 2 and time.monotonic() - t < 1.0


def test_add_peer_resolves_the_mac_on_demand(pair):
    """No static ARP entry for a third address: add_peer makes the kernel ARP for it."""
    a, b = pair["ns"]
    extra = "198.18.8.3"
    with net.ipr(b) as ip:
        ip.addr("add", index=ip.link_lookup(ifname="vb")[0], address=extra, prefixlen=24)
    try:
        with xsk(pair, 0) as ta, xsk(pair, 1) as tb:
            pid = ta.add_peer(extra)
            assert ta._tmpl.table[pid, :6].tobytes() == bytes.fromhex(MAC[1].replace(":", ""))
            transfer(ta, tb, pid, 2000, 0, 1)
    finally:
        with net.ipr(b) as ip:
            ip.addr("del", index=ip.link_lookup(ifname="vb")[0], address=extra, prefixlen=24)


def test_foreign_xskmap_receive_validates_headers():
    """Behind a program that is not pydblp's (no kernel checks), receive validates and counts."""
    a, b = make_pair()
    try:
        with foreign_xskmap("vb", b) as xskmap, XskTransport("va", netns=a) as ta, \
                XskTransport("vb", netns=b, xskmap=xskmap) as tb:
            pb = ta.add_peer(ADDR[4][1])
            good = packets(0, 300, 0, 1, JOB, pb)
            bad = packets(300, 300, 0, 1, JOB, pb)
            bad.headers["magic"][0::3] = 0x1234       # wrong magic
            bad.headers["version"][1::3] = 9          # unknown version
            bad.headers["nchunks"][2::3] = 0          # no chunks
            chk = Checker(600, 0, 1)
            got = 0
            into = Batch.empty(4096, MAXLEN)
            for batch in (good, bad):
                assert ta.send(batch, timeout=5) == 300
                deadline = time.monotonic() + 3
                while time.monotonic() < deadline and tb.stats()["rx_packets"] + tb.stats()["rx_invalid"] < got + 300:
                    got += chk.add(tb.recv(into, timeout=0.2))
            got += chk.add(tb.recv(into, timeout=0.2))
            assert got == 300 and (chk.seen[:300] == 1).all() and not chk.seen[300:].any()
            assert tb.stats()["rx_invalid"] >= 300  # plus any IPv6 housekeeping frames the program redirected
    finally:
        net.netns_del(a)
        net.netns_del(b)
