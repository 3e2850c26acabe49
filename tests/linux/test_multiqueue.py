"""AF_XDP on multi-queue NICs: a veth pair with 4 queues each side, and a 4-rank testbed of them.

A veth hands a packet to the peer's receive queue numbered as the sender's
transmit queue, which the stack picks by flow hash: UDP flows from distinct
source ports spread over the 4 queues as RSS spreads them on a NIC.  One
socket on queue 0 hears only the flows hashed to it (the host program passes
the others to a stack where nothing listens, counted ``nosock``); one socket
per queue hears them all.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import socket
import time

import numpy as np
import pytest

from pydblp import cli, host, net, wire
from pydblp.collective import Collective, Config
from pydblp.dataplane import open_dataplane
from pydblp.testbed import Testbed
from pydblp.transport import Batch, TransportError
from pydblp.transport import xsk_queues
from pydblp.transport.xsk import XskTransport
from pydblp.transport.xsk_queues import XskQueues
from tests.helpers import run_threads, skip_without, unique_name

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns]

QUEUES = 4
ADDR = ("198.18.10.1", "198.18.10.2")
JOB = 23
FLOWS, PER_FLOW = 32, 20


@pytest.fixture
def pair(bpf_xdp, netns):
    """Namespaces joined by veth ma <-> mb, 4 rx and 4 tx queues on each end, addressed."""
    a, b = netns("qa"), netns("qb")
    qs = {"num_tx_queues": QUEUES, "num_rx_queues": QUEUES}
    with net.ipr(a) as ip:
        ip.link("add", ifname="ma", kind="veth", **qs, peer={"ifname": "mb", "net_ns_fd": b, **qs})
    for ns, dev, i in ((a, "ma", 0), (b, "mb", 1)):
        with net.ipr(ns) as ip:
            idx = ip.link_lookup(ifname=dev)[0]
            ip.addr("add", index=idx, address=ADDR[i], prefixlen=24)
            ip.link("set", index=idx, state="up")
    yield (a, "ma"), (b, "mb")
    for ns, dev in ((a, "ma"), (b, "mb")):
        assert host.attached_program(dev, ns) is None, f"XDP left on {dev}"


def _flows(ns: str) -> None:
    """32 UDP flows (one socket, one source port each) x 20 DATA packets to rank 1 of JOB; the
    payload's bytes are its chunk id's low byte, 100 + chunk % 50 of them; flow f's IP header
    carries ECN field f % 4 (Not-ECT, ECT(1), ECT(0), CE)."""
    with net.in_netns(ns):
        socks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(FLOWS)]
    try:
        for f, s in enumerate(socks):
            s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, f % 4)
            for c in range(f * PER_FLOW, (f + 1) * PER_FLOW):
                pay = bytes([c & 0xFF]) * (100 + c % 50)
                s.sendto(wire.encode(wire.Header(job=JOB, src=0, dst=1, chunk=c, nchunks=FLOWS * PER_FLOW), pay),
                         (ADDR[1], wire.DEFAULT_PORT))
    finally:
        for s in socks:
            s.close()


def _take(t, copy: bool, cap: int = 64, quiet: float = 0.5) -> np.ndarray:
    """Receive until ``quiet`` s pass without a packet; the chunk ids, each payload and ECN field
    checked (the rows of several queues' sockets merged into one batch, or one socket's lent)."""
    chunks, into, last = [], Batch.empty(cap), time.monotonic()
    while time.monotonic() - last < quiet:
        b = t.recv(into, timeout=0.05, copy=copy)
        if b.n:
            last = time.monotonic()
            c = b.headers["chunk"].astype(np.int64)
            assert np.array_equal(b.lengths, 100 + c % 50)
            assert b.ecn is not None and np.array_equal(b.ecn, (c // PER_FLOW) % 4), (c, b.ecn)
            for i in range(b.n):  # (a few hundred rows: a loop is fine in a test)
                assert (b.payload[i, : b.lengths[i]] == (c[i] & 0xFF)).all(), f"payload of chunk {c[i]}"
            chunks.append(c)
    return np.concatenate(chunks) if chunks else np.zeros(0, np.int64)


@pytest.mark.parametrize("copy", [True, False])
def test_every_flow_arrives_on_every_queue_where_one_queue_misses_some(pair, copy):
    (a, _), (b, dev) = pair
    assert xsk_queues.rx_queue_count(dev, b) == QUEUES
    with open_dataplane("xsk", dev, netns=b, job=JOB, rank=1, world=2) as dp:
        assert isinstance(dp.transport, XskQueues) and dp.queues == tuple(range(QUEUES))
        assert dp.endpoint.queues == tuple(range(QUEUES)) and dp.endpoint.queue == 0
        _flows(a)
        got = _take(dp.transport, copy)
        per = {q: s["rx_packets"] for q, s in dp.transport.stats()["queues"].items()}
    assert np.array_equal(np.sort(got), np.arange(FLOWS * PER_FLOW)), f"{len(got)} of {FLOWS * PER_FLOW}"
    assert sum(1 for v in per.values() if v) >= 2, per  # the flows did spread over the queues
    with open_dataplane("xsk", dev, netns=b, queue=0, job=JOB, rank=1, world=2) as dp:
        assert dp.queues == (0,)
        _flows(a)
        one = _take(dp.transport, copy)
        nosock = dp.host.counters()["nosock"]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli.main(["status"]) == 0
        head, *rows = [ln.split() for ln in out.getvalue().splitlines()]
        row = next(r for r in rows if r[:2] == [b, dev])
        assert int(row[head.index("NOSOCK")]) == nosock  # what `dblp status` shows of the queues missed
    # the flows hashed to queues 1-3 went to a stack with no listener
    assert len(one) < FLOWS * PER_FLOW and nosock == FLOWS * PER_FLOW - len(one), (len(one), nosock)
    print(f"\n32 flows x 20 DATA packets, 4-queue veth: {len(got)} received on every queue {per}, "
          f"{len(one)} on queue 0 alone")


@pytest.mark.parametrize("kind", ["xsk", "xsk-ktx"])
def test_set_ect_is_the_transmitting_sockets(pair, kind):
    """``set_ect`` on the queue set reaches the socket that sends (the first; with ``xsk-ktx`` its
    UDP socket): what leaves the device carries ECT(0) where ``ect`` says so, Not-ECT after off."""
    (a, dev_a), (b, dev) = pair
    with net.ipr(a) as ip:
        mac = ip.get_links(ip.link_lookup(ifname=dev_a)[0])[0].get_attr("IFLA_ADDRESS")
    with net.in_netns(a):
        cap = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0800))
    with cap, open_dataplane(kind, dev, netns=b, job=JOB, rank=1, world=2) as dp:
        cap.bind((dev_a, 0))
        cap.settimeout(0.2)
        t = dp.transport
        assert isinstance(t, XskQueues) and len(t.sockets) == QUEUES and not t.ect
        peer = t.add_peer(ADDR[0], mac=mac)
        for on in (True, False):
            t.set_ect(on)
            first = t.sockets[0]
            assert t.ect == first.ect == (on and (first._ktx is None or first._ktx.ect))
            assert not any(s.ect for s in t.sockets[1:])
            h = wire.empty_batch(8)
            h["kind"], h["job"], h["src"], h["dst"], h["nchunks"] = wire.Kind.DATA, JOB, 1, 0, 8
            h["chunk"] = np.arange(8)
            assert t.send(Batch.fill(h, np.zeros((8, 64), np.uint8), peer=peer)) == 8
            ecn, deadline = [], time.monotonic() + 5  # (with xsk-ktx a GSO batch may cross the veth as one)
            while time.monotonic() < deadline:
                try:
                    f = cap.recv(65536)
                except TimeoutError:
                    if ecn:
                        break
                    continue
                if f[23] == socket.IPPROTO_UDP and int.from_bytes(f[36:38], "big") == wire.DEFAULT_PORT:
                    ecn.append(f[15] & 3)
            assert ecn and set(ecn) == {2 if t.ect else 0} and (kind != "xsk" or len(ecn) == 8), ecn


def test_stats_and_dblp_status_show_each_queues_socket(pair):
    (_, _), (b, dev) = pair
    with open_dataplane("xsk-ktx", dev, netns=b, job=JOB, rank=1, world=2) as dp:
        t = dp.transport
        st = t.stats()
        assert sorted(st["queues"]) == list(range(QUEUES)) and st["mode"] == "copy" and not st["zerocopy"]
        assert all(not q["zerocopy"] for q in st["queues"].values())  # veth: copy mode
        assert t.sockets[0].tx == "kernel" and all(s.tx_frames == xsk_queues.TOKEN_TX_FRAMES for s in t.sockets[1:])
        assert "copy mode" in dp.describe() and "queues 0-3" in dp.describe()
        mine = [r for r in xsk_queues.published() if r["netns"] == b and r["ifname"] == dev]
        assert len(mine) == 1 and [q["queue"] for q in mine[0]["queues"]] == list(range(QUEUES))
        assert {q["mode"] for q in mine[0]["queues"]} == {"copy"}
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli.main(["status"]) == 0
        rows = [ln.split() for ln in out.getvalue().splitlines() if ln.startswith(b)]
        assert sorted(int(r[2]) for r in rows if r[1] == dev and len(r) > 5 and r[5] == "copy") == list(range(QUEUES))
    assert not [r for r in xsk_queues.published() if r["netns"] == b]  # the status file went with it,
    assert not (xsk_queues.STATUS_DIR / b).exists()  # and its directories


def test_status_names_the_namespace_of_a_process_started_inside_it(pair):
    """A job started inside a worker's namespace (``dblp testbed exec``, nsenter) names none;
    ``dblp status`` still shows which namespace its sockets are in."""
    (_, _), (b, dev) = pair
    with net.in_netns(b):
        with open_dataplane("xsk-ktx", dev, job=JOB, rank=1, world=2) as dp:
            assert dp.transport.netns is None
            mine = [r for r in xsk_queues.published() if r["ifname"] == dev and r["pid"] == os.getpid()]
            assert [r["netns"] for r in mine] == [b]
    assert not (xsk_queues.STATUS_DIR / b).exists()


def test_a_queue_the_device_lacks_is_refused_before_anything_attaches(pair):
    (_, _), (b, dev) = pair
    with pytest.raises(ValueError, match=r"queue 4 does not exist on mb: it has 4 receive queues \(0\.\.3\)"):
        open_dataplane("xsk", dev, netns=b, queues=[0, 4], job=JOB, rank=1, world=2)
    assert host.attached_program(dev, b) is None


def test_steering_is_refused_where_the_driver_has_no_ntuple_filters(pair):
    (_, _), (b, dev) = pair
    with pytest.raises(TransportError, match=r"steer: mb \(netns .*\) has no ntuple filters .*leave steer off") as e:
        open_dataplane("xsk", dev, netns=b, steer=1, job=JOB, rank=1, world=2)
    assert e.value.errno == errno.EOPNOTSUPP and "\n" not in str(e.value)
    assert host.attached_program(dev, b) is None


def test_busy_poll_is_set_or_refused_in_one_line(pair):
    (_, _), (b, dev) = pair
    with host.HostProgram(dev, netns=b) as h:
        try:
            t = XskTransport(dev, netns=b, host=h, busy_poll=50)
        except TransportError as e:
            if e.errno == errno.ENOPROTOOPT:
                skip_without("busy_poll")
            raise
        with t:
            assert t.busy_poll == 50
        # a budget beyond the kernel's u16: the kernel refuses it, and says so in one line with the fix
        with pytest.raises(TransportError, match=r"busy_poll: the kernel refused SO_BUSY_POLL_BUDGET=131072 "
                                                 r"\(Invalid argument\): .*; or leave busy_poll=0") as e:
            XskTransport(dev, netns=b, host=h, busy_poll=50, busy_poll_budget=1 << 17)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="busy_poll=-1: microseconds"):
        XskTransport(dev, netns=b, busy_poll=-1)


# ---- a 4-rank round over 4-queue NICs ------------------------------------------------------------

WORLD = 4


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["xsk-ktx", "xsk"])
def test_a_four_rank_allreduce_over_four_queue_nics_is_exact(bpf_xdp, kind):
    """The testbed without its XDP fabric: the bridge hands each flow to a worker's receive queue
    by hash, as RSS does (the fabric's XDP_REDIRECT would pick the queue by CPU)."""
    rng = np.random.default_rng(4)
    xs = [rng.standard_normal(300_007).astype(np.float32) for _ in range(WORLD)]
    with Testbed(workers=WORLD, name=unique_name("mq"), queues=QUEUES, fabric=False) as tb:
        dps = []
        try:
            for r in range(WORLD):
                dps.append(open_dataplane(kind, "eth0", netns=tb.ns(r), job=JOB, rank=r, world=WORLD,
                                          rate=tb.rate_bps if kind == "xsk" else 0))
            assert all(dp.queues == tuple(range(QUEUES)) for dp in dps)
            peers = [(dp.endpoint.addr, dp.endpoint.port, dp.endpoint.mac) for dp in dps]
            cols = [Collective(dp.transport, r, WORLD, peers, Config(job=JOB, peer_timeout=20.0))
                    for r, dp in enumerate(dps)]
            try:
                res, errs = run_threads(lambda r: [cols[r].allreduce(xs[r]) for _ in range(2)], range(WORLD), 120)
                assert not errs, errs
                per = [{q: s["rx_packets"] for q, s in dp.transport.stats()["queues"].items()} for dp in dps]
            finally:
                for c in cols:
                    c.close()
            exact = np.mean(xs, axis=0)
            for r in range(WORLD):
                for y in res[r]:
                    np.testing.assert_allclose(y, exact, atol=1e-5)
            # a rank heard peers on queues other than 0: a single socket there would have stalled the round
            assert sum(v for p in per for q, v in p.items() if q) > 0, per
            print(f"\n{kind}: packets received per queue, by rank: {per}")
        finally:
            for dp in dps:
                dp.close()
        for r in range(WORLD):
            assert host.attached_program("eth0", tb.ns(r)) is None
