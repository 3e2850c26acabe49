"""Vectorised Eth/IP/UDP frames agree with scapy, byte for byte, and parse back."""

from __future__ import annotations

import numpy as np
import pytest

from pydblp import wire
from pydblp.transport import Batch
from pydblp.transport import frames

scapy = pytest.importorskip("scapy.all")
from scapy.all import IP, UDP, Ether, IPv6, Raw  # noqa: E402

SMAC, DMAC = "02:00:00:00:00:01", "02:00:00:00:00:02"


def _tp():
    tp = frames.Templates()
    p4 = tp.add(*frames.template(SMAC, DMAC, "198.18.0.1", "198.18.0.2", 47800, 47801))
    p6 = tp.add(*frames.template(SMAC, DMAC, "2001:2::1", "2001:2::2", 47800, 47802))
    p4b = tp.add(*frames.template(SMAC, DMAC, "198.18.0.1", "198.19.255.254", 1, 65535))
    return tp, (p4, p6, p4b)


def _batch(n, peers, seed=3):
    rng = np.random.default_rng(seed)
    h = wire.empty_batch(n)
    h["kind"], h["job"], h["nchunks"] = 1, 0xABCDEF01, 1000
    h["chunk"] = rng.integers(0, 1000, n)
    h["round"] = rng.integers(0, 2**32, n, dtype=np.uint64)
    pay = rng.integers(0, 256, (n, 1400), dtype=np.uint8)
    lens = rng.integers(0, 1401, n)
    lens[:4] = [0, 1, 1399, 1400]
    return Batch.fill(h, pay, lens, np.asarray(peers)[rng.integers(0, len(peers), n)])


def _scapy_frame(tp, pid, dblp: bytes) -> bytes:
    t = tp.table[pid, : tp.hlen[pid]].tobytes()
    dst = ".".join(map(str, t[30:34])) if tp.hlen[pid] == frames.HDR4 else None
    sport, dport = int.from_bytes(t[-8:-6], "big"), int.from_bytes(t[-6:-4], "big")
    if tp.hlen[pid] == frames.HDR4:
        ip = IP(src=".".join(map(str, t[26:30])), dst=dst, id=0, flags="DF", ttl=64)
        u = UDP(sport=sport, dport=dport, chksum=0)
    else:
        import ipaddress
        ip = IPv6(src=str(ipaddress.IPv6Address(t[22:38])), dst=str(ipaddress.IPv6Address(t[38:54])), hlim=64)
        u = UDP(sport=sport, dport=dport)
    return bytes(Ether(src=SMAC, dst=DMAC) / ip / u / Raw(dblp))


def test_frames_match_scapy():
    tp, peers = _tp()
    b = _batch(300, peers)
    out = frames.build(tp, b.peer, b.headers, b.payload, b.lengths)
    assert sorted(np.concatenate([r for r, _, _ in out]).tolist()) == list(range(300))
    # one family: built in place into a caller's array, same bytes
    one = _batch(50, [peers[1]])
    dst = np.zeros((50, 2048), np.uint8)
    hl = int(tp.hlen[peers[1]])
    st, flen = frames.build_one(tp, hl, one.peer, one.headers, one.payload, one.lengths, out=dst)
    assert np.shares_memory(st, dst)
    [(_, st2, _)] = frames.build(tp, one.peer, one.headers, one.payload, one.lengths)
    assert all(dst[i, : flen[i]].tobytes() == st2[i, : flen[i]].tobytes() for i in range(50))
    for rows, st, flen in out:
        for j, i in enumerate(range(len(st)) if rows is None else rows):
            dblp = wire.encode(wire.Header.unpack(b.headers[i].tobytes()), b.payload[i, : b.lengths[i]].tobytes())
            want = _scapy_frame(tp, int(b.peer[i]), dblp)
            assert st[j, : flen[j]].tobytes() == want, f"row {i} peer {b.peer[i]} len {b.lengths[i]}"


def test_ipv6_checksum_never_zero_and_verifies():
    tp, (_, p6, _) = _tp()
    b = _batch(2000, [p6], seed=11)
    [(_, st, flen)] = frames.build(tp, b.peer, b.headers, b.payload, b.lengths)
    for j in range(0, 2000, 97):
        f = Ether(st[j, : flen[j]].tobytes())
        c = f[UDP].chksum
        assert c != 0
        del f[UDP].chksum
        assert Ether(bytes(f))[UDP].chksum == c


