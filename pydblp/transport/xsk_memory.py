"""An :class:`~pydblp.transport.xsk.XskTransport` over plain memory, with the kernel's part played in numpy.

:class:`MemoryXsk` has the transport's rings and UMEM in process memory and
no socket: :meth:`MemoryXsk.deliver` does what the kernel does on receive
(takes fill-ring frames, writes frames into them at ``XDP_PACKET_HEADROOM``,
publishes rx descriptors) and transmit "happens" when the transport kicks
(every released tx descriptor's frame is appended to :attr:`MemoryXsk.wire`
and its address completed).  The transport's own receive and transmit code
runs unchanged on it, so the pure-Python and the compiled paths can be
compared byte for byte without root: :func:`agree` is the compiled
library's self test (:mod:`pydblp.transport.xsk_native`), and
tests/unit/test_xsk_native.py goes further.
"""

from __future__ import annotations

import threading

import numpy as np

from pydblp import dscp as dscp_mod
from pydblp import wire
from pydblp.transport import frames
from pydblp.transport.base import Batch, check_port, parse_ip
from pydblp.transport.pacer import Pacer
from pydblp.transport.xsk import XskTransport
from pydblp.transport.xsk_ring import (ADDR_DTYPE, DESC_DTYPE, XDP_PACKET_HEADROOM, XDP_PKT_CONTD, Ring,
                                       pow2)

OFFS = (0, 64, 256, 128)  # producer, consumer, descriptors, flags: the kernel's cache-line layout
MAC = b"\x02\x00\x5e\x10\x00\x01"


def _ring(n: int, dtype: np.dtype) -> Ring:
    return Ring(bytearray(256 + n * dtype.itemsize), OFFS, n, dtype)


class MemoryXsk(XskTransport):
    """An XskTransport without a socket: rings and UMEM in memory, the kernel in numpy.

    Args:
        native: as :class:`~pydblp.transport.xsk.XskTransport`'s.
        port: the UDP port received (and sent from).
        frame_size, rx_frames, tx_frames: as the transport's (small by default).
        validated: whether receive trusts the headers (as with pydblp's host program).
        sg: whether multi-buffer is on (receive then passes multi-descriptor frames to Python).
        dscp: as the transport's.
        rate: transmit pacing, bits/s (0: none).
        lib: a loaded library to use (the self test passes the one being checked).
    """

    def __init__(self, native: bool | None = False, *, port: int = wire.DEFAULT_PORT, frame_size: int = 2048,
                 rx_frames: int = 64, tx_frames: int = 64, validated: bool = False, sg: bool = False,
                 dscp="off", rate: float = 0, lib=None):
        self.ifname, self.netns, self.queue, self.port = "mem", None, 0, check_port(port)
        self.spin, self.tx, self._ktx, self._ctrl, self._ctrl_last = 0.0, "xsk", None, None, None
        self._tx_lock = threading.Lock()
        self._fd, self._sock, self._umem_mm, self._host, self._xskmap = 0, None, None, None, None
        self._xlib, self.native = None, False
        self._validated = validated
        self._pressure_fn, self._pressure, self._inserted = None, -1, False
        self.frame_size = frame_size
        self.rx_frames, self.tx_frames = pow2(rx_frames, "rx_frames"), pow2(tx_frames, "tx_frames")
        self._pacer = Pacer(rate, None, tx_frames, 4 * frame_size)
        self.rate, self.rate_burst = self._pacer.rate, self._pacer.burst
        self._sources, self._tmpl = frames.Sources(), frames.Templates()
        self._dscp = dscp
        self._tos = dscp_mod.tos_table(dscp)
        self._c = dict.fromkeys(("rx_packets", "rx_bytes", "tx_packets", "tx_bytes", "rx_invalid",
                                 "rx_truncated", "rx_errors", "tx_busy_drops", "tx_kicks", "rx_polls", "tx_held"), 0)
        self.ifindex, self.mac = 1, MAC
        nframes = rx_frames + tx_frames
        self._umem = np.zeros(nframes * frame_size, np.uint8)
        self._umem2d = self._umem.reshape(nframes, frame_size)
        self._rings = [_ring(rx_frames, DESC_DTYPE), _ring(tx_frames, DESC_DTYPE),
                       _ring(2 * rx_frames, ADDR_DTYPE), _ring(2 * tx_frames, ADDR_DTYPE)]
        self._rx, self._tx, self._fill, self._comp = self._rings
        self.tx_budget = tx_frames
        self._fill_pending = np.zeros(0, np.uint64)
        self._lent = self._taking = self._taken = None
        self._fill_push(np.arange(rx_frames, dtype=np.uint64) * np.uint64(frame_size))
        self._tx_free = np.arange(rx_frames, nframes, dtype=np.uint64) * np.uint64(frame_size)
        self._tx_head, self._tx_nfree, self._tx_outstanding = 0, tx_frames, 0
        self._wprod = 0
        self._tx_words = self._tx.desc.view(np.uint64).reshape(-1, 2)
        self.need_wakeup, self.sg, self.zerocopy = False, sg, False
        self._poll = None
        self.wire: list[bytes] = []  # frames "transmitted", in order
        self._native_setup(native, lib)

    def add_peer(self, addr, port: int = wire.DEFAULT_PORT, mac=b"\x02\x00\x5e\x10\x00\x02", src=None) -> int:
        """Register ``addr`` (``src``: the local address, default one of the same family)."""
        dst = parse_ip(addr)
        src = parse_ip(src if src is not None else ("198.18.0.1" if dst.version == 4 else "2001:db8::1"))
        t, partial = frames.template(self.mac, frames.mac_bytes(mac), src, dst, self.port, check_port(port))
        pid = self._tmpl.add(t, partial)
        self._sources.add(dst)
        self._native_sources()
        return pid

    def _kick(self) -> bool:
        """The kernel transmits every released descriptor: frames to :attr:`wire`, addresses completed."""
        tx, comp = self._tx, self._comp
        cons, prod = int(tx.cons[0]), int(tx.prod[0])
        n = (prod - cons) & 0xFFFFFFFF
        if n:
            d = tx.at(cons, n).copy()
            pending = b""
            for a, ln, opt in zip(d["addr"].tolist(), d["len"].tolist(), d["options"].tolist()):
                pending += self._umem[a: a + ln].tobytes()
                if not opt & XDP_PKT_CONTD:
                    self.wire.append(pending)
                    pending = b""
            done = comp.produce(d["addr"].astype(np.uint64))
            assert done == n, "completion ring full"
            tx.consume(cons, n)
        return True

    def deliver(self, frame_list, headroom: int = XDP_PACKET_HEADROOM, segment: int | None = None) -> int:
        """The kernel receives ``frame_list`` (bytes each): each into the next fill-ring frame at
        ``headroom`` (a frame longer than ``segment`` bytes spans several, chained with
        ``XDP_PKT_CONTD``); how many frames were delivered (fewer when the fill or rx ring runs out)."""
        fill, rx, fs = self._fill, self._rx, self.frame_size
        seg = segment or fs - headroom
        done = 0
        for f in frame_list:
            parts = [f[i: i + seg] for i in range(0, max(len(f), 1), seg)]
            if fill.used() < len(parts) or rx.free() < len(parts):
                break
            fc = int(fill.cons[0])
            addrs = [int(a) for a in fill.at(fc, len(parts))]
            fill.consume(fc, len(parts))
            prod = int(rx.prod[0])
            for j, (a, p) in enumerate(zip(addrs, parts)):
                base = a - a % fs
                self._umem[base + headroom: base + headroom + len(p)] = np.frombuffer(p, np.uint8)
                e = rx.desc[(prod + j) & rx.mask]
                e["addr"], e["len"] = base + headroom, len(p)
                e["options"] = XDP_PKT_CONTD if j < len(parts) - 1 else 0
            rx.prod[0] = (prod + len(parts)) & 0xFFFFFFFF
            done += 1
        return done

    def xdp_statistics(self) -> dict:
        return {}

    def close(self) -> None:
        self._fd = -1


