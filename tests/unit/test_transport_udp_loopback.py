"""The UDP transport without root: loopback, both families, batches bit-exact."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from pydblp import wire
from pydblp.transport import Batch
from pydblp.transport.base import TransportError
from pydblp.transport.udp import UdpTransport
from tests.helpers import all_queued, require_native, skip_without


@pytest.fixture(autouse=True, params=["c", "python"])
def path(request, monkeypatch):
    """Every test here runs on both paths: the compiled loops (csrc/udp.c) and the pure-Python
    reference, chosen by what a transport opened with ``native=None`` finds."""
    from pydblp.transport import udp

    if request.param == "python":
        monkeypatch.setattr(udp, "native_lib", lambda: None)
    elif udp.native_lib() is None:
        require_native()
    return request.param


def make_batch(n, start=0, maxlen=1400, peer=0, seed=0):
    h = wire.empty_batch(n)
    h["kind"] = wire.Kind.DATA
    h["job"] = 9
    h["nchunks"] = 1 << 20
    h["chunk"] = np.arange(start, start + n)
    h["prio"] = np.arange(n) % 8
    rng = np.random.default_rng(seed + start)
    pay = rng.integers(0, 256, (n, maxlen), dtype=np.uint8)
    lens = 1 + (np.arange(start, start + n) * 37) % maxlen
    return Batch.fill(h, pay, lens, peer)


def check_same(sent: Batch, got: Batch):
    assert len(got) == len(sent)
    o = np.argsort(got.headers["chunk"])
    assert np.array_equal(got.headers[o], sent.headers)
    assert np.array_equal(got.lengths[o], sent.lengths)
    w = got.payload.shape[1]
    mask = np.arange(w) < sent.lengths[:, None]
    assert np.array_equal(np.where(mask, got.payload[o], 0), np.where(mask, sent.payload[:, :w], 0))


def _have_ipv6_loopback():
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("addr", ["127.0.0.1", "::1"])
def test_udp_loopback_bit_exact(addr):
    if addr == "::1" and not _have_ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    with UdpTransport(port=0) as a, UdpTransport(port=0) as b:
        pb = a.add_peer(addr, b.port)
        pa = b.add_peer(addr, a.port)
        into = Batch.empty(2048, 1400)
        total = 0
        for start in range(0, 20000, 1000):
            sent = make_batch(1000, start, peer=pb)
            assert a.send(sent) == 1000
            got_h, got_l, got_p = [], [], []
            n = 0
            for _ in range(200):
                r = b.recv(into, timeout=0.5)
                got_h.append(r.headers.copy()); got_l.append(r.lengths.copy()); got_p.append(r.payload.copy())
                assert (r.peer == pa).all()
                n += len(r)
                if n >= 1000:
                    break
            got = Batch(np.concatenate(got_h), np.concatenate(got_p), np.concatenate(got_l), np.zeros(n, np.int32), n)
            check_same(sent, got)
            total += n
        s = b.stats()
        assert s["rx_packets"] == total == 20000
        assert s["rx_invalid"] == s["rx_truncated"] == s["rx_dropped"] == 0
        assert a.stats()["tx_packets"] == 20000


def test_udp_invalid_and_truncated_counted():
    with UdpTransport(port=0) as b, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as raw:
        good = wire.encode(wire.Header(job=3, chunk=1, nchunks=2), b"x" * 100)
        raw.sendto(b"junk" * 10, ("127.0.0.1", b.port))
        raw.sendto(good, ("127.0.0.1", b.port))
        raw.sendto(wire.encode(wire.Header(job=3), b"y" * 300), ("127.0.0.1", b.port))
        into = Batch.empty(8, 200)
        got = []
        for _ in range(20):
            r = b.recv(into, timeout=0.2)
            got += [(int(h["chunk"]), int(l)) for h, l in zip(r.headers, r.lengths)]
            if len(got) >= 2:
                break
        assert got == [(1, 100), (0, 200)]
        s = b.stats()
        assert s["rx_invalid"] == 1 and s["rx_truncated"] == 1
        assert into.payload[1, :200].tobytes() == b"y" * 200


def test_udp_recv_timeout_and_empty():
    with UdpTransport(port=0) as t:
        r = t.recv(timeout=0)
        assert len(r) == 0
        r = t.recv(timeout=0.05)
        assert len(r) == 0
        assert t.send(Batch.empty(4)) == 0
    assert t.closed
    t.close()  # twice is fine


def test_udp_bad_peer_rejected():
    with UdpTransport(port=0) as t:
        b = make_batch(3, peer=5)
        with pytest.raises(ValueError):
            t.send(b)


@pytest.mark.parametrize("port", [70000, -1, "9000", 9000.0, True])
def test_udp_ports_checked(port):
    """A port that is no UDP port number is a ValueError naming it (70000 was an OverflowError from
    the socket layer, or "int too big to convert" from add_peer); numpy integers are ports too."""
    with pytest.raises(ValueError, match=r"^port .*0\.\.65535"):
        UdpTransport(port=port)
    with UdpTransport(port=0) as t:
        with pytest.raises(ValueError, match=r"^peer port .*1\.\.65535"):
            t.add_peer("127.0.0.1", port)
        with pytest.raises(ValueError, match="peer port 0"):
            t.add_peer("127.0.0.1", 0)
        assert t.add_peer("127.0.0.1", np.uint16(9000)) == 0 and t._addrs[0][1] == 9000


def test_udp_transport_works_without_root():
    """A loopback transfer in a forked child that dropped to an unprivileged user (when we are root)."""
    import os

    if os.geteuid() != 0:
        return  # the tests above already ran unprivileged
    pid = os.fork()
    if pid == 0:  # child: no exceptions may escape into pytest
        code = 1
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            assert os.geteuid() == 65534
            with UdpTransport(port=0) as a, UdpTransport(port=0) as b:
                sent = make_batch(500, peer=a.add_peer("127.0.0.1", b.port))
                assert a.send(sent) == 500
                n = 0
                for _ in range(50):
                    n += len(b.recv(Batch.empty(1024, 1400), timeout=0.1))
                    if n == 500:
                        break
                code = 0 if n == 500 else 2
        except BaseException:
            code = 3
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_recv_coalesces_a_trickle_into_one_batch():
    """want/linger: with fewer than ``want`` packets waiting, recv waits up to ``linger`` for more
    (packets sent meanwhile come back in the same batch, as soon as ``want`` are in, not at the
    linger's end); without them it returns what it has."""
    import threading
    import time

    with UdpTransport(port=0) as a, UdpTransport(port=0) as b:
        pb = a.add_peer("127.0.0.1", b.port)
        into = Batch.empty(256, 1400)
        assert a.send(make_batch(10, 0, peer=pb)) == 10
        later = threading.Timer(0.05, lambda: a.send(make_batch(10, 10, peer=pb)))
        later.start()
        t = time.monotonic()
        try:
            got = b.recv(into, timeout=1.0, want=20, linger=5.0)
        finally:
            later.join()
        assert sorted(got.headers["chunk"]) == list(range(20))
        # back once the 20 were in (~50 ms; a loaded machine may delay the timer's thread), not at
        # the 5 s linger's end
        assert time.monotonic() - t < 2.5
        assert a.send(make_batch(5, 20, peer=pb)) == 5
        all_queued(b)
        t = time.monotonic()
        got = b.recv(into, timeout=1.0, want=1, linger=5.0)  # enough already: no wait
        assert len(got) == 5 and time.monotonic() - t < 2.5


@pytest.mark.parametrize("gro", [False, True])
def test_a_control_packet_ends_a_linger(gro):
    """A control packet (any kind but DATA) wants an answer: a lingering recv returns with it
    at once instead of waiting out the linger for DATA that may never come (a burst eats it)."""
    import threading

    with UdpTransport(port=0) as a, UdpTransport(port=0, gro=gro) as b:
        pb = a.add_peer("127.0.0.1", b.port)
        into = Batch.empty(256, 1400)
        assert a.send(make_batch(3, 0, peer=pb)) == 3
        stop = make_batch(2, 3, peer=pb)  # two STOP copies, back to back (GRO merges them)
        stop.headers["kind"] = wire.Kind.STOP
        stop.lengths[:] = stop.headers["len"] = 2
        later = threading.Timer(0.05, lambda: a.send(stop))
        later.start()
        t = time.monotonic()
        try:
            got = b.recv(into, timeout=1.0, want=50, linger=2.0)  # the 3 DATA are queued already
        finally:
            later.join()
        assert time.monotonic() - t < 1.0  # not the 2 s linger
        kinds = got.headers["kind"].tolist()
        if kinds.count(int(wire.Kind.STOP)) == 1:  # two datagrams, read apart: the first ended the linger
            kinds += b.recv(into, timeout=1.0).headers["kind"].tolist()
        assert sorted(kinds) == [int(wire.Kind.DATA)] * 3 + [int(wire.Kind.STOP)] * 2
        assert a.send(make_batch(1, 5, peer=pb)) == 1 and a.send(stop) == 2  # in the first read: no linger
        all_queued(b)
        t = time.monotonic()
        got = b.recv(into, timeout=1.0, want=50, linger=2.0)
        assert len(got) == 3 and time.monotonic() - t < 1.0


def _recv_all(t, n, into, peer_of):
    """Receive ``n`` packets from ``t``; returns them as one batch, ``peer`` filled by ``peer_of``."""
    hs, ps, ls, pe = [], [], [], []
    k = 0
    for _ in range(100):
        r = t.recv(into, timeout=0.2)
        hs.append(r.headers.copy()); ps.append(r.payload.copy()); ls.append(r.lengths.copy())
        pe.append(np.full(len(r), peer_of))
        k += len(r)
        if k >= n:
            break
    return Batch(np.concatenate(hs), np.concatenate(ps), np.concatenate(ls), np.concatenate(pe), k)


@pytest.mark.parametrize("gso,few", [(None, 0), (None, 10**6), (False, 0)],
                         ids=["gso-numpy-cut", "gso-python-cut", "no-gso"])
def test_udp_gso_runs_bit_exact(gso, few, monkeypatch):
    """Runs of equal-length packets to one peer go as GSO messages (runs longer than a message may
    carry are cut, peers interleave in runs, odd lengths break runs); every datagram arrives whole,
    and the same stream without GSO arrives the same.  ``few``: the run count up to which runs are
    cut in Python rather than numpy."""
    from pydblp.transport import udp

    monkeypatch.setattr(udp, "SMALL", few)
    with UdpTransport(port=0, gso=gso) as a, UdpTransport(port=0) as b, UdpTransport(port=0) as c:
        if gso is None and not a.gso:
            skip_without("udp_gso")
        pb, pc = a.add_peer("127.0.0.1", b.port), a.add_peer("127.0.0.1", c.port)
        n = 1200
        sent = make_batch(n, 0, maxlen=1400)
        i = np.arange(n)
        # 150 to b, 70 to c, ... (runs of 150 > GSO_MAX_SEGS are cut); lengths constant within
        # blocks of 100 with every 37th packet odd-sized
        sent.peer[:n] = np.where((i % 220) < 150, pb, pc)
        sent.lengths[:n] = np.where(i % 37 == 5, 1 + i % 1399, 1400 - 100 * (i // 100) % 1300)
        sent.headers["len"] = sent.lengths[:n]
        assert a.send(sent) == n
        into = Batch.empty(2048, 1400)
        for t, pid in ((b, pb), (c, pc)):
            mine = sent.peer[:n] == pid
            exp = Batch(sent.headers[mine], sent.payload[mine], sent.lengths[mine], sent.peer[mine],
                        int(mine.sum()))
            check_same(exp, _recv_all(t, exp.n, into, pid))
            assert t.stats()["rx_invalid"] == t.stats()["rx_truncated"] == 0
        s = a.stats()
        assert s["tx_packets"] == n and s["tx_errors"] == 0
        if gso is None:
            assert a.gso and s["tx_gso_packets"] > n // 2 and s["tx_gso_off"] == 0
        else:
            assert not a.gso and s["tx_gso_packets"] == 0


def test_udp_gso_required_or_refused():
    """gso=True either gets UDP_SEGMENT or fails at open with the capability's name."""
    try:
        t = UdpTransport(port=0, gso=True)
    except Exception as e:  # noqa: BLE001 - only kernels before 4.18
        assert "UDP_SEGMENT" in str(e)
        return
    with t:
        assert t.gso


def _gro_pair(**kw):
    """Sender with GSO, receiver with UDP_GRO: over loopback a GSO message reaches it merged."""
    a = UdpTransport(port=0, gso=True)
    try:
        b = UdpTransport(port=0, gro=True, **kw)
    except Exception as e:  # noqa: BLE001 - only kernels before 5.0
        a.close()
        pytest.skip(f"UDP_GRO: {e}")
    return a, b


@pytest.mark.parametrize("few", [0, 10**6], ids=["numpy", "python"])
@pytest.mark.parametrize("width,addr", [(1400, "127.0.0.1"), (1400, "::1"), (900, "127.0.0.1"),
                                        (600, "127.0.0.1"), (200, "::1")])
def test_udp_gro_merged_datagrams_bit_exact(width, addr, few, monkeypatch):
    """Merged runs come back one datagram per row, bit-exact: datagrams of the row's size (1400),
    of other sizes (re-cut from the stream), longer than a row (cut to it, counted), and rows of
    a batch narrower than one merged message (spill) over several calls; sent with the
    vectorised GSO grouping and the per-run one for a few runs (``few``: its threshold)."""
    from pydblp.transport import udp

    if addr == "::1" and not _have_ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    monkeypatch.setattr(udp, "SMALL", few)
    a, b = _gro_pair()
    with a, b:
        pb = a.add_peer(addr, b.port)
        n = 1500
        sent = make_batch(n, 0, maxlen=1400, peer=pb)
        i = np.arange(n)
        sent.lengths[:n] = np.where(i < 700, 1400, np.where(i < 1200, 500, 1 + (i * 37) % 1400))
        sent.headers["len"] = sent.lengths[:n]
        assert a.send(sent) == n and a.stats()["tx_gso_packets"] > 1000
        cap = 40 if width == 600 else 2048  # 40 < 64 rows: through the spill batch
        into = Batch.empty(cap, width)
        got = _recv_all(b, n, into, pb)
        assert got.n == n
        cut = np.minimum(sent.lengths[:n], width)
        exp = Batch(sent.headers[:n], sent.payload[:n, :width], cut, sent.peer[:n], n)
        check_same(exp, got)
        s = b.stats()
        assert s["rx_packets"] == n and s["rx_invalid"] == 0 and s["rx_gro_packets"] > 1000
        assert s["rx_truncated"] == int((sent.lengths[:n] > width).sum())
        assert s["rx_bytes"] == int(cut.sum()) + n * wire.HEADER_LEN  # what was delivered, headers included


def test_udp_gro_source_registered_after_its_first_packets():
    """Packets from a source not registered yet come with peer -1; once ``add_peer`` registers
    it, the next ones carry its peer id (a GRO receive remembers sources it has looked up)."""
    a, b = _gro_pair()

    def peers(n):
        got = []
        for _ in range(50):
            r = b.recv(into, timeout=0.2)
            got += r.peer[: len(r)].tolist()
            if len(got) >= n:
                return got
        return got

    with a, b:
        pb = a.add_peer("127.0.0.1", b.port)
        into = Batch.empty(256, 1400)
        assert a.send(make_batch(5, 0, peer=pb)) == 5
        assert peers(5) == [-1] * 5  # unknown source
        pa = b.add_peer("127.0.0.1", a.port)
        assert a.send(make_batch(5, 5, peer=pb)) == 5
        assert peers(5) == [pa] * 5


def test_udp_bind_address():
    """``bind`` takes an IPv4 address on the dual-stack socket (as its mapped form) or an IPv6
    one; a name is refused in one line that says what to give."""
    with UdpTransport(port=0, bind="127.0.0.2") as t:
        assert t._sock.getsockname()[0] == "::ffff:127.0.0.2"
    if _have_ipv6_loopback():
        with UdpTransport(port=0, bind="::1") as t:
            assert t._sock.getsockname()[0] == "::1"
    with pytest.raises(TransportError, match="not an IP address"):
        UdpTransport(port=0, bind="localhost")


@pytest.mark.parametrize("sizes", [(1400, 1400), (1400, 700)], ids=["one-size", "two-sizes"])
def test_udp_gro_receive_of_two_sources_names_each(sizes):
    """One GRO receive holding merged runs from two senders (of one datagram size or two) gives
    every packet its own sender's peer id (found by source address) and length."""
    a1, b = _gro_pair()
    a2 = UdpTransport(port=0, gso=True, bind="127.0.0.2")
    with a1, a2, b:
        p1, p2 = b.add_peer("127.0.0.1", a1.port), b.add_peer("127.0.0.2", a2.port)
        for k, (a, size) in enumerate(zip((a1, a2), sizes)):
            sent = make_batch(100, 1000 * k, peer=a.add_peer("127.0.0.1", b.port))
            sent.lengths[:100] = size
            sent.headers["len"] = size
            assert a.send(sent) == 100
        all_queued(b)  # every datagram queued: one receive takes both runs
        got = b.recv(Batch.empty(2048, 1400), timeout=1.0)
        assert got.n == 200
        from_a2 = got.headers["chunk"] >= 1000
        assert int(from_a2.sum()) == 100
        assert np.array_equal(got.peer[:200], np.where(from_a2, p2, p1))
        assert np.array_equal(got.lengths[:200], np.where(from_a2, sizes[1], sizes[0]))
        assert b.stats()["rx_gro_packets"] > 100


@pytest.mark.parametrize("addr", ["127.0.0.1", "::1"])
def test_udp_few_packets_bit_exact(addr):
    """Batches of 1..4 packets (one sendmsg each: control packets) to two peers arrive bit-exact."""
    if addr == "::1" and not _have_ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    with UdpTransport(port=0) as a, UdpTransport(port=0) as b, UdpTransport(port=0) as c:
        pb, pc = a.add_peer(addr, b.port), a.add_peer(addr, c.port)
        into = Batch.empty(64, 1400)
        start = 0
        for n in (1, 2, 3, 4):
            sent = make_batch(n, start, peer=pb)
            sent.peer[:n] = np.where(np.arange(n) % 2, pc, pb)
            assert a.send(sent) == n
            for t, pid in ((b, pb), (c, pc)):
                mine = sent.peer[:n] == pid
                exp = Batch(sent.headers[mine], sent.payload[mine], sent.lengths[mine], sent.peer[mine],
                            int(mine.sum()))
                if exp.n:
                    check_same(exp, _recv_all(t, exp.n, into, pid))
            start += n
        assert a.stats()["tx_packets"] == 10 and a.stats()["tx_errors"] == 0


def test_udp_gso_refused_falls_back_to_datagrams():
    """A kernel that refuses a GSO message (here: checksums off, SO_NO_CHECK) turns GSO off for the
    socket, counts it, and the rest of the batch goes datagram by datagram: nothing is lost."""
    with UdpTransport(port=0) as a, UdpTransport(port=0) as b:
        if not a.gso:
            skip_without("udp_gso")
        a._sock.setsockopt(socket.SOL_SOCKET, 11, 1)  # SO_NO_CHECK: udp_send_skb refuses GSO (EINVAL)
        pb = a.add_peer("127.0.0.1", b.port)
        n = 300
        sent = make_batch(n, 0, peer=pb)
        sent.lengths[:n] = 1000
        sent.headers["len"] = 1000
        assert a.send(sent) == n
        s = a.stats()
        assert not a.gso and s["tx_gso_off"] == 1 and s["tx_gso_packets"] == 0
        assert s["tx_packets"] == n and s["tx_errors"] == 0
        check_same(sent, _recv_all(b, n, Batch.empty(512, 1400), pb))


@pytest.mark.parametrize("gro", [False, True])
def test_udp_recv_into_a_taller_view_of_the_same_rows(gro):
    """A receive batch that is a taller view of the rows the last one used gets all its rows
    pointed at (the iovecs are re-pointed when the row count grows, not only when the address moves)."""
    a, b = UdpTransport(port=0), UdpTransport(port=0, gro=gro)
    with a, b:
        pb = a.add_peer("127.0.0.1", b.port)
        big = Batch.empty(1024, 1400)
        small = Batch(big.headers[:64], big.payload[:64], big.lengths[:64], big.peer[:64], 0)
        assert a.send(make_batch(10, 0, peer=pb)) == 10
        assert len(_recv_all(b, 10, small, pb)) == 10
        sent = make_batch(800, 10, peer=pb)
        sent.lengths[:] = 1400
        sent.headers["len"] = 1400
        assert a.send(sent) == 800
        check_same(sent, _recv_all(b, 800, big, pb))


def test_xsk_port_checked_before_anything_opens():
    """The AF_XDP transport refuses a bad port first (no socket, no UMEM; no root needed to see it)."""
    from pydblp.transport.xsk import XskTransport

    for port in (0, 70000):
        with pytest.raises(ValueError, match=f"^port {port}: want an integer in 1..65535"):
            XskTransport("no-such-if0", port=port)


# ---- ECN: ECT(0) sent on request, each datagram's ECN field reported (Batch.ecn) ----------------

def _open_rx(gro, **kw):
    """A receiving transport with UDP_GRO on or off (skips where the kernel lacks UDP_GRO)."""
    try:
        return UdpTransport(port=0, gro=gro, **kw)
    except TransportError as e:  # only kernels before 5.0
        pytest.skip(f"UDP_GRO: {e}")


def _recv_ecn(t, n, into, copy=True):
    """Receive ``n`` packets from ``t``: (chunk, ECN field) of each, in arrival order (ECN None
    where the batch has no ``ecn``)."""
    out = []
    for _ in range(100):
        r = t.recv(into, timeout=0.2, copy=copy)
        ecn = [None] * len(r) if r.ecn is None else r.ecn[: len(r)].tolist()
        out += zip(r.headers["chunk"].tolist(), ecn)
        if len(out) >= n:
            break
    return out


@pytest.mark.parametrize("gro", [False, True], ids=["no-gro", "gro"])
@pytest.mark.parametrize("addr", ["127.0.0.1", "::1"])
def test_udp_ect_reaches_the_receiver_as_ecn_2(addr, gro):
    """``ect=True`` (the constructor), then ``set_ect(False)``, then ``set_ect(True)``: every
    datagram (GSO runs, single ones, and a few-packet send: one sendmsg each, as control packets
    go) arrives ECT(0), ECN field 2 in every row of the receiver's batches, or 0 with it off;
    IPv4 and IPv6, into a receiver with and without UDP_GRO."""
    if addr == "::1" and not _have_ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    with UdpTransport(port=0, ect=True) as a, _open_rx(gro) as b:
        assert a.ect is True
        pb = a.add_peer(addr, b.port)
        into = Batch.empty(1024, 1400)
        start = 0
        for ect in (True, False, True):
            if start:
                a.set_ect(ect)
            assert a.ect is ect
            sent = make_batch(300, start, peer=pb)
            sent.lengths[:200] = sent.headers["len"][:200] = 1000  # GSO runs (merged for a GRO receiver)
            few = make_batch(3, start + 300, peer=pb)
            few.headers["kind"][0] = wire.Kind.STOP
            assert a.send(sent) == 300 and a.send(few) == 3
            got = _recv_ecn(b, 303, into)
            assert sorted(c for c, _ in got) == list(range(start, start + 303))
            assert {e for _, e in got} == {2 if ect else 0}
            start += 303
        assert b.stats()["rx_invalid"] == 0


def test_udp_ect_to_a_broadcast_address():
    """A broadcast peer's datagrams go ECT(0) too (the same per-message TOS)."""
    with UdpTransport(port=0, ect=True) as a, UdpTransport(port=0) as b:
        p = a.add_peer("127.255.255.255", b.port)
        if not a._bcast[p]:
            pytest.skip("127.255.255.255 is no broadcast address here")
        assert a.send(make_batch(20, 0, peer=p)) == 20 and a.send(make_batch(2, 20, peer=p)) == 2
        got = _recv_ecn(b, 22, Batch.empty(64, 1400))
        assert sorted(c for c, _ in got) == list(range(22)) and {e for _, e in got} == {2}


@pytest.mark.parametrize("addr", ["127.0.0.1", "::1"])
def test_udp_dscp_and_ect_combine_in_the_tos_byte(addr):
    """With ``dscp="default"`` and ECT on, each datagram's TOS / traffic class is its priority's
    DSCP << 2 | ECT(0) (read by a plain socket), and a transport receiving the same reports ECN 2,
    not the DSCP bits."""
    from pydblp import dscp

    if addr == "::1" and not _have_ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    v6 = addr == "::1"
    with UdpTransport(port=0, dscp="default") as a, UdpTransport(port=0) as b, \
            socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_DGRAM) as rx:
        if v6:
            rx.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_RECVTCLASS, 1)
        else:
            rx.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
        rx.bind((addr, 0))
        rx.settimeout(2.0)
        a.set_ect(True)
        pr, pb = a.add_peer(addr, rx.getsockname()[1]), a.add_peer(addr, b.port)
        for p in (pr, pb):
            assert a.send(make_batch(40, 0, peer=p)) == 40 and a.send(make_batch(3, 40, peer=p)) == 3
        want = {i: int(dscp.DEFAULT[i % 8 if i < 40 else (i - 40) % 8]) << 2 | dscp.ECT0 for i in range(43)}
        seen = {}
        for _ in range(43):
            data, anc, _, _ = rx.recvmsg(2048, 64)
            (lvl, typ, val), = anc
            assert (lvl, typ) == ((socket.IPPROTO_IPV6, socket.IPV6_TCLASS) if v6
                                  else (socket.IPPROTO_IP, socket.IP_TOS))
            seen[int(wire.decode(data)[0].chunk)] = int.from_bytes(val, "little")
        assert seen == want
        got = _recv_ecn(b, 43, Batch.empty(64, 1400))
        assert sorted(c for c, _ in got) == list(range(43)) and {e for _, e in got} == {2}


def _send_marked(addr, port, tos_of, junk_every=0, runs=()):
    """Send DBLP packets from a plain socket, packet i with TOS / traffic class ``tos_of[i]`` (low
    bits: the ECN field; 3 is CE, what a marking switch writes: loopback has none), a junk
    datagram (invalid: dropped by the receive) before every ``junk_every``-th, then GSO runs
    ``(first chunk, count, tos)`` of 500-byte payloads (merged for a GRO receiver).  Returns
    {chunk: ECN field} of the valid packets and the junk count."""
    from pydblp.transport import udp

    v6 = ":" in addr
    want, junk = {}, 0
    with socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_DGRAM) as s:
        def tos(t):
            s.setsockopt(*((socket.IPPROTO_IPV6, socket.IPV6_TCLASS) if v6 else (socket.IPPROTO_IP, socket.IP_TOS)), t)

        for i, t in enumerate(tos_of):
            if junk_every and i % junk_every == 0:
                tos(3)
                s.sendto(b"junk" * 12, (addr, port))
                junk += 1
            tos(t)
            s.sendto(wire.encode(wire.Header(job=3, chunk=i, nchunks=1000, len=40), bytes(40)), (addr, port))
            want[i] = t & 3
        for first, count, t in runs:
            tos(t)
            s.setsockopt(udp.SOL_UDP, udp.UDP_SEGMENT, wire.HEADER_LEN + 500)
            s.sendto(b"".join(wire.encode(wire.Header(job=3, chunk=c, nchunks=1000, len=500), bytes(500))
                              for c in range(first, first + count)), (addr, port))
            s.setsockopt(udp.SOL_UDP, udp.UDP_SEGMENT, 0)
            want.update(dict.fromkeys(range(first, first + count), t & 3))
    return want, junk


