"""Helpers shared by test modules (fixtures live in the conftest.py files).

Names: :func:`unique_name` for namespaces and testbeds (the session's leftover
check in ``tests/conftest.py`` looks for :data:`NS_PREFIX`);
:func:`run_in_workers` for one process per testbed worker; :func:`run_threads`
for one thread per rank of this process; and the two-namespace
veth pair the transport tests send through (:func:`make_pair`,
:func:`host_pair`), with :func:`packets` whose every field is a function of
the chunk id, checked on receipt by :class:`Checker` (:func:`transfer`,
:func:`both_ways`); :func:`skip_without` for a kernel feature a probe found missing;
:func:`poll_until`, :func:`settled` and :func:`all_queued` to wait on counters and queues
with a deadline.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import platform
import re
import subprocess
import threading
import time

import numpy as np
import pytest

from pydblp import net, wire
from pydblp.transport import Batch

NS_PREFIX = f"dblpt{os.getpid() % 100000}"
_seq = itertools.count()

# Kernel features some tests need: name -> (first Linux release with it, what it is).
KERNEL_FEATURES = {
    "udp_gso": ((4, 18), "UDP_SEGMENT (UDP GSO)"),
    "xdp_frags": ((5, 18), "multi-buffer XDP (BPF_F_XDP_HAS_FRAGS)"),
    "xsk_sg": ((6, 6), "multi-buffer AF_XDP (XDP_USE_SG)"),
    "busy_poll": ((5, 11), "socket busy polling (SO_PREFER_BUSY_POLL, SO_BUSY_POLL_BUDGET)"),
    # (raised from 64 in 6.9, and in some stable releases before it)
    "udp_gso_128": ((6, 9), "UDP GSO messages of 128 datagrams (UDP_MAX_SEGMENTS 128)"),
}
# The reason's prefix of a skip that DBLP_REQUIRE_PRIVILEGED=1 accepts (tests/conftest.py).
KERNEL_FEATURE_SKIP = "kernel feature missing:"


def kernel_version(release: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``release`` (default: the running kernel's, ``uname -r``)."""
    m = re.match(r"(\d+)\.(\d+)", release or platform.release())
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def skip_without(feature: str):
    """Skip the test: the caller's probe found kernel ``feature`` (a :data:`KERNEL_FEATURES` name) missing.

    On a kernel older than the feature's first release, the reason starts with
    :data:`KERNEL_FEATURE_SKIP`, a skip that ``DBLP_REQUIRE_PRIVILEGED=1`` accepts (the
    VM kernel matrix runs 6.1, without ``xsk_sg``).  On a release that should have it,
    the skip says so and ``DBLP_REQUIRE_PRIVILEGED=1`` turns it into a failure: a
    kernel built without it, or a broken probe, must not pass as "too old".
    """
    need, what = KERNEL_FEATURES[feature]
    release = platform.release()
    if kernel_version(release) < need:
        pytest.skip(f"{KERNEL_FEATURE_SKIP} {feature}: {what}, Linux {need[0]}.{need[1]}+; this is {release}")
    pytest.skip(f"{what} refused by Linux {release}, which has it from {need[0]}.{need[1]}: "
                "a kernel configured without it, or a broken probe")


# The reason's prefix of a skip of the compiled path asked for by DBLP_NATIVE=0 (a run of the
# pure-Python paths): DBLP_REQUIRE_PRIVILEGED=1 accepts it (tests/conftest.py).
NATIVE_OFF_SKIP = "compiled path off (DBLP_NATIVE=0):"


def needs_native(name: str, available: bool):
    """A skip mark for tests of compiled ``name`` when it is not ``available``: under
    ``DBLP_NATIVE=0`` an accepted skip; otherwise a skip only outside CI (under
    ``DBLP_REQUIRE_PRIVILEGED=1`` the test runs and fails: CI must build the compiled path)."""
    from pydblp import native

    if native.mode() is False:
        return pytest.mark.skipif(not available, reason=f"{NATIVE_OFF_SKIP} {name}")
    return pytest.mark.skipif(not available and not os.environ.get("DBLP_REQUIRE_PRIVILEGED"),
                              reason=f"compiled {name} unavailable: {native.why(name)}")


