"""The AF_XDP kinds on networks that are not the testbed's one bridge.

A routed fabric (a leaf switch per rack, a /31 per host) puts a gateway between ranks: frames
an AF_XDP transport builds must then carry the gateway's MAC and leave by the interface the
kernel's route names, and they arrive with the gateway's MAC as their source, so the host
program can bind a routed peer's address, not its MAC.  Two ranks of one host, each on its
own interface, have each other's addresses as local ones: frames built for the wire reach the
other interface over the link they share, and kernel transmit would keep them inside the host.
"""

from __future__ import annotations

import errno

import numpy as np
import pytest
import torch.distributed as dist

import pydblp.torch as ptorch
from pydblp import host, net
from pydblp.collective import Config
from pydblp.dataplane import open_dataplane
from pydblp.transport import TransportError
from tests.helpers import run_threads

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns]

JOB = 31
SUBNET = {"a": "198.18.21", "b": "198.18.22"}  # .2: the rank, .1: the router's side
SUBNET6 = {"a": "2001:db8:21:", "b": "2001:db8:22:"}  # ::2 the rank, ::1 and fe80::1 the router's side
IFA_F_NODAD = 0x02  # (no duplicate address detection: the address is usable at once)


@pytest.fixture
def routed(bpf_xdp, netns):
    """Namespaces a and b, each joined by a veth to namespace r, which forwards between the
    two /24s; a and b reach each other through r only."""
    a, r, b = netns("ra"), netns("rr"), netns("rb")
    for ns, dev, far in ((a, "xa", "ya"), (b, "xb", "yb")):
        with net.ipr(ns) as ip:
            ip.link("add", ifname=dev, kind="veth", peer={"ifname": far, "net_ns_fd": r})
    for ns, dev, side, host_part in ((a, "xa", "a", 2), (r, "ya", "a", 1), (r, "yb", "b", 1), (b, "xb", "b", 2)):
        with net.ipr(ns) as ip:
            idx = ip.link_lookup(ifname=dev)[0]
            ip.addr("add", index=idx, address=f"{SUBNET[side]}.{host_part}", prefixlen=24)
            ip.link("set", index=idx, state="up")
    for ns, dev, side, host_part in ((a, "xa", "a", "2"), (r, "ya", "a", "1"), (r, "yb", "b", "1"),
                                     (b, "xb", "b", "2")):
        with net.ipr(ns) as ip:  # IPv6: the ranks' gateways are the router's link-local addresses,
            idx = ip.link_lookup(ifname=dev)[0]  # as a router's advertisements set them
            for address in [f"{SUBNET6[side]}:{host_part}"] + (["fe80::1"] if ns == r else []):
                ip.addr("add", index=idx, address=address, prefixlen=64, flags=IFA_F_NODAD)
    for ns, dev, here, there in ((a, "xa", "a", "b"), (b, "xb", "b", "a")):
        with net.ipr(ns) as ip:
            ip.route("add", dst=f"{SUBNET[there]}.0/24", gateway=f"{SUBNET[here]}.1")
            ip.route("add", dst=f"{SUBNET6[there]}:/64", gateway="fe80::1", oif=ip.link_lookup(ifname=dev)[0])
    with net.in_netns(r):
        for knob in ("/proc/sys/net/ipv4/ip_forward", "/proc/sys/net/ipv6/conf/all/forwarding"):
            with open(knob, "w") as f:
                f.write("1")
    yield {"a": (a, "xa"), "b": (b, "xb")}
    for ns, dev in ((a, "xa"), (b, "xb")):
        assert host.attached_program(dev, ns) is None, f"XDP left on {dev}"


@pytest.fixture
def one_host(bpf_xdp, netns):
    """Namespace h with two interfaces, h1 and h2, in one /24, joined by a bridge (namespace s)."""
    h, sw = netns("hh"), netns("hs")
    with net.ipr(sw) as ip:
        ip.link("add", ifname="br0", kind="bridge")
        br = ip.link_lookup(ifname="br0")[0]
        ip.link("set", index=br, state="up")
    for i in (1, 2):
        with net.ipr(h) as ip:
            ip.link("add", ifname=f"h{i}", kind="veth", peer={"ifname": f"s{i}", "net_ns_fd": sw})
            idx = ip.link_lookup(ifname=f"h{i}")[0]
            ip.addr("add", index=idx, address=f"198.18.23.{i}", prefixlen=24)
            ip.link("set", index=idx, state="up")
        with net.ipr(sw) as ip:
            ip.link("set", index=ip.link_lookup(ifname=f"s{i}")[0], master=br, state="up")
    yield h
    for dev in ("h1", "h2"):
        assert host.attached_program(dev, h) is None, f"XDP left on {dev}"


def _open_both(places, kind: str, addrs=(None, None)):
    """Both ranks' States on one store: rank r on ``places[r]`` (netns, interface), publishing
    ``addrs[r]`` (None: the interface's IPv4 address).  (States, the errors of those that failed.)"""
    store = dist.HashStore()
    states, errors = run_threads(
        lambda r: ptorch.State.open(store, r, 2, transport=kind, iface=places[r][1], netns=places[r][0],
                                    addr=addrs[r], config=Config(job=JOB, peer_timeout=5.0)), range(2), 60)
    return [states.get(r) for r in range(2)], list(errors.values())


