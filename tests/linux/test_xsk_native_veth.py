"""The AF_XDP transport's compiled loops against its Python path on a real socket (veth, copy mode).

The same seeded traffic is sent and received with ``native=True`` and with ``native=False``
(both ends alike) and must give the same packets, rows and counters: through pydblp's host
program (headers checked in the kernel), and through a foreign XDP program that redirects every
frame, so that malformed ones sent from a raw socket reach the receive path's own checks.
ECN on both paths: ECT(0) sent with ``set_ect``, and each received packet's ECN field
(Not-ECT, ECT(0), and CE from a socket of the stack's with ``IP_TOS`` 3) in ``Batch.ecn``.
"""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from pydblp import dscp, net, wire
from pydblp.transport import Batch, xsk_native
from pydblp.transport.xsk import XskTransport
from tests.helpers import ADDR, JOB, MAC, MAXLEN, Checker, foreign_xskmap, make_pair, needs_native, packets, xsk

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns]
NEEDS_CC = needs_native("xsk", xsk_native.load_lib() is not None)  # (the ECN tests run the Python path without it)

TOTAL = 3000


def rows(b: Batch) -> list:
    """Each received packet as (header bytes, length, peer, payload bytes)."""
    h = wire.encode_batch(b.headers[: b.n])
    return [(h[i].tobytes(), int(b.lengths[i]), int(b.peer[i]), b.payload[i, : b.lengths[i]].tobytes())
            for i in range(b.n)]


def exchange(ta, tb, peers, total=TOTAL, step=150, copy=True, expect=None) -> tuple[list, dict]:
    """Send ``total`` packets of :func:`tests.helpers.packets` from ``ta`` to ``tb``, alternating
    ``peers`` (both of ``tb``'s families); what ``tb`` received, sorted by chunk, and its counters."""
    got, into = [], Batch.empty(1024, 1400)
    for start in range(0, total, step):
        n = min(step, total - start)
        b = packets(start, n, 0, 1, peer=0)
        b.peer[:n] = np.resize(np.asarray(peers, np.int32), n)
        assert ta.send(b, timeout=5) == n
        want = len(got) + n
        for _ in range(100):
            got += rows(tb.recv(into, timeout=0.05, copy=copy))
            if len(got) >= want:
                break
    for _ in range(3):
        got += rows(tb.recv(into, timeout=0.05, copy=copy))
    s = tb.stats()
    return sorted(got, key=lambda r: r[0][20:24]), {k: s[k] for k in ("rx_packets", "rx_bytes", "rx_invalid",
                                                                         "rx_truncated", "rx_errors")}


@NEEDS_CC
@pytest.mark.parametrize("copy", [True, False])
def test_same_seeded_traffic_gives_the_same_batches_on_both_paths(pair, copy):
    out = []
    for native in (False, True):
        with xsk(pair, 0, native=native) as ta, xsk(pair, 1, native=native) as tb:
            assert (ta.native, tb.native) == (native, native)
            peers = [ta.add_peer(ADDR[4][1]), ta.add_peer(ADDR[6][1])]
            tb.add_peer(ADDR[4][0])
            tb.add_peer(ADDR[6][0])
            got, counts = exchange(ta, tb, peers, copy=copy)
            assert ta.flush()
            assert ta.stats()["tx_packets"] == TOTAL and counts["rx_packets"] == TOTAL, counts
            out.append((got, counts, {k: ta.stats()[k] for k in ("tx_packets", "tx_bytes")}))
    assert out[0] == out[1]
    assert {r[2] for r in out[0][0]} == {0, 1}  # both families' senders recognised


def raw_frames() -> list[bytes]:
    """Well-formed and malformed DBLP frames from side a (198.18.8.1) to side b, as bytes."""
    from pydblp.transport import frames
    from pydblp.transport.xsk_memory import MemoryXsk, seeded_batch

    src = MemoryXsk(False)
    src.mac = frames.mac_bytes(MAC[0])
    p4 = src.add_peer(ADDR[4][1], mac=MAC[1], src=ADDR[4][0])
    p6 = src.add_peer(ADDR[6][1], mac=MAC[1], src=ADDR[6][0])
    src.send(seeded_batch(40, [p4, p6], 8, width=900))
    good = src.wire
    h4 = frames.HDR4
    bad = []
    for f in good[:20]:
        off = h4 if f[12:14] == b"\x08\x00" else frames.HDR6
        bad += [f[: off + 20], f[:off] + b"\xdb\x1c" + f[off + 2:], f[:off + 3] + b"\x09" + f[off + 4:],
                f[:off + 28] + b"\x7f\xff" + f[off + 30:]]
    return good + bad


