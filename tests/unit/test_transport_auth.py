"""The authenticated transport over UDP loopback: tags on the wire, forged and replayed packets
dropped and counted before the collective, one clear error for ranks with different keys."""

from __future__ import annotations

import socket
import time

import numpy as np
import pytest

from pydblp import wire
from pydblp.jobkey import KeyLoadError, load_key, new_epoch
from pydblp.collective import Collective, CollectiveError, Config
from pydblp.transport.auth import AuthTransport, authenticate
from pydblp.transport.base import Batch, TransportError
from pydblp.transport.udp import UdpTransport
from tests.helpers import run_threads

KEY, OTHER = b"K" * 32, b"O" * 32
EPOCH = 0x5EED0001


def batch(n, maxlen=1408, seed=0, peer=0, kinds=(wire.Kind.DATA,)):
    h = wire.empty_batch(n)
    h["kind"] = np.resize(np.array(kinds), n)
    h["job"], h["round"], h["src"], h["dst"] = 3, 7, 1, 0
    h["nchunks"] = 1 << 20
    h["chunk"] = np.arange(n)
    rng = np.random.default_rng(seed)
    lens = 1 + (np.arange(n) * 37) % maxlen
    return Batch.fill(h, rng.integers(0, 256, (n, maxlen), dtype=np.uint8), lens, peer)


def recv_all(t, n, copy=True, timeout=3.0):
    """Receive until ``n`` packets came (or ``timeout``): (headers, lengths, payload bytes)."""
    into = Batch.empty(2048, 1408)
    hs, ls, ps = [], [], []
    end = time.monotonic() + timeout
    while sum(map(len, hs)) < n and time.monotonic() < end:
        g = t.recv(into, timeout=0.1, copy=copy)
        hs.append(g.headers.copy())
        ls.append(g.lengths.copy())
        ps += [g.payload[i, : g.lengths[i]].tobytes() for i in range(g.n)]
    return np.concatenate(hs), np.concatenate(ls), ps


def raw_socket():
    return socket.socket(socket.AF_INET, socket.SOCK_DGRAM)


@pytest.mark.parametrize("copy", [True, False])
def test_tagged_batches_arrive_untagged_and_bit_exact(copy):
    """What goes in on one side comes out on the other: headers (flag TAG clear), lengths and
    payloads of every size, control kinds included; each one verified and counted."""
    with authenticate(UdpTransport(port=0), KEY, EPOCH) as a, authenticate(UdpTransport(port=0), KEY, EPOCH) as b:
        pb = a.add_peer("127.0.0.1", b.port)
        b.add_peer("127.0.0.1", a.port)
        sent = batch(600, peer=pb, kinds=list(wire.Kind))
        assert a.send(sent) == 600
        h, lens, pays = recv_all(b, 600, copy)
        o = np.argsort(h["chunk"])
        assert np.array_equal(h[o], sent.headers)
        assert np.array_equal(lens[o], sent.lengths)
        assert [pays[i] for i in o] == sent.payloads()
        s = b.stats()
        assert s["auth_verified"] == 600 and a.stats()["auth_tagged"] == 600
        assert sum(s[f"auth_{r}"] for r in ("untagged", "epoch", "bad_tag", "truncated")) == 0


def test_the_wire_carries_the_tag_of_wire_tag_and_no_key_changes_nothing():
    """With a key, each datagram is header (flag TAG) + payload + ``wire.tag`` of them for the
    run's epoch; without one, ``authenticate`` is the transport itself, the datagrams untagged."""
    rx = raw_socket()
    rx.bind(("127.0.0.1", 0))
    rx.settimeout(2)
    sent = batch(5)
    plain = UdpTransport(port=0)
    assert authenticate(plain, None, EPOCH) is plain
    for key in (None, KEY):
        with authenticate(UdpTransport(port=0), key, EPOCH) as t:
            sent.peer[:] = t.add_peer("127.0.0.1", rx.getsockname()[1])
            t.send(sent)
            for i in range(5):
                got = rx.recv(4096)
                body = wire.encode(wire.Header.unpack(sent.headers[i].tobytes()), sent.payloads()[i])
                if key is None:
                    assert got == body
                else:
                    hdr = wire.Header.unpack(got)
                    assert hdr.flags == wire.Flag.TAG and hdr.len == sent.lengths[i]
                    assert got[:-16] == hdr.pack() + sent.payloads()[i]
                    assert got[-16:] == wire.tag(KEY, got[:-16], EPOCH)
                    assert wire.validate(got, key=KEY, epoch=EPOCH) is wire.Reason.OK
    plain.close()
    rx.close()


