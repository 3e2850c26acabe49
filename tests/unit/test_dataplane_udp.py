"""``open_dataplane`` without root: the udp kind on loopback, and the arguments it refuses."""

from __future__ import annotations

import numpy as np
import pytest

from pydblp import wire
from pydblp.dataplane import KINDS, DataPlane, Endpoint, open_dataplane
from pydblp.transport import Batch
from pydblp.transport.udp import UdpTransport


def test_udp_on_loopback_publishes_where_it_listens_and_carries_packets():
    with open_dataplane("udp", port=0) as a, open_dataplane("udp", port=0) as b:
        assert isinstance(a, DataPlane) and isinstance(a.transport, UdpTransport) and a.host is None
        assert a.endpoint == Endpoint("127.0.0.1", a.transport.port, None, 0, None, (0,))
        assert a.queues == (0,) and a.describe() == f"udp on any interface port {a.transport.port}"
        assert a.endpoint.port != 0 and a.endpoint.as_dict()["port"] == a.transport.port
        pb = a.transport.add_peer(b.endpoint.addr, b.endpoint.port)
        h = wire.empty_batch(4)
        h["kind"], h["job"], h["nchunks"], h["chunk"] = wire.Kind.DATA, 5, 4, np.arange(4)
        out = Batch.fill(h, np.full((4, 64), 7, np.uint8), np.full(4, 64), pb)
        assert a.transport.send(out) == 4
        got = 0
        for _ in range(50):
            got += len(b.transport.recv(timeout=0.1))
            if got == 4:
                break
        assert got == 4
        t = a.transport
    assert a.transport is None and t.closed
    a.close()  # twice is fine


def test_addr_overrides_what_is_published():
    with open_dataplane("udp", port=0, addr="198.18.0.9") as dp:
        assert dp.endpoint.addr == "198.18.0.9"


@pytest.mark.parametrize("kind, kw, match", [
    ("tcp", {}, "transport 'tcp': use udp, xsk or xsk-ktx"),
    ("xsk", {}, "the xsk transport needs iface="),
    ("xsk-ktx", {}, "the xsk-ktx transport needs iface="),
    ("xsk-ktx", {"iface": "lo"}, "the xsk-ktx transport needs job="),
    ("xsk", {"iface": "lo", "job": 3, "port": 0}, "port 0: want an integer in 1..65535"),
    ("xsk", {"iface": "lo", "job": 3, "queue": 1, "queues": [0, 1]}, r"queue=1 and queues=\[0, 1\]: give one"),
    ("udp", {"steer": 1}, "steer= is for the AF_XDP kinds"),
])
def test_bad_arguments_are_refused_before_anything_opens(kind, kw, match):
    with pytest.raises(ValueError, match=match):
        open_dataplane(kind, **kw)


def test_kinds():
    assert KINDS == ("udp", "xsk", "xsk-ktx")
