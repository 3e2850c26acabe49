"""Whole Ethernet frames for DBLP packets, built and parsed with numpy.

The AF_XDP transport sends and receives raw frames: Ethernet → IPv4 (no
options on send) or IPv6 (no extension headers) → UDP → DBLP header →
payload.  Every function here works on a whole batch at once: per-peer
work is a loop over peers (a handful), per-packet work is array arithmetic.

On send, each peer has a template (the Eth/IP/UDP headers with lengths and
checksums zero) and a precomputed partial checksum; only the length fields
and checksums differ per packet.  The IPv4 header checksum is always
computed; the UDP checksum is 0 on IPv4 (allowed, RFC 768) and computed on
IPv6 (mandatory, RFC 8200 section 8.1).  A batch may carry a TOS byte per
packet (``tos``: :func:`pydblp.dscp.tos_table` of the header's priority),
written into the IPv4 TOS byte (the header checksum adjusted, RFC 1624) or
the IPv6 traffic class; the UDP checksum covers neither.  The byte's low two
bits are the ECN field (ECT(0) when the transport sends ECN-capable,
``set_ect``); :func:`ecn_of` reads it back from received frames.
"""

from __future__ import annotations

import ipaddress

import numpy as np

from pydblp import wire

ETH_LEN = 14
IPV4_LEN = 20
IPV6_LEN = 40
UDP_LEN = 8
ETH_P_IP = 0x0800
ETH_P_IPV6 = 0x86DD
IPPROTO_UDP = 17
HDR4 = ETH_LEN + IPV4_LEN + UDP_LEN   # 42: DBLP header offset, IPv4
HDR6 = ETH_LEN + IPV6_LEN + UDP_LEN   # 62: DBLP header offset, IPv6
TEMPLATE_WIDTH = HDR6
PARSE_WIDTH = ETH_LEN + 60 + UDP_LEN + wire.HEADER_LEN  # IPv4 with maximal options + UDP + DBLP


def mac_bytes(mac: str | bytes) -> bytes:
    if isinstance(mac, (bytes, bytearray)):
        if len(mac) != 6:
            raise ValueError(f"MAC must be 6 bytes, got {len(mac)}")
        return bytes(mac)
    b = bytes(int(x, 16) for x in mac.replace("-", ":").split(":"))
    if len(b) != 6:
        raise ValueError(f"bad MAC {mac!r}")
    return b


def fold(s: np.ndarray, rounds: int = 4) -> np.ndarray:
    """Fold 64-bit one's-complement sums to 16 bits (not inverted); sums below 2^32 need 2 rounds."""
    s = np.asarray(s, np.uint64)
    for _ in range(rounds):
        s = (s & np.uint64(0xFFFF)) + (s >> np.uint64(16))
    return s


def checksum(b: bytes, start: int = 0) -> int:
    """The Internet checksum (RFC 1071) of ``b``, from partial sum ``start`` (a pseudo-header's)."""
    if len(b) & 1:
        b += b"\0"
    s = start + int(np.frombuffer(b, ">u2").sum(dtype=np.uint64))
    while s >> 16:
        s = (s & 0xFFFF) + (s >> 16)
    return ~s & 0xFFFF


def _words(b: bytes) -> int:
    if len(b) % 2:
        b += b"\0"
    return int(np.frombuffer(b, ">u2").astype(np.uint64).sum())


def template(src_mac, dst_mac, src_ip, dst_ip, sport: int, dport: int) -> tuple[bytes, int]:
    """(Eth/IP/UDP header bytes with zero lengths and checksums, partial checksum).

    The partial checksum covers every constant 16-bit word that enters the
    IPv4 header checksum (IPv4) or the UDP checksum (IPv6: pseudo-header
    addresses and next header, ports).
    """
    src_ip, dst_ip = ipaddress.ip_address(src_ip), ipaddress.ip_address(dst_ip)
    if src_ip.version != dst_ip.version:
        raise ValueError(f"address families differ: {src_ip} -> {dst_ip}")
    ports = sport.to_bytes(2, "big") + dport.to_bytes(2, "big")
    eth = mac_bytes(dst_mac) + mac_bytes(src_mac)
    if dst_ip.version == 4:
        ip = bytes([0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, IPPROTO_UDP, 0, 0]) + src_ip.packed + dst_ip.packed
        return eth + ETH_P_IP.to_bytes(2, "big") + ip + ports + bytes(4), _words(ip)
    ip = bytes([0x60, 0, 0, 0, 0, 0, IPPROTO_UDP, 64]) + src_ip.packed + dst_ip.packed
    partial = _words(src_ip.packed + dst_ip.packed) + IPPROTO_UDP + _words(ports)
    return eth + ETH_P_IPV6.to_bytes(2, "big") + ip + ports + bytes(4), partial