@NEEDS_CC
def test_malformed_frames_through_a_foreign_program_alike():
    """No host program: receive checks headers itself (``_validated`` False) on either path."""
    a, b = make_pair()
    try:
        sent = raw_frames()
        out = []
        for native in (False, True):
            with foreign_xskmap("vb", b) as xskmap, XskTransport("vb", netns=b, xskmap=xskmap, native=native) as tb:
                tb.add_peer(ADDR[4][0], mac=MAC[0])
                tb.add_peer(ADDR[6][0], mac=MAC[0])
                with net.in_netns(a):
                    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
                with s:
                    s.bind(("va", 0))
                    got, into = [], Batch.empty(256, 1400)
                    for i in range(0, len(sent), 20):
                        for f in sent[i: i + 20]:
                            s.send(f)
                        for _ in range(5):
                            got += rows(tb.recv(into, timeout=0.05))
                    for _ in range(5):
                        got += rows(tb.recv(into, timeout=0.05))
                st = tb.stats()
                assert st["rx_packets"] == 40 and st["rx_invalid"] >= 80 and st["rx_errors"] == 0, st
                out.append(sorted(got))  # (rx_invalid may also count a stray frame of the stack's)
        assert out[0] == out[1] and len(out[0]) == 40
    finally:
        net.netns_del(a)
        net.netns_del(b)


# ---- ECN -------------------------------------------------------------------------------------

def send_ce(ns: str, family: int, chunks) -> None:
    """DBLP DATA packets with ``chunks`` from side a's stack to side b, CE-marked: a plain UDP
    socket with ``IP_TOS`` / ``IPV6_TCLASS`` 3 (what a switch's mark leaves in the header)."""
    af = socket.AF_INET if family == 4 else socket.AF_INET6
    with net.in_netns(ns):
        s = socket.socket(af, socket.SOCK_DGRAM)
    with s:
        if family == 4:
            s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, dscp.CE)
        else:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS, dscp.CE)
        for c in chunks:
            s.sendto(wire.encode(wire.Header(job=JOB, src=0, dst=1, chunk=c, nchunks=1 << 24), bytes([c & 0xFF]) * 64),
                     (ADDR[family][1], wire.DEFAULT_PORT))


def take(tb, into: Batch, n: int, copy: bool, want: int = 1) -> list[Batch]:
    """Receive until ``n`` packets came (5 s at most); the batches, each copied (``copy=False``
    lends rows only until the next receive)."""
    out, got, deadline = [], 0, time.monotonic() + 5
    while got < n and time.monotonic() < deadline:
        r = tb.recv(into, timeout=0.2, copy=copy, want=want, linger=0.5 if want > 1 else 0.0)
        if r.n:
            assert r.ecn is not None and len(r.ecn) == r.n
            out.append(Batch(r.headers.copy(), r.payload.copy(), r.lengths.copy(), r.peer.copy(), r.n, None,
                             r.ecn.copy()))
            got += r.n
    assert got == n, f"{got} of {n} packets"
    return out