@pytest.mark.parametrize("gro", [False, True], ids=["no-gro", "gro"])
@pytest.mark.parametrize("addr", ["127.0.0.1", "::1"])
@pytest.mark.parametrize("mode", ["copy", "lent", "narrow", "strided", "strided-ecn", "no-ecn"])
def test_udp_ce_marks_are_reported_row_by_row(addr, gro, mode):
    """A switch's CE mark (ECN 3) cannot be made on loopback: a plain socket sends valid DBLP
    packets with TOS 3 (CE), 2, 0x8a, 0, 1 and junk between them, then GSO runs marked CE and
    not.  Each delivered row's ``ecn`` is its own packet's ECN field, the invalid rows compacted
    away, through a copying receive, a lending one (``copy=False``), a batch narrower than a
    merged message (GRO: the spill batch), one whose rows the kernel cannot scatter into, one
    whose ``ecn`` is a strided view (the compiled read cannot write it directly), and a
    hand-made batch without ``ecn`` (left None)."""
    if addr == "::1" and not _have_ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    with _open_rx(gro) as b:
        pid = b.add_peer(addr, 9)
        tos = [(3, 2, 0x8a, 0, 1, 0x8b, 3)[i % 7] for i in range(60)]
        want, junk = _send_marked(addr, b.port, tos, junk_every=4, runs=[(100, 40, 3), (200, 30, 2), (300, 20, 3)])
        into = Batch.empty(16 if mode == "narrow" else 256, 600)
        if mode == "strided":
            into = Batch(into.headers, np.asfortranarray(into.payload), into.lengths, into.peer, 0, None, into.ecn)
        elif mode == "strided-ecn":
            into = Batch(into.headers, into.payload, into.lengths, into.peer, 0, None,
                         np.full(2 * into.cap, 7, np.uint8)[::2])
        elif mode == "no-ecn":
            into = Batch(into.headers, into.payload, into.lengths, into.peer, 0)
        got = _recv_ecn(b, len(want), into, copy=mode != "lent")
        assert len(got) == len(want) and sorted(c for c, _ in got) == sorted(want)
        if mode == "no-ecn":
            assert {e for _, e in got} == {None}
        else:
            assert got == [(c, want[c]) for c, _ in got]
            assert sum(e == 3 for _, e in got) == sum(e == 3 for e in want.values()) > 60
        s = b.stats()
        assert s["rx_invalid"] == junk == 15 and s["rx_packets"] == len(want)
        if gro:
            assert s["rx_gro_packets"] == 90


@pytest.mark.parametrize("gro", [False, True], ids=["no-gro", "gro"])
def test_udp_ecn_is_0_for_a_datagram_without_a_tos_cmsg(gro):
    """A message that comes without a TOS cmsg (here: IP_RECVTOS turned off behind the transport's
    back) reads ECN 0, not what an earlier message left in the control buffer (CE here)."""
    with _open_rx(gro) as b:
        into = Batch.empty(256, 600)
        want, _ = _send_marked("127.0.0.1", b.port, [3] * 5)
        assert _recv_ecn(b, 5, into) == sorted(want.items())
        b._sock.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 0)
        want, _ = _send_marked("127.0.0.1", b.port, [3] * 5)
        assert _recv_ecn(b, 5, into) == [(c, 0) for c in sorted(want)]