class Templates:
    """Per-peer frame templates, indexed by peer id."""

    def __init__(self):
        self.table = np.zeros((0, TEMPLATE_WIDTH), np.uint8)
        self.hlen = np.zeros(0, np.int64)
        self.partial = np.zeros(0, np.uint64)
        self._v4 = np.zeros((0, 0, HDR4), np.uint8)  # [peer, DBLP payload length] -> finished IPv4 headers

    def __len__(self):
        return len(self.hlen)

    def add(self, tmpl: bytes, partial: int) -> int:
        row = np.zeros((1, TEMPLATE_WIDTH), np.uint8)
        row[0, : len(tmpl)] = np.frombuffer(tmpl, np.uint8)
        self.table = np.concatenate([self.table, row])
        self.hlen = np.append(self.hlen, len(tmpl))
        self.partial = np.append(self.partial, np.uint64(partial))
        self._v4 = self._v4[:0, :0]  # rebuilt with the new peer on next use
        return len(self.hlen) - 1

    def v4_headers(self, maxlen: int) -> np.ndarray:
        """Finished Eth/IPv4/UDP headers (lengths and IP checksum filled in) for every peer and
        every DBLP payload length 0..``maxlen``: ``[peer, length] -> HDR4 bytes``.

        On IPv4 nothing in those headers depends on the payload bytes, so a
        batch gets its headers in one gather instead of per-packet arithmetic.
        Rows of IPv6 peers are garbage (their UDP checksum covers the payload).
        """
        if self._v4.shape[0] != len(self) or self._v4.shape[1] <= maxlen:
            n = max(maxlen + 1, 4096)
            udp_len = UDP_LEN + wire.HEADER_LEN + np.arange(n, dtype=np.uint64)
            tot = IPV4_LEN + udp_len
            c = ~fold(self.partial[:, None] + tot[None, :], 2) & np.uint64(0xFFFF)
            t = np.repeat(self.table[:, None, :HDR4], n, axis=1)
            u = ETH_LEN + IPV4_LEN
            t[:, :, 16], t[:, :, 17] = (tot >> np.uint64(8)).astype(np.uint8), (tot & np.uint64(0xFF)).astype(np.uint8)
            t[:, :, 24], t[:, :, 25] = (c >> np.uint64(8)).astype(np.uint8), (c & np.uint64(0xFF)).astype(np.uint8)
            t[:, :, u + 4] = (udp_len >> np.uint64(8)).astype(np.uint8)
            t[:, :, u + 5] = (udp_len & np.uint64(0xFF)).astype(np.uint8)
            self._v4 = t
        return self._v4


def build(tp: Templates, peer: np.ndarray, headers: np.ndarray, payload: np.ndarray,
          lengths: np.ndarray, tos: np.ndarray | None = None) -> list[tuple]:
    """Frames for a batch: ``[(rows, frames (m, L) uint8, frame_lens (m,))]``, one item per header length.

    ``rows`` index the batch (None: all rows, in order); frame bytes past
    ``frame_lens`` are undefined.  (:func:`build_one` with ``out`` builds a
    batch of one header length in place, e.g. in consecutive UMEM frames.)
    """
    n = len(peer)
    if n == 0:
        return []
    peer = np.asarray(peer, np.int64)
    if peer.min() < 0 or peer.max() >= len(tp):
        raise ValueError(f"peer ids must be in [0, {len(tp)}); add_peer() first")
    lengths = np.asarray(lengths, np.int64)
    hl_all = tp.hlen[peer]
    hl0 = hl_all[0]
    if np.all(hl_all == hl0):
        return [(None, *build_one(tp, int(hl0), peer, headers, payload, lengths, tos=tos))]
    out_list = []
    for hl in np.unique(hl_all):
        rows = np.flatnonzero(hl_all == hl)
        out_list.append((rows, *build_one(tp, int(hl), peer[rows], wire.take(headers, rows), payload[rows],
                                          lengths[rows], tos=None if tos is None else tos[rows])))
    return out_list