def _spray(port, pkts):
    s = raw_socket()
    for p in pkts:
        s.sendto(p, ("127.0.0.1", port))
    s.close()


def _wait(pred, timeout=5.0):
    end = time.monotonic() + timeout
    while not pred() and time.monotonic() < end:
        time.sleep(0.01)
    return pred()


def test_forged_packets_are_dropped_by_reason_before_the_caller():
    with authenticate(UdpTransport(port=0), KEY, EPOCH) as t:
        h = wire.Header(job=3, round=7, src=1, dst=0, nchunks=4, chunk=1)
        good = wire.encode(h, b"x" * 64, key=KEY, epoch=EPOCH)
        forged = [wire.encode(h, b"y" * 64)] * 3                                     # untagged
        forged += [wire.encode(h, b"y" * 64, key=OTHER, epoch=EPOCH)] * 4            # another key
        forged += [good[:40] + b"y" + good[41:]] * 2                                 # altered payload
        forged += [good[:8] + b"\0\0\0\x08" + good[12:]] * 2                         # altered round
        forged += [wire.encode(h, b"x" * 64, key=KEY, epoch=EPOCH + 1)] * 5          # another run
        _spray(t.port, forged + [good])
        got = recv_all(t, 1)
        assert len(got[0]) == 1 and got[2] == [b"x" * 64] and got[0][0]["round"] == 7
        s = t.stats()
        assert (s["auth_untagged"], s["auth_bad_tag"], s["auth_epoch"], s["auth_verified"]) == (3, 8, 5, 1)


class Pair:
    """Two keyed collectives on loopback (threads), with optional per-rank keys and epochs."""

    def __init__(self, keys=(KEY, KEY), epochs=(EPOCH, EPOCH), fail_after=5.0, **cfg):
        self.raw = [UdpTransport(port=0) for _ in range(2)]
        self.ts = [authenticate(t, k, e, fail_after) for t, k, e in zip(self.raw, keys, epochs)]
        peers = [("127.0.0.1", t.port) for t in self.raw]
        self.cols = [Collective(self.ts[r], r, 2, peers, Config(**cfg)) for r in range(2)]

    def run(self, fn, ranks=(0, 1), timeout=30.0):
        return run_threads(lambda r: fn(r, self.cols[r]), ranks, timeout)

    def close(self):
        for c in self.cols:
            c.close()


@pytest.fixture
def pair():
    made = []

    def make(**kw):
        p = Pair(**kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


def xs_of(rounds, n=10_000, seed=0):
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(n).astype(np.float32) for _ in range(2)] for _ in range(rounds)]


def _record(t: AuthTransport):
    """Keep every datagram ``t`` puts on the wire (tagged) as bytes, in order."""
    out, send = [], t.inner.send

    def rec(b, timeout=1.0):
        for i in range(len(b)):
            out.append(b.headers[i].tobytes() + b.payload[i, : b.lengths[i]].tobytes())
        return send(b, timeout)

    t.inner.send = rec
    return out


def test_a_keyed_allreduce_is_exact_and_every_packet_verifies(pair):
    p = pair()
    xs = xs_of(3)
    res, errs = p.run(lambda r, c: [c.allreduce(xs[i][r]) for i in range(3)])
    assert not errs
    for i in range(3):
        for r in range(2):
            np.testing.assert_allclose(res[r][i], (xs[i][0] + xs[i][1]) / 2, atol=1e-6)
    for t in p.ts:
        s = t.stats()
        assert s["auth_verified"] > 0 and s["auth_untagged"] == s["auth_bad_tag"] == s["auth_epoch"] == 0
    assert all(c.counters["bad_payload"] == 0 for c in p.cols)


def _forged_data(rnd, n=15, seed=1, key=None):
    """Well-formed DATA of the running job for rank 1's reduce-scatter message from rank 0 (of
    10,000 floats on 2 ranks, 29 chunks: rank 1's shard is 15), random payloads."""
    rng = np.random.default_rng(seed)
    return [wire.encode(wire.Header(round=rnd, src=0, dst=1, nchunks=n, chunk=c, dtype=wire.Dtype.F32),
                        rng.standard_normal(352).astype(np.float32).tobytes(), key=key, epoch=EPOCH)
            for c in range(n)]


