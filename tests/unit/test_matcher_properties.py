"""Property tests of the collective's receive path above the transport (``Protocol.process``,
which drives the :class:`~pydblp.collective.matcher.Matcher` and answers control packets).

The transport hands up only packets that passed :func:`pydblp.wire.validate_batch`: headers
are ``HEADER_DTYPE`` records of any kind, job, round, tensor, ranks, flags, dtype and chunk
counts, ``lens[i]`` is the payload length (``len``, plus the 16-byte tag with flag TAG) and
``pay`` an (n, width) uint8 array with width >= max(lens), 0 when every packet is header-only.
Batches of such packets, with fields drawn near the running round's (its job, round, tensor,
ranks, chunk counts) and far from it (other jobs, rounds across the 2**32 wrap, ranks past the
world, huge chunk counts, any flags), go to a real :class:`~pydblp.collective.Collective` on
loopback (world 2 or 3, any rank, several configurations), with a round running and between
rounds.  Properties:

* nothing raises, and the round's state stays within bounds: each message counts exactly the
  chunks its arrival mask holds (at most its chunk count), masks keep their message's length,
  and nothing is written outside the round's receive buffers (its input, this rank's own
  contribution and result rows, the other scratch buffers, a finished round's result and the
  trailing messages' rows stay as they were);
* exactly the packets not of this job, from no peer (this rank, past the world) or for
  another rank are counted in ``counters["foreign"]`` (in a neighbour round: also this round's
  DATA from a rank that is not a neighbour);
* the same batch fed twice changes nothing the second time but counters (and the control
  packets queued in answer, and the stash of the next rounds' packets);
* a genuine DATA packet of the running round in a batch of arbitrary junk still arrives.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from pydblp import wire
from pydblp.collective import Collective, Config
from pydblp.collective.config import AG, DATA, F32, MASK32, NB, RETX, STASH_AHEAD, STASH_MAX
from pydblp.collective.rounds import GatherRound, NeighbourRound
from pydblp.transport.udp import UdpTransport
from tests.helpers import require_native

CB = 64  # chunk_bytes: the smallest allowed, so payloads stay small
SETTINGS = settings(max_examples=150, deadline=None, derandomize=True)
KINDS = [int(k) for k in wire.Kind]
MAX32 = MASK32

# ---- the round under test ------------------------------------------------------

# (mode, allgather, phase, consistent, allgather_bound, fill, order)
PROFILES = [
    ("tar", "unicast", "static:0", True, False, "stale", "shuffle"),
    ("tar", "unicast", "static:0.3", False, False, "local", "rows"),
    ("tar", "broadcast", "static:0.2", True, False, "stale", "shuffle"),
    ("tar", "unicast", "static:0.3", True, True, "carry", "shuffle"),
    ("ps", "unicast", "static:0.1", True, False, "stale", "rows"),
    ("ps", "broadcast", "static:0", False, False, "stale", "shuffle"),
]

# what the round is: an allreduce (also into the caller's array: with order "shuffle" the all-gather
# writes it through the round's permutation), a broadcast of shards, or a neighbour round
ROUND_KINDS = ("allreduce", "allreduce_into", "broadcast", "neighbours", "reduce_scatter", "all_gather")

rounds = st.fixed_dictionaries({
    "world": st.sampled_from([2, 3]),
    "rank": st.integers(0, 2),  # (mod world)
    "profile": st.integers(0, len(PROFILES) - 1),
    "kind": st.sampled_from(ROUND_KINDS),
    "chunks": st.integers(1, 9),  # the tensor's chunk rows
    "tensor": st.one_of(st.integers(0, 3), st.integers(0, 0xFFFF)),
    # the round counter before the round: its number is this + 1, across the wrap too
    "before": st.one_of(st.sampled_from([0, 1, MAX32 - 1, MAX32, 1 << 31, (1 << 31) - 1]),
                        st.integers(0, MAX32)),
    "history": st.booleans(),   # a round finished before (trailing messages, late probes answered)
    "reduced": st.booleans(),   # the owner has reduced (its all-gather is out)
})


class Rank:
    """A Collective of ``world`` ranks on loopback, idle responder kept away, and its protocol."""

    def __init__(self, world: int, rank: int, profile: int):
        mode, allgather, phase, consistent, bound, fill, order = PROFILES[profile]
        cfg = Config(chunk_bytes=CB, mode=mode, allgather=allgather, phase=phase, consistent=consistent,
                     allgather_bound=bound, fill=fill, order=order, job=0x1D)
        group = ("127.0.0.1", 9) if allgather == "broadcast" else None
        self.col = Collective(UdpTransport(port=0), rank, world, [("127.0.0.1", 9)] * world, cfg, group=group)
        self.col._poll_lock.acquire()  # the idle responder stays away from the transport
        self.col._running = True       # ... and asleep (as while a round runs: it would spin on the
        self.col._alarm.set(0)         # lock when a trailing message waits for retransmissions)
        self.p = self.col.protocol
        self.world, self.rank = world, rank

    def close(self) -> None:
        self.col._poll_lock.release()
        self.col.close()

    def begin(self, kind: str, chunks: int, tensor: int):
        """Start a round of ``kind`` on ``chunks`` chunk rows (values 0, 1, 2, ...)."""
        p = self.p
        flat = np.arange(chunks * self.col.C, dtype=np.float32)
        if kind == "neighbours":
            peers = [r for r in range(self.world) if r != self.rank]
            return p.start_neighbours(flat, tensor, peers, [0.5 / len(peers)] * len(peers), [1.0] * len(peers))
        if kind == "reduce_scatter":  # (chunks rows per rank)
            return p.start_reduce_scatter(np.arange(self.world * chunks * self.col.C, dtype=np.float32), tensor)
        if kind == "all_gather":
            return p.start_all_gather(flat, tensor)
        if kind == "allreduce_into":  # (whole rows with an even number of them: the caller's array itself)
            flat = flat[: flat.size - (chunks % 2) * 5]
            return p.start(flat, tensor, True, out=np.full(flat.size, np.nan, np.float32))
        return p.start(flat, tensor, kind != "broadcast")

    def finish(self, st, now: float) -> None:
        """End round ``st`` with every message of its sent whole (so the all-gather's trail)."""
        for o in st.outs.values():
            o.sent = o.avail = o.n
            o.t_sent_all = o.t_last = now
        self.p.finish(st)


@pytest.fixture(autouse=True, scope="module", params=["c", "python"])
def path(request):
    """Every property here holds on both paths of the receive: the compiled absorb
    (csrc/matcher.c) and the pure-Python reference."""
    from pydblp.collective import matcher

    lib = matcher.native_lib
    if request.param == "python":
        matcher.native_lib = lambda: None
    elif lib() is None:
        require_native("matcher")
    yield request.param
    matcher.native_lib = lib


def setup(r: dict) -> tuple[Rank, object]:
    """The rank and its running round that ``r`` (a draw of ``rounds``) describes."""
    world = r["world"]
    rk = Rank(world, r["rank"] % world, r["profile"])
    try:
        rk.p.round = r["before"]
        if r["history"]:
            prev = rk.begin(r["kind"], r["chunks"], r["tensor"])
            if not prev.reduced:
                rk.p.reduce(prev)
            rk.finish(prev, time.monotonic())
        s = rk.begin(r["kind"], r["chunks"], r["tensor"])
        if r["reduced"] and not s.reduced:
            rk.p.reduce(s)
    except BaseException:
        rk.close()
        raise
    return rk, s


# ---- packets --------------------------------------------------------------------

# Each field is drawn as a value or as None, "the round's own" (resolved against the round), the
# round's own more often than not: most packets then get past the first checks to the later ones.
ROUND_OFFSETS = [0, 0, 0, 1, 2, -1, -2, STASH_AHEAD, STASH_AHEAD + 1, 1 << 31, (1 << 31) - 1, -(1 << 31)]
FLAG_VALUES = [0, AG, NB, RETX, AG | RETX, NB | RETX, wire.FLAG_TAG, AG | wire.FLAG_TAG, AG | NB, 0xF0, 0xFF]
MINE = st.none()
peer = st.tuples(st.just("peer"), st.integers(0, 3))  # a rank other than this one (k-th, mod world - 1)

spec = st.fixed_dictionaries({
    "kind": st.one_of(st.just(DATA), st.sampled_from(KINDS)),
    "job": st.one_of(MINE, MINE, MINE, st.integers(1, MAX32)),
    "round": st.one_of(st.sampled_from(ROUND_OFFSETS), st.integers(-80, 80),
                       st.tuples(st.just("abs"), st.integers(0, MAX32))),
    "tensor": st.one_of(MINE, MINE, st.integers(0, 0xFFFF)),
    "src": st.one_of(peer, peer, st.integers(0, 4), st.integers(0, 0xFFFF)),
    "dst": st.one_of(MINE, MINE, st.just(wire.DST_ALL), st.integers(0, 4), st.integers(0, 0xFFFF)),
    "prio": st.integers(0, 0xFF),
    "dtype": st.one_of(st.just(F32), st.integers(0, 0xFF)),
    "nchunks": st.one_of(MINE, MINE, st.integers(1, 12), st.integers(1, wire.MAX_NCHUNKS)),
    "chunk": st.one_of(st.integers(0, 12), st.integers(0, wire.MAX_NCHUNKS - 1)),  # (mod nchunks)
    "len": st.one_of(st.just(CB), st.integers(0, 130), st.sampled_from([0, 1, 2, CB - 4, CB + 4, 1408, 0xFFFF])),
    "tol": st.integers(0, 0xFF),
    "flags": st.one_of(MINE, MINE, st.sampled_from(FLAG_VALUES), st.integers(0, 0xFF)),
    "pick": st.integers(0, 3),  # which of the peer's messages "the round's own" flags and chunk count name
    "body": st.binary(max_size=24),
})


def data_spec(rounds=(0, 0, 0, 1, -1), dst=st.one_of(MINE, MINE, st.just(wire.DST_ALL))):
    """A DATA packet as the round's peers send it (its sender, chunk, bound, retransmission mark
    drawn; now and then from no peer, or of another chunk count)."""
    return st.fixed_dictionaries({
        "kind": st.just(DATA), "job": MINE, "round": st.sampled_from(rounds), "tensor": MINE,
        "src": st.one_of(peer, peer, peer, st.integers(0, 4)), "dst": dst,
        "prio": st.integers(0, 7), "dtype": st.just(F32), "nchunks": st.one_of(MINE, MINE, MINE, st.integers(1, 12)),
        "chunk": st.integers(0, 12), "len": st.just(CB), "tol": st.integers(0, 0xFF),
        "flags": st.one_of(MINE, MINE, st.just(RETX), st.just(AG | RETX)),
        "pick": st.integers(0, 3), "body": st.binary(max_size=CB),
    })


genuine_spec = data_spec()
matching_spec = data_spec(rounds=(0,), dst=MINE)  # every one passes Matcher.match: its vectorised path

# a control packet a peer sends about a message of this round or the last ones
control_spec = st.fixed_dictionaries({
    "kind": st.sampled_from([k for k in KINDS if k != DATA]), "job": MINE,
    "round": st.sampled_from([0, 0, -1, -2, 1]), "tensor": MINE, "src": peer, "dst": MINE,
    "prio": st.integers(0, 7), "dtype": st.sampled_from([int(wire.Dtype.RAW), F32]), "nchunks": MINE,
    "chunk": st.sampled_from([0, 0, 1, 8]), "len": st.integers(0, 4), "tol": st.integers(0, 0xFF),
    "flags": st.one_of(MINE, MINE, st.sampled_from(FLAG_VALUES)), "pick": st.integers(0, 3),
    "body": st.binary(max_size=4),
})

batches = st.one_of(st.lists(st.one_of(spec, genuine_spec, control_spec), min_size=1, max_size=24),
                    st.lists(matching_spec, min_size=9, max_size=20),  # (the matcher's vectorised path)
                    st.lists(st.one_of(spec, control_spec), min_size=1, max_size=8))
widths = st.sampled_from([0, 0, 1, 3, 64])  # payload row width past the longest packet


def messages_of(p, s) -> tuple[dict, dict]:
    """(incoming, outgoing) messages packets may be about: the running round's, or between
    rounds the last finished one's and the trailing ones ((ag, rank) -> message, each)."""
    if s is not None:
        return s.ins, s.outs
    return (p._prev[1] if p._prev else {}), {(ag, dst): o for (_, ag, dst), o in p.trail.items()}


def resolve(p, s, sp: dict, tensor: int) -> tuple:
    """The header record (a tuple in wire order) that ``sp`` describes for round ``s`` (None:
    between rounds, the last finished round's) of protocol ``p`` on ``tensor``."""
    me = p.rank
    base = p.round if s is None else s.round
    rnd = sp["round"][1] if isinstance(sp["round"], tuple) else (base + sp["round"]) & MASK32
    src = sp["src"]
    if isinstance(src, tuple):  # a peer
        src = [r for r in range(p.world) if r != me][src[1] % (p.world - 1)]
    ins, outs = messages_of(p, s)
    if sp["flags"] is None:  # the flag of one of the messages to or from it (none: as a round of this kind)
        nb = isinstance(s, NeighbourRound)
        kinds = sorted({m.flag for (_, r), m in list(ins.items()) + list(outs.items()) if r == src})
        flags = kinds[sp["pick"] % len(kinds)] if kinds else (NB if nb else 0)
    else:
        flags = sp["flags"]
    inn = ins.get((bool(flags & AG), src))
    nchunks = sp["nchunks"] or (inn.n if inn is not None and inn.n else 1)
    dst = me if sp["dst"] is None else sp["dst"]
    return (wire.MAGIC, wire.VERSION, sp["kind"], p.cfg.job if sp["job"] is None else sp["job"], rnd,
            tensor if sp["tensor"] is None else sp["tensor"], src, dst, sp["prio"], sp["dtype"],
            sp["chunk"] % nchunks, nchunks, sp["len"], sp["tol"], flags)


def build(p, s, specs: list, extra: int, tensor: int | None = None):
    """(headers, payload, lens) of ``specs`` as the transport hands them up (``tensor``: the
    round's, between rounds)."""
    tensor = s.tensor if s is not None else tensor
    h = np.array([resolve(p, s, sp, tensor) for sp in specs], wire.HEADER_DTYPE)
    lens = (h["len"].astype(np.int32) + np.where(h["flags"] & wire.FLAG_TAG, wire.TAG_LEN, 0)).astype(np.int32)
    width = int(lens.max()) + extra if int(lens.max()) else extra  # (0 wide: every packet header-only)
    pay = np.full((len(h), width), 0xA5, np.uint8)  # bytes past a packet's length: undefined
    for i, sp in enumerate(specs):
        body = np.frombuffer(sp["body"] or b"\x00", np.uint8)
        pay[i, : lens[i]] = np.resize(body, int(lens[i]))
    assert not wire.validate_batch(h, lens.astype(np.int64) + wire.HEADER_LEN).any()  # as the transport
    return h, pay, lens


# ---- what the properties compare -----------------------------------------------

def _b(a) -> bytes | None:
    return None if a is None else np.ascontiguousarray(a).tobytes()


def _inn(i) -> tuple:
    return (i.n, len(i.mask), _b(i.mask), i.count, i.hi, i.tol8, i.need, i.done, i.stop_sent, i.skipped,
            i.t_data, i.t_first)


def _out(o) -> tuple:
    return (o.n, o.sent, o.done, _b(o.acked), _b(o.retx), o.nretx, o.timeouts, o.t_heard, o.t_last,
            o.rtt, o.abandoned, _b(o.rows))


def _result(s) -> np.ndarray | None:
    """A running allreduce's result rows in the caller's array (None: it has none), its partial last
    row (kept apart until the round ends) last: (T, C)."""
    res = getattr(s, "result", None)
    if res is None or s.tail is None:
        return res
    return np.concatenate([res, s.tail])


def results(p, s) -> dict:
    """Everything a receive may change but counters, the control packets queued and the stash."""
    r = {"timeouts": list(p.timeouts), "bufs": {k: _b(v) for k, v in p._bufs.items()},
         "stale": {k: _b(v) for k, v in p.fill.stale.items()},
         "carried": {k: _b(v) for k, v in p.fill.carried.items()},
         "trail": {k: _out(o) for k, o in p.trail.items()},
         "prev": None if p._prev is None else (p._prev[0], {k: _inn(i) for k, i in p._prev[1].items()})}
    if s is not None:
        r.update(x=_b(s.x), flat=_b(getattr(s, "flat", None)), y=_b(s.y), result=_b(_result(s)), have=_b(getattr(s, "have", None)),
                 rbuf=_b(getattr(s, "rbuf", None)),
                 rmask=_b(getattr(s, "rmask", None)), hi=_b(s.hi),
                 heard=_b(s.heard), misfit=dict(s.misfit), repair=s.repair, reduced=s.reduced,
                 ins={k: _inn(i) for k, i in s.ins.items()}, outs={k: _out(o) for k, o in s.outs.items()})
    return r


def expected_foreign(p, s, h: np.ndarray) -> int:
    """The packets of ``h`` that ``counters["foreign"]`` must count: of another job, from no peer
    (this rank or past the world), for another rank (unless all-gather DATA to every rank); in a
    neighbour round also this round's DATA, laid out for it, from a rank not its neighbour."""
    n = 0
    for f in h.tolist():
        kind, job, rnd, tensor, src, dst = (f[wire.F_KIND], f[wire.F_JOB], f[wire.F_ROUND], f[wire.F_TENSOR],
                                            f[wire.F_SRC], f[wire.F_DST])
        flags = f[wire.F_FLAGS]
        if (job != p.cfg.job or src >= p.world or src == p.rank
                or (dst != p.rank and not (dst == wire.DST_ALL and kind == DATA and flags & AG))):
            n += 1
        elif (isinstance(s, NeighbourRound) and rnd == s.round and kind == DATA and tensor == s.tensor
              and f[wire.F_DTYPE] == F32 and f[wire.F_LEN] == CB and not flags & wire.FLAG_TAG and flags & NB
              and s.slot[src] < 0):
            n += 1
    return n


def check_bounds(p, s) -> None:
    """The round's (or the last finished round's) messages within bounds, the stash bounded."""
    for ins in ([s.ins] if s is not None else []) + ([p._prev[1]] if p._prev else []):
        for key, inn in ins.items():
            assert inn.mask.ndim == 1 and len(inn.mask) == inn.n, key
            assert 0 <= inn.count <= inn.n and inn.count == np.count_nonzero(inn.mask), key
            assert 0 <= inn.hi <= inn.n, key
            assert inn.done == (inn.count >= inn.need), key
    if s is not None:
        assert s.hi.min() >= 0
        for (ag, src), inn in s.ins.items():
            assert s.hi[1 if ag else 0][src] <= inn.n
    assert sum(len(x[0]) for x in p.matcher.stash) <= STASH_MAX
    assert all(v >= 0 for v in p.counters.values())


def check_writes(before: dict, after: dict, p, s) -> None:
    """Nothing written outside the running round's receive buffers: its input, this rank's own
    contribution and result rows, every other scratch buffer, the trailing messages' rows."""
    if s is not None:
        assert after["x"] == before["x"] and after["flat"] == before["flat"], "the round's input changed"
        T = len(s.y)
        may = np.zeros(T, bool)  # result rows the all-gather messages to this rank may fill
        for (ag, k), inn in s.ins.items():
            if ag:
                may[s.ag_first[k]: s.ag_first[k] + inn.n] = True
        y0 = np.frombuffer(before["y"], np.uint8).reshape(T, -1)
        y1 = np.frombuffer(after["y"], np.uint8).reshape(T, -1)
        if getattr(s, "result", None) is not None:  # the all-gather writes there, at row perm[i] for row i
            assert (y0 == y1).all(), "the round's own y changed where the all-gather writes the result"
            mt = np.zeros(T, bool)
            mt[s.perm[may]] = True
            y0 = np.frombuffer(before["result"], np.uint8).reshape(T, -1)
            y1 = np.frombuffer(after["result"], np.uint8).reshape(T, -1)
            assert (y0[~mt] == y1[~mt]).all(), "a result row no message to this rank fills changed"
        else:
            assert (y0[~may] == y1[~may]).all(), "a result row no message to this rank fills changed"
        if isinstance(s, GatherRound):
            h0, h1 = np.frombuffer(before["have"], bool), np.frombuffer(after["have"], bool)
            assert (h0[~may] == h1[~may]).all() and (h1 >= h0).all()
        if getattr(s, "rbuf", None) is not None and not isinstance(s, NeighbourRound):  # (an owner: its own row stays)
            n = s.rbuf.shape[1]
            r0 = np.frombuffer(before["rbuf"], np.uint8).reshape(p.world, -1)
            r1 = np.frombuffer(after["rbuf"], np.uint8).reshape(p.world, -1)
            assert (r0[p.rank] == r1[p.rank]).all(), "this rank's own contribution changed"
            m0 = np.frombuffer(before["rmask"], bool).reshape(p.world, n)
            m1 = np.frombuffer(after["rmask"], bool).reshape(p.world, n)
            assert (m0[p.rank] == m1[p.rank]).all() and (m1 >= m0).all()
        for k, v in after["bufs"].items():
            if all(p._bufs[k] is not b for b in (getattr(s, "rbuf", None), s.x, s.y, getattr(s, "result", None),
                                                  getattr(s, "tail", None))):
                assert v == before["bufs"][k], f"scratch buffer {k} changed"
    else:
        assert after["bufs"] == before["bufs"], "a scratch buffer changed between rounds"
        if before["prev"] is not None:  # the finished round's messages take no more data
            assert {k: v[:5] for k, v in after["prev"][1].items()} == {k: v[:5] for k, v in before["prev"][1].items()}
    assert after["stale"] == before["stale"] and after["carried"] == before["carried"]
    for k, o in after["trail"].items():
        assert o[-1] == before["trail"][k][-1], "a trailing message's rows changed"


def feed_twice(p, s, h, pay, lens) -> None:
    """The properties of one batch: fed once, then again at the same time."""
    now = time.monotonic()
    foreign0 = p.counters["foreign"]
    before = results(p, s)
    p.process(s, h, pay, lens, now)
    assert p.counters["foreign"] - foreign0 == expected_foreign(p, s, h)
    check_bounds(p, s)
    once = results(p, s)
    check_writes(before, once, p, s)
    p.process(s, h, pay, lens, now)
    check_bounds(p, s)
    assert results(p, s) == once, "the batch fed again changed more than counters"


# ---- the properties --------------------------------------------------------------

def _data(**kw) -> dict:
    """A packet spec: DATA of the round from its first peer, chunk 0, unless ``kw`` says otherwise."""
    d = dict(kind=DATA, job=None, round=0, tensor=None, src=("peer", 0), dst=None, prio=0, dtype=F32, nchunks=None,
             chunk=0, len=CB, tol=0, flags=None, pick=0, body=b"")
    d.update(kw)
    return d


OWNER = dict(world=2, rank=0, profile=0, kind="allreduce", chunks=4, tensor=1, before=MAX32, history=True,
             reduced=False)


@SETTINGS
@given(r=rounds, specs=batches, extra=widths)
# an owner's batch of reduce-scatter and all-gather DATA mixed, all of the round (the vectorised path)
@example(r=OWNER, specs=[_data(chunk=c, pick=c % 2) for c in range(10)], extra=0)
# header-only packets alone: payload rows 0 bytes wide
@example(r=OWNER, specs=[_data(kind=k, len=0, pick=c) for k in (wire.Kind.PROBE, wire.Kind.STOP, wire.Kind.BITMAP)
                         for c in range(2)] + [_data(len=0)], extra=0)
def test_a_running_round_takes_any_valid_batch_within_bounds(r, specs, extra):
    rk, s = setup(r)
    try:
        h, pay, lens = build(rk.p, s, specs, extra)
        check_bounds(rk.p, s)
        feed_twice(rk.p, s, h, pay, lens)
    finally:
        rk.close()


@SETTINGS
@given(r=rounds, specs=batches, extra=widths, later=batches)
def test_between_rounds_any_valid_batch_changes_no_result(r, specs, extra, later):
    """Between rounds (st None): late probes answered, trailing messages' STOPs and BITMAPs
    taken, the next rounds' packets stashed; the round that finished is not written.  The next
    round then takes in what was stashed, and more."""
    rk, s = setup(r)
    try:
        p = rk.p
        rk.finish(s, time.monotonic())
        done_y = s.y.copy()
        h, pay, lens = build(p, None, specs, extra, r["tensor"])
        feed_twice(p, None, h, pay, lens)
        np.testing.assert_array_equal(s.y.view(np.uint8), done_y.view(np.uint8))  # the caller's result
        nxt = rk.begin(r["kind"], r["chunks"], r["tensor"])  # (takes the stash in)
        check_bounds(p, nxt)
        feed_twice(p, nxt, *build(p, nxt, later, extra))
    finally:
        rk.close()


@SETTINGS
@given(r=rounds, junk=st.lists(st.one_of(spec, genuine_spec, control_spec), max_size=20), at=st.integers(0, 20), which=st.integers(0, 7),
       chunk=st.integers(0, 12), dst_all=st.booleans(), tol=st.integers(0, 0xFF), extra=widths,
       values=st.binary(min_size=CB, max_size=CB))
def test_a_genuine_packet_among_junk_arrives(r, junk, at, which, chunk, dst_all, tol, extra, values):
    rk, s = setup(r)
    try:
        p = rk.p
        # the messages the round still takes in: all-gather and neighbour ones, reduce-scatter
        # ones until this rank has reduced
        keys = sorted(k for k, i in s.ins.items() if i.n and (k[0] or i.nb or not s.reduced))
        assume(keys)  # (a round with nothing left to take in: no genuine packet to make)
        ag, src = keys[which % len(keys)]
        inn = s.ins[(ag, src)]
        c = chunk % inn.n
        flags = AG if ag else NB if inn.nb else 0
        good = (wire.MAGIC, wire.VERSION, DATA, p.cfg.job, s.round, s.tensor, src,
                wire.DST_ALL if dst_all and ag else p.rank, 3, F32, c, inn.n, CB, tol, flags)
        jh, jpay, jlens = build(p, s, junk, extra) if junk else (wire.empty_batch(0), None, np.zeros(0, np.int32))
        i = at % (len(junk) + 1)
        h = np.concatenate([jh[:i], np.array([good], wire.HEADER_DTYPE), jh[i:]]).astype(wire.HEADER_DTYPE)
        assert h.dtype == wire.HEADER_DTYPE  # (concatenate gives native byte order)
        lens = np.concatenate([jlens[:i], [CB], jlens[i:]]).astype(np.int32)
        pay = np.zeros((len(h), max(CB, 0 if jpay is None else jpay.shape[1])), np.uint8)
        if jpay is not None:
            pay[:i, : jpay.shape[1]], pay[i + 1:, : jpay.shape[1]] = jpay[:i], jpay[i:]
        pay[i, :CB] = np.frombuffer(values, np.uint8)
        p.process(s, h, pay, lens, time.monotonic())
        assert inn.mask[c], "the genuine packet did not arrive"
        check_bounds(p, s)
        # its bytes are where its chunk goes, unless junk that fits names the same chunk too
        same = [f for j, f in enumerate(h.tolist()) if j != i and f[wire.F_KIND] == DATA
                and f[wire.F_SRC] == src and f[wire.F_CHUNK] == c and f[wire.F_ROUND] == s.round]
        if not same:
            if isinstance(s, NeighbourRound):
                got = s.rbuf[s.slot[src], c]
            elif ag:  # (written through the permutation into an allreduce's result in place)
                row = s.ag_first[src] + c
                got = s.y[row] if s.result is None else _result(s)[s.perm[row]]
            else:
                got = s.rbuf[src, c]
            assert got.tobytes() == values
    finally:
        rk.close()
