"""DBLP v1 wire format: round trips, batches, and every malformed reason."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pydblp import wire
from pydblp.wire import Header, Kind, Reason

KEY = b"k" * 32
NAMES = [name for name, _ in wire.FIELDS]
OFFSETS = {}
_off = 0
for _name, _code in wire.FIELDS:
    OFFSETS[_name] = _off
    _off += struct.calcsize("!" + _code)


def sample_header(**kw) -> Header:
    base = dict(kind=Kind.DATA, job=0xA1B2C3D4, round=0xFFFFFFFE, tensor=0x1234, src=3,
                dst=7, prio=5, dtype=wire.Dtype.BF16, chunk=9, nchunks=10, tol=51, flags=wire.Flag.RETX)
    base.update(kw)
    return Header(**base)


def poke(buf: bytes, field: str, value: int) -> bytes:
    """Overwrite one header field in wire bytes."""
    code = dict(wire.FIELDS)[field]
    out = bytearray(buf)
    struct.pack_into("!" + code, out, OFFSETS[field], value)
    return bytes(out)


def batch_of(packets: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Zero-padded (n, width) frames and their lengths, as the AF_XDP path sees them."""
    width = max([len(p) for p in packets] + [wire.HEADER_LEN])
    frames = np.zeros((len(packets), width), np.uint8)
    for i, p in enumerate(packets):
        frames[i, : len(p)] = np.frombuffer(p, np.uint8)
    return frames, np.array([len(p) for p in packets])


# ---- layout and single round trip ------------------------------------------

def test_layout_matches_design_table():
    # the design card's table, section 3: offsets in wire order
    assert wire.HEADER_LEN == 32 == wire._STRUCT.size
    assert NAMES == ["magic", "version", "kind", "job", "round", "tensor", "src", "dst",
                     "prio", "dtype", "chunk", "nchunks", "len", "tol", "flags"]
    assert [OFFSETS[n] for n in NAMES] == [0, 2, 3, 4, 8, 12, 14, 16, 18, 19, 20, 24, 28, 30, 31]
    assert [wire.HEADER_DTYPE.fields[n][1] for n in NAMES] == [OFFSETS[n] for n in NAMES]


def test_network_byte_order():
    buf = wire.encode(sample_header(), b"xyz")
    assert buf[:4] == bytes([0xDB, 0x1B, 1, 1])
    assert buf[4:8] == bytes([0xA1, 0xB2, 0xC3, 0xD4])
    assert buf[28:30] == b"\x00\x03"


def test_single_round_trip():
    h = sample_header()
    buf = wire.encode(h, b"payload!")
    assert len(buf) == wire.HEADER_LEN + 8
    got, payload = wire.decode(buf)
    assert got == h.replace(len=8)
    assert payload == b"payload!"
    assert Header.unpack(memoryview(buf)) == got


def test_encode_sets_len_and_clears_stale_tag_flag():
    h = sample_header(len=999, flags=wire.Flag.TAG | wire.Flag.ALLGATHER | 0x80)
    got = Header.unpack(wire.encode(h, b"ab"))
    assert got.len == 2
    # reserved bits survive; the tag bit follows the key, not the caller
    assert got.flags == wire.Flag.ALLGATHER | 0x80


def test_tagged_round_trip():
    h = sample_header()
    buf = wire.encode(h, b"grad", key=KEY)
    assert len(buf) == wire.HEADER_LEN + 4 + wire.TAG_LEN
    got, payload = wire.decode(buf, key=KEY)
    assert got.flags & wire.Flag.TAG
    assert got.len == 4 and payload == b"grad"
    # the tag: the run epoch (0 here), then keyed BLAKE2b-96 over header + payload salted with it
    assert buf[-16:] == wire.tag(KEY, buf[:-16])
    mac = hashlib.blake2b(buf[:-16], key=KEY, digest_size=12, salt=bytes(4), person=b"dblp-tag-v1").digest()
    assert buf[-16:] == bytes(4) + mac
    # a receiver without a key still accepts the framing
    assert wire.validate(buf) is Reason.OK


def test_a_tag_binds_the_run_epoch():
    """The same packet tagged in two runs differs; each verifies under the epoch it names, and
    only under it when the receiver gives its own; an epoch rewritten in the clear fails."""
    h = sample_header()
    a, b = wire.encode(h, b"grad", key=KEY, epoch=1), wire.encode(h, b"grad", key=KEY, epoch=2)
    assert a[:-16] == b[:-16] and a[-16:] != b[-16:]
    assert wire.tag_epoch(a[-16:]) == 1 and a[-16:-12] == b"\0\0\0\1"
    assert wire.validate(a, key=KEY) is Reason.OK and wire.validate(a, key=KEY, epoch=1) is Reason.OK
    assert wire.validate(a, key=KEY, epoch=2) is Reason.TAG
    assert wire.validate(a[:-16] + b[-16:-12] + a[-12:], key=KEY) is Reason.TAG


