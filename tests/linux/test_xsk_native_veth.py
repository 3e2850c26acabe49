"""The AF_XDP transport's compiled loops against its Python path on a real socket (veth, copy mode).

The same seeded traffic is sent and received with ``native=True`` and with ``native=False``
(both ends alike) and must give the same packets, rows and counters: through pydblp's host
program (headers checked in the kernel), and through a foreign XDP program that redirects every
frame, so that malformed ones sent from a raw socket reach the receive path's own checks.
"""

from __future__ import annotations

import socket

import numpy as np
import pytest

from pydblp import net, wire
from pydblp.transport import Batch, xsk_native
from pydblp.transport.xsk import XskTransport
from tests.helpers import ADDR, MAC, foreign_xskmap, make_pair, needs_native, packets, xsk

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns,
              needs_native("xsk", xsk_native.load_lib() is not None)]

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