@pytest.mark.parametrize("keyed", [True, False])
def test_forged_data_changes_a_result_only_without_a_key(pair, keyed):
    """The issue's attack: well-formed DATA of the running job's next round, sent to rank 1
    before it (rank 0 joins once rank 1's round has begun).  Without a key rank 1 takes it as rank
    0's data and its result is wrong; with one every forged packet is dropped, counted, and the
    result exact."""
    p = pair(keys=(KEY, KEY) if keyed else (None, None))
    forged = _forged_data(1) + _forged_data(1, key=OTHER)
    _spray(p.raw[1].port, forged)
    c1 = p.cols[1]
    t1 = p.ts[1]
    if keyed:
        assert _wait(lambda: t1.stats()["auth_untagged"] + t1.stats()["auth_bad_tag"] == len(forged))
        assert c1.counters["stashed"] == 0  # none reached the collective
    else:
        assert _wait(lambda: c1.counters["stashed"] == len(forged))  # kept for round 1
    xs = xs_of(1)[0]
    # rank 1 cannot end its round without rank 0's all-gather: it is in it until rank 0 joins
    res, errs = p.run(lambda r, c: (r == 0 and _wait(lambda: c1._running), c.allreduce(xs[r]))[1])
    assert not errs
    exact = np.allclose(res[1], (xs[0] + xs[1]) / 2, atol=1e-6)
    assert exact == keyed
    if keyed:
        s = t1.stats()
        assert (s["auth_untagged"], s["auth_bad_tag"]) == (15, 15)
        assert c1.counters["bad_payload"] == 0


def test_a_forged_stop_ends_no_message_and_a_genuine_one_does():
    """Rank 0 has sent its reduce-scatter message to rank 1; STOPs for it that do not verify
    (untagged, another key, another run) leave it open; one tagged with the key ends it."""
    t = authenticate(UdpTransport(port=0), KEY, EPOCH)
    col = Collective(t, 0, 2, [("127.0.0.1", 1), ("127.0.0.1", 1)], Config())
    col._poll_lock.acquire()  # the idle responder stays away from the transport
    try:
        st = col.protocol.start(np.zeros(100 * col.C, np.float32), 0, True)
        o = st.outs[(False, 1)]
        stop = wire.Header(kind=wire.Kind.STOP, round=st.round, src=1, dst=0, nchunks=o.n)
        forged = [wire.encode(stop, b"\0\x14"), wire.encode(stop, b"\0\x14", key=OTHER, epoch=EPOCH),
                  wire.encode(stop, b"\0\x14", key=KEY, epoch=EPOCH ^ 1)]
        _spray(t.port, forged)
        assert _wait(lambda: (col.protocol.take(st, 0.05), sum(t.stats()[f"auth_{r}"] for r in
                                                       ("untagged", "bad_tag", "epoch")))[1] == 3)
        assert not o.done
        _spray(t.port, [wire.encode(stop, b"\0\x14", key=KEY, epoch=EPOCH)])
        assert _wait(lambda: (col.protocol.take(st, 0.05), o.done)[1])
    finally:
        col._poll_lock.release()
        col.close()


def test_a_replayed_packet_of_an_earlier_round_changes_nothing(pair):
    """Every datagram rank 0 sent in round 1 (DATA, STOPs: tagged, genuine) is replayed to rank 1
    during round 3: they verify, the collective ignores them (their round is finished), and
    round 3 is exact on both ranks."""
    p = pair()
    wire0 = _record(p.ts[0])
    xs = xs_of(3, seed=5)
    res, errs = p.run(lambda r, c: c.allreduce(xs[0][r]))
    assert not errs
    round1 = [d for d in wire0 if wire.Header.unpack(d).round == 1]
    assert {wire.Header.unpack(d).kind for d in round1} >= {wire.Kind.DATA, wire.Kind.STOP}
    res, errs = p.run(lambda r, c: c.allreduce(xs[1][r]))
    assert not errs
    verified0 = p.ts[1].stats()["auth_verified"]

    def third(r, c):
        if r == 0:  # rank 1 is in round 3 until rank 0's data comes: replay into it
            assert _wait(lambda: p.cols[1]._running)
            _spray(p.raw[1].port, round1)
        return c.allreduce(xs[2][r])

    res, errs = p.run(third)
    assert not errs
    for r in range(2):
        np.testing.assert_allclose(res[r], (xs[2][0] + xs[2][1]) / 2, atol=1e-6)
    assert p.ts[1].stats()["auth_verified"] - verified0 >= len(round1)  # genuine: they pass the transport
    assert p.cols[1].counters["bad_payload"] == 0