@pytest.mark.parametrize("copy", [True, False])
@pytest.mark.parametrize("native", [False, pytest.param(True, marks=NEEDS_CC)], ids=["python", "c"])
def test_ect_is_sent_and_each_packets_ecn_field_reported(pair, native, copy):
    """Not-ECT, then ECT(0) after ``set_ect(True)``, per family (one layout a batch: the run path,
    lent with ``copy=False``) and both in one batch (the general path); then ECT(0), Not-ECT and
    CE from the stack mixed in one batch, every sender still recognised."""
    a = pair["ns"][0]
    with xsk(pair, 0, native=native) as ta, xsk(pair, 1, native=native) as tb:
        assert (ta.native, tb.native) == (native, native) and not ta.ect
        p4, p6 = ta.add_peer(ADDR[4][1]), ta.add_peer(ADDR[6][1])
        a4, a6 = tb.add_peer(ADDR[4][0]), tb.add_peer(ADDR[6][0])
        into = Batch.empty(256, MAXLEN)
        start = 0
        for peers in ([p4], [p6], [p4, p6]):
            for on in (False, True):
                ta.set_ect(on)
                assert ta.ect is on
                b = packets(start, 40, 0, 1, JOB, peers[0])
                b.peer[:] = np.resize(np.asarray(peers, np.int32), 40)
                assert ta.send(b, timeout=5) == 40
                chk = Checker(start + 40, 0, 1)
                for r in take(tb, into, 40, copy):
                    chk.add(r)
                    assert (r.ecn == (dscp.ECT0 if on else 0)).all(), (peers, on, r.ecn)
                    fam6 = r.headers["chunk"] % 2 == 1 if len(peers) == 2 else np.full(r.n, peers[0] == p6)
                    assert (r.peer == np.where(fam6, a6, a4)).all()
                assert (chk.seen[start:] == 1).all()
                start += 40
        # ECT(0), Not-ECT and CE (from the stack), in one batch
        for on, chunks in ((True, range(start, start + 10)), (False, range(start + 10, start + 20))):
            ta.set_ect(on)
            b = packets(chunks[0], 10, 0, 1, JOB, p4)
            b.peer[1::2] = p6
            assert ta.send(b, timeout=5) == 10
        send_ce(a, 4, range(start + 20, start + 25))
        send_ce(a, 6, range(start + 25, start + 30))
        time.sleep(0.2)
        got = take(tb, into, 30, copy, want=30)
        c = np.concatenate([r.headers["chunk"] for r in got]).astype(np.int64) - start
        ecn = np.concatenate([r.ecn for r in got])
        peer = np.concatenate([r.peer for r in got])
        assert sorted(c.tolist()) == list(range(30))
        assert (ecn == np.select([c < 10, c < 20], [dscp.ECT0, 0], dscp.CE)).all(), (c, ecn)
        six = np.where(c < 20, c % 2 == 1, c >= 25)
        assert (peer == np.where(six, a6, a4)).all()
        assert any(len(set(r.ecn.tolist())) == 3 for r in got), [r.ecn for r in got]  # all three in one batch
        assert tb.stats()["rx_invalid"] == 0


def test_only_a_kernel_transmit_reports_its_queue(pair):
    """``tx="kernel"`` sends through a UDP socket, whose queue ``tx_queued`` measures (the collective
    grows its turns while it stays empty); AF_XDP transmit cannot tell, says 0, and says so."""
    from pydblp.transport.auth import AuthTransport

    with xsk(pair, 0, tx="kernel") as ta, xsk(pair, 1) as tb:
        assert ta.reports_tx_queue and not tb.reports_tx_queue
        assert tb.tx_queued() == 0
        key = bytes(range(wire.KEY_MIN))
        assert AuthTransport(ta, key, 1).reports_tx_queue and not AuthTransport(tb, key, 1).reports_tx_queue


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=NEEDS_CC)], ids=["python", "c"])
def test_ect_with_kernel_transmit_is_the_udp_sockets(pair, native):
    """``tx="kernel"``: ``set_ect`` is the UDP socket's, ``ect`` what it reports, and what arrives
    carries it (ECT(0) where that socket writes it, Not-ECT where it cannot)."""
    with xsk(pair, 0, tx="kernel", native=native) as ta, xsk(pair, 1, native=native) as tb:
        p4 = ta.add_peer(ADDR[4][1])
        tb.add_peer(ADDR[4][0])
        into = Batch.empty(256, MAXLEN)
        for start, on in ((0, True), (40, False)):
            ta.set_ect(on)
            assert ta.ect == ta._ktx.ect and (on or not ta.ect)
            assert ta.send(packets(start, 40, 0, 1, JOB, p4), timeout=5) == 40
            for r in take(tb, into, 40, True):
                assert (r.ecn == (dscp.ECT0 if ta.ect else 0)).all(), r.ecn