def build_one(tp: Templates, hl: int, peer: np.ndarray, headers: np.ndarray, payload: np.ndarray,
              lengths: np.ndarray, out: np.ndarray | None = None, tos: np.ndarray | None = None) -> tuple:
    """``build`` for peers that all have header length ``hl`` (unchecked): ``(frames, frame_lens)``.

    ``tos``: the TOS / traffic-class byte of each packet, or None (0).
    """
    m = len(peer)
    w = int(lengths.max()) if m else 0
    if w > payload.shape[1]:
        raise ValueError(f"lengths exceed the payload width {payload.shape[1]}")
    L = hl + wire.HEADER_LEN + w
    L += L & 1  # even width: the IPv6 checksum sums 16-bit words
    if out is not None and out.shape[1] >= L:
        st = out[:m, :L]
    else:
        st = np.empty((m, L), np.uint8)
    st[:, hl: hl + wire.HEADER_LEN] = wire.encode_batch(headers)
    st[:, hl + wire.HEADER_LEN: hl + wire.HEADER_LEN + w] = payload[:, :w]
    if hl == HDR4:  # lengths and IP checksum from the table; the UDP checksum stays 0 (RFC 768)
        st[:, :hl] = tp.v4_headers(w)[peer, lengths]
    else:
        st[:, :hl] = tp.table[peer, :hl]
        udp_len = UDP_LEN + wire.HEADER_LEN + lengths
        u = hl - UDP_LEN
        st[:, u + 4] = udp_len >> 8
        st[:, u + 5] = udp_len & 0xFF
        st[:, 18] = udp_len >> 8
        st[:, 19] = udp_len & 0xFF
        # zero bytes past each frame so the word sum covers exactly the datagram
        flen = hl + wire.HEADER_LEN + lengths
        st[np.arange(L) >= flen[:, None]] = 0
        body = st[:, hl:].view(">u2").sum(axis=1, dtype=np.uint64)
        s = tp.partial[peer] + body + 2 * udp_len.astype(np.uint64)  # pseudo-header length + UDP length field
        c = ~fold(s) & np.uint64(0xFFFF)
        c[c == 0] = 0xFFFF
        st[:, u + 6] = (c >> np.uint64(8)).astype(np.uint8)
        st[:, u + 7] = (c & np.uint64(0xFF)).astype(np.uint8)
    if tos is not None:
        set_tos(st, hl, tos)
    return st, hl + wire.HEADER_LEN + lengths


def set_tos(st: np.ndarray, hl: int, tos: np.ndarray) -> None:
    """Write ``tos`` into frames ``st`` built from templates (``hl``: HDR4 or HDR6): the IPv4 TOS
    byte with the header checksum updated incrementally (RFC 1624: the template's TOS is 0, so the
    word 0x45|TOS grows by TOS), or the IPv6 traffic class (flow label 0, as templates have it)."""
    t = np.asarray(tos, np.uint8)
    if hl == HDR4:
        old = (st[:, 24].astype(np.uint32) << 8) | st[:, 25]
        c = (~old & 0xFFFF) + t
        c = (c & 0xFFFF) + (c >> 16)
        c = ~c & 0xFFFF
        st[:, 15] = t
        st[:, 24] = c >> 8
        st[:, 25] = c & 0xFF
    else:
        st[:, 14] = 0x60 | (t >> 4)
        st[:, 15] = (t & 0x0F) << 4


