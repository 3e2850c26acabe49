"""``open_dataplane`` with the AF_XDP kinds between two namespaces over a veth pair.

Each kind attaches the host program when none is loaded, registers the job,
publishes where it listens, carries packets, and on close (or on a failed
open) leaves nothing attached; over a program ``dblp load`` pinned it only
adds and removes its job.
"""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from pydblp import host, net, wire
from pydblp.dataplane import open_dataplane
from pydblp.transport import Batch, xsk_queues
from pydblp.transport.xsk import XskTransport
from pydblp.transport.xsk_queues import XskQueues

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns]

ADDR = ("198.18.9.1", "198.18.9.2")
MAC = ("02:00:5e:13:00:01", "02:00:5e:13:00:02")
JOB = 21


@pytest.fixture
def pair(bpf_xdp, netns):
    """Namespaces joined by veth va <-> vb, addressed, with static ARP entries."""
    a, b = netns("da"), netns("db")
    with net.ipr(a) as ip:
        ip.link("add", ifname="va", kind="veth", peer={"ifname": "vb", "net_ns_fd": b})
    for ns, dev, i in ((a, "va", 0), (b, "vb", 1)):
        with net.ipr(ns) as ip:
            idx = ip.link_lookup(ifname=dev)[0]
            ip.link("set", index=idx, address=MAC[i])
            ip.addr("add", index=idx, address=ADDR[i], prefixlen=24)
            ip.link("set", index=idx, state="up")
            ip.neigh("add", dst=ADDR[1 - i], lladdr=MAC[1 - i], ifindex=idx, state=0x80)  # permanent
    return (a, "va"), (b, "vb")


def _packets(n: int, src: int, dst: int, peer: int) -> Batch:
    h = wire.empty_batch(n)
    h["kind"], h["job"], h["src"], h["dst"] = wire.Kind.DATA, JOB, src, dst
    h["chunk"], h["nchunks"] = np.arange(n), n
    pay = np.random.default_rng(n).integers(0, 256, (n, 512), dtype=np.uint8)
    return Batch.fill(h, pay, np.full(n, 512), peer)


@pytest.mark.vm
@pytest.mark.parametrize("kind, tx", [("xsk", "xsk"), ("xsk-ktx", "kernel")])
def test_opens_attaches_registers_carries_and_releases(pair, kind, tx):
    dps = []
    try:
        for r, (ns, dev) in enumerate(pair):
            dps.append(open_dataplane(kind, dev, netns=ns, job=JOB, rank=r, world=2))
        for r, ((ns, dev), dp) in enumerate(zip(pair, dps)):
            assert dp.endpoint.as_dict() == {"addr": ADDR[r], "port": wire.DEFAULT_PORT, "mac": MAC[r],
                                             "queue": 0, "mtu": 1500, "queues": (0,)}  # a 1-queue veth
            assert isinstance(dp.transport, XskQueues) and dp.transport.tx == tx
            assert isinstance(dp.transport.sockets[0], XskTransport)
            assert host.attached_program(dev, ns)["name"] == host.PROG_NAME
            assert dp.host.jobs()[JOB] == {"world_size": 2, "rank": r, "transport": "xsk"}
        e1 = dps[1].endpoint
        peer = dps[0].transport.add_peer(e1.addr, e1.port, e1.mac)
        assert dps[0].transport.send(_packets(50, 0, 1, peer), timeout=5) == 50
        got, deadline = 0, time.monotonic() + 5
        while got < 50 and time.monotonic() < deadline:
            got += len(dps[1].transport.recv(timeout=0.2))
        assert got == 50
    finally:
        for dp in dps:
            dp.close()
    for ns, dev in pair:
        assert host.attached_program(dev, ns) is None


@pytest.mark.parametrize("kind", ["xsk", "xsk-ktx"])
def test_a_failed_open_releases_the_host_program(pair, kind):
    (ns, dev), _ = pair
    with pytest.raises(Exception, match="queue 99"):
        open_dataplane(kind, dev, netns=ns, queue=99, job=JOB, rank=0, world=2)
    assert host.attached_program(dev, ns) is None