def test_a_replayed_packet_of_an_earlier_run_is_refused(pair):
    """A run's datagrams replayed into a later run of the same job and key (another epoch) are
    dropped as another run's before the collective sees them."""
    first = pair()
    wire0 = _record(first.ts[0])
    xs = xs_of(1, seed=9)
    _, errs = first.run(lambda r, c: c.allreduce(xs[0][r]))
    assert not errs and wire0
    later = pair(epochs=(EPOCH + 1, EPOCH + 1))
    _spray(later.raw[1].port, wire0)
    t1 = later.ts[1]
    assert _wait(lambda: t1.stats()["auth_epoch"] == len(wire0))
    assert later.cols[1].counters["stashed"] == 0  # none reached the collective
    res, errs = later.run(lambda r, c: c.allreduce(xs[0][r][::-1].copy()))
    assert not errs
    np.testing.assert_allclose(res[1], (xs[0][0][::-1] + xs[0][1][::-1]) / 2, atol=1e-6)
    assert t1.stats()["auth_verified"] > 0


@pytest.mark.parametrize("case,says", [
    ("key", "ranks hold different job keys"),
    ("epoch", "of another run"),
    ("nokey", "carry no tag"),
])
def test_ranks_that_cannot_verify_each_other_fail_with_one_clear_error(pair, case, says):
    """Rank 1 holds another key, is of another run, or has no key: rank 0 raises one error
    naming rank 1 and the cause within peer_timeout (5 s), and again on the next call; with
    another key or run rank 1 does the same about rank 0, and without a key it fails the round
    as the collective does for a peer whose data never fits.  No rank hangs."""
    keys = {"key": (KEY, OTHER), "nokey": (KEY, None)}.get(case, (KEY, KEY))
    epochs = (EPOCH, EPOCH + 7) if case == "epoch" else (EPOCH, EPOCH)
    p = pair(keys=keys, epochs=epochs, fail_after=0.5, peer_timeout=5.0)
    took = {}

    def go(r, c):
        t0 = time.monotonic()
        try:
            return c.allreduce(np.ones(10_000, np.float32))
        finally:
            took[r] = time.monotonic() - t0

    _, errs = p.run(go, timeout=20)
    assert set(errs) == {0, 1}
    for r in (0, 1) if case != "nokey" else (0,):
        e = errs[r]
        assert isinstance(e, CollectiveError) and isinstance(e.__cause__, TransportError), e
        assert f"rank {1 - r}'s packets failed authentication" in str(e) and says in str(e), e
        assert took[r] < 5.0
    if case == "nokey":
        assert isinstance(errs[1], CollectiveError) and "tagged" in str(errs[1]), errs[1]
    with pytest.raises(TransportError, match=says):
        p.ts[0].recv(Batch.empty(4))


def test_forged_failures_after_a_packet_verified_are_logged_never_raised(pair, caplog):
    """Once a packet has verified, a header's ``src`` on a packet that fails proves nothing:
    a forger spraying untagged packets under a rank that never sends here (this rank's own
    number) from a peer's address, past ``fail_after``, does not stop the job; the streak is
    logged once."""
    import logging

    p = pair(keys=(KEY, KEY), epochs=(EPOCH, EPOCH), fail_after=0.3, peer_timeout=5.0)
    ones = lambda r, c: c.allreduce(np.full(10_000, r + 1.0, np.float32))  # noqa: E731
    _, errs = p.run(ones)
    assert not errs
    forged = wire.encode(wire.Header(kind=wire.Kind.HELLO, job=999, round=0, src=0, dst=0, nchunks=1), b"")
    s = raw_socket()
    with caplog.at_level(logging.WARNING, logger="pydblp.transport.auth"):
        for _ in range(12):  # 12 over ~0.7 s: a streak past FAIL_MIN and fail_after
            s.sendto(forged, ("127.0.0.1", p.raw[0].port))
            time.sleep(0.06)
        assert _wait(lambda: p.ts[0].stats()["auth_untagged"] >= 12)
        res, errs = p.run(ones)
    s.close()
    assert not errs, errs
    np.testing.assert_allclose(res[0], 1.5)
    assert caplog.text.count("rank 0's packets failed authentication") == 1, caplog.text


