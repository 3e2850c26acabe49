"""No packet stops a job: a seeded spray of mutated frames at a receiving rank while a job runs.

The matrix: every data-plane kind (``udp``, ``xsk``, ``xsk-ktx``) x a job key or none x every
kind of round (allreduce, sharded update, neighbour round, shard broadcast), 24 cells.  In
each, two ranks on workers 0 and 1 of a three-worker testbed run rounds while worker 2, a host
of the job's network that is no rank, sprays rank 0's data port with every category of
:mod:`pydblp.testbed.hostile` (bit flips, truncation at every length, bad length and count
fields, unknown kinds, random flags, wrong-key tags, replays of an earlier run, oversized
frames, IPv6, lying UDP and IP lengths, VLAN tags, far rounds, other jobs).  Expected: exact results, no
error, no hang, no batch the receive path had to drop on an exception (``rx_errors`` 0), and
counters that say what was dropped and why.

Then the guard itself: a batch whose handling raises inside each transport's receive (injected)
costs a repair, never the round, and an AF_XDP socket gives the batch's frames back.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from pydblp import host, wire
from pydblp.collective import Collective, Config
from pydblp.testbed import Testbed
from pydblp.testbed.hostile import Sprayer, Target, frame, mutants
from pydblp.transport import Batch
from pydblp.transport.auth import authenticate
from pydblp.transport.udp import UdpTransport
from pydblp.transport.xsk import XskTransport
from tests.helpers import run_threads, unique_name

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns]

JOB = 31
KEY = bytes(range(32))
N = 50_003          # floats a round (36 chunks a rank)
ROUNDS = 4          # while the spray runs; then two more after it ended
SPRAY = 1400        # frames a cell: 100 of each category
ROUND_KINDS = ("allreduce", "sharded", "neighbours", "broadcast")


@pytest.fixture(scope="module")
def tb(bpf_xdp):
    with Testbed(workers=3, name=unique_name("fz"), rate=0) as t:  # (the switch in XDP forwards every frame)
        yield t


@pytest.fixture(scope="module")
def hosts(tb):
    """The host program on both ranks' NICs, the job registered for AF_XDP (UDP cells use an
    ephemeral port the program does not filter: the UDP transport's own checks meet the spray)."""
    hs = []
    try:
        for r in range(2):
            h = host.HostProgram("eth0", netns=tb.ns(r))
            h.register_job(JOB, 2, r, "xsk")
            hs.append(h)
        yield hs
    finally:
        for h in hs:
            h.close()


def open_ranks(tb, hosts, kind, key, epoch, rx_frames=4096):
    ts = []
    try:
        for r in range(2):
            if kind == "udp":
                t = UdpTransport("eth0", netns=tb.ns(r), port=0)
            else:
                t = XskTransport("eth0", netns=tb.ns(r), host=hosts[r], tx="kernel" if kind == "xsk-ktx" else "xsk",
                                 rx_frames=rx_frames, tx_frames=1024)
            ts.append(authenticate(t, key, epoch))
        peers = [(tb.addr(r), ts[r].port, tb.mac(r)) for r in range(2)]
        return [Collective(ts[r], r, 2, peers, Config(job=JOB, peer_timeout=10.0)) for r in range(2)]
    except BaseException:
        for t in ts:
            t.close()
        raise


def step(kind, r, c, x, i):
    """One round of ``kind`` on rank ``r``; what it returned."""
    if kind == "allreduce":
        return c.allreduce(x)
    if kind == "sharded":
        return c.sharded_update(x, np.full_like(x, i), lambda rows, mean, values: values - 0.5 * mean)
    if kind == "neighbours":
        return c.neighbours(x, [1 - r], [0.5])
    return c.broadcast_shards(x)