def test_over_a_loaded_program_only_the_job_comes_and_goes(pair):
    (ns, dev), _ = pair
    loaded = host.HostProgram(dev, netns=ns, pin=True, keep=True)  # what `dblp load` leaves behind
    try:
        loaded.register_job(JOB + 1, 4, 3, "udp")  # someone else's job: untouched
        with open_dataplane("xsk", dev, netns=ns, job=JOB, rank=1, world=2) as dp:
            assert not isinstance(dp.host, host.HostProgram)
            assert dp.host.jobs()[JOB] == {"world_size": 2, "rank": 1, "transport": "xsk"}
        jobs = loaded.jobs()
        assert JOB not in jobs and jobs[JOB + 1]["rank"] == 3
        assert host.attached_program(dev, ns)["prog_id"] == loaded.prog_id
        # a job registered before is put back as it was
        loaded.register_job(JOB, 8, 5, "udp")
        with open_dataplane("xsk-ktx", dev, netns=ns, job=JOB, rank=0, world=2) as dp:
            assert dp.host.jobs()[JOB]["rank"] == 0
        assert loaded.jobs()[JOB] == {"world_size": 8, "rank": 5, "transport": "udp"}
    finally:
        loaded.close()
        host.unload(dev, ns)
    assert host.attached_program(dev, ns) is None


DIES = """
import os, sys
from pydblp.dataplane import open_dataplane
dp = open_dataplane("xsk-ktx", sys.argv[2], netns=sys.argv[1], job=int(sys.argv[3]), rank=1, world=2)
print("open", flush=True)
sys.stdin.read()
"""


