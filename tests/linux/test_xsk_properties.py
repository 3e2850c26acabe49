"""Property test of the AF_XDP socket's own receive parsing on arbitrary frames.

Behind a foreign XDP program that redirects every frame to the socket (no kernel checks: what
pydblp's host program would have dropped reaches :class:`~pydblp.transport.xsk.XskTransport`
whole), arbitrary frames (random bytes, any UDP payload to the port over IPv4 and IPv6, valid
DBLP packets cut or with a lying length) go in: ``recv`` never raises, hands up exactly the
valid DBLP packets to its port, bit exact, and counts the rest in ``rx_invalid``.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pydblp import net, wire
from pydblp.testbed.hostile import Sprayer, Target, frame
from pydblp.transport import Batch
from pydblp.transport.xsk import XskTransport
from tests.helpers import ADDR, MAC, foreign_xskmap, make_pair

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns]

PORT = wire.DEFAULT_PORT


@pytest.fixture(scope="module")
def rig(bpf_xdp):
    """Namespaces a <-> b; on vb a foreign program redirecting everything to one AF_XDP socket."""
    a, b = make_pair()
    try:
        with foreign_xskmap("vb", b) as xskmap, \
                XskTransport("vb", netns=b, xskmap=xskmap, rx_frames=1024, tx_frames=64) as t:
            target = Target(MAC[1], ADDR[4][1], PORT, MAC[0], ADDR[4][0], job=5, world=2)
            yield {"ns": a, "t": t, "target": target}
    finally:
        with contextlib.suppress(Exception):
            net.netns_del(a)
        with contextlib.suppress(Exception):
            net.netns_del(b)


def _dblp(kind, n, cut, lie):
    d = wire.encode(wire.Header(kind=kind, job=5, src=0, dst=1, nchunks=9, chunk=n % 9),
                    bytes((n * 13 + i) & 0xFF for i in range(n)))
    if lie:
        d = d[:28] + ((n + lie) & 0xFFFF).to_bytes(2, "big") + d[30:]
    return d[:cut] if cut is not None else d


dblp = st.builds(_dblp, st.sampled_from(list(wire.Kind)), st.integers(0, 1400),
                 st.one_of(st.none(), st.integers(0, 40)), st.sampled_from([0, 0, 1, -1, 0x8000]))
item = st.one_of(
    st.tuples(st.just("raw"), st.binary(min_size=14, max_size=1514), st.booleans()),
    st.tuples(st.just("udp"), st.binary(min_size=0, max_size=1400), st.booleans()),
    st.tuples(st.just("dblp"), dblp, st.booleans()),
)


def _frame(target, what, data, v6):
    if what == "raw":  # anything, addressed to the socket's NIC so the veth delivers it
        return bytes.fromhex(MAC[1].replace(":", "")) + data[6:]
    return frame(target, data, v6=v6)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(items=st.lists(item, min_size=1, max_size=30))
def test_af_xdp_receive_hands_up_exactly_the_valid_packets(rig, items):
    t, target = rig["t"], rig["target"]
    frames_ = [_frame(target, *it) for it in items]
    good = [data for what, data, _ in items if what != "raw" and wire.validate(data) == wire.Reason.OK]
    before = t.stats()
    with Sprayer(rig["ns"], "va", [("x", f) for f in frames_], count=len(frames_), duration=10) as sp:
        sp.start()
        assert sp.wait(10)
    into, seen = Batch.empty(64, 1408), []
    end = time.monotonic() + 3
    while time.monotonic() < end:
        b = t.recv(into, timeout=0.05)
        seen += [b.headers[i].tobytes() + b.payload[i, : b.lengths[i]].tobytes() for i in range(b.n)]
        now = t.stats()
        if now["rx_packets"] - before["rx_packets"] >= len(good) and \
                now["rx_packets"] + now["rx_invalid"] - before["rx_packets"] - before["rx_invalid"] >= len(frames_):
            break
    after = t.stats()
    assert after["rx_errors"] == before["rx_errors"] == 0
    assert sorted(seen) == sorted(good)  # every valid packet, bit exact, and nothing else
    # every other frame counted invalid (the namespace's own IPv6 housekeeping may add a few)
    assert after["rx_invalid"] - before["rx_invalid"] >= len(frames_) - len(good)