def test_a_cut_is_counted_where_it_happens_and_a_drop_where_it_stops():
    """A tagged datagram cut by the receive buffer: ``rx_truncated`` (the cut) and
    ``auth_truncated`` (it stops at the tag check).  A packet that verified and is wider than
    the caller's rows is delivered cut: ``rx_truncated`` alone, as without a key."""
    h = wire.Header(kind=wire.Kind.DATA, job=3, round=1, src=1, dst=0, nchunks=4)
    with authenticate(UdpTransport(port=0), KEY, EPOCH) as t:
        t.add_peer("127.0.0.1", 9)
        for pay, width, want in ((3000, 1408, {"rx_truncated": 1, "auth_truncated": 1}),
                                 (1408, 64, {"rx_truncated": 1, "auth_verified": 1})):
            before = t.stats()
            _spray(t.port, [wire.encode(h, b"x" * pay, key=KEY, epoch=EPOCH)])
            got = t.recv(Batch.empty(8, width), timeout=1.0)
            after = t.stats()
            moved = {k: after[k] - before[k] for k in ("rx_truncated", "auth_truncated", "auth_verified")
                     if after[k] != before[k]}
            assert moved == want, (pay, width, moved)
            assert got.n == want.get("auth_verified", 0) and (not got.n or got.lengths[0] == width)


def _replay(packets, port, stop, seconds=15.0) -> bool:
    """Send ``packets`` to ``port`` every 0.1 s until ``stop`` is set or ``seconds`` pass (15 x the
    tests' peer_timeout); whether ``stop`` ended it."""
    s = raw_socket()
    end = time.monotonic() + seconds
    while not stop.is_set() and time.monotonic() < end:
        for d in packets:
            s.sendto(d, ("127.0.0.1", port))
        time.sleep(0.1)
    s.close()
    return stop.is_set()


def test_a_dead_peers_replayed_packets_do_not_keep_it_alive(pair):
    """Rank 1 dies after a round; its genuine packets of that round (tagged, so they verify)
    replayed to rank 0 during the next are not news: rank 0's round fails at ``peer_timeout``
    naming rank 1 while the replay still goes on (before, each replay refreshed rank 1's
    liveness and the round waited as long as the replay lasted)."""
    import threading

    p = pair(peer_timeout=1.0)
    sent = _record(p.ts[1])
    _, errs = p.run(lambda r, c: c.allreduce(np.ones(10_000, np.float32)))
    assert not errs
    last = max(wire.Header.unpack(d).round for d in sent)
    replay = [d for d in sent if wire.Header.unpack(d).round == last]
    assert any(wire.Header.unpack(d).kind != wire.Kind.DATA for d in replay)
    p.cols[1].close()
    stop = threading.Event()

    got = {}
    th = threading.Thread(target=lambda: got.setdefault("stopped", _replay(replay[:64], p.raw[0].port, stop)))
    th.start()
    try:
        _, errs = p.run(lambda r, c: c.allreduce(np.ones(10_000, np.float32)), ranks=(0,), timeout=30)
    finally:
        stop.set()
        th.join()
    assert got["stopped"], "the round outlasted the replay"
    assert isinstance(errs.get(0), CollectiveError) and "rank 1 sent nothing" in str(errs[0]), errs


def test_a_busy_peers_replayed_hellos_do_not_keep_it_alive(pair):
    """Rank 1 is busy between rounds (its idle responder says HELLO to rank 0, waiting in the next
    round), then dies.  Its genuine HELLOs (tagged: they verify) replayed to rank 0 are not news,
    their numbers already taken: rank 0's round fails at ``peer_timeout`` naming rank 1 while
    the replay still goes on."""
    import threading

    p = pair(peer_timeout=1.0)
    sent = _record(p.ts[1])
    _, errs = p.run(lambda r, c: c.allreduce(np.ones(10_000, np.float32)))
    assert not errs
    stop, got = threading.Event(), {}

    def busy_then_dead():
        time.sleep(2.5)  # rank 1's caller is busy; rank 0 is in the next round
        hellos = [d for d in sent if wire.Header.unpack(d).kind == wire.Kind.HELLO]
        got["hellos"] = hellos
        p.cols[1].close()
        got["stopped"] = bool(hellos) and _replay(hellos, p.raw[0].port, stop)

    th = threading.Thread(target=busy_then_dead)
    th.start()
    try:
        _, errs = p.run(lambda r, c: c.allreduce(np.ones(10_000, np.float32)), ranks=(0,), timeout=40)
    finally:
        stop.set()
        th.join()
    assert got["hellos"], "rank 1 sent no HELLO while busy"
    assert p.cols[0].counters["hellos"] >= 1  # the genuine ones were news
    assert got["stopped"], "the round outlasted the replay"
    assert isinstance(errs.get(0), CollectiveError) and "rank 1 sent nothing" in str(errs[0]), errs