def test_decode_raises_wire_error_with_reason():
    with pytest.raises(wire.WireError) as e:
        wire.decode(b"\x00" * 40)
    assert e.value.reason is Reason.MAGIC
    assert "magic" in str(e.value)
    with pytest.raises(wire.WireError) as e:
        Header.unpack(b"\xdb\x1b")
    assert e.value.reason is Reason.SHORT


# ---- every malformed reason --------------------------------------------------

GOOD = wire.encode(sample_header(), b"0123456789")

MALFORMED = [
    (Reason.SHORT, lambda: GOOD[:31], {}),
    (Reason.SHORT, lambda: b"", {}),
    (Reason.MAGIC, lambda: poke(GOOD, "magic", 0x1BDB), {}),
    (Reason.VERSION, lambda: poke(GOOD, "version", 2), {}),
    (Reason.VERSION, lambda: poke(GOOD, "version", 0), {}),
    (Reason.KIND, lambda: poke(GOOD, "kind", 0), {}),
    (Reason.KIND, lambda: poke(GOOD, "kind", max(Kind) + 1), {}),
    (Reason.LENGTH, lambda: GOOD[:-1], {}),
    (Reason.LENGTH, lambda: GOOD + b"\x00", {}),
    (Reason.LENGTH, lambda: poke(GOOD, "flags", wire.Flag.TAG), {}),  # tag bit, no tag bytes
    (Reason.CHUNK, lambda: poke(GOOD, "chunk", 10), {}),
    (Reason.CHUNK, lambda: poke(GOOD, "chunk", 0xFFFFFFFF), {}),
    (Reason.NCHUNKS, lambda: poke(poke(GOOD, "nchunks", 0), "chunk", 0), {}),
    (Reason.NCHUNKS, lambda: poke(GOOD, "nchunks", wire.MAX_NCHUNKS + 1), {}),
    (Reason.RANK, lambda: GOOD, {"world_size": 7}),   # dst 7
    (Reason.RANK, lambda: GOOD, {"world_size": 3}),   # src 3
    (Reason.JOB, lambda: poke(GOOD, "job", 0), {}),
    (Reason.DST, lambda: GOOD, {"world_size": 8, "rank": 6}),
    (Reason.DST, lambda: poke(poke(GOOD, "dst", wire.DST_ALL), "kind", Kind.STOP), {"world_size": 8, "rank": 6}),
    (Reason.TAG, lambda: GOOD, {"key": KEY}),                                   # missing tag
    (Reason.TAG, lambda: wire.encode(sample_header(), b"0123456789", key=b"other"), {"key": KEY}),
    (Reason.TAG, lambda: _tamper(wire.encode(sample_header(), b"0123456789", key=KEY), 40), {"key": KEY}),
    (Reason.TAG, lambda: _tamper(wire.encode(sample_header(), b"0123456789", key=KEY), 8), {"key": KEY}),
    (Reason.TAG, lambda: _tamper(wire.encode(sample_header(), b"0123456789", key=KEY), -1), {"key": KEY}),
]


def _tamper(buf: bytes, i: int) -> bytes:
    out = bytearray(buf)
    out[i] ^= 0x01
    return bytes(out)


def test_every_reason_is_covered():
    # (the spoofing and VLAN reasons are the host program's alone: tests/linux/test_host_prog.py)
    assert {r for r, _, _ in MALFORMED} == set(Reason) - {Reason.OK, Reason.SPOOF_IP, Reason.SPOOF_MAC, Reason.VLAN}


@pytest.mark.parametrize("reason,make,kw", MALFORMED, ids=[f"{r.name}{i}" for i, (r, _, _) in enumerate(MALFORMED)])
def test_malformed_reason(reason, make, kw):
    buf = make()
    assert wire.validate(buf, **kw) is reason
    with pytest.raises(wire.WireError) as e:
        wire.decode(buf, **kw)
    assert e.value.reason is reason
    if reason is not Reason.TAG:  # the batch path does not verify tags
        frames, lens = batch_of([buf])
        got = wire.validate_batch(wire.decode_batch(frames), lens,
                                  world_size=kw.get("world_size"), rank=kw.get("rank"))
        assert got.tolist() == [reason]