def _open_and_die(ns: str, dev: str) -> None:
    """A process that opens a data plane for JOB on ``dev`` and is killed (SIGKILL) holding it."""
    import os
    import signal
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child = subprocess.Popen([sys.executable, "-c", DIES, ns, dev, str(JOB)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": root})
    try:
        assert child.stdout.readline().strip() == "open"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
        xsk_queues.published()  # (as `dblp status` does: a dead transport's status files go)


@pytest.mark.parametrize("job", [JOB, JOB + 1])
def test_a_second_rank_on_an_interface_is_told_to_take_its_own(pair, job):
    """Two ranks of a host on one interface (torchrun's ranks given one DBLP_IFACE): the second
    data plane finds the first's host program there, and is told what to do, not to unload it."""
    (ns, dev), _ = pair
    with open_dataplane("xsk", dev, netns=ns, job=JOB, rank=0, world=8) as first:
        with pytest.raises(host.HostError, match=rf"^{dev} already has a data plane: the AF_XDP kinds take one rank "
                                                 r"per interface: .*DBLP_IFACE=eth1,eth2,.*or use transport udp$"):
            open_dataplane("xsk", dev, netns=ns, job=job, rank=1, world=8)
        assert first.host.jobs()[JOB]["rank"] == 0  # the refused one changed nothing
    assert host.attached_program(dev, ns) is None


def test_a_job_is_held_by_one_data_plane_on_a_loaded_program(pair, monkeypatch, tmp_path):
    """A second data plane of the job on the interface is refused while the first is open (its
    registration would be overwritten, then removed under it when either closed); the job's
    registration that a killed data plane left is replaced and not put back."""
    import os

    monkeypatch.setattr(host, "CLAIM_DIR", tmp_path / "jobs")
    monkeypatch.setenv("DBLP_JOBS_DIR", str(tmp_path / "jobs"))  # (the child's claims go there too)
    (ns, dev), _ = pair
    loaded = host.HostProgram(dev, netns=ns, pin=True, keep=True)
    try:
        with open_dataplane("xsk-ktx", dev, netns=ns, job=JOB, rank=1, world=2):
            with pytest.raises(host.HostError, match=f"job {JOB} is open on {dev} --netns {ns} by pid {os.getpid()}: "
                                                     "the AF_XDP kinds take one rank per interface: give each rank"):
                open_dataplane("xsk-ktx", dev, netns=ns, job=JOB, rank=0, world=2)
            assert loaded.jobs()[JOB]["rank"] == 1  # (the refused one changed nothing)
        assert JOB not in loaded.jobs()
        _open_and_die(ns, dev)
        assert loaded.jobs()[JOB]["rank"] == 1  # what the killed one left registered
        with open_dataplane("xsk-ktx", dev, netns=ns, job=JOB, rank=0, world=2) as dp:
            assert dp.host.jobs()[JOB]["rank"] == 0
        assert JOB not in loaded.jobs()  # the dead one's registration is not put back
        _open_and_die(ns, dev)
        assert (tmp_path / "jobs" / ns / dev / str(JOB)).exists()  # what the killed one left
    finally:
        loaded.close()
        host.unload(dev, ns)
    assert not (tmp_path / "jobs" / ns).exists()  # unload took the claims its program no longer has


def test_an_interface_without_native_xdp_gets_the_host_program_in_generic_mode(bpf_xdp, netns, caplog):
    """A macvlan (a container's interface) has no native XDP: the data plane attaches the host
    program in generic mode, says so once in the log and in ``describe()``, and both ways carry
    every packet, between AF_XDP kinds over the macvlan as over the veth on the other side.
    ``dblp load`` keeps to native mode unless told: one line naming ``--mode skb``."""
    a, b = netns("ga"), netns("gb")
    with net.ipr(a) as ip:
        ip.link("add", ifname="pa", kind="veth", peer={"ifname": "pb", "net_ns_fd": b})
        parent = ip.link_lookup(ifname="pa")[0]
        ip.link("set", index=parent, state="up")
        try:
            ip.link("add", ifname="mv", kind="macvlan", link=parent, macvlan_mode="bridge")
        except Exception as e:  # (a kernel without macvlan: nothing here to test with)
            if getattr(e, "code", None) == 95:
                pytest.skip("the kernel has no macvlan")
            raise
    for ns, dev, addr in ((a, "mv", "198.18.52.1"), (b, "pb", "198.18.52.2")):
        with net.ipr(ns) as ip:
            idx = ip.link_lookup(ifname=dev)[0]
            ip.addr("add", index=idx, address=addr, prefixlen=24)
            ip.link("set", index=idx, state="up")
    with caplog.at_level("WARNING", logger="pydblp.host"), \
            open_dataplane("xsk", "mv", netns=a, job=JOB, rank=0, world=2) as dp0, \
            open_dataplane("xsk", "pb", netns=b, job=JOB, rank=1, world=2) as dp1:
        assert net.xdp_query("mv", a)["mode"] == net.Mode.SKB and net.xdp_query("pb", b)["mode"] == net.Mode.NATIVE
        assert dp0.describe().endswith(", generic XDP") and "generic" not in dp1.describe()
        said = [r.getMessage() for r in caplog.records if "native XDP" in r.getMessage()]
        assert said == ["mv: the driver has no native XDP; the host program runs in generic (skb) mode, "
                        "each frame copied into an skb before it (slower)"], said
        for (src, s), (dst, d) in (((0, dp0), (1, dp1)), ((1, dp1), (0, dp0))):
            peer = s.transport.add_peer(d.endpoint.addr)  # (the MAC through ARP: none is given)
            assert s.transport.send(_packets(40, src, dst, peer)) == 40
            got, into, deadline = [], Batch.empty(64), time.monotonic() + 5
            while len(got) < 40 and time.monotonic() < deadline:
                r = d.transport.recv(into, timeout=0.05)
                got += r.headers["chunk"][: r.n].tolist()
            assert sorted(got) == list(range(40)), f"{src} -> {dst}: {len(got)} of 40"
    assert host.attached_program("mv", a) is None and host.attached_program("pb", b) is None
    p = subprocess.run([sys.executable, "-m", "pydblp.cli", "load", "mv", "--netns", a], capture_output=True, text=True)
    assert p.returncode != 0 and p.stderr.strip().splitlines()[-1].endswith(
        "cannot attach XDP to mv (native): the driver lacks native XDP; try --mode skb"), p.stderr
    assert host.attached_program("mv", a) is None