def seeded_batch(n: int, peers, seed: int, width: int = 600) -> Batch:
    """``n`` DATA packets to ``peers`` (cycled) with seeded fields, payloads and lengths (0, odd, full)."""
    rng = np.random.default_rng(seed)
    h = wire.empty_batch(n)
    h["kind"], h["job"], h["round"], h["src"], h["dst"] = wire.Kind.DATA, 7, seed, 1, 0
    h["nchunks"] = n
    h["chunk"] = np.arange(n)
    h["prio"] = rng.integers(0, 8, n)
    h["tol"] = rng.integers(0, 256, n)
    lens = rng.integers(0, width + 1, n)
    lens[:3] = (0, 1, width)[:n]
    pay = rng.integers(0, 256, (n, width), dtype=np.uint8)
    return Batch.fill(h, pay, lens, np.resize(np.asarray(peers, np.int32), n))


def agree(lib) -> bool:
    """Whether ``lib`` and the Python path build the same frames from a seeded batch (IPv4 and
    IPv6 peers, DSCP set, half of them ECN-capable) and receive the same batch (ECN fields
    included) from them plus malformed ones and CE-marked ones."""
    out = []
    for native in (False, True):
        t = MemoryXsk(native, dscp="default", lib=lib if native else None)
        peers = [t.add_peer("198.18.0.2"), t.add_peer("2001:db8::2")]
        t.send(seeded_batch(6, peers, 5))
        t.set_ect(True)
        t.send(seeded_batch(6, peers, 6))
        out.append(t.wire)
    if out[0] != out[1]:
        return False
    bad = [f[:60] for f in out[0][:2]] + [f[:30] + b"\0" + f[31:] for f in out[0][2:4]]
    ce = [f[:15] + bytes([f[15] | (3 if f[12:14] == b"\x08\x00" else 0x30)]) + f[16:] for f in out[0][:2]]
    got = []
    for native in (False, True):
        r = MemoryXsk(native, lib=lib if native else None)
        r.add_peer("198.18.0.1")
        r.add_peer("2001:db8::1")
        r.deliver(out[0] + bad + ce)
        b = r.recv(Batch.empty(32, 400))
        got.append((b.headers.tobytes(), b.lengths.tolist(), b.peer.tolist(), b.ecn.tolist(),
                     [b.payload[i, : b.lengths[i]].tobytes() for i in range(b.n)], r.stats()))
    return got[0] == got[1] and got[0][3][:12] + got[0][3][-2:] == [0] * 6 + [2] * 6 + [3] * 2