def require_native(name: str = "udp"):
    """Skip the test: compiled ``name`` (pydblp/csrc) did not load here.  Under
    ``DBLP_REQUIRE_PRIVILEGED=1`` (CI) the skip is a failure (CI must build the compiled path),
    unless ``DBLP_NATIVE=0`` asked for the Python paths."""
    from pydblp import native

    if native.mode() is False:
        pytest.skip(f"{NATIVE_OFF_SKIP} {name}")
    pytest.skip(f"compiled {name} unavailable: {native.why(name)}")


def run_threads(fn, ranks, timeout: float) -> tuple[dict, dict]:
    """Call ``fn(rank)`` in one thread per rank at once; (results, exceptions) by rank.

    A thread still running after ``timeout`` seconds fails the test ("a rank hung"); exceptions
    are returned for the test to assert on, not raised.
    """
    res, errs = {}, {}

    def go(r):
        try:
            res[r] = fn(r)
        except Exception as e:  # returned to the caller, which asserts on them
            errs[r] = e

    th = [threading.Thread(target=go, args=(r,), daemon=True) for r in ranks]
    for t in th:
        t.start()
    for t in th:
        t.join(timeout)
    assert not any(t.is_alive() for t in th), "a rank hung"
    return res, errs


class Ranks:
    """``world`` collectives over UDP on loopback, one per rank, run in threads (:meth:`run`)."""

    def __init__(self, world: int, native: bool | None = None, **cfg):
        from pydblp.collective import Collective, Config
        from pydblp.transport.udp import UdpTransport

        self.world = world
        self.ts = [UdpTransport(port=0, native=native) for _ in range(world)]
        peers = [("127.0.0.1", t.port) for t in self.ts]
        self.cols = [Collective(self.ts[r], r, world, peers, Config(**cfg)) for r in range(world)]

    def run(self, fn, ranks=None, timeout: float = 60.0):
        """Call fn(rank, collective) in one thread per rank; results and exceptions by rank."""
        return run_threads(lambda r: fn(r, self.cols[r]), range(self.world) if ranks is None else ranks, timeout)

    def close(self):
        for c in self.cols:
            c.close()


def lose_sent(t, drop) -> None:
    """Make transport ``t`` lose, as the wire would, the packets of each batch it sends for which
    ``drop(headers)`` (a bool per packet) is True."""
    send = t.send

    def lossy(batch, timeout=1.0):
        n = batch.n
        h = batch.headers[:n]
        keep = ~drop(h)
        if keep.all():
            return send(batch, timeout)
        return send(Batch(h[keep], batch.payload[:n][keep], batch.lengths[:n][keep], batch.peer[:n][keep],
                          int(keep.sum()), None if batch.addr is None else batch.addr[:n][keep]),
                    timeout) + int(n - keep.sum())

    t.send = lossy