def test_boundaries_are_valid():
    last = poke(poke(GOOD, "nchunks", wire.MAX_NCHUNKS), "chunk", wire.MAX_NCHUNKS - 1)
    assert wire.validate(last) is Reason.OK
    assert wire.validate(GOOD, world_size=8, rank=7) is Reason.OK
    # DATA to every rank (a broadcast all-gather) is every rank's, whatever the world
    assert wire.validate(poke(GOOD, "dst", wire.DST_ALL), world_size=8, rank=6) is Reason.OK
    for k in Kind:
        assert wire.validate(poke(GOOD, "kind", k)) is Reason.OK


def test_first_failing_check_wins():
    # magic and kind both wrong: magic is checked first (the kernel's order)
    assert wire.validate(poke(poke(GOOD, "magic", 0), "kind", 99)) is Reason.MAGIC
    # length and chunk both wrong: length first
    assert wire.validate(poke(GOOD, "chunk", 99)[:-1]) is Reason.LENGTH


# ---- batches -----------------------------------------------------------------

def _records(headers: list[Header]) -> np.ndarray:
    a = wire.empty_batch(len(headers))
    for i, h in enumerate(headers):
        for name in NAMES:
            a[i][name] = getattr(h, name)
    return a


def test_batch_encode_matches_single_encode():
    hs = [sample_header(chunk=i, len=4) for i in range(10)]
    rows = wire.encode_batch(_records(hs))
    assert rows.shape == (10, 32) and rows.dtype == np.uint8
    for i, h in enumerate(hs):
        assert rows[i].tobytes() == h.pack()


def test_batch_decode_matches_single_decode():
    pkts = [wire.encode(sample_header(chunk=i % 10, src=i % 4, dst=(i + 1) % 4), bytes(i)) for i in range(12)]
    frames, lens = batch_of(pkts)
    recs = wire.decode_batch(frames)
    for rec, p in zip(recs, pkts):
        h = Header.unpack(p)
        assert {n: int(rec[n]) for n in NAMES} == {n: getattr(h, n) for n in NAMES}
    assert not wire.validate_batch(recs, lens, world_size=4).any()


def test_batch_decode_at_offsets():
    # headers behind an Ethernet/IPv4/UDP prefix (42 bytes) and an IPv6 one (62 bytes)
    pkts = [wire.encode(sample_header(chunk=i), b"x" * i) for i in range(4)]
    offs = [42, 62, 42, 62]
    width = 62 + max(len(p) for p in pkts)
    frames = np.zeros((4, width), np.uint8)
    for i, (p, o) in enumerate(zip(pkts, offs)):
        frames[i, o: o + len(p)] = np.frombuffer(p, np.uint8)
    recs = wire.decode_batch(frames, np.array(offs))
    assert recs["chunk"].tolist() == [0, 1, 2, 3]
    assert (recs["magic"] == wire.MAGIC).all()
    same = wire.decode_batch(frames[[0, 2]], 42)
    assert same["len"].tolist() == [0, 2]


def test_batch_decode_row_too_short_is_rejected():
    frames = np.zeros((2, 40), np.uint8)
    frames[:, :32] = np.frombuffer(sample_header(len=0).pack(), np.uint8)
    recs = wire.decode_batch(frames, np.array([0, 20]))
    reasons = wire.validate_batch(recs, np.array([32, 20]))
    assert reasons.tolist() == [Reason.OK, Reason.SHORT]


def test_empty_batch():
    recs = wire.decode_batch(np.zeros((0, 64), np.uint8))
    assert recs.shape == (0,) and recs.dtype == wire.HEADER_DTYPE
    assert wire.validate_batch(recs, np.zeros(0)).shape == (0,)
    assert wire.encode_batch(wire.empty_batch(0)).shape == (0, 32)


def test_batch_mixed_reasons_in_one_call():
    cases = [(m(), kw) for r, m, kw in MALFORMED if r is not Reason.TAG and not kw]
    pkts = [GOOD] + [p for p, _ in cases]
    frames, lens = batch_of(pkts)
    got = wire.validate_batch(wire.decode_batch(frames), lens)
    assert got.tolist() == [wire.validate(p) for p in pkts]
    assert got[0] == Reason.OK and (got[1:] != Reason.OK).all()


# ---- properties ----------------------------------------------------------------

def _field(code: str):
    return st.integers(0, (1 << (8 * struct.calcsize(code))) - 1)


