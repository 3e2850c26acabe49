"""Hostile traffic: seeded, mutated DBLP frames sprayed at a rank from a host of the job's network.

What the fuzz matrix (``tests/linux/test_fuzz_matrix.py``) and the soak (``bench/soak.py``) send
while a job runs.  :func:`mutants` makes a pool of whole Ethernet frames, each labelled with the
category it tests; :class:`Sprayer` sends them from a namespace through an ``AF_PACKET`` socket,
so nothing of the sender's stack fixes or refuses them (IPv6 to an IPv4-only host, a UDP length
that lies, a header cut short).

Categories (:data:`CATEGORIES`):

``bitflip``     1-8 random bits flipped anywhere in the DBLP header, payload or tag
``truncate``    the DBLP bytes cut at every length from 0 through the header (32) and beyond
``length``      the header's ``len`` field off by one, 0, 0xFFFF or random
``count``       ``nchunks`` 0 or past 2**24, or ``chunk >= nchunks``
``kind``        an unknown ``kind`` (0, 6..255)
``flags``       a random ``flags`` byte
``wrong_key``   tagged with another key (the job's epoch: the MAC is what fails)
``replay``      tagged with the job key under another epoch (a packet of an earlier run)
``untagged``    a well-formed packet without a tag, every other one header-only (no payload)
``oversize``    a DATA packet filling the MTU, longer than any chunk the job sends
``ipv6``        a well-formed packet over IPv6 (the rank's host may not speak it)
``udp_length``  the UDP or IPv4 length field lies about the datagram
``vlan``        a packet behind an 802.1Q tag (AF_XDP receivers take untagged frames)
``far_round``   a well-formed packet of a round far ahead of or behind the job's
``foreign_job`` a well-formed packet of another job id

Without a key a job accepts any well-formed packet of its own rounds by design
(docs/threat-model.md): :func:`mutants` then moves every packet to rounds far from the job's
(``keyless``) and leaves out any mutant that would still pass as one of the job's current rounds,
so what remains must be dropped and counted.  With a key every mutant lacks a valid tag and must
be dropped however well-formed its header is.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time

import numpy as np

from pydblp import net, wire
from pydblp.transport import frames

CATEGORIES = ("bitflip", "truncate", "length", "count", "kind", "flags", "wrong_key", "replay", "untagged",
              "oversize", "ipv6", "udp_length", "vlan", "far_round", "foreign_job")
OTHER_KEY = bytes(range(100, 132))  # a key no job holds
FAR = 1 << 20                        # keyless rounds start this far from 0: never one a test job runs
ETH_P_ALL = 0x0003
_LEN_OFF, _NCHUNKS_OFF, _CHUNK_OFF, _KIND_OFF, _FLAGS_OFF = 28, 24, 20, 3, 31


class Target:
    """Where the spray goes and whom it pretends to be.

    Args:
        mac, ip, port: the receiving rank's interface MAC, IPv4 address and data port.
        src_mac, src_ip: the sprayer's (its own interface: not a registered peer address).
        job, world, rank: the job, its size and the receiving rank (``dst`` of the packets).
        claim: the rank the packets claim to come from (``src``).
        key, epoch: the job key and run epoch (None: a keyless job).
        rounds: the job's rounds the spray overlaps (keyed; keyless spray stays ``FAR`` away).
        chunk_bytes: the job's payload per packet.
    """

    def __init__(self, mac: str, ip: str, port: int, src_mac: str, src_ip: str, *, job: int, world: int,
                 rank: int = 0, claim: int = 1, key: bytes | None = None, epoch: int = 0,
                 rounds: tuple[int, int] = (0, 64), chunk_bytes: int = 1408):
        self.mac, self.ip, self.port, self.src_mac, self.src_ip = mac, ip, port, src_mac, src_ip
        self.job, self.world, self.rank, self.claim = job, world, rank, claim
        self.key, self.epoch, self.rounds, self.chunk_bytes = key, epoch, rounds, chunk_bytes


def frame(t: Target, dblp: bytes, v6: bool = False, sport: int = 40000) -> bytes:
    """``dblp`` (any bytes) as the UDP payload of a whole Ethernet frame to ``t``, lengths and
    checksums right (``v6``: between benchmarking IPv6 addresses in 2001:2::/48 made from the
    IPv4 ones; the receiving host need not have them: its XDP program sees the frame first)."""
    src = ipaddress.ip_address(t.src_ip)
    dst = ipaddress.ip_address(t.ip)
    if v6:
        src = ipaddress.IPv6Address("2001:2::" + format(int(src) & 0xFFFF, "x"))
        dst = ipaddress.IPv6Address("2001:2::" + format(int(dst) & 0xFFFF, "x"))
    tmpl, _ = frames.template(t.src_mac, t.mac, src, dst, sport, t.port)
    f = bytearray(tmpl)
    udp_len = frames.UDP_LEN + len(dblp)
    u = len(tmpl) - frames.UDP_LEN
    f[u + 4: u + 6] = udp_len.to_bytes(2, "big")
    if not v6:
        f[16:18] = (frames.IPV4_LEN + udp_len).to_bytes(2, "big")
        f[24:26] = frames.checksum(bytes(f[frames.ETH_LEN: frames.ETH_LEN + frames.IPV4_LEN])).to_bytes(2, "big")
        return bytes(f) + dblp
    f[18:20] = udp_len.to_bytes(2, "big")
    pseudo = src.packed + dst.packed + udp_len.to_bytes(4, "big") + bytes([0, 0, 0, frames.IPPROTO_UDP])
    c = frames.checksum(pseudo + bytes(f[u:]) + dblp) or 0xFFFF
    f[u + 6: u + 8] = c.to_bytes(2, "big")
    return bytes(f) + dblp


def _packet(t: Target, rng, *, job=None, rnd=None, key=None, epoch=None, payload_len=None) -> bytes:
    """One well-formed DBLP packet from ``t.claim`` to ``t.rank``: DATA mostly, else control."""
    kind = wire.Kind(int(rng.choice([1, 1, 1, 1, 2, 3, 4, 5])))
    nchunks = int(rng.integers(1, 300))
    if rnd is None:
        lo, hi = t.rounds if t.key is not None else (FAR, FAR + 1000)
        rnd = int(rng.integers(lo, hi))
    h = wire.Header(kind=kind, job=t.job if job is None else job, round=rnd & 0xFFFFFFFF,
                    tensor=int(rng.integers(0, 3)), src=t.claim, dst=t.rank, prio=int(rng.integers(0, 8)),
                    dtype=wire.Dtype.F32, chunk=int(rng.integers(0, nchunks)), nchunks=nchunks,
                    tol=int(rng.integers(0, 256)))
    if payload_len is None:
        payload_len = int(rng.integers(1, t.chunk_bytes + 1)) if kind == wire.Kind.DATA else int(rng.integers(0, 64))
    payload = rng.integers(0, 256, payload_len, dtype=np.uint8).tobytes()
    return wire.encode(h, payload, key=key, epoch=0 if epoch is None else epoch)


def _mutant(t: Target, cat: str, rng, i: int) -> tuple[bytes, bool]:
    """(DBLP bytes, over IPv6) of one mutant of category ``cat`` (``i``: its index, for sweeps)."""
    keyed = t.key is not None
    tagged = {"key": t.key, "epoch": t.epoch} if keyed else {}
    if cat == "wrong_key":
        return _packet(t, rng, key=OTHER_KEY, epoch=t.epoch), False
    if cat == "replay":
        return _packet(t, rng, key=t.key or OTHER_KEY, epoch=(t.epoch + 1 + int(rng.integers(0, 1000))) & 0xFFFFFFFF), False
    if cat == "untagged":  # every other one header-only: a frame with no payload byte at all
        return _packet(t, rng, payload_len=0 if i % 2 == 0 else None), False
    if cat == "oversize":
        room = 1500 - frames.IPV4_LEN - frames.UDP_LEN - wire.HEADER_LEN - (wire.TAG_LEN if keyed else 0)
        h = wire.Header.unpack(_packet(t, rng)[:wire.HEADER_LEN]).replace(kind=wire.Kind.DATA)
        return wire.encode(h, rng.integers(0, 256, room, dtype=np.uint8).tobytes(),
                           key=OTHER_KEY if keyed else None, epoch=t.epoch), False
    if cat == "ipv6":
        return _packet(t, rng), True
    if cat == "far_round":
        rnd = int(rng.choice([FAR + int(rng.integers(0, 1000)), (1 << 32) - 1 - int(rng.integers(0, 1000))]))
        return _packet(t, rng, rnd=rnd, key=OTHER_KEY if keyed else None, epoch=t.epoch), False
    if cat == "foreign_job":
        return _packet(t, rng, job=(t.job + 1 + int(rng.integers(0, 100))) & 0xFFFFFFFF), False
    b = bytearray(_packet(t, rng, **tagged) if keyed else _packet(t, rng))
    if keyed:  # what a forger without the key holds: the right header, a tag it cannot make
        b[-wire.MAC_LEN:] = rng.integers(0, 256, wire.MAC_LEN, dtype=np.uint8).tobytes()
    if cat == "bitflip":
        for bit in rng.integers(0, len(b) * 8, int(rng.integers(1, 9))):
            b[bit >> 3] ^= 1 << (bit & 7)
    elif cat == "truncate":
        cut = i % (wire.HEADER_LEN + 9) if i % 2 == 0 else int(rng.integers(0, len(b)))
        b = b[:cut]
    elif cat == "length":
        true = int.from_bytes(b[_LEN_OFF:_LEN_OFF + 2], "big")
        v = int(rng.choice([0, true + 1, max(true - 1, 0), 0xFFFF, int(rng.integers(0, 0x10000))]))
        if v == true:
            v ^= 0x8000
        b[_LEN_OFF:_LEN_OFF + 2] = v.to_bytes(2, "big")
    elif cat == "count":
        n = int.from_bytes(b[_NCHUNKS_OFF:_NCHUNKS_OFF + 4], "big")
        which = i % 4
        if which == 0:
            b[_NCHUNKS_OFF:_NCHUNKS_OFF + 4] = bytes(4)
        elif which == 1:
            b[_NCHUNKS_OFF:_NCHUNKS_OFF + 4] = (wire.MAX_NCHUNKS + 1 + int(rng.integers(0, 1000))).to_bytes(4, "big")
        elif which == 2:
            b[_NCHUNKS_OFF:_NCHUNKS_OFF + 4] = b"\xff\xff\xff\xff"
        else:
            b[_CHUNK_OFF:_CHUNK_OFF + 4] = (n + int(rng.integers(0, 1000))).to_bytes(4, "big")
    elif cat == "kind":
        b[_KIND_OFF] = int(rng.choice([0, *range(6, 256)]))
    elif cat == "flags":
        b[_FLAGS_OFF] = int(rng.integers(0, 256))
    elif cat not in ("udp_length", "vlan"):  # (those change the frame: mutants)
        raise ValueError(f"unknown category {cat!r}: one of {', '.join(CATEGORIES)}")
    return bytes(b), False


def _harmless_without_key(t: Target, dblp: bytes) -> bool:
    """A keyless job may take a well-formed packet of its own job and rounds near its own: such a
    mutant is a forgery the threat model leaves to the key, not hostile input it must drop."""
    try:
        h = wire.decode(dblp, world_size=t.world, rank=t.rank)[0]
    except wire.WireError:
        return True
    ahead = (h.round - t.rounds[0]) & 0xFFFFFFFF  # rounds behind the first are finished: ignored
    return h.job != t.job or ahead >= FAR // 2


def mutants(t: Target, n: int, seed: int, categories=CATEGORIES) -> list[tuple[str, bytes]]:
    """``n`` frames to ``t``, ``(category, frame)``, the categories in turn; a function of ``seed``.

    Raises:
        ValueError: an unknown category.
    """
    rng = np.random.default_rng(seed)
    out = []
    cats = list(categories)
    for c in cats:
        if c not in CATEGORIES:
            raise ValueError(f"unknown category {c!r}: one of {', '.join(CATEGORIES)}")
    i = 0
    while len(out) < n:
        cat = cats[i % len(cats)]
        dblp, v6 = _mutant(t, cat, rng, i // len(cats))
        i += 1
        if t.key is None and not _harmless_without_key(t, dblp):
            continue
        f = frame(t, dblp, v6)
        if cat == "udp_length":
            f = bytearray(f)
            u = frames.ETH_LEN + frames.IPV4_LEN
            if rng.integers(0, 2):
                f[u + 4: u + 6] = int(rng.choice([0, 7, len(dblp) + 9, 0xFFFF])).to_bytes(2, "big")
            else:
                f[16:18] = int(rng.choice([0, 20, 27, len(f) - 13, 0xFFFF])).to_bytes(2, "big")
            f = bytes(f)
        elif cat == "vlan":  # (802.1Q, a random VLAN id, before the EtherType)
            f = f[:12] + b"\x81\x00" + int(rng.integers(1, 4095)).to_bytes(2, "big") + f[12:]
        out.append((cat, f))
    return out


class Sprayer:
    """Sends frames from ``ifname`` in namespace ``netns`` through an ``AF_PACKET`` socket, in a
    thread of its own, until told to stop or a bound is reached (every loop is bounded).

    Args:
        netns, ifname: where the frames leave (a host of the job's network, not one of its ranks).
        pool: ``(category, frame)`` pairs (:func:`mutants`), sent in turn, round and round.
        count: frames to send at most; ``duration``: seconds at most; ``pps``: frames a second at
            most (0: as fast as the socket takes them).

    :attr:`sent` counts frames handed to the socket by category; a frame the socket refuses
    (a full queue: ``ENOBUFS``) is retried after a pause, never counted twice.  :meth:`close`
    (also ``with``) stops the thread and closes the socket.
    """

    def __init__(self, netns: str | None, ifname: str, pool: list[tuple[str, bytes]], *, count: int,
                 duration: float, pps: float = 0):
        if not pool:
            raise ValueError("an empty pool: give mutants(...) at least one frame")
        self.pool, self.count, self.duration, self.pps = pool, int(count), float(duration), float(pps)
        self.sent: dict[str, int] = dict.fromkeys(sorted({c for c, _ in pool}), 0)
        self._stop = threading.Event()
        with net.in_netns(netns):
            self._sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        try:
            self._sock.bind((ifname, 0))
        except OSError:
            self._sock.close()
            raise
        self._thread = threading.Thread(target=self._run, name="pydblp-sprayer", daemon=True)

    @property
    def total(self) -> int:
        return sum(self.sent.values())

    def start(self) -> "Sprayer":
        self._thread.start()
        return self

    def _run(self) -> None:
        t0 = time.monotonic()
        end = t0 + self.duration
        i = 0
        while i < self.count and not self._stop.is_set():
            now = time.monotonic()
            if now >= end:
                break
            if self.pps and i >= (now - t0) * self.pps:
                time.sleep(min(0.002, end - now))
                continue
            cat, f = self.pool[i % len(self.pool)]
            try:
                self._sock.send(f)
            except OSError:  # ENOBUFS and the like: the device queue is full, try again shortly
                time.sleep(0.0005)
                continue
            self.sent[cat] += 1
            i += 1

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the thread to end (its bounds); True if it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        self._sock.close()

    def __enter__(self) -> "Sprayer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