def run_in_workers(tb, argv_of, env: dict, timeout: float, what: str) -> list[str]:
    """Run ``argv_of(rank)`` in every worker of testbed ``tb`` at once; their outputs, by rank.

    Each must exit 0 and print ``ok <rank>``; one that hangs past ``timeout`` ends them all
    (each by its pid) and fails the test with its output.
    """
    procs = [tb.popen(w, argv_of(r), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r, w in enumerate(tb.workers)]
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{what}: a worker hung: {p.communicate()[0][-3000:]}")
        outs.append(out)
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"ok {r}" in out, out[-3000:]
    return outs


def unique_name(tag: str = "") -> str:
    """A name no other test run uses: prefix + pid + sequence (max 15 chars for ifnames)."""
    return f"{NS_PREFIX}{tag}{next(_seq)}"


# ---- a veth pair between two namespaces, and packets to check end to end ----

JOB, JOB_UDP = 11, 12
ADDR = {4: ("198.18.8.1", "198.18.8.2"), 6: ("2001:2::1", "2001:2::2")}
MAC = ("02:00:5e:12:00:01", "02:00:5e:12:00:02")
POOL = np.random.default_rng(2024).integers(0, 256, 1 << 20, dtype=np.uint8)
MAXLEN = 1400
N = 100_000  # packets per direction of the bit-exact transport tests


def make_pair(mtu: int = 1500):
    """Namespaces joined by veth va <-> vb with IPv4 + IPv6 benchmarking addresses and static ARP/ND entries."""
    a, b = unique_name("xa"), unique_name("xb")
    net.netns_add(a)
    net.netns_add(b)
    with net.ipr(a) as ip:
        ip.link("add", ifname="va", kind="veth", peer={"ifname": "vb", "net_ns_fd": b})
    for ns, dev, i in ((a, "va", 0), (b, "vb", 1)):
        with net.ipr(ns) as ip:
            idx = ip.link_lookup(ifname=dev)[0]
            ip.link("set", index=idx, address=MAC[i], mtu=mtu)
            ip.addr("add", index=idx, address=ADDR[4][i], prefixlen=24)
            ip.addr("add", index=idx, address=ADDR[6][i], prefixlen=64, flags=0x02)  # IFA_F_NODAD
            ip.link("set", index=idx, state="up")
            ip.link("set", index=ip.link_lookup(ifname="lo")[0], state="up")
            for fam in (4, 6):
                ip.neigh("add", dst=ADDR[fam][1 - i], lladdr=MAC[1 - i], ifindex=idx, state=0x80)  # permanent
    return a, b


def packets(start: int, n: int, src: int, dst: int, job: int = JOB, peer: int = 0, maxlen: int = MAXLEN) -> Batch:
    """Packets with chunk ids start..start+n-1; everything else (lengths 1..maxlen) is a function of the chunk id."""
    c = np.arange(start, start + n, dtype=np.int64)
    h = wire.empty_batch(n)
    h["kind"] = wire.Kind.DATA
    h["job"] = job
    h["round"] = c // 1000
    h["tensor"] = c % 7
    h["src"], h["dst"] = src, dst
    h["prio"] = 0
    h["dtype"] = c % 4
    h["chunk"] = c
    h["nchunks"] = 1 << 24
    h["tol"] = c % 200
    lens = 1 + (c * 37) % maxlen
    off = (c * 7919) % (len(POOL) - maxlen)
    pay = POOL[off[:, None] + np.arange(maxlen)]
    return Batch.fill(h, pay, lens, peer)


class Checker:
    """Verifies received batches against :func:`packets` and counts each chunk."""

    def __init__(self, total: int, src: int, dst: int, job: int = JOB, maxlen: int = MAXLEN):
        self.seen = np.zeros(total, np.int64)
        self.src, self.dst, self.job, self.maxlen = src, dst, job, maxlen

    def add(self, r: Batch) -> int:
        if len(r) == 0:
            return 0
        c = r.headers["chunk"].astype(np.int64)
        assert c.max() < len(self.seen)
        h = r.headers
        assert (h["job"] == self.job).all() and (h["src"] == self.src).all() and (h["dst"] == self.dst).all()
        assert np.array_equal(h["round"], c // 1000) and np.array_equal(h["tensor"], c % 7)
        assert np.array_equal(h["dtype"], c % 4) and np.array_equal(h["tol"], c % 200)
        lens = 1 + (c * 37) % self.maxlen
        assert np.array_equal(r.lengths, lens) and np.array_equal(h["len"], lens)
        w = int(lens.max())
        off = (c * 7919) % (len(POOL) - self.maxlen)
        exp = POOL[off[:, None] + np.arange(w)]
        mask = np.arange(w) < lens[:, None]
        assert np.array_equal(np.where(mask, r.payload[:, :w], 0), np.where(mask, exp, 0)), "payload differs"
        np.add.at(self.seen, c, 1)
        return len(r)


def transfer(tx, rx, peer: int, total: int, src: int, dst: int, job: int = JOB, step: int = 200,
             into: Batch | None = None, copy: bool = True, maxlen: int = MAXLEN) -> Checker:
    """Send ``total`` packets in lockstep steps (a modest rate: none may be lost) and check them.

    Steps stay below the 256-slot ring a veth with XDP queues into: a longer
    burst can overflow it when the softirq is starved on a busy machine.
    """
    chk = Checker(total, src, dst, job, maxlen)
    into = into or Batch.empty(4096, maxlen)
    got = 0
    for start in range(0, total, step):
        n = min(step, total - start)
        assert tx.send(packets(start, n, src, dst, job, peer, maxlen), timeout=5) == n
        deadline = time.monotonic() + 5
        while got < start + n and time.monotonic() < deadline:
            got += chk.add(rx.recv(into, timeout=0.2, copy=copy))
        assert got == start + n, f"lost packets: {start + n - got} after chunk {start}"
    for _ in range(3):  # nothing extra trails behind
        got += chk.add(rx.recv(into, timeout=0.05, copy=copy))
    assert (chk.seen == 1).all(), f"missing {int((chk.seen == 0).sum())}, duplicated {int((chk.seen > 1).sum())}"
    return chk


def both_ways(ta, tb, family: int, total: int, job: int = JOB, maxlen: int = MAXLEN):
    """Register side 0 and side 1 with each other, :func:`transfer` ``total`` packets each way.

    Returns (peer id of side 0 at tb, peer id of side 1 at ta, the batch the first leg received into).
    """
    pb, pa = ta.add_peer(ADDR[family][1]), tb.add_peer(ADDR[family][0])
    into = Batch.empty(4096, maxlen)
    transfer(ta, tb, pb, total, src=0, dst=1, job=job, into=into, maxlen=maxlen)
    assert (into.peer[: into.n] == pa).all()  # sender recognised by its source address
    transfer(tb, ta, pa, total, src=1, dst=0, job=job, maxlen=maxlen)
    return pa, pb, into


@contextlib.contextmanager
def host_pair(mtu: int = 1500):
    """:func:`make_pair` with the host program native on both ends, JOB for AF_XDP and JOB_UDP for UDP."""
    from pydblp.host import HostProgram

    a, b = make_pair(mtu)
    hosts = []
    try:
        for ns, dev, rank in ((a, "va", 0), (b, "vb", 1)):
            h = HostProgram(dev, netns=ns, mode="native")
            hosts.append(h)
            h.register_job(JOB, world_size=2, rank=rank, transport="xsk")
            h.register_job(JOB_UDP, world_size=2, rank=rank, transport="udp")
            assert net.xdp_query(dev, ns)["mode"] == net.Mode.NATIVE
        yield {"ns": (a, b), "dev": ("va", "vb"), "host": tuple(hosts)}
    finally:
        for h in hosts:
            h.close()
        net.netns_del(a)
        net.netns_del(b)


FOREIGN_PROG = r"""
BPF_XSKMAP(xsks, 4);
int xdp_to_xsk(struct xdp_md *ctx) {
    return xsks.redirect_map(ctx->rx_queue_index, XDP_PASS);
}
"""


@contextlib.contextmanager
def foreign_xskmap(dev: str, netns: str):
    """An XDP program that is not pydblp's on ``dev``: it redirects every frame to the AF_XDP
    socket of its queue (no checks); yields its ``xskmap`` for ``XskTransport(xskmap=)``.
    Detached with the namespace; the program is released at exit."""
    from bcc import BPF

    from pydblp.bpf import Map

    prog = BPF(text=FOREIGN_PROG.encode())
    try:
        fd = prog.load_func(b"xdp_to_xsk", BPF.XDP).fd
        net.xdp_attach(dev, fd, net.Mode.NATIVE, netns)
        yield Map(prog[b"xsks"].map_fd, owned=False)
    finally:
        prog.cleanup()


def xsk(pair, side: int, **kw):
    """An :class:`~pydblp.transport.xsk.XskTransport` on queue 0 of side ``side`` of a :func:`host_pair`."""
    from pydblp.transport.xsk import XskTransport

    return XskTransport(pair["dev"][side], netns=pair["ns"][side], queue=0, host=pair["host"][side], **kw)


# ---- seeded loss at a sender ----

def _unit(key: tuple) -> float:
    """A uniform number in [0, 1) that is a function of ``key`` (ints) only: splitmix64 of its hash
    (the hash of a tuple of ints does not depend on PYTHONHASHSEED)."""
    z = (hash(key) + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


def seeded_loss(t, p: float, seed: int) -> list[tuple[int, int, int, int, int]]:
    """Make transport ``t`` lose, as the wire would, each DATA packet it sends with probability ``p``.

    Whether a packet is lost is a function of ``seed``, its (round, tensor, src, dst, chunk, flags)
    and how many times that packet was sent before, not of timing: a run repeats its losses.
    Returns the list the lost packets' (round, tensor, src, dst, chunk) are appended to.

    Args:
        t: a :class:`pydblp.transport.base.Transport`; its ``send`` is replaced.
        p: loss probability in [0, 1].
        seed: selects the loss pattern.
    """
    send, lost, sent = t.send, [], {}

    def lossy(batch, timeout=1.0):
        n = len(batch)
        h = batch.headers[:n]
        keep = np.ones(n, bool)
        for i in np.flatnonzero(h["kind"] == wire.Kind.DATA):
            ident = tuple(int(h[f][i]) for f in ("round", "tensor", "src", "dst", "chunk", "flags"))
            attempt = sent[ident] = sent.get(ident, -1) + 1
            if _unit((seed, *ident, attempt)) < p:
                keep[i] = False
                lost.append(ident[:5])
        if keep.all():
            return send(batch, timeout)
        return send(Batch(h[keep], batch.payload[:n][keep], batch.lengths[:n][keep], batch.peer[:n][keep],
                          int(keep.sum()), None if batch.addr is None else batch.addr[:n][keep]),
                    timeout) + int(n - keep.sum())

    t.send = lossy
    return lost


# ---- waiting on conditions ----

def poll_until(pred, timeout: float = 10.0, interval: float = 0.01) -> bool:
    """Call ``pred()`` until it is true or ``timeout`` seconds pass; whether it became true.

    For counters and queues that a loaded machine's softirqs update late: the caller asserts
    on the result (or on the state itself), so a condition that never comes still fails.
    """
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return bool(pred())
        time.sleep(interval)
    return True


def settled(read, quiet: float = 0.2, timeout: float = 10.0, interval: float = 0.01):
    """``read()`` once it has returned the same value for ``quiet`` seconds (or at ``timeout``).

    For counters whose final value is what the test checks but is not known in advance
    (drops counted by the kernel as it works through a backlog).
    """
    deadline = time.monotonic() + timeout
    last, since = read(), time.monotonic()
    while time.monotonic() - since < quiet and time.monotonic() < deadline:
        time.sleep(interval)
        if (v := read()) != last:
            last, since = v, time.monotonic()
    return last


def all_queued(t, timeout: float = 5.0) -> None:
    """Wait until what was just sent to the UDP transport ``t`` over loopback is in its socket,
    so that one receive finds all of it: queued bytes present and unchanged for 50 ms.

    Loopback delivers in the sender's softirq, which a loaded machine can defer to ksoftirqd.
    """
    assert poll_until(lambda: t.stats()["rx_queued_bytes"] > 0, timeout=timeout), "nothing arrived"
    settled(lambda: t.stats()["rx_queued_bytes"], quiet=0.05, timeout=timeout)