def expected(kind, xs, i, C):
    """What every round of ``kind`` must give each rank, exactly."""
    if kind == "allreduce":
        return [(xs[0] + xs[1]) / 2] * 2
    if kind == "sharded":
        return [np.full_like(xs[0], i) - 0.5 * (xs[0] + xs[1]) / 2] * 2
    if kind == "neighbours":
        return [(0.5 * xs[r] + 0.5 * xs[1 - r], [1 - r]) for r in range(2)]
    T = -(-N // C)
    want = np.empty(N, np.float32)
    for k in range(2):  # shard k (rows k*T//2 .. (k+1)*T//2) from its owner, rank k
        rows = slice(k * T // 2 * C, (k + 1) * T // 2 * C)
        want[rows] = xs[k][rows]
    return [want] * 2


def check(kind, got, want):
    if kind == "neighbours":
        np.testing.assert_allclose(got[0], want[0], atol=1e-6)
        assert got[1] == want[1]
    else:
        np.testing.assert_allclose(got, want, atol=1e-6)


def verdicts(h) -> dict:
    """The host program's counters a sprayed frame can end in: drops (all reasons), frames it
    took for not DBLP (passed to the stack) and DBLP for a queue without a socket."""
    c = h.counters()
    return {"drop": sum(c["drop"].values()), "pass": c["pass"], "nosock": c["nosock"]}


@pytest.mark.parametrize("round_kind", ROUND_KINDS)
@pytest.mark.parametrize("keyed", [False, True], ids=["nokey", "key"])
@pytest.mark.parametrize("kind", ["udp", "xsk", "xsk-ktx"])
def test_spray_changes_nothing(tb, hosts, kind, keyed, round_kind):
    seed = zlib.crc32(f"{kind} {keyed} {round_kind}".encode()) & 0xFFFF
    key, epoch = (KEY, 0x5EED0000 + seed) if keyed else (None, 0)
    cols = open_ranks(tb, hosts, kind, key, epoch)
    rng = np.random.default_rng(seed)
    rounds = [[rng.standard_normal(N).astype(np.float32) for _ in range(2)] for _ in range(ROUNDS + 2)]
    target = Target(tb.mac(0), tb.addr(0), cols[0].t.port, tb.mac(2), tb.addr(2), job=JOB, world=2, key=key,
                    epoch=epoch, rounds=(0, ROUNDS + 4), chunk_bytes=cols[0].cfg.chunk_bytes)
    pool = mutants(target, SPRAY, seed)
    h0 = hosts[0]
    host_before = verdicts(h0)
    try:
        with Sprayer(tb.ns(2), "eth0", pool, count=SPRAY, duration=30, pps=40_000) as sp:
            sp.start()
            res, errs = run_threads(lambda r: [step(round_kind, r, cols[r], rounds[i][r], i) for i in range(ROUNDS)],
                                    range(2), 60)
            assert not errs, errs
            assert sp.wait(30) and sp.total == SPRAY
        res2, errs = run_threads(lambda r: [step(round_kind, r, cols[r], rounds[i][r], i)
                                            for i in range(ROUNDS, ROUNDS + 2)], range(2), 60)
        assert not errs, errs
        for i in range(ROUNDS + 2):
            want = expected(round_kind, rounds[i], i, cols[0].C)
            for r in range(2):
                check(round_kind, res[r][i] if i < ROUNDS else res2[r][i - ROUNDS], want[r])
        st = cols[0].t.stats()
        ctr = cols[0].counters
        assert st["rx_errors"] == 0 and ctr["rx_errors"] == 0, (st, ctr)  # handled, not caught
        host_after = verdicts(h0)
        in_xdp = host_after["drop"] - host_before["drop"] if kind != "udp" else 0
        auth = sum(st.get(f"auth_{w}", 0) for w in ("untagged", "epoch", "bad_tag", "truncated"))
        counted = in_xdp + st["rx_invalid"] + auth
        assert 0 < counted <= SPRAY, (in_xdp, st)
        if keyed and kind != "udp":  # every frame sent is in a counter (the kernel's ring drops aside)
            other = host_after["pass"] + host_after["nosock"] - host_before["pass"] - host_before["nosock"]
            kernel = st.get("rx_dropped", 0) + st.get("rx_ring_full", 0)
            assert SPRAY - kernel <= counted + other <= SPRAY, (in_xdp, other, kernel, st)
        if kind == "udp":
            assert st["rx_invalid"] > 0, (sorted(st.items()), ctr)
        else:  # the host program drops what is malformed before AF_XDP sees it
            d = h0.counters()["drop"]
            assert d["length"] > 0 and d["kind"] > 0 and d["vlan"] > 0 and in_xdp > 0
        if keyed:  # well-formed forgeries reach the tag check and fail it, each for its reason
            assert st["auth_untagged"] > 0 and st["auth_epoch"] > 0 and st["auth_bad_tag"] > 0, st
            assert ctr["bad_payload"] == 0
        else:  # far rounds (and, over UDP, other jobs) reach the collective, which ignores and counts them
            assert ctr["stray"] > 0 and (kind != "udp" or ctr["foreign"] > 0), ctr
    finally:
        for c in cols:
            c.close()


@pytest.mark.parametrize("kind", ["xsk", "xsk-ktx"])
def test_header_only_frames_at_a_keyed_af_xdp_socket(tb, hosts, kind):
    """The fault that stopped keyed AF_XDP jobs: a receive whose frames are all header-only (no
    payload byte) lends payload rows 0 bytes wide; the tag check read column -1 of them and
    raised IndexError out of ``recv``.  Now: dropped as untagged, counted, nothing raised."""
    t = authenticate(XskTransport("eth0", netns=tb.ns(0), host=hosts[0], rx_frames=512,
                                  tx="kernel" if kind == "xsk-ktx" else "xsk"), KEY, 5)
    try:
        target = Target(tb.mac(0), tb.addr(0), t.port, tb.mac(2), tb.addr(2), job=JOB, world=2)
        bare = frame(target, wire.encode(wire.Header(job=JOB, round=3, src=1, dst=0, nchunks=4, chunk=1)))
        with Sprayer(tb.ns(2), "eth0", [("untagged", bare)], count=20, duration=10) as sp:
            sp.start()
            assert sp.wait(10)
        into, got = Batch.empty(64, 1408), 0
        for _ in range(20):
            got += t.recv(into, timeout=0.05, copy=False).n
            if t.stats()["auth_untagged"] == 20:
                break
        st = t.stats()
        assert got == 0 and st["auth_untagged"] == 20 and st["rx_errors"] == 0, st
    finally:
        t.close()


# ---- a batch that raises inside a receive -------------------------------------------------

def _fail_n(obj, name, n, before=None):
    """Make ``obj.name`` raise on its first ``n`` calls (``before(*args)`` runs first); a list
    that counts the calls that raised."""
    orig, failed = getattr(obj, name), []

    def bad(*a, **kw):
        if len(failed) < n:
            if before is not None:
                before(*a, **kw)
            failed.append(1)
            raise IndexError("injected: a batch the receive path chokes on")
        return orig(*a, **kw)

    setattr(obj, name, bad)
    return failed


@pytest.mark.parametrize("where", ["udp", "auth", "xsk-after-take", "xsk-before-take", "xsk-ktx-after-take"])
def test_a_failing_batch_costs_a_repair_not_the_round(tb, hosts, where):
    """Rank 0's receive raises on its first batches: the rounds still complete, exact; each
    dropped batch is counted in ``rx_errors``.  AF_XDP: the failing batches together hold more
    frames than the socket has (``rx_frames`` 512), so a frame not given back would starve it."""
    kind = where.split("-after")[0].split("-before")[0]
    kind = "udp" if kind == "auth" else kind
    key = KEY if where == "auth" else None
    cols = open_ranks(tb, hosts, kind, key, 77, rx_frames=512)
    t0 = cols[0].t
    taken = []
    try:
        if where in ("udp", "auth"):  # (a UdpTransport's, or the AuthTransport's over it)
            failed = _fail_n(t0, "_deliver", 5)
        elif where.endswith("before-take"):
            failed = _fail_n(t0, "_receive", 40)
        else:  # raise after the descriptors were taken off the rx ring, until 600 frames were
            failed = []
            # the Python paths' first steps past the take; the compiled path's step after its call
            for name in ("_recv_done",) if t0.native else ("_recv_run", "_headers_in"):
                real = getattr(t0, name)

                def bad(*a, _real=real, **kw):
                    if sum(taken) < 600:
                        taken.append(a[1] if t0.native else len(t0._taken))  # (native: a[1] descriptors)
                        failed.append(1)
                        raise IndexError("injected: a batch the receive path chokes on")
                    return _real(*a, **kw)

                setattr(t0, name, bad)
        xs = [np.random.default_rng(9).standard_normal(1_000_000).astype(np.float32) + r for r in range(2)]
        res, errs = run_threads(lambda r: [cols[r].allreduce(xs[r]) for _ in range(3)], range(2), 90)
        assert not errs, errs
        for r in range(2):
            for y in res[r]:
                np.testing.assert_allclose(y, (xs[0] + xs[1]) / 2, atol=1e-6)
        assert failed and t0.stats()["rx_errors"] == len(failed)
        if taken:
            assert sum(taken) >= 600 > 512  # more frames than the UMEM holds went through failing batches
    finally:
        for c in cols:
            c.close()


