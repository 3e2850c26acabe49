"""The AF_XDP transport's compiled loops (csrc/xsk.c) against its pure-Python path, without root.

Both paths run inside the same transport code over plain-memory rings and UMEM
(:class:`pydblp.transport.xsk_memory.MemoryXsk`, the kernel's part played in numpy): the
frames sent must be byte-identical (ECT(0) with ``set_ect``), and frames received (well-formed,
malformed, forged, multi-buffer, lent with ``copy=False``, each ECN codepoint) must give
identical batches (``Batch.ecn`` included), counters and fill rings.
Without a compiler (or with ``DBLP_NATIVE=0``) the Python path runs, after one warning.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pydblp import dscp, wire
from pydblp.transport import Batch, frames, xsk_native
from pydblp.transport.xsk_memory import MemoryXsk, agree, seeded_batch
from tests.helpers import needs_native

LIB = xsk_native.load_lib()
needs_cc = needs_native("xsk", LIB is not None)
PORT = wire.DEFAULT_PORT
V4, V6 = ("198.18.0.2", "198.18.0.3"), ("2001:db8::2", "2001:db8::3")


def pair(**kw):
    """(python, native) MemoryXsk transports built alike."""
    return MemoryXsk(False, **kw), MemoryXsk(True, lib=LIB, **kw)


def add_peers(t, addrs=V4 + V6):
    return [t.add_peer(a) for a in addrs]


def sent_frames(peers_of=lambda ids: ids, n=40, seed=1, width=600, batches=1, ect=False, **kw):
    """The frames each path puts on the wire for the same seeded batches (``ect``: after ``set_ect(True)``)."""
    wires = []
    for t in pair(**kw):
        ids = add_peers(t)
        if ect:
            t.set_ect(True)
            assert t.ect
        for b in range(batches):
            assert t.send(seeded_batch(n, peers_of(ids), seed + b, width)) == n
        assert t.flush(5)
        wires.append(t.wire)
    return wires


def received(frame_list, cap=64, maxlen=1500, copy=True, rounds=None, ecn=True, **kw):
    """What each path receives from ``frame_list``: per recv call the batch's rows (the ECN field of
    each too; ``ecn`` False: into a batch without ``ecn``, which must come back None), then the
    counters and the fill ring's entries."""
    out = []
    for t in pair(**kw):
        add_peers(t, ("198.18.0.1", "2001:db8::1"))
        left = list(frame_list)
        got = []
        for _ in range(rounds or 1 + len(left) // 8):
            left = left[t.deliver(left):]
            into = Batch.empty(cap, maxlen)
            if not ecn:
                into.ecn = None
            b = t.recv(into, copy=copy)
            assert (b.ecn is None) == (not ecn) and (b.ecn is None or len(b.ecn) == b.n)
            got.append((wire.encode_batch(b.headers[: b.n]).tobytes(), b.lengths[: b.n].tolist(),
                        b.peer[: b.n].tolist(), [b.payload[i, : b.lengths[i]].tobytes() for i in range(b.n)],
                        None if b.ecn is None else b.ecn[: b.n].tolist()))
        s = t.stats()
        fill = t._fill
        out.append((got, {k: s[k] for k in ("rx_packets", "rx_bytes", "rx_invalid", "rx_truncated", "rx_errors")},
                    fill.at(int(fill.cons[0]), fill.used()).tolist(), t._fill_pending.tolist()))
    return out


@needs_cc
def test_the_self_test_passes_and_the_paths_are_chosen():
    assert agree(LIB)
    py, c = pair()
    assert (py.native, c.native) == (False, True)
    assert MemoryXsk(None, lib=LIB).native


@needs_cc
@pytest.mark.parametrize("dscp", ["off", "default"])
@pytest.mark.parametrize("peers", ["v4", "v6", "mixed"])
def test_sent_frames_are_byte_identical(peers, dscp):
    pick = {"v4": lambda ids: ids[:2], "v6": lambda ids: ids[2:], "mixed": lambda ids: ids}[peers]
    # 3 batches of 40 through 64 frames and a 64-slot ring: the free list and the ring wrap
    a, b = sent_frames(pick, batches=3, dscp=dscp)
    assert len(a) == 120 and a == b
    if peers != "v4":  # the IPv6 UDP checksum verifies (odd lengths included)
        for f in a:
            if f[12:14] == b"\x86\xdd":
                udp = f[54:]
                pseudo = f[22:54] + len(udp).to_bytes(4, "big") + b"\0\0\0\x11"
                assert frames.checksum(pseudo + udp) == 0


@needs_cc
def test_sent_frames_identical_at_full_frame_width_and_when_paced():
    a, b = sent_frames(width=2048 - 62 - 32, n=20)
    assert a == b and max(map(len, a)) == 2048
    a, b = sent_frames(n=30, rate=2e9, batches=2)  # paced: the producer index is released by Python
    assert len(a) == 60 and a == b


def valid_frames(n=24, seed=3, **kw):
    t = MemoryXsk(False, **kw)
    ids = add_peers(t)
    t.send(seeded_batch(n, ids, seed))
    return t.wire


def is_v4(f: bytes) -> bool:
    return f[12:14] == b"\x08\x00"


def ip_fields(f: bytes) -> tuple[int, int]:
    """(ECN field, DSCP) of frame ``f``'s IP header."""
    b, fam = np.frombuffer(f[:16], np.uint8)[None], 4 if is_v4(f) else 6
    return int(frames.ecn_of(b, fam)[0]), int(frames.dscp_of(b, fam)[0])


def with_ecn(f: bytes, e: int) -> bytes:
    """Frame ``f`` with its IP header's ECN field set to ``e`` (a switch's mark: the IPv4 header
    checksum recomputed, the DSCP kept)."""
    b = bytearray(f)
    if is_v4(f):
        end = frames.ETH_LEN + (b[14] & 0x0F) * 4
        b[15] = (b[15] & 0xFC) | e
        b[24:26] = b"\0\0"
        b[24:26] = frames.checksum(bytes(b[14:end])).to_bytes(2, "big")
    else:
        b[15] = (b[15] & 0xCF) | (e << 4)
    return bytes(b)


def checksums_verify(f: bytes) -> bool:
    """The IPv4 header checksum, or the IPv6 UDP checksum, of frame ``f`` verifies."""
    if is_v4(f):
        return frames.checksum(f[14:34]) == 0
    udp = f[54:]
    return frames.checksum(f[22:54] + len(udp).to_bytes(4, "big") + b"\0\0\0\x11" + udp) == 0


@needs_cc
@pytest.mark.parametrize("spec", ["off", "default"])
@pytest.mark.parametrize("peers", ["v4", "v6", "mixed"])
def test_set_ect_sends_ect0_beside_the_dscp_byte_identically(peers, spec):
    pick = {"v4": lambda ids: ids[:2], "v6": lambda ids: ids[2:], "mixed": lambda ids: ids}[peers]
    a, b = sent_frames(pick, batches=3, dscp=spec, ect=True)
    assert len(a) == 120 and a == b
    table = dscp.resolve(spec)
    for f in a:
        prio = f[(frames.HDR4 if is_v4(f) else frames.HDR6) + 18]
        assert ip_fields(f) == (dscp.ECT0, table[prio]) and checksums_verify(f)


@needs_cc
@pytest.mark.parametrize("case", ["rows", "full", "paced", "addr", "multi-buffer"])
def test_ect_marks_every_kind_on_every_send_path_and_turns_off(case):
    """Control packets (prio 0, every kind) and data alike, through in-place and scratch builds,
    paced release, ``Batch.addr`` and multi-buffer frames; ``set_ect(False)`` sends Not-ECT again."""
    width, kw = {"rows": (600, {}), "full": (2048 - 62 - 32, {}), "paced": (600, {"rate": 2e9}),
                 "addr": (600, {}), "multi-buffer": (3000, {"sg": True})}[case]
    wires = []
    for t in pair(dscp="default", **kw):
        ids = add_peers(t)
        for on in (True, False):
            t.set_ect(on)
            assert t.ect is on
            b = seeded_batch(20, ids, 12, width)
            b.headers["kind"] = np.resize(np.array(list(wire.Kind), np.uint8), 20)
            b.headers["prio"][b.headers["kind"] != wire.Kind.DATA] = 0
            if case == "addr" and t.native:
                src = b.payload.copy()
                b = Batch(b.headers, np.zeros_like(b.payload), b.lengths, b.peer, b.n,
                          np.uint64(src.ctypes.data) + np.arange(20, dtype=np.uint64) * np.uint64(width))
            assert t.send(b) == 20 and t.flush(5)
        wires.append(t.wire)
    assert wires[0] == wires[1] and len(wires[0]) == 40
    assert [ip_fields(f)[0] for f in wires[0]] == [dscp.ECT0] * 20 + [0] * 20
    assert all(checksums_verify(f) for f in wires[0])
    assert max(map(len, wires[0])) > 2048 if case == "multi-buffer" else True


def edit(f: bytes, at: int, value: bytes) -> bytes:
    return f[:at] + value + f[at + len(value):]


def malformed(v4: bytes, v6: bytes) -> list[bytes]:
    """One of each thing receive must drop (or take) the same way on both paths."""
    opts = v4[:14] + b"\x46" + v4[15:34] + b"\x01\x01\x01\x01" + v4[34:]  # IPv4 with 4 option bytes: valid
    h4 = frames.HDR4
    return [
        v4[:10], v4[:h4 + 31], v4[: h4 + 32], v4[:h4 + 40],          # truncated: short, short header, header only
        edit(v4, 36, (PORT + 1).to_bytes(2, "big")),                  # wrong port
        opts,
        edit(v4, 20, b"\x20"), edit(v4, 21, b"\x08"), edit(v4, 20, b"\x40"),  # MF, offset; DF alone is fine
        edit(v4, 23, b"\x06"), edit(v4, 12, b"\x08\x06"), edit(v4, 14, b"\x44"),  # TCP, ARP, IHL 4
        edit(v4, h4, b"\xdb\x1c"), edit(v4, h4 + 2, b"\x02"),         # bad magic, version
        edit(v4, h4 + 3, b"\x00"), edit(v4, h4 + 3, b"\x06"),         # kinds 0 and 6
        edit(v4, h4 + 4, b"\0\0\0\0"),                                # job 0
        edit(v4, h4 + 24, b"\0\0\0\0"), edit(v4, h4 + 24, b"\x01\0\0\x01"),  # nchunks 0, > MAX
        edit(v4, h4 + 20, b"\xff\xff\xff\xff"),                       # chunk >= nchunks
        edit(v4, h4 + 28, b"\x7f\xff"), edit(v4, h4 + 31, b"\x04"),   # len lies; TAG flag without a tag
        edit(v4, 38, b"\x00\x10"), edit(v4, 38, b"\xff\xff"),         # UDP length short; beyond the frame
        edit(v4, 26, b"\xc6\x12\x09\x09"),                            # unknown source: peer -1
        v6[: frames.HDR6 + 20], edit(v6, 20, b"\x06"), edit(v6, 14, b"\x50"),  # IPv6: truncated, TCP, version
        edit(v6, frames.HDR6, b"\0\0"), edit(v6, 56, (PORT + 1).to_bytes(2, "big")),
        edit(v6, 22, b"\x20\x01\x0d\xb9"),                            # unknown IPv6 source
        v4 + b"\0" * 9, v6 + b"\x55" * 3,                             # trailing bytes past the UDP length
    ]


@needs_cc
@pytest.mark.parametrize("validated", [False, True])
def test_receive_is_identical_for_well_formed_and_malformed_frames(validated):
    good = valid_frames()
    v4 = max((f for f in good if f[12:14] == b"\x08\x00"), key=len)  # a long payload
    v6 = max((f for f in good if f[12:14] == b"\x86\xdd" and len(f) % 2), key=len)  # an odd length
    mix = good[:5] + malformed(v4, v6) + good[5:]
    py, c = received(mix, validated=validated, rounds=6)
    assert py == c
    got, counts = py[0], py[1]
    assert counts["rx_packets"] + counts["rx_invalid"] == len(mix) and counts["rx_errors"] == 0
    assert counts["rx_invalid"] == (26 if not validated else 13)
    assert -1 in sum((g[2] for g in got), [])


@needs_cc
@pytest.mark.parametrize("copy", [True, False])
@pytest.mark.parametrize("layout", ["v4", "v6", "mixed"])
def test_receive_reports_each_ecn_codepoint_alike(layout, copy):
    """Frames with ECN 0, 1, 2, 3 (a DSCP beside it) in one batch: one layout (the run path, lent
    with ``copy=False``) or both families (the general path); then the same with malformed frames
    between them (rows compacted, ECN with them)."""
    good = [f for f in valid_frames(32, seed=7, dscp="default")
            if layout == "mixed" or is_v4(f) == (layout == "v4")]
    marked = [with_ecn(f, i % 4) for i, f in enumerate(good)]
    want = [i % 4 for i in range(len(good))]
    py, c = received(marked, copy=copy, rounds=2)
    assert py == c and sum((g[4] for g in py[0]), []) == want and py[1]["rx_packets"] == len(good)
    mixed = sum(([f, f[:50], edit(f, 36 if is_v4(f) else 56, (PORT + 1).to_bytes(2, "big"))] if i % 3 == 1 else [f]
                 for i, f in enumerate(marked)), [])
    py, c = received(mixed, copy=copy, rounds=3)
    assert py == c and sum((g[4] for g in py[0]), []) == want and py[1]["rx_invalid"] > 0
    # into a batch without ecn: the same rows, ecn None
    py, c = received(marked, copy=copy, rounds=2, ecn=False)
    assert py == c and [g[4] for g in py[0]] == [None, None]


@needs_cc
def test_receive_truncates_and_caps_alike():
    good = valid_frames(40)
    py, c = received(good, cap=7, maxlen=300, rounds=8)
    assert py == c and py[1]["rx_truncated"] > 0 and py[1]["rx_packets"] == 40


@needs_cc
def test_receive_fuzzed_frames_alike():
    rng = np.random.default_rng(11)
    good = valid_frames(32, seed=4)
    mix = []
    for i in range(400):
        f = bytearray(good[i % len(good)])
        for _ in range(rng.integers(1, 4)):  # bit flips in the headers, where parsing looks
            at = int(rng.integers(0, min(len(f), 100)))
            f[at] ^= 1 << int(rng.integers(0, 8))
        if rng.random() < 0.2:
            f = f[: int(rng.integers(0, len(f)))]
        mix.append(bytes(f))
    py, c = received(mix, rx_frames=512, cap=128, rounds=5)
    assert py == c and py[1]["rx_packets"] + py[1]["rx_invalid"] == 400


@needs_cc
def test_copy_false_lends_umem_frames_and_refills_them_next_call():
    good = valid_frames(16)
    v4s = [with_ecn(f, i % 4) for i, f in enumerate(f for f in good if f[12:14] == b"\x08\x00")]
    for t in pair():
        add_peers(t, ("198.18.0.1", "2001:db8::1"))
        t.deliver(v4s)
        into = Batch.empty(32)
        b = t.recv(into, copy=False)
        assert b.n == len(v4s) and np.shares_memory(b.payload, t._umem)  # lent: no payload copy
        assert [b.payload[i, : b.lengths[i]].tobytes() for i in range(b.n)] == [f[frames.HDR4 + 32:] for f in v4s]
        assert b.ecn.tolist() == [i % 4 for i in range(b.n)] and np.shares_memory(b.ecn, into.ecn)
        used = t._fill.used()
        t.recv(Batch.empty(32), copy=False)
        assert t._fill.used() == used + len(v4s)  # given back at the next receive
    # a batch that is not the run shape (two layouts, one invalid) is copied, identically
    py, c = received(good[:6] + [good[6][:50]] + good[7:], copy=False, rounds=3)
    assert py == c and py[1]["rx_invalid"] == 1


@needs_cc
def test_multi_buffer_frames_take_the_python_path_on_both():
    t = MemoryXsk(False, frame_size=2048)
    ids = add_peers(t)
    t.send(seeded_batch(8, ids[:2], 9, width=1400))
    marked = [with_ecn(f, i % 4) for i, f in enumerate(t.wire)]
    py, c = received(marked, sg=True, rounds=2, maxlen=1500)
    assert py == c and py[1]["rx_packets"] == 8 and py[0][0][4] == [0, 1, 2, 3] * 2
    # the same frames split over two descriptors each (XDP_PKT_CONTD): lengths differ (the general
    # gather), then all alike (one strided copy per segment index); ECN read from the first segment
    same = seeded_batch(8, ids[:1], 10, width=1400)
    same.lengths[:] = 1400
    same.headers["len"] = 1400
    t.wire = []
    t.send(same)
    for fl in (marked, [with_ecn(f, 3 - i % 4) for i, f in enumerate(t.wire)]):
        outs = []
        for r in pair(sg=True):
            add_peers(r, ("198.18.0.1",))
            r.deliver(fl, segment=1000)
            b = r.recv(Batch.empty(16, 1500))
            outs.append((b.n, b.lengths[: b.n].tolist(), b.payload[: b.n].tobytes(), b.ecn.tolist()))
            into = Batch.empty(16, 1500)
            into.ecn = None
            r.deliver(fl, segment=1000)
            assert r.recv(into).ecn is None
        assert outs[0] == outs[1] and outs[0][0] == 8
        assert outs[0][3] == [ip_fields(f)[0] for f in fl]


@needs_cc
def test_a_batch_that_raises_gives_its_frames_back_on_both(monkeypatch):
    for t in pair():
        add_peers(t, ("198.18.0.1", "2001:db8::1"))
        t.deliver(valid_frames(8))
        before = t._fill.used()

        def boom(*a, **k):
            raise RuntimeError("injected")

        monkeypatch.setattr(t._sources, "match", boom)
        monkeypatch.setattr(t, "_headers_in", boom)
        if t.native:  # C matches sources itself: break the batch after the call instead
            monkeypatch.setattr(t, "_recv_done", boom)
        b = t.recv(Batch.empty(16))
        assert b.n == 0 and t.stats()["rx_errors"] == 1
        assert t._fill.used() + len(t._fill_pending) == before + 8 and t._rx.used() == 0


_PROBE = """
import logging
logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
from pydblp import native
native._installed = lambda name: None  # (what these tests check is the first-use build)
from pydblp.transport.xsk_memory import MemoryXsk, agree
from pydblp.transport import xsk_native
t = MemoryXsk(None)
print("native", t.native)
"""


def _child(**env) -> subprocess.CompletedProcess:
    e = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2]), **env}
    e.pop("DBLP_NATIVE", None)
    e.update(env)
    return subprocess.run([sys.executable, "-c", _PROBE], env=e, capture_output=True, text=True, timeout=300)