valid_headers = st.builds(
    lambda kind, nchunks, data, fields: Header(
        kind=kind, nchunks=nchunks, chunk=data.draw(st.integers(0, nchunks - 1)), **fields),
    kind=st.sampled_from(list(Kind)),
    nchunks=st.integers(1, wire.MAX_NCHUNKS),
    data=st.data(),
    fields=st.fixed_dictionaries({
        "job": st.integers(1, 2**32 - 1), "round": _field("I"), "tensor": _field("H"),
        "src": _field("H"), "dst": _field("H"), "prio": st.integers(0, wire.MAX_PRIO),
        "dtype": st.sampled_from(list(wire.Dtype)), "tol": _field("B"), "flags": _field("B"),
    }),
)


@settings(max_examples=200, deadline=None)
@given(h=valid_headers, payload=st.binary(max_size=64), keyed=st.booleans())
def test_property_round_trip(h, payload, keyed):
    key = KEY if keyed else None
    buf = wire.encode(h, payload, key=key)
    got, body = wire.decode(buf, key=key)
    assert body == payload
    want_flags = (h.flags | wire.Flag.TAG) if keyed else (h.flags & ~int(wire.Flag.TAG))
    assert got == h.replace(len=len(payload), flags=want_flags)
    frames, lens = batch_of([buf])
    rec = wire.decode_batch(frames)[0]
    assert {n: int(rec[n]) for n in NAMES} == {n: getattr(got, n) for n in NAMES}
    assert wire.validate_batch(wire.decode_batch(frames), lens).tolist() == [Reason.OK]


# random bytes biased towards a valid magic/version so later checks are reached
def _near_valid(data: bytes, kind: int, fix_len: bool) -> bytes:
    b = bytearray(data)
    if len(b) >= 4:
        b[0:4] = bytes([0xDB, 0x1B, 1, kind])
    if fix_len and len(b) >= 32:
        taglen = wire.TAG_LEN if b[31] & wire.Flag.TAG else 0
        struct.pack_into("!H", b, 28, max(0, len(b) - 32 - taglen) & 0xFFFF)
    return bytes(b)


packets = st.one_of(
    st.binary(max_size=80),
    st.builds(_near_valid, st.binary(min_size=28, max_size=80), st.integers(0, 7), st.booleans()),
)


@settings(max_examples=300, deadline=None)
@given(pkts=st.lists(packets, min_size=1, max_size=8),
       world=st.one_of(st.none(), st.integers(1, 70000)), rank=st.one_of(st.none(), st.integers(0, 70000)))
def test_property_validate_total_and_batch_agrees(pkts, world, rank):
    single = [wire.validate(p, world_size=world, rank=rank) for p in pkts]
    assert all(isinstance(r, Reason) for r in single)
    for p in pkts:  # also with a key: still a reason, never an exception
        assert isinstance(wire.validate(p, key=KEY), Reason)
    frames, lens = batch_of(pkts)
    batch = wire.validate_batch(wire.decode_batch(frames), lens, world_size=world, rank=rank)
    assert batch.tolist() == [int(r) for r in single]


GOOD_PKT = wire.encode(sample_header(), b"\x01" * 40)


@settings(max_examples=300, deadline=None)
@given(pkts=st.lists(st.one_of(packets, st.just(GOOD_PKT), st.just(GOOD_PKT)), min_size=1, max_size=24))
def test_property_all_valid_agrees_with_the_labelled_path(pkts):
    """``all_valid`` (Python up to 8 headers, numpy words past that) says yes exactly when
    ``validate_batch``'s labelled path finds no reason (rank checks off: no rank fails them)."""
    frames, lens = batch_of(pkts)
    recs = wire.decode_batch(frames)
    labelled = wire.validate_batch(recs, lens, world_size=1 << 17)
    assert wire.all_valid(recs, lens.astype(np.int64)) == (not labelled.any())


def test_take_and_put_copy_records_exactly():
    h = wire.empty_batch(300)
    rng = np.random.default_rng(3)
    for name in wire.HEADER_DTYPE.names:
        h[name] = rng.integers(0, 200, 300)
    rows = rng.permutation(300)[:123]
    got = wire.take(h, rows)
    assert got.dtype == wire.HEADER_DTYPE and np.array_equal(got, h[rows])
    before = h.copy()
    got["chunk"] = 7777  # a copy, not a view
    assert np.array_equal(h, before)
    dst = wire.empty_batch(500)
    wire.put(dst[10:133], h[rows])
    assert np.array_equal(dst[10:133], h[rows]) and np.all(dst["magic"][:10] == wire.MAGIC)
    assert np.all(dst["chunk"][133:] == 0)
