"""Property tests of the transports' receive on arbitrary input: nothing raises, every packet is
either handed up intact or dropped and counted for one reason.

* :class:`~pydblp.transport.auth.AuthTransport` over a scripted inner transport that lends
  arbitrary batches as AF_XDP does (``copy=False``: payload rows exactly as wide as the widest
  packet, 0 bytes wide when every packet is header-only), of genuine, forged, replayed,
  untagged, cut and altered packets.
* :class:`~pydblp.transport.udp.UdpTransport` over loopback, with and without GRO, on arbitrary
  datagrams mixed with valid DBLP packets.

(The AF_XDP socket's own parsing on arbitrary frames: tests/linux/test_xsk_properties.py.)
"""

from __future__ import annotations

import socket
import time

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pydblp import wire
from pydblp.transport.auth import AuthTransport
from pydblp.transport.base import Batch, Transport
from pydblp.transport.udp import UdpTransport

KEY, OTHER = b"K" * 32, b"O" * 32
EPOCH = 0x0A0B0C0D
SETTINGS = settings(max_examples=150, deadline=None, derandomize=True)


class Scripted(Transport):
    """A transport whose receive hands out the batches it was given, lent as AF_XDP lends them."""

    kind = "scripted"
    netns = ifname = None
    queue, port = 0, 1

    def __init__(self):
        self.queued: list[Batch] = []
        self._c = {"rx_errors": 0}

    def add_peer(self, addr, port=wire.DEFAULT_PORT, mac=None) -> int:
        return 0

    def send(self, batch, timeout=1.0) -> int:
        return len(batch)

    def _recv(self, into, timeout, max, want, linger, copy) -> Batch:
        if not self.queued:
            into.n = 0
            return into.view(0, 0)
        b = self.queued.pop(0)
        k = len(b)
        wire.put(into.headers[:k], b.headers[:k])
        into.lengths[:k], into.peer[:k], into.n = b.lengths[:k], b.peer[:k], k
        return Batch(into.headers[:k], b.payload, into.lengths[:k], into.peer[:k], k)

    def stats(self) -> dict:
        return dict(self._c)

    def fileno(self) -> int:
        return 0

    def close(self) -> None:
        pass


MODES = ("genuine", "other_key", "other_epoch", "untagged", "cut", "altered", "flag_only")
packet = st.tuples(st.sampled_from(MODES), st.integers(0, 200), st.sampled_from(list(wire.Kind)),
                   st.integers(0, 2 ** 32 - 1), st.binary(min_size=0, max_size=8))


def _datagram(mode, n, kind, rnd, salt):
    """(UDP payload bytes, it must verify) for one packet of ``mode``."""
    rng = np.random.default_rng(list(salt) + [n, rnd & 0xFFFF])
    h = wire.Header(kind=kind, job=3, round=rnd, src=1, dst=0, nchunks=1 << 20, chunk=n)
    body = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    if mode == "genuine":
        return wire.encode(h, body, key=KEY, epoch=EPOCH), True
    if mode == "other_key":
        return wire.encode(h, body, key=OTHER, epoch=EPOCH), False
    if mode == "other_epoch":
        return wire.encode(h, body, key=KEY, epoch=EPOCH ^ 1), False
    if mode == "untagged":
        return wire.encode(h, body), False
    d = bytearray(wire.encode(h, body, key=KEY, epoch=EPOCH))
    if mode == "cut":  # the tag's last bytes lost, len left as it was
        return bytes(d[: len(d) - 1 - (n % wire.TAG_LEN)]), False
    if mode == "altered":  # one bit of the header or payload changed after tagging
        i = n % (len(d) - wire.TAG_LEN)
        d[i if i not in range(28, 30) else 0] ^= 0x10  # (not len: that is "cut"'s reason)
        return bytes(d), False
    return wire.encode(h, body)[:31] + bytes([int(wire.Flag.TAG)]) + body, False  # flag set, no tag


