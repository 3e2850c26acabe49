"""Jumbo frames (MTU 9000) over AF_XDP: multi-buffer XDP and ``XDP_USE_SG``.

A 9000-byte frame spans three 4 KiB UMEM frames on receive (the kernel's
copy mode leaves 256 bytes of headroom in each) and two or three on
transmit.  Bit-exact delivery both ways, IPv4 and IPv6, lengths from 1 to
8,900 bytes mixed in every batch (single- and multi-descriptor frames
together); interop with kernel UDP sockets (which verify our IPv6 checksums
over the whole frame, and send frames the kernel itself splits); what a
socket without multi-buffer does with a jumbo frame.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from pydblp import bpf, wire
from pydblp.transport import Batch
from pydblp.transport.udp import UdpTransport
from pydblp.transport.xsk import XskTransport
from tests.helpers import ADDR, JOB, JOB_UDP, Checker, both_ways, host_pair, packets, skip_without, transfer

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns]

MTU = 9000
JUMBO = 8900  # DBLP payload bytes: 14 + 40 (IPv6) + 8 + 32 + 8900 = 8994 <= 9014
N = 6000


@pytest.fixture(scope="module")
def jpair(root, bpf_xdp):
    if not bpf.xdp_frags_supported():
        skip_without("xdp_frags")  # no native XDP above MTU 3506 without it
    with host_pair(mtu=MTU) as p:
        assert all(h.frags for h in p["host"])
        yield p


def full(n: int, src: int, dst: int, peer: int) -> Batch:
    """Packets of :func:`packets` content, every one JUMBO bytes long."""
    b = packets(0, n, src, dst, JOB, peer, maxlen=JUMBO)
    b.lengths[:] = b.headers["len"] = JUMBO
    return b


def xsk(p, side: int, **kw) -> XskTransport:
    kw.setdefault("frame_size", 4096)
    t = XskTransport(p["dev"][side], netns=p["ns"][side], host=p["host"][side], **kw)
    if kw.get("sg") is not False and not t.sg:
        t.close()
        skip_without("xsk_sg")
    return t


@pytest.mark.vm
@pytest.mark.parametrize("family", [4, 6])
def test_jumbo_bit_exact_both_directions(jpair, family):
    ha, hb = jpair["host"]
    with xsk(jpair, 0) as ta, xsk(jpair, 1) as tb:
        c0 = (ha.counters(), hb.counters())
        pa, pb, into = both_ways(ta, tb, family, N, maxlen=JUMBO)
        # copy=False cannot lend a frame spread over several UMEM frames: the payload is copied, intact
        transfer(ta, tb, pb, N // 4, 0, 1, into=into, maxlen=JUMBO, copy=False)
        assert ta.flush() and tb.flush()
        for t, tx, rx in ((ta, N + N // 4, N), (tb, N, N + N // 4)):
            s = t.stats()
            assert (s["tx_packets"], s["rx_packets"]) == (tx, rx), s
            assert s["rx_invalid"] == s["rx_truncated"] == s["tx_busy_drops"] == 0, s
            assert s["rx_dropped"] == s["rx_ring_full"] == s["rx_invalid_descs"] == s["tx_invalid_descs"] == 0, s
            assert s["tx_outstanding"] == 0  # every descriptor of every frame completed
        c1 = (ha.counters(), hb.counters())
        for before, after, rx in zip(c0, c1, (N, N + N // 4)):
            assert after["redirect"] - before["redirect"] == rx  # the host program passed each frame whole
            assert sum(after["drop"].values()) == sum(before["drop"].values())


def test_jumbo_payload_wider_than_the_receive_buffer_is_truncated_and_counted(jpair):
    with xsk(jpair, 0) as ta, xsk(jpair, 1) as tb:
        pb = ta.add_peer(ADDR[4][1])
        b = full(50, 0, 1, pb)
        assert ta.send(b, timeout=5) == 50
        into = Batch.empty(256, 5000)
        got, deadline = [], time.monotonic() + 5
        while sum(map(len, got)) < 50 and time.monotonic() < deadline:
            r = tb.recv(into, timeout=0.2)
            got.append(r.lengths.copy())
            assert np.array_equal(r.payload[:, :5000], b.payload[r.headers["chunk"], :5000])
        assert np.concatenate(got).tolist() == [5000] * 50
        assert tb.stats()["rx_truncated"] == 50


@pytest.mark.parametrize("family", [4, 6])
def test_jumbo_xsk_and_udp_interoperate(jpair, family):
    """Jumbo AF_XDP frames into a kernel UDP socket (it checks the IPv6 checksum over all 9000 bytes)
    and kernel-sent jumbo datagrams into AF_XDP (frames the veth hands XDP in fragments)."""
    a, b = jpair["ns"]
    with xsk(jpair, 0) as ta, UdpTransport("vb", netns=b) as ub:
        transfer(ta, ub, ta.add_peer(ADDR[family][1]), 3000, 0, 1, job=JOB_UDP, maxlen=JUMBO)
        transfer(ub, ta, ub.add_peer(ADDR[family][0]), 3000, 1, 0, job=JOB, maxlen=JUMBO)
        assert ub.stats()["rx_dropped"] == 0 and ta.stats()["rx_dropped"] == 0


def test_without_multibuffer_jumbo_is_refused_on_send_and_counted_on_receive(jpair):
    with xsk(jpair, 0) as ta, xsk(jpair, 1, sg=False) as tb:
        assert not tb.sg
        with pytest.raises(ValueError, match="multi-buffer"):
            tb.send(full(1, 1, 0, tb.add_peer(ADDR[4][0])))
        b = packets(0, 100, 0, 1, JOB, ta.add_peer(ADDR[4][1]), maxlen=JUMBO)
        assert ta.send(b, timeout=5) == 100
        small = int((b.lengths + wire.HEADER_LEN + 42 <= 4096 - 256).sum())  # fit one receive frame
        # until every frame is received or counted dropped (the veth's softirq may lag behind)
        got, deadline = 0, time.monotonic() + 5
        while got + tb.stats()["rx_dropped"] < 100 and time.monotonic() < deadline:
            got += len(tb.recv(timeout=0.2))
        got += len(tb.recv(timeout=0.05))  # nothing more
        s = tb.stats()
        assert got == small and s["rx_dropped"] == 100 - small, s  # dropped by the kernel and counted


def test_jumbo_mixed_families_and_short_receives(jpair):
    """IPv4 and IPv6 jumbo frames interleaved (two header offsets in one batch: the general multi-buffer
    path), received 7 frames at a time (batches end inside the ring; frames are never split)."""
    total = 3000
    with xsk(jpair, 0) as ta, xsk(jpair, 1) as tb:
        p4, p6 = ta.add_peer(ADDR[4][1]), ta.add_peer(ADDR[6][1])
        a4, a6 = tb.add_peer(ADDR[4][0]), tb.add_peer(ADDR[6][0])
        chk = Checker(total, 0, 1, maxlen=JUMBO)
        into = Batch.empty(64, JUMBO)
        got = 0
        for start in range(0, total, 100):
            b = packets(start, 100, 0, 1, JOB, p4, maxlen=JUMBO)
            b.peer[1::2] = p6
            assert ta.send(b, timeout=5) == 100
            deadline = time.monotonic() + 5
            while got < start + 100 and time.monotonic() < deadline:
                r = tb.recv(into, timeout=0.2, max=7)
                assert len(r) <= 7
                assert (r.peer == np.where(r.headers["chunk"] % 2 == 1, a6, a4)).all()
                got += chk.add(r)
            assert got == start + 100
        assert (chk.seen == 1).all()
        s = tb.stats()
        assert s["rx_invalid"] == s["rx_dropped"] == 0 and s["rx_packets"] == total, s


@pytest.mark.parametrize("frame", [2048, 4096])
def test_frame_size_for_gives_frames_that_hold_the_datagram_whole(jpair, frame):
    """``frame_size_for`` is tight: the largest DBLP payload it puts in 2 KiB (4 KiB) frames
    arrives over IPv6 (the longer header) in one receive frame of a socket without multi-buffer,
    one byte more is dropped by the kernel.  (It sizes pydblp.torch's frames for a chunk size.)"""
    from pydblp.transport.xsk_ring import FRAME_HEADERS, XDP_PACKET_HEADROOM, frame_size_for

    most = frame - XDP_PACKET_HEADROOM - FRAME_HEADERS  # 1698 / 3746 bytes
    assert frame_size_for(most) == frame and frame_size_for(1408) == 2048
    assert frame_size_for(most + 1) == 4096  # (past a 4 KiB frame too: it spans several, XDP_USE_SG)
    into = Batch.empty(64, most + 1)
    with xsk(jpair, 0) as ta, xsk(jpair, 1, sg=False, frame_size=frame) as tb:
        peer = ta.add_peer(ADDR[6][1])
        for size, arrives in ((most, True), (most + 1, False)):
            b = packets(0, 20, 0, 1, JOB, peer, maxlen=size)
            b.lengths[:] = b.headers["len"] = size
            d0 = tb.stats()["rx_dropped"]
            assert ta.send(b, timeout=5) == 20
            got, deadline = 0, time.monotonic() + (3 if arrives else 0.5)
            while got < 20 and time.monotonic() < deadline:
                r = tb.recv(into, timeout=0.1)
                assert (r.lengths[: len(r)] == size).all()
                got += len(r)
            assert (got, tb.stats()["rx_dropped"] - d0) == ((20, 0) if arrives else (0, 20)), (size, tb.stats())