def test_without_a_compiler_the_python_path_runs_with_one_warning(tmp_path):
    r = _child(CC=str(tmp_path / "no-such-cc"), XDG_CACHE_HOME=str(tmp_path))
    assert r.returncode == 0 and "native False" in r.stdout, r.stderr
    assert r.stderr.count("WARNING") == 1 and "compiled xsk unavailable" in r.stderr
    r = _child(CC=str(tmp_path / "no-such-cc"), XDG_CACHE_HOME=str(tmp_path), DBLP_NATIVE="1")
    assert r.returncode != 0 and "NativeUnavailable" in r.stderr


@needs_cc
def test_dblp_native_0_picks_the_python_path(tmp_path):
    r = _child(XDG_CACHE_HOME=str(tmp_path), DBLP_NATIVE="0")
    assert r.returncode == 0 and "native False" in r.stdout, r.stderr
    r = _child(XDG_CACHE_HOME=str(tmp_path))
    assert r.returncode == 0 and "native True" in r.stdout and "WARNING" not in r.stderr, r.stderr


@needs_cc
def test_sends_read_batch_addr_where_given_and_gather_it_for_multi_buffer_frames():
    """``Batch.addr`` (the collective's tensor rows): C reads each payload there, the frames are
    those the Python path builds from payload rows; frames beyond a UMEM frame gather it first."""
    for width, kw in ((600, {}), (3000, {"sg": True})):  # the second: multi-buffer, the Python path
        py, c = pair(**kw)
        assert c.reads_addresses and not py.reads_addresses
        for t in (py, c):
            ids = add_peers(t)
            b = seeded_batch(20, ids, 6, width)
            if t.native:  # payload rows elsewhere, scrambled: only addr tells where the bytes are
                src = b.payload.copy()
                b = Batch(b.headers, np.zeros_like(b.payload), b.lengths, b.peer, b.n,
                          np.uint64(src.ctypes.data) + np.arange(20, dtype=np.uint64) * np.uint64(width))
            assert t.send(b) == 20 and t.flush(5)
        assert py.wire == c.wire and len(py.wire) == 20
