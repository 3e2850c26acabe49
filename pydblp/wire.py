"""DBLP wire format v1: the one Python definition of the packet header.

The header is 32 bytes in network byte order, followed by ``len`` payload
bytes and, when ``flags & FLAG_TAG``, a 16-byte tag: the run's 4-byte epoch
(big-endian) and a 12-byte keyed BLAKE2b MAC over header + payload, salted
with that epoch (:func:`tag`).  ``bpf/dblp.h`` mirrors every constant and field here;
``tests/unit/test_header_agreement.py`` compiles it and checks they agree.

Single packets go through :class:`Header`, :func:`encode` and
:func:`validate`.  Batches (the AF_XDP path parses thousands of headers a
call) go through :data:`HEADER_DTYPE`, :func:`encode_batch`,
:func:`decode_batch` and :func:`validate_batch`, which are numpy-vectorised.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from dataclasses import dataclass, replace

import numpy as np

MAGIC = 0xDB1B
VERSION = 1
HEADER_LEN = 32
DATAGRAM_OVERHEAD = 40 + 8 + HEADER_LEN  # IPv6 (the longer IP header), UDP and DBLP headers on a payload
TAG_LEN = 16
EPOCH_LEN = 4  # the tag's first bytes: the run epoch, in the clear
MAC_LEN = TAG_LEN - EPOCH_LEN  # the rest: keyed BLAKE2b-96
KEY_MIN, KEY_MAX = 16, 64  # job key bytes (BLAKE2b takes keys of up to 64)
_PERSON = b"dblp-tag-v1"  # BLAKE2b personalisation: a DBLP tag is no other keyed hash of the same key
DEFAULT_PORT = 47800
MAX_NCHUNKS = 1 << 24
MAX_PRIO = 7
TOL_SCALE = 255
DST_ALL = 0xFFFF  # dst of DATA sent to every rank at once (a broadcast all-gather); control packets name one


class Kind(enum.IntEnum):
    DATA = 1
    PROBE = 2
    BITMAP = 3
    STOP = 4
    HELLO = 5


HELLO_PAYLOAD = struct.Struct("!QI")  # a HELLO's payload: its number (from 1, per sender and run) and the
                                      # ms since the sender's last round (docs/wire.md)


class Dtype(enum.IntEnum):
    F32 = 0
    F16 = 1
    BF16 = 2
    RAW = 3


class Flag(enum.IntFlag):
    RETX = 1 << 0       # retransmission
    ALLGATHER = 1 << 1  # all-gather phase
    TAG = 1 << 2        # auth tag follows payload
    NEIGHBOUR = 1 << 3  # a neighbour (gossip) round's message, rank to rank
    FINAL = 1 << 4      # BITMAP: the bits an owner's estimate used (error feedback), not a repair request
    ASK = 1 << 5        # HELLO: from a rank in the round, asking a quiet peer it waits for to say HELLO if busy


class Reason(enum.IntEnum):
    """Why a packet is malformed.  Shared with the kernel's drop counters.

    ``JOB`` and ``DST`` are only decided where the job table lives (the XDP
    program, or a receiver told its rank); ``SPOOF_IP`` and ``SPOOF_MAC`` only
    in the XDP program (it holds the ranks' addresses), ``VLAN`` only there too;
    ``TAG`` only in userspace.
    """

    OK = 0
    SHORT = 1     # shorter than the 32-byte header (XDP: or than its IP and UDP lengths say)
    MAGIC = 2
    VERSION = 3
    KIND = 4
    LENGTH = 5    # len != payload length (minus the tag)
    CHUNK = 6     # chunk >= nchunks
    NCHUNKS = 7   # nchunks == 0 or > MAX_NCHUNKS
    RANK = 8      # src or dst >= world size
    JOB = 9       # job id 0 or not registered
    DST = 10      # dst is not this host's rank
    TAG = 11      # tag missing or does not verify
    SPOOF_IP = 12   # the src rank is bound to another source IP (host program's peers map)
    SPOOF_MAC = 13  # the src rank is bound to another source MAC (host program's peers map)
    VLAN = 14       # an xsk job's packet behind a VLAN tag (host program: AF_XDP takes untagged frames)


# Field name -> struct code, in wire order.  The single source for the
# struct format, the numpy dtype and the header agreement test.
FIELDS = (
    ("magic", "H"),
    ("version", "B"),
    ("kind", "B"),
    ("job", "I"),
    ("round", "I"),
    ("tensor", "H"),
    ("src", "H"),
    ("dst", "H"),
    ("prio", "B"),
    ("dtype", "B"),
    ("chunk", "I"),
    ("nchunks", "I"),
    ("len", "H"),
    ("tol", "B"),
    ("flags", "B"),
)

# Position of each field in a record as a tuple (``ndarray.tolist()`` of header records, struct order).
(F_MAGIC, F_VERSION, F_KIND, F_JOB, F_ROUND, F_TENSOR, F_SRC, F_DST, F_PRIO, F_DTYPE, F_CHUNK, F_NCHUNKS,
 F_LEN, F_TOL, F_FLAGS) = range(len(FIELDS))
assert [name for name, _ in FIELDS][F_NCHUNKS] == "nchunks" and [name for name, _ in FIELDS][F_FLAGS] == "flags"

_STRUCT = struct.Struct("!" + "".join(code for _, code in FIELDS))
assert _STRUCT.size == HEADER_LEN

_NP_CODE = {"B": "u1", "H": ">u2", "I": ">u4"}
HEADER_DTYPE = np.dtype([(name, _NP_CODE[code]) for name, code in FIELDS])
assert HEADER_DTYPE.itemsize == HEADER_LEN


class WireError(ValueError):
    """A packet failed validation; ``reason`` says why."""

    def __init__(self, reason: Reason, detail: str = ""):
        self.reason = Reason(reason)
        super().__init__(f"{self.reason.name.lower()}: {detail}" if detail else self.reason.name.lower())


@dataclass(frozen=True)
class Header:
    kind: int = Kind.DATA
    job: int = 1
    round: int = 0
    tensor: int = 0
    src: int = 0
    dst: int = 0
    prio: int = 0
    dtype: int = Dtype.F32
    chunk: int = 0
    nchunks: int = 1
    len: int = 0
    tol: int = 0
    flags: int = 0
    magic: int = MAGIC
    version: int = VERSION

    def pack(self) -> bytes:
        return _STRUCT.pack(*(getattr(self, name) for name, _ in FIELDS))

    @classmethod
    def unpack(cls, buf: bytes | memoryview) -> "Header":
        if len(buf) < HEADER_LEN:
            raise WireError(Reason.SHORT, f"{len(buf)} bytes")
        return cls(**dict(zip((n for n, _ in FIELDS), _STRUCT.unpack_from(buf))))

    def replace(self, **kw) -> "Header":
        return replace(self, **kw)


def mac_state(key: bytes, epoch: int = 0):
    """The keyed BLAKE2b-96 state a tag of run ``epoch`` starts from (``.copy()`` it per packet:
    the key block is then compressed once, not per packet).

    Args:
        key: the job key, KEY_MIN..KEY_MAX bytes.
        epoch: the run epoch, 0..2**32-1 (BLAKE2b's salt: a tag of one run never verifies in another).
    """
    return hashlib.blake2b(key=key, digest_size=MAC_LEN, salt=epoch.to_bytes(EPOCH_LEN, "big"),
                           person=_PERSON)


def tag(key: bytes, data: bytes | memoryview, epoch: int = 0) -> bytes:
    """The 16-byte tag of ``data`` (header + payload): ``epoch`` (4 bytes, big-endian), then the
    keyed BLAKE2b-96 MAC of ``data`` under ``key`` salted with ``epoch`` (:func:`mac_state`)."""
    h = mac_state(key, epoch)
    h.update(data)
    return epoch.to_bytes(EPOCH_LEN, "big") + h.digest()


def tag_epoch(trailer: bytes | memoryview) -> int:
    """The run epoch a 16-byte tag claims (unverified)."""
    return int.from_bytes(bytes(trailer[:EPOCH_LEN]), "big")


def encode(hdr: Header, payload: bytes = b"", key: bytes | None = None, epoch: int = 0) -> bytes:
    """Header + payload (+ tag of run ``epoch`` when ``key``); ``len`` and the tag flag are set here."""
    # int(): ~Flag.TAG on an IntFlag would also clear the reserved bits 6-7
    flags = (hdr.flags | Flag.TAG) if key else (hdr.flags & ~int(Flag.TAG))
    body = hdr.replace(len=len(payload), flags=int(flags)).pack() + bytes(payload)
    return body + tag(key, body, epoch) if key else body


def validate(buf: bytes | memoryview, world_size: int | None = None,
             key: bytes | None = None, rank: int | None = None, epoch: int | None = None) -> Reason:
    """Return :data:`Reason.OK` or the first reason ``buf`` (a UDP payload) is malformed.

    Checks are made in the kernel's order so both sides report the same
    reason for the same packet.  With ``key`` a packet must carry a tag that
    verifies under it, for the epoch the tag names, or only for ``epoch`` if given.
    """
    n = len(buf)
    if n < HEADER_LEN:
        return Reason.SHORT
    h = _STRUCT.unpack_from(buf)
    magic, version, kind = h[0], h[1], h[2]
    job, src, dst, chunk, nchunks, length, flags = h[3], h[6], h[7], h[10], h[11], h[12], h[14]
    if magic != MAGIC:
        return Reason.MAGIC
    if version != VERSION:
        return Reason.VERSION
    if kind not in _KINDS:
        return Reason.KIND
    taglen = TAG_LEN if flags & Flag.TAG else 0
    if length != n - HEADER_LEN - taglen:
        return Reason.LENGTH
    if nchunks == 0 or nchunks > MAX_NCHUNKS:
        return Reason.NCHUNKS
    if chunk >= nchunks:
        return Reason.CHUNK
    if job == 0:
        return Reason.JOB
    if world_size is not None and (src >= world_size or (dst >= world_size and dst != DST_ALL)):
        return Reason.RANK
    if rank is not None and dst != rank and not (dst == DST_ALL and kind == Kind.DATA):
        return Reason.DST
    if key:  # an empty key means no key, as in encode
        if not taglen:
            return Reason.TAG
        got = bytes(buf[n - TAG_LEN:])
        claimed = tag_epoch(got)
        if (epoch is not None and claimed != epoch) or not hmac.compare_digest(
                tag(key, buf[: n - TAG_LEN], claimed), got):
            return Reason.TAG
    return Reason.OK


_KINDS = frozenset(int(k) for k in Kind)


def decode(buf: bytes | memoryview, world_size: int | None = None,
           key: bytes | None = None, rank: int | None = None, epoch: int | None = None) -> tuple[Header, bytes]:
    """Validate and split a UDP payload into (header, payload); raise :class:`WireError`."""
    reason = validate(buf, world_size, key, rank, epoch)
    if reason:
        raise WireError(reason, f"{len(buf)}-byte packet")
    hdr = Header.unpack(buf)
    return hdr, bytes(buf[HEADER_LEN: HEADER_LEN + hdr.len])


# ---- batches -------------------------------------------------------------

def empty_batch(n: int) -> np.ndarray:
    """``n`` headers with magic/version set and every other field zero."""
    a = np.zeros(n, HEADER_DTYPE)
    a["magic"] = MAGIC
    a["version"] = VERSION
    return a


_RECORD = np.dtype((np.void, HEADER_LEN))


def take(headers: np.ndarray, idx) -> np.ndarray:
    """``headers[idx]`` (a copy), gathered as opaque 32-byte records.

    numpy moves structured records field by field; as void records a gather
    or copy runs at memcpy speed (~15x faster for a 2048-header gather).
    """
    return headers.view(_RECORD)[idx].view(HEADER_DTYPE)


def put(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` for header arrays of one length, copied as opaque records (see :func:`take`)."""
    dst.view(_RECORD)[...] = src.view(_RECORD)


def move(headers: np.ndarray, dst, src) -> None:
    """``headers[dst] = headers[src]`` within one array, copied as opaque records (see :func:`take`)."""
    v = headers.view(_RECORD)
    v[dst] = v[src]


def encode_batch(headers: np.ndarray) -> np.ndarray:
    """Header records -> an (n, 32) uint8 array of wire bytes (no copy of fields by Python)."""
    headers = np.ascontiguousarray(headers, dtype=HEADER_DTYPE)
    return headers.view(np.uint8).reshape(len(headers), HEADER_LEN)


def decode_batch(frames: np.ndarray, offset: int | np.ndarray = 0) -> np.ndarray:
    """Parse headers out of an (n, m) uint8 array at ``offset`` (scalar or per row).

    Rows shorter than ``offset + 32`` give zeroed records (magic 0, so
    :func:`validate_batch` reports them).
    """
    frames = np.asarray(frames, dtype=np.uint8)
    n, width = frames.shape
    if n == 0:
        return np.zeros(0, HEADER_DTYPE)
    off = np.broadcast_to(np.asarray(offset, dtype=np.int64), (n,))
    if np.all(off == off[0]) and off[0] + HEADER_LEN <= width:
        raw = np.ascontiguousarray(frames[:, off[0]: off[0] + HEADER_LEN])
    else:
        idx = off[:, None] + np.arange(HEADER_LEN)
        ok = idx < width
        raw = np.where(ok, frames[np.arange(n)[:, None], np.minimum(idx, width - 1)], 0).astype(np.uint8)
    return raw.view(HEADER_DTYPE).reshape(n)


_W0_MIN = (MAGIC << 16) | (VERSION << 8) | min(_KINDS)  # first header word: magic, version, kind
_W0_SPAN = max(_KINDS) - min(_KINDS)
_U4 = np.dtype("<u4")
_KIND_MIN, _KIND_MAX = min(_KINDS), max(_KINDS)
_FEW = 8  # headers up to which all_valid checks them in Python
FLAG_TAG = int(Flag.TAG)  # a plain int (C: DBLP_FLAG_TAG): numpy takes an IntFlag operand ~5x slower
assert sorted(_KINDS) == list(range(min(_KINDS), max(_KINDS) + 1)) and Flag.TAG == 4 and TAG_LEN == 16


def all_valid(h: np.ndarray, plen: np.ndarray) -> bool:
    """True when every header passes :func:`validate_batch`'s checks (no rank checks), computed on
    big-endian 32-bit words of the records: a third of the numpy calls of the labelled path.
    ``plen``: the UDP payload lengths (header included), int64."""
    if not (h.dtype == HEADER_DTYPE and h.flags.c_contiguous) or len(h) == 0:
        return len(h) == 0
    if len(h) <= _FEW:  # a few packets (control packets): Python on the fields beats numpy's per-call cost
        for f, pl in zip(h.tolist(), plen.tolist()):
            if (f[F_MAGIC] != MAGIC or f[F_VERSION] != VERSION or not _KIND_MIN <= f[F_KIND] <= _KIND_MAX
                    or f[F_JOB] == 0 or not 1 <= f[F_NCHUNKS] <= MAX_NCHUNKS or f[F_CHUNK] >= f[F_NCHUNKS]
                    or f[F_LEN] + (TAG_LEN if f[F_FLAGS] & FLAG_TAG else 0) + HEADER_LEN != pl):
                return False
        return True
    w = h.view(_U4).reshape(-1, 8).byteswap()  # one swap; the checks then run on native words
    n_ch = w[:, 6]
    w7 = w[:, 7]  # len, tol, flags
    bad = (w[:, 0] - np.uint32(_W0_MIN)) > _W0_SPAN  # magic, version, kind (wraps below the range)
    bad |= w[:, 1] == 0  # job
    bad |= (n_ch - np.uint32(1)) >= MAX_NCHUNKS  # nchunks 1..MAX_NCHUNKS
    bad |= w[:, 5] >= n_ch  # chunk
    bad |= (w7 >> 16) + ((w7 & FLAG_TAG) << 2) + HEADER_LEN != plen  # len (tag included); so plen >= 32 too
    return not bad.any()


def validate_batch(headers: np.ndarray, payload_lens: np.ndarray,
                   world_size: int | None = None, rank: int | None = None) -> np.ndarray:
    """Vectorised :func:`validate` without the tag check: a uint8 array of :class:`Reason`.

    ``payload_lens`` are the UDP payload lengths (header included).  The
    first failing check wins, in the same order as :func:`validate`.
    """
    h = headers
    plen = np.asarray(payload_lens, dtype=np.int64)
    if world_size is None and rank is None and all_valid(h, plen):  # the usual case, in few numpy calls
        return np.zeros(len(h), np.uint8)
    taglen = np.where(h["flags"] & FLAG_TAG, TAG_LEN, 0)
    nch = h["nchunks"].astype(np.int64)
    checks = [
        (Reason.SHORT, plen < HEADER_LEN),
        (Reason.MAGIC, h["magic"] != MAGIC),
        (Reason.VERSION, h["version"] != VERSION),
        (Reason.KIND, (h["kind"] < min(_KINDS)) | (h["kind"] > max(_KINDS))),
        (Reason.LENGTH, h["len"].astype(np.int64) != plen - HEADER_LEN - taglen),
        (Reason.NCHUNKS, (nch == 0) | (nch > MAX_NCHUNKS)),
        (Reason.CHUNK, h["chunk"].astype(np.int64) >= nch),
        (Reason.JOB, h["job"] == 0),
    ]
    if world_size is not None:
        checks.append((Reason.RANK, (h["src"] >= world_size) | ((h["dst"] >= world_size) & (h["dst"] != DST_ALL))))
    if rank is not None:
        checks.append((Reason.DST, (h["dst"] != rank) & ~((h["dst"] == DST_ALL) & (h["kind"] == Kind.DATA))))
    out = np.zeros(len(h), np.uint8)
    anybad = checks[0][1].copy()
    for _, bad in checks[1:]:
        anybad |= bad
    if not anybad.any():  # the usual case: nothing to label
        return out
    for reason, bad in reversed(checks):
        out[bad] = reason
    return out