def test_the_key_and_epoch_are_checked():
    t = UdpTransport(port=0)
    try:
        with pytest.raises(ValueError, match="16..64"):
            AuthTransport(t, b"short", 0)
        with pytest.raises(ValueError, match="epoch"):
            AuthTransport(t, KEY, 1 << 32)
        with pytest.raises(ValueError, match="needs the run's epoch"):
            authenticate(t, KEY, None)
    finally:
        t.close()
    assert 0 <= new_epoch() < 1 << 32 and len({new_epoch() for _ in range(8)}) > 1


# ---- load_key --------------------------------------------------------------------

def test_load_key_sources(tmp_path):
    f = tmp_path / "job.key"
    f.write_bytes(KEY)
    f.chmod(0o600)
    assert load_key(env={}) is None
    assert load_key(f, env={}) == KEY
    assert load_key(env={"DBLP_KEY_FILE": str(f)}) == KEY
    assert load_key(env={"DBLP_KEY": KEY.hex()}) == KEY
    assert load_key(f, env={"DBLP_KEY": OTHER.hex()}) == KEY  # the path wins


@pytest.mark.parametrize("make,env,says", [
    (None, {}, "no such file; make one with `head -c 32 /dev/urandom > job.key`"),
    (b"x" * 8, {}, "holds 8 bytes: a key is 16..64 raw bytes"),
    (b"x" * 65, {}, "holds more than 64 bytes"),
    ("dir", {}, "is a directory"),
    (KEY, {"DBLP_KEY_FILE": "F", "DBLP_KEY": KEY.hex()}, "both DBLP_KEY_FILE and DBLP_KEY are set"),
    (KEY, {"DBLP_KEY": "zz"}, "DBLP_KEY is not hex"),
    (KEY, {"DBLP_KEY": "abcd"}, "DBLP_KEY holds 2 bytes"),
])
def test_load_key_errors_are_one_line_with_the_fix(tmp_path, make, env, says):
    f = tmp_path / "job.key"
    if make == "dir":
        f.mkdir()
    elif make is not None:
        f.write_bytes(make)
    with pytest.raises(KeyLoadError) as e:
        load_key(None if env else f, env=env)
    assert says in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("copy", [True, False])
def test_ecn_passes_through_for_verified_packets_only(copy):
    """set_ect reaches the inner transport (ECT(0) on the wire); a CE mark arrives in Batch.ecn on
    a packet whose tag verifies, and a forged CE-marked packet is dropped with its mark."""
    with authenticate(UdpTransport(port=0), KEY, EPOCH) as a, authenticate(UdpTransport(port=0), KEY, EPOCH) as b:
        pb = a.add_peer("127.0.0.1", b.port)
        b.add_peer("127.0.0.1", a.port)
        a.set_ect(True)
        assert a.ect and a.inner.ect
        assert a.send(batch(20, peer=pb)) == 20
        h = wire.Header(kind=wire.Kind.DATA, job=3, round=7, src=1, dst=0, chunk=0, nchunks=1 << 20)
        tagged = wire.encode(h, b"x" * 64, key=KEY, epoch=EPOCH)
        forged = wire.encode(h, b"y" * 64, key=OTHER, epoch=EPOCH)
        with raw_socket() as s:
            s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, 3)  # CE, as a marking switch leaves it
            for pkt in (forged, tagged, forged):
                s.sendto(pkt, ("127.0.0.1", b.port))
        into = Batch.empty(2048, 1408)
        ecn, end = [], time.monotonic() + 3
        while len(ecn) < 21 and time.monotonic() < end:
            g = b.recv(into, timeout=0.1, copy=copy)
            assert g.ecn is not None and len(g.ecn) == g.n
            ecn += g.ecn.tolist()
        assert ecn == [2] * 20 + [3]
        assert b.stats()["auth_verified"] == 21