def _average_and_close(states, n: int = 70_001, rounds: int = 3) -> list[dict]:
    """Exact rounds of seeded vectors; the host programs' counters; every State closed."""
    rng = np.random.default_rng(21)
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
    try:
        for _ in range(rounds):
            futs = [s.submit(lambda col, x: col.allreduce(x, exact=True), x) for s, x in zip(states, xs)]
            for f in futs:
                np.testing.assert_allclose(f.wait(), (xs[0] + xs[1]) / 2, atol=1e-6)
        return [s.host_counters() for s in states]
    finally:
        run_threads(lambda r: states[r].close(), range(2), 30)


@pytest.mark.parametrize("kind, family", [("xsk", 4), ("xsk-ktx", 4), ("xsk", 6)])
def test_two_ranks_across_a_router_average_exactly(routed, kind, family):
    """Before routes were read, ``xsk`` framed packets for the peer's own MAC (the router drops
    them) and both kinds bound the peer's MAC on the host program (the router's arrive instead,
    dropped as ``spoof_mac``): the round never completed."""
    addrs = [f"{SUBNET[s]}.2" if family == 4 else f"{SUBNET6[s]}:2" for s in "ab"]
    states, errors = _open_both([routed["a"], routed["b"]], kind, addrs)
    assert not errors, errors
    dp = states[0].data_plane
    assert dp.link_mac(f"{SUBNET['b']}.2", "02:00:00:00:00:0b") is None  # routed: the gateway's MAC
    assert dp.link_mac(f"{SUBNET['a']}.1", "02:00:00:00:00:0a") == "02:00:00:00:00:0a"  # on the link
    for c in _average_and_close(states):
        assert c["drop"]["spoof_mac"] == c["drop"]["spoof_ip"] == 0 and c["redirect"] > 0, c


def test_two_ranks_of_one_host_on_their_own_interfaces(one_host):
    """``xsk`` sends rank to rank over the link the two interfaces share (each other's published
    MAC; the kernel would deliver a local address inside the host), exactly; ``xsk-ktx``, whose
    transmit is the kernel's, is refused at the start in one line instead of timing out."""
    places = [(one_host, "h1"), (one_host, "h2")]
    states, errors = _open_both(places, "xsk")
    assert not errors, errors
    for c in _average_and_close(states):
        assert c["drop"]["spoof_mac"] == c["drop"]["spoof_ip"] == 0 and c["redirect"] > 0, c
    states, errors = _open_both(places, "xsk-ktx")
    for s in states:
        if s is not None:
            s.close(barrier=False)
    assert len(errors) == 2 and all(isinstance(e, TransportError) and e.errno == errno.EADDRNOTAVAIL
                                    for e in errors), errors
    assert "is an address of this host: kernel transmit delivers to it inside the host, where its " \
           "AF_XDP socket never sees it; use transport xsk (or udp) for ranks that share a host" in str(errors[0])


def test_a_peer_the_interface_cannot_reach_is_one_line_naming_the_fix(routed):
    a, dev = routed["a"]
    with net.ipr(a) as ip:
        ip.link("add", ifname="dz", kind="veth", peer={"ifname": "dy"})
        idx = ip.link_lookup(ifname="dz")[0]
        ip.addr("add", index=idx, address="198.18.24.1", prefixlen=24)
        ip.link("set", index=idx, state="up")
    with open_dataplane("xsk", dev, netns=a, job=JOB, rank=0, world=2) as dp:
        cases = {
            "198.18.24.7": r"198\.18\.24\.7 is routed out of dz, not xa: open the data plane on dz, "
                           r"or route 198\.18\.24\.7 through xa$",
            "198.18.99.1": r"no route to 198\.18\.99\.1: add one through xa \(ip route add 198\.18\.99\.1 "
                           r"via GATEWAY dev xa\)$",
            f"{SUBNET['a']}.2": r"is an address of this host: frames to it leave by xa and come back over the "
                                r"link; give its interface's MAC \(mac=\)",
        }
        for addr, message in cases.items():
            with pytest.raises(TransportError, match=message) as e:
                dp.transport.add_peer(addr)
            assert e.value.errno == errno.ENETUNREACH and "\n" not in e.value.strerror
        # across the router: the gateway's MAC, and the route's source address
        peer = dp.transport.add_peer(f"{SUBNET['b']}.2")
        with net.ipr(a) as ip:
            gw_mac = next(r.get_attr("NDA_LLADDR") for r in ip.get_neighbours(dst=f"{SUBNET['a']}.1"))
        frame = bytes(dp.xsk.sockets[0]._tmpl.table[peer])
        assert frame[:6] == bytes.fromhex(gw_mac.replace(":", ""))
        assert frame[26:30] == bytes(int(p) for p in f"{SUBNET['a']}.2".split("."))
