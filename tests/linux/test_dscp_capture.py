"""Every class's DSCP on the wire: both transports' packets captured on the receiving veth.

An AF_PACKET socket on ``vb`` sees what reaches the kernel there (the host program passes the
UDP job's packets to the stack); each frame's DSCP is checked against the default map for its
DBLP priority, and ``dblp dump -v``'s decoding of a captured frame shows it too.
"""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from pydblp import dscp, net, wire
from pydblp.transport import frames
from pydblp.transport.udp import UdpTransport
from tests.helpers import ADDR, JOB_UDP, MAC, packets, xsk

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns]
ETH_P_ALL = 0x0003


def _capture(pair):
    with net.in_netns(pair["ns"][1]):
        s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.bind(("vb", 0))
    s.settimeout(0.2)
    return s


def _sender(pair, kind):
    if kind == "udp":
        return UdpTransport("va", netns=pair["ns"][0], port=0, dscp="default")
    return xsk(pair, 0, dscp="default", **({"tx": "kernel"} if kind == "xsk-ktx" else {}))


@pytest.mark.parametrize("family", [4, 6])
@pytest.mark.parametrize("kind", ["udp", "xsk", "xsk-ktx"])
def test_each_class_leaves_with_its_dscp(pair, kind, family):
    from scapy.layers.l2 import Ether

    from pydblp import inspect

    n = 64
    want = dscp.resolve("default")
    cap = _capture(pair)
    with cap, _sender(pair, kind) as t:
        peer = t.add_peer(ADDR[family][1], wire.DEFAULT_PORT, mac=MAC[1])
        b = packets(0, n, 0, 1, job=JOB_UDP, peer=peer, maxlen=200)
        b.headers["prio"] = np.arange(n) % 8
        assert t.send(b) == n
        if hasattr(t, "flush"):
            assert t.flush()
        seen, sample = {}, {}
        deadline = time.monotonic() + 5
        while len(seen) < n and time.monotonic() < deadline:
            try:
                fr = cap.recv(4096)
            except TimeoutError:
                continue
            blk = np.frombuffer(fr.ljust(frames.PARSE_WIDTH, b"\0"), np.uint8)[None]
            ok, off, _, fam = frames.parse(blk, np.array([len(fr)]), wire.DEFAULT_PORT)
            if not ok[0] or int(fam[0]) != family:
                continue
            h = wire.Header.unpack(fr[int(off[0]):])
            if h.job != JOB_UDP:
                continue
            seen[h.chunk] = (h.prio, int(frames.dscp_of(blk, family)[0]))
            sample.setdefault(h.prio, fr)
    assert sorted(seen) == list(range(n))
    assert all(d == want[p] for p, d in seen.values()), seen
    for prio, fr in sample.items():  # what dblp dump -v shows for that frame
        body = inspect.describe(Ether(fr)).splitlines()
        assert f"    dscp     {dscp.name(int(want[prio]))} ({want[prio]})" in body