def dscp_of(block: np.ndarray, family) -> np.ndarray:
    """The DSCP of each frame of ``block`` (Ethernet without VLAN tag; ``family`` 4 or 6 per frame
    or one int): the IPv4 TOS byte's or the IPv6 traffic class's upper six bits."""
    b = block.astype(np.int64)
    v4 = b[:, 15] >> 2
    v6 = ((b[:, 14] & 0x0F) << 2) | (b[:, 15] >> 6)
    return np.where(np.asarray(family) == 4, v4, v6)


def ecn_of(block: np.ndarray, family) -> np.ndarray:
    """The ECN field of each frame of ``block`` as uint8 (Ethernet without VLAN tag; ``family`` 4
    or 6 per frame or one int): the IPv4 TOS byte's or the IPv6 traffic class's low two bits
    (0 Not-ECT, 1 ECT(1), 2 ECT(0), 3 CE; RFC 3168), what a receive reports in ``Batch.ecn``."""
    b = block[:, 15]  # IPv4: the TOS byte; IPv6: the traffic class's low nibble, then the flow label's
    if isinstance(family, (int, np.integer)):
        return b & 3 if family == 4 else (b >> 4) & 3
    return np.where(np.asarray(family) == 4, b & 3, (b >> 4) & 3).astype(np.uint8)


def parse(block: np.ndarray, frame_lens: np.ndarray, port: int | None = None):
    """Locate the UDP payload in each frame of ``block`` ((n, >= PARSE_WIDTH) uint8).

    Returns ``(ok, off, plen, family)``: ``ok`` a bool mask of well-formed
    Eth/IPv4|IPv6/UDP frames (to ``port`` when given) with at least a DBLP
    header; ``off`` the UDP payload offset; ``plen`` the UDP payload length
    (the smaller of what UDP says and what the frame holds); ``family`` 4 or 6.

    A batch whose frames all share the first frame's layout (the usual case:
    one sender family, no IP options) takes a shorter path with the same
    results; anything else goes through the general one.
    """
    n = len(block)
    flen = np.asarray(frame_lens, np.int64)
    if n:
        fast = parse_uniform(block, flen, port)
        if fast is not None:
            ok, off, plen, fam = fast
            return ok, np.full(n, off, np.int64), plen, np.full(n, fam, np.int64)
    return parse_general(block, flen, port)


# bytes that fix a frame's layout: EtherType, IP version/IHL, fragment bits (v4), protocol
_LAYOUT4 = np.array([12, 13, 14, 20, 21, 23])
_LAYOUT6 = np.array([12, 13, 14, 20])


def parse_uniform(b: np.ndarray, flen: np.ndarray, port: int | None):
    """``parse`` for a batch laid out like its first frame (IPv4 without options or IPv6), else None.

    Returns ``(ok, off, plen, family)`` with ``off`` and ``family`` one int for the whole batch.
    """
    r0 = b[0]
    if r0[12] == 0x08 and r0[13] == 0x00 and r0[14] == 0x45 and r0[23] == IPPROTO_UDP \
            and (r0[20] & 0x3F) == 0 and r0[21] == 0:
        cols, u, fam = _LAYOUT4, ETH_LEN + IPV4_LEN, 4
    elif r0[12] == 0x86 and r0[13] == 0xDD and r0[14] >> 4 == 6 and r0[20] == IPPROTO_UDP:
        cols, u, fam = _LAYOUT6, ETH_LEN + IPV6_LEN, 6
    else:
        return None
    if b.shape[1] < u + UDP_LEN:
        return None
    lay = b[:, cols]
    if fam == 4:
        lay[:, 3] &= 0xBF  # DF may differ (the kernel sets it on a plain datagram, not on GSO segments)
    same = lay == lay[0]
    if fam == 6:
        same[:, 2] = (lay[:, 2] >> 4) == 6  # traffic class bits may differ
    if not same.all():
        return None
    uh = b[:, u: u + UDP_LEN].view(">u2").astype(np.int64)  # source port, dest port, length, checksum
    off = u + UDP_LEN
    plen = np.minimum(uh[:, 2] - UDP_LEN, flen - off)
    ok = plen >= wire.HEADER_LEN  # (so the UDP length is at least 8 + the DBLP header too)
    if port is not None:
        ok &= uh[:, 1] == port
    return ok, off, plen, fam