def test_parse_finds_payload_and_rejects_others():
    tp, peers = _tp()
    b = _batch(64, peers)
    blocks, lens, want_off = [], [], []
    for rows, st, flen in frames.build(tp, b.peer, b.headers, b.payload, b.lengths):
        for j in range(len(st)):
            blocks.append(np.pad(st[j, : flen[j]], (0, 2048))[:2048])
            lens.append(flen[j])
            want_off.append(frames.HDR4 if st[j, 12] == 8 else frames.HDR6)
    # non-UDP, fragment, short
    arp = np.zeros(2048, np.uint8); arp[12:14] = [8, 6]
    frag = blocks[0].copy(); frag[20] |= 0x20  # MF
    blocks += [arp, frag, blocks[0].copy()]
    lens += [60, lens[0], 50]
    want_off += [0, 0, 0]
    blk = np.stack(blocks)
    ok, off, plen, fam = frames.parse(blk[:, : frames.PARSE_WIDTH], np.array(lens))
    assert ok[:64].all() and not ok[64:].any()
    assert np.array_equal(off[:64], want_off[:64])
    hdr_lens = np.array([b.lengths[i] for rows, st, _ in frames.build(tp, b.peer, b.headers, b.payload, b.lengths)
                         for i in (range(len(st)) if rows is None else rows)])
    assert np.array_equal(plen[:64], hdr_lens + wire.HEADER_LEN)
    ok2, *_ = frames.parse(blk[:, : frames.PARSE_WIDTH], np.array(lens), port=47801)
    assert ok2[:64].sum() == sum(1 for rows, st, _ in frames.build(tp, b.peer, b.headers, b.payload, b.lengths)
                                 for j in range(len(st)) if st[j, 12] == 8 and st[j, 36:38].tolist() == [0xBA, 0xB9])


def test_source_match():
    tp, peers = _tp()
    b = _batch(50, peers)
    # swap roles: frames *from* our peers arrive with their addresses as source
    rtp = frames.Templates()
    r4 = rtp.add(*frames.template(DMAC, SMAC, "198.18.0.2", "198.18.0.1", 47801, 47800))
    r6 = rtp.add(*frames.template(DMAC, SMAC, "2001:2::2", "2001:2::1", 47802, 47800))
    peer = np.where(np.arange(50) % 2 == 0, r4, r6)
    for rows, st, flen in frames.build(rtp, peer, b.headers, b.payload, b.lengths):
        fam = np.where(st[:, 12] == 8, 4, 6)
        src = frames.Sources()
        for a in ["2001:2::2", None, "198.18.0.2", "198.18.0.2"]:  # a repeated address: its first id
            src.add(a)
        got = src.match(st, fam)
        assert np.array_equal(got, np.where(fam == 4, 2, 0))
        assert (frames.Sources().match(st, fam) == -1).all()
        one = int(fam[0])  # a one-family batch may pass its family as an int: same answer
        assert np.array_equal(src.match(st, one), got) and src.match(st, one).dtype == np.int32
        stranger = st.copy()
        stranger[:, 26:30] = (198, 18, 0, 99)  # an unregistered IPv4 source
        if one == 4:
            assert (src.match(stranger, 4) == -1).all()


def test_build_rejects_unknown_peer_and_overlong():
    tp, _ = _tp()
    b = _batch(4, [0])
    b.peer[:] = 7
    with pytest.raises(ValueError):
        frames.build(tp, b.peer, b.headers, b.payload, b.lengths)
    b.peer[:] = 0
    b.lengths[0] = 5000
    with pytest.raises(ValueError):
        frames.build(tp, b.peer, b.headers, b.payload, b.lengths)


@pytest.mark.parametrize("peer_idx", [0, 1])
def testparse_uniform_path_agrees_with_general(peer_idx):
    """The one-layout shortcut gives the general parser's answer, and hands odd batches to it."""
    tp, peers = _tp()
    b = _batch(40, [peers[peer_idx]])
    [(_, st, flen)] = frames.build(tp, b.peer, b.headers, b.payload, b.lengths)
    blk = np.zeros((40, frames.PARSE_WIDTH), np.uint8)
    blk[:, : min(st.shape[1], frames.PARSE_WIDTH)] = st[:, : frames.PARSE_WIDTH]
    flen = np.asarray(flen, np.int64)
    variants = {"uniform": blk.copy()}
    v = blk.copy(); v[7, 23 if peer_idx == 0 else 20] = 6; variants["tcp row"] = v          # not UDP
    v = blk.copy(); v[0, 12:14] = [8, 6]; variants["arp first"] = v                         # first row odd
    if peer_idx == 0:
        v = blk.copy(); v[5, 20] |= 0x20; variants["fragment"] = v
        v = blk.copy(); v[9, 14] = 0x46; variants["options"] = v
        v = blk.copy(); v[::3, 20] ^= 0x40; variants["DF mixed"] = v  # control packets beside GSO segments
    for port in (None, 47801, 47802):
        for name, blk_v in variants.items():
            fast = frames.parse(blk_v, flen, port)
            slow = frames.parse_general(blk_v, flen, port)
            for f, s in zip(fast, slow):
                assert np.array_equal(f, s), (name, port)
    assert frames.parse_uniform(variants["uniform"], flen, None) is not None
    assert frames.parse_uniform(variants["tcp row"], flen, None) is None
    if peer_idx == 0:
        assert frames.parse_uniform(variants["DF mixed"], flen, None) is not None
        assert frames.parse_uniform(variants["fragment"], flen, None) is None