@SETTINGS
@given(pkts=st.lists(packet, min_size=1, max_size=24), extra=st.integers(0, 40), copy=st.booleans())
def test_auth_receive_takes_exactly_the_genuine_packets(pkts, extra, copy):
    dgrams = [_datagram(*p) for p in pkts]
    n = len(dgrams)
    lens = np.array([len(d) - wire.HEADER_LEN for d, _ in dgrams], np.int32)
    width = int(lens.max()) + extra if extra % 3 else int(lens.max())  # lent rows: exact or wider
    hdrs = wire.empty_batch(n)
    pay = np.zeros((n, width), np.uint8)
    for i, (d, _) in enumerate(dgrams):
        hdrs[i] = np.frombuffer(d[: wire.HEADER_LEN], wire.HEADER_DTYPE)[0]
        pay[i, : lens[i]] = np.frombuffer(d[wire.HEADER_LEN:], np.uint8)
    inner = Scripted()
    inner.queued.append(Batch(hdrs, pay, lens, np.full(n, -1, np.int32), n))
    t = AuthTransport(inner, KEY, EPOCH)
    got = t.recv(Batch.empty(64, 1408), copy=copy)
    s = t.stats()
    want = [i for i, (_, ok) in enumerate(dgrams) if ok]
    assert s["rx_errors"] == 0  # handled, never caught by recv's guard
    assert got.n == len(want) == s["auth_verified"]
    assert sum(s[f"auth_{r}"] for r in ("untagged", "epoch", "bad_tag", "truncated")) == n - len(want)
    for j, i in enumerate(want):
        d = dgrams[i][0]
        body = d[wire.HEADER_LEN: len(d) - wire.TAG_LEN]
        assert got.lengths[j] == len(body) and got.payload[j, : len(body)].tobytes() == body
        h = got.headers[j]
        assert not h["flags"] & wire.Flag.TAG and int(h["round"]) == pkts[i][3] and int(h["chunk"]) == pkts[i][1]


# ---- UDP over loopback ----------------------------------------------------------------------

_udp: dict = {}


def _receiver(gro: bool) -> UdpTransport:
    """One receiver per GRO setting for the whole module (hypothesis runs many examples)."""
    if gro not in _udp:
        _udp[gro] = UdpTransport(port=0, bind="127.0.0.1", gro=gro)
    return _udp[gro]


def teardown_module():
    for t in _udp.values():
        t.close()
    _udp.clear()


valid = st.tuples(st.sampled_from(list(wire.Kind)), st.integers(0, 1400)).map(
    lambda kl: wire.encode(wire.Header(kind=kl[0], job=9, nchunks=7, chunk=kl[1] % 7),
                           bytes((kl[1] * 7 + i) & 0xFF for i in range(kl[1]))))
datagram = st.one_of(st.binary(min_size=0, max_size=1500), valid, valid.map(lambda d: d[: len(d) // 2]),
                     valid.map(lambda d: d[:28] + b"\xff\xff" + d[30:]))


@SETTINGS
@given(dgrams=st.lists(datagram, min_size=1, max_size=40), gro=st.booleans(), width=st.sampled_from([64, 1408]))
def test_udp_receive_hands_up_valid_packets_and_counts_the_rest(dgrams, gro, width):
    t = _receiver(gro)
    before = t.stats()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for d in dgrams:
            s.sendto(d, ("127.0.0.1", t.port))
    ok = [d for d in dgrams if wire.validate(d) == wire.Reason.OK]
    into = Batch.empty(64, width)
    seen: list[tuple[bytes, int]] = []
    end = time.monotonic() + 5
    while time.monotonic() < end:
        b = t.recv(into, timeout=0.05, copy=False)
        seen += [(b.headers[i].tobytes(), int(b.lengths[i])) for i in range(b.n)]
        assert all(wire.validate_batch(b.headers[: b.n], b.headers["len"][: b.n].astype(np.int64)
                                       + wire.HEADER_LEN) == 0)
        now = t.stats()
        if now["rx_packets"] + now["rx_invalid"] - before["rx_packets"] - before["rx_invalid"] >= len(dgrams):
            break
    after = t.stats()
    assert after["rx_errors"] == before["rx_errors"]
    assert after["rx_packets"] - before["rx_packets"] == len(ok) == len(seen)
    assert after["rx_invalid"] - before["rx_invalid"] == len(dgrams) - len(ok)
    assert sorted(seen) == sorted((d[: wire.HEADER_LEN], min(len(d) - wire.HEADER_LEN, width)) for d in ok)
    assert after["rx_truncated"] - before["rx_truncated"] == sum(len(d) - wire.HEADER_LEN > width for d in ok)