def parse_general(b: np.ndarray, frame_lens: np.ndarray, port: int | None):
    """``parse`` for any mix of layouts (IPv4 with options, IPv6, non-UDP frames)."""
    n = len(b)
    ar = np.arange(n)
    et = (b[:, 12].astype(np.int64) << 8) | b[:, 13]
    v4 = (et == ETH_P_IP) & ((b[:, 14] >> 4) == 4) & (b[:, 23] == IPPROTO_UDP)
    v6 = (et == ETH_P_IPV6) & ((b[:, 14] >> 4) == 6) & (b[:, 20] == IPPROTO_UDP)
    ihl = (b[:, 14] & 0x0F).astype(np.int64) * 4
    v4 &= ihl >= IPV4_LEN
    # IPv4 fragments (MF set or offset non-zero) are not DBLP packets
    v4 &= ((b[:, 20].astype(np.int64) & 0x3F) | b[:, 21]) == 0
    u = np.where(v4, ETH_LEN + ihl, ETH_LEN + IPV6_LEN)
    ucl = np.minimum(u, b.shape[1] - UDP_LEN)
    udp_len = (b[ar, ucl + 4].astype(np.int64) << 8) | b[ar, ucl + 5]
    off = u + UDP_LEN
    plen = np.minimum(udp_len - UDP_LEN, frame_lens - off)
    ok = (v4 | v6) & (udp_len >= UDP_LEN) & (plen >= wire.HEADER_LEN)
    if port is not None:
        dport = (b[ar, ucl + 2].astype(np.int64) << 8) | b[ar, ucl + 3]
        ok &= dport == port
    return ok, off, plen, np.where(v6, 6, 4)


class Sources:
    """Registered source addresses, matched against received frames by peer id."""

    def __init__(self):
        self.v4 = np.zeros(0, np.uint32)      # addresses, host order
        self.v4_pid = np.zeros(0, np.int32)
        self.v6 = np.zeros((0, 16), np.uint8)
        self.v6_pid = np.zeros(0, np.int32)
        self.n = 0

    def add(self, addr) -> None:
        """Register the next peer id's address (None: a peer that never matches)."""
        pid = self.n
        self.n += 1
        if addr is None:
            return
        a = ipaddress.ip_address(addr)
        if a.version == 4:
            self.v4 = np.append(self.v4, np.uint32(int(a)))
            self.v4_pid = np.append(self.v4_pid, np.int32(pid))
        else:
            self.v6 = np.concatenate([self.v6, np.frombuffer(a.packed, np.uint8)[None]])
            self.v6_pid = np.append(self.v6_pid, np.int32(pid))

    def match(self, block: np.ndarray, family) -> np.ndarray:
        """Peer id per frame from the source IP, -1 when no registered address matches.

        ``family``: 4 or 6 per frame, or one int for the whole batch.  An
        address registered twice matches its first peer id.
        """
        if isinstance(family, int):  # one family: a compare against the registered addresses, no masks
            if family == 4 and len(self.v4):
                eq = block[:, 26:30].view(">u4") == self.v4  # (n, 1) against (peers,)
                return np.where(eq.any(axis=1), self.v4_pid[eq.argmax(axis=1)], -1).astype(np.int32)
            family = np.full(len(block), family, np.int64)
        out = np.full(len(block), -1, np.int32)
        v4 = family == 4
        if len(self.v4) and v4.any():
            src = np.ascontiguousarray(block[:, 26:30]).view(">u4").reshape(-1)
            eq = (src[:, None] == self.v4[None, :]) & v4[:, None]
            hit = eq.any(axis=1)
            out[hit] = self.v4_pid[eq.argmax(axis=1)[hit]]
        v6 = family == 6
        if len(self.v6) and v6.any():
            eq = (block[:, None, 22:38] == self.v6[None]).all(axis=2) & v6[:, None]
            hit = eq.any(axis=1)
            out[hit] = self.v6_pid[eq.argmax(axis=1)[hit]]
        return out
