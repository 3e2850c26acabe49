"""The collective's timing behaviour on the simulator (:mod:`pydblp.sim`): dead, silent and
mismatched peers, ``peer_timeout`` and deadlines, lost STOPs and probes, trailing all-gather
messages and the late probes answered between rounds.

The ranks run the unchanged :class:`~pydblp.collective.Collective` in virtual time: a pause is
``node.compute(s)``, a death ``sim.kill(rank, at)``, and ``node.now`` and ``RoundRecord.latency``
are virtual seconds, the same on every run.  So these tests neither sleep nor read a wall clock,
and a bound on a latency is a statement about the protocol, not about how loaded the machine
is.  What needs the real transport or the idle responder's thread stays on loopback
(test_collective.py, test_collective_neighbours.py, test_collective_lifecycle.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from pydblp import wire
from pydblp.collective import CollectiveError, Config
from pydblp.collective.config import HELLO_EVERY
from pydblp.sim import Link, Sim
from pydblp.torch.exchange import neighbours
from tests.helpers import lose_sent

LINK = Link("1gbit", latency=25e-6)


def inputs(world, n, rounds=1, seed=0):
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(n).astype(np.float32) for _ in range(world)] for _ in range(rounds)]


def sim(world, seed=1, **cfg) -> Sim:
    return Sim(world, Config(**cfg), link=LINK, seed=seed)


def until_error(node, rounds):
    """Run ``rounds()`` (a generator of rounds) until one raises CollectiveError: (results so far,
    the error, the virtual time its round began, the virtual time it raised)."""
    out, began = [], node.now
    try:
        for step in rounds:
            began = node.now
            out.append(step())
    except CollectiveError as e:
        return out, e, began, node.now
    return out, None, began, node.now


# ---- allreduce: dead and mismatched peers, deadlines ---------------------------------------

@pytest.mark.parametrize("dies", [0.0, 0.015], ids=["before-its-first-round", "between-rounds"])
def test_a_dead_peer_fails_the_round_after_peer_timeout_naming_it(dies):
    """Rank 2 dies (before any round, or while computing after its second one): ranks 0 and 1
    finish the rounds it was in exactly, then fail the next one ``peer_timeout`` after it began,
    with an error naming rank 2 as dead, not as another job."""
    s = sim(3, peer_timeout=0.5)
    s.kill(2, at=dies)
    xs = inputs(3, 10_000, rounds=3)

    def program(node):
        def rnd(i):
            y = node.collective.allreduce(xs[i][node.rank])
            node.compute(0.01)
            return y
        return until_error(node, (lambda i=i: rnd(i) for i in range(3)))

    nodes = s.run(program)
    assert nodes[2].error == "killed"
    for node in nodes[:2]:
        done, err, began, failed = node.result
        assert len(done) == (0 if dies == 0.0 else 2)
        for i, y in enumerate(done):
            np.testing.assert_allclose(y, np.mean(xs[i], axis=0), atol=1e-5)
        assert isinstance(err, CollectiveError)
        assert "rank 2" in str(err) and "dead or unreachable" in str(err) and "another job" not in str(err)
        assert 0.5 <= failed - began < 0.55, (began, failed)


@pytest.mark.parametrize("kind", ["reduce_scatter", "all_gather"])
def test_a_dead_peer_fails_a_sharded_round_after_peer_timeout(kind):
    """As for an allreduce: rank 2 dead from the start fails ranks 0 and 1's reduce-scatter or
    all-gather ``peer_timeout`` after it began, naming rank 2."""
    s = sim(3, peer_timeout=0.5)
    s.kill(2, at=0.0)
    x = np.ones(3 * 10 * 352, np.float32)  # 10 chunk rows a rank
    nodes = s.run(lambda node: until_error(node, [lambda: getattr(node.collective, kind)(x)]))
    for node in nodes[:2]:
        done, err, began, failed = node.result
        assert done == [] and isinstance(err, CollectiveError)
        assert "rank 2" in str(err) and "dead or unreachable" in str(err)
        assert 0.5 <= failed - began < 0.55, (began, failed)


@pytest.mark.parametrize("case", ["size", "tensor"])
def test_a_peer_whose_data_does_not_fit_fails_the_round_after_peer_timeout(case):
    """Ranks that disagree (another tensor size or tensor id) are alive and keep probing, so no
    peer goes silent: each must still fail the round with a clear error ``peer_timeout`` after it
    began (before, they probed and retransmitted forever).  (Another ``chunk_bytes`` needs a
    Config per rank: test_collective.py, on loopback.)"""
    s = sim(2, peer_timeout=0.5)
    n = {"size": (3_000, 4_000)}.get(case, (3_000, 3_000))  # 9 and 12 chunk rows: fewer packets to simulate
    tensor = (0, 1) if case == "tensor" else (0, 0)

    def program(node):
        r = node.rank
        return until_error(node, [lambda: node.collective.allreduce(np.ones(n[r], np.float32), tensor=tensor[r])])

    nodes = s.run(program)
    for r, node in enumerate(nodes):
        done, err, began, failed = node.result
        says = {"size": "another tensor size", "tensor": f"tensor {1 - r}, "}[case]
        assert isinstance(err, CollectiveError), err
        assert f"rank {1 - r}'s data in round 0 does not fit" in str(err) and says in str(err), err
        assert 0.5 <= failed - began < 0.55, (began, failed)
        assert node.collective.counters["bad_payload"] > 0


# ---- a peer busy between rounds: HELLO ----------------------------------------------------

def busy_then_round(xs, busy: int, seconds: float):
    """A program: round ``xs[0]``, rank ``busy`` computes ``seconds`` (the others 10 ms), then
    round ``xs[1]`` through :func:`until_error`."""
    def program(node):
        c = node.collective
        c.allreduce(xs[0][node.rank])
        node.compute(seconds if node.rank == busy else 0.01)
        return until_error(node, [lambda: c.allreduce(xs[1][node.rank])])
    return program


@pytest.mark.parametrize("kind", ["allreduce", "reduce_scatter", "all_gather"])
def test_a_peer_busy_between_rounds_is_waited_for_not_taken_for_dead(kind):
    """Rank 1 computes for 6 x ``peer_timeout`` between two rounds while ranks 0 and 2 wait for it
    in the second: it tells them it is alive (HELLO, every ``peer_timeout / HELLO_EVERY``), so their
    round waits and ends exactly once it joins, instead of failing at ``peer_timeout``."""
    s = sim(3, peer_timeout=0.5)
    xs = inputs(3, 3 * 10 * 352, rounds=2, seed=4)

    def program(node):
        c, r = node.collective, node.rank
        first = getattr(c, kind)(xs[0][r])
        node.compute(3.0 if r == 1 else 0.01)
        began = node.now
        second = getattr(c, kind)(xs[1][r])
        return (first, second), node.now - began

    nodes = s.run(program)
    for i in range(2):
        full = np.mean(xs[i], axis=0)
        for r, node in enumerate(nodes):
            want = {"allreduce": full, "reduce_scatter": full.reshape(3, -1)[r],
                    "all_gather": np.concatenate(xs[i])}[kind]
            np.testing.assert_allclose(node.result[0][i], want, atol=1e-5)
    for r in (0, 2):
        assert nodes[r].result[1] > 2.9  # (virtual s: it waited out rank 1's compute)
        assert nodes[r].collective.counters["hellos"] >= 3.0 / (0.5 / HELLO_EVERY) - 2
    c1 = nodes[1].collective.counters
    assert c1["hellos_sent"] >= 2 * (3.0 / (0.5 / HELLO_EVERY) - 2)
    # the waiting ranks probe rank 1 all along (~20 a second each): it keeps their data and one
    # PROBE a message (an all-gather's peers send it their whole 30-row input, else 10 rows each)
    assert c1["duplicate"] > 50 and c1["stashed"] <= 2 * (30 if kind == "all_gather" else 10) + 2, c1
    # back-to-back rounds send none: HELLOs begin only peer_timeout / HELLO_EVERY out of rounds
    assert all(n.collective.counters["hellos_sent"] == 0 for n in (nodes[0], nodes[2]))


@pytest.mark.parametrize("mode", ["tar", "ps"])
def test_a_busy_peer_is_waited_for_over_a_lossy_network(mode):
    """8 ranks, 10 % random loss on every port (the paper scenario's), each seed a different rank
    busy for 4 x ``peer_timeout``: every HELLO, ask and answer may be lost, and each waiting rank
    judges up to 7 peers all along, so a few lost in a row must not read as a dead peer.  Every
    round ends exact on every seed.  (With 4 HELLOs and asks per ``peer_timeout``, as before,
    most seeds failed naming a live rank, at 5 % loss too.)"""
    for seed in range(2):
        s = Sim(8, Config(peer_timeout=0.5, mode=mode), link=LINK, seed=seed)
        s.network.loss(0.1)
        xs = inputs(8, 8 * 352, rounds=2, seed=seed)
        nodes = s.run(busy_then_round(xs, 3 * seed % 8, 2.0))  # (ps: rank 0, the server, busy first)
        for node in nodes:
            done, err, _, _ = node.result
            assert err is None, (seed, node.rank, err)
            np.testing.assert_allclose(done[0], np.mean(xs[1], axis=0), atol=1e-5)


@pytest.mark.parametrize("world,rows,busy,seconds", [(3, 20, 0, 2.0), (4, 140, 1, 1.5)])
def test_peers_that_waited_together_for_a_busy_one_are_not_taken_for_dead(world, rows, busy, seconds):
    """While one rank is busy, the others wait for it and have nothing new to say to each other
    (they are watched meanwhile: asked, each answers on the busy rank's behalf).  Once it joins,
    a rank needs the last rank's all-gather, which that rank's slow link delivers only later:
    the last rank has been needed for that long, not silent since its last answer during the
    wait, so the round ends exactly (before, the first case failed naming it at once, and with
    watching timed together with needing, the second did ~0.8 s after the join).  The slow link's
    queues hold 256 KiB, 0.2 s of it: a packet that waits in a queue longer than ``peer_timeout``
    (1 MiB would be 0.84 s) is rightly late, whatever its sender did."""
    slow = Link("10mbit", latency=25e-6, queue=256 << 10)
    s = Sim(world, Config(peer_timeout=0.5), link=[LINK] * (world - 1) + [slow], seed=1)
    xs = inputs(world, world * rows * 352, rounds=2, seed=5)

    nodes = s.run(busy_then_round(xs, busy, seconds))
    for node in nodes:
        done, err, _, _ = node.result
        assert err is None, err
        np.testing.assert_allclose(done[0], np.mean(xs[1], axis=0), atol=1e-5)


@pytest.mark.parametrize("mode,n,busy", [("ps", 10_000, 1), ("ps", 10_000, 0), ("tar", 1, 0), ("tar", 1, 3)],
                         ids=["ps-client", "ps-server", "scalar-empty-shard", "scalar-owner"])
def test_a_busy_rank_no_peer_sent_anything_is_asked_and_waited_for(mode, n, busy):
    """Waits where the busy rank holds nothing of the round to answer with HELLO: a parameter
    server waiting for a busy client's contribution, and an allreduce of one value (only rank 3
    owns a row) waiting for a rank with an empty shard.  A rank quiet for a sixteenth of
    ``peer_timeout`` is asked (HELLO with ASK): the busy one stashes the ask and answers, and a
    rank in the round waiting for the busy one answers on its behalf, so every round ends exact."""
    s = sim(4, peer_timeout=0.5, mode=mode)
    xs = inputs(4, n, rounds=2, seed=6)

    nodes = s.run(busy_then_round(xs, busy, 3.0))
    for node in nodes:
        done, err, began, ended = node.result
        assert err is None, err
        np.testing.assert_allclose(done[0], np.mean(xs[1], axis=0), atol=1e-5)
        if node.rank != busy:
            assert ended - began > 2.9
    assert nodes[busy].collective.counters["hellos_sent"] > 0


def test_a_peer_dying_while_the_round_waits_for_a_busy_one_is_named_at_peer_timeout():
    """Rank 0 computes for 6 x ``peer_timeout`` between two allreduces; rank 2 dies 0.5 s into
    the second, its contributions out, while ranks 1 and 3 wait there for rank 0 and have nothing
    to say to rank 2 until rank 0 joins (they need its all-gather then).  Those later peers are
    judged during the wait too (asked; a live one answers on the busy rank's behalf), so ranks 1
    and 3 fail about ``peer_timeout`` after rank 2 died, naming it, not only once rank 0 joins."""
    s = sim(4, peer_timeout=0.5)
    s.kill(2, at=0.5)
    xs = inputs(4, 10_000, rounds=2, seed=7)

    nodes = s.run(busy_then_round(xs, 0, 3.0))
    for r in (1, 3):
        done, err, began, failed = nodes[r].result
        assert done == [] and isinstance(err, CollectiveError), (r, err)
        assert "rank 2 sent nothing" in str(err) and "alive" not in str(err), err
        assert 0.5 < failed < 0.5 + 0.5 + 0.5 / HELLO_EVERY + 0.1, (r, failed)


def test_a_peer_busy_past_join_timeout_fails_the_round_naming_it():
    """Rank 1 stays busy past ``join_timeout``: ranks 0 and 2 fail their round ``join_timeout``
    after it began (within a HELLO interval and a dead-peer tick), naming rank 1 as alive but not
    in the round, not as dead."""
    s = sim(3, peer_timeout=0.5, join_timeout=1.0)
    xs = inputs(3, 10_000, rounds=2)

    nodes = s.run(busy_then_round(xs, 1, 3.0))
    for r in (0, 2):
        done, err, began, failed = nodes[r].result
        assert done == [] and isinstance(err, CollectiveError)
        assert "rank 1 alive but not in round 1 (tensor 0) after 1 s (Config.join_timeout)" in str(err), err
        assert "dead" not in str(err)
        assert 1.0 <= failed - began < 1.0 + 0.5 / HELLO_EVERY + 0.05, (began, failed)


def test_a_rank_that_runs_no_more_rounds_is_found_gone_at_peer_timeout():
    """Rank 1 runs one round fewer than its peers and then only answers them (a simulated rank
    whose program ended clears ``Collective.hello``): it sends no HELLO, so ranks 0 and 2 fail
    their second round at ``peer_timeout`` naming it, not at ``join_timeout``."""
    s = sim(3, peer_timeout=0.5)
    xs = inputs(3, 10_000, rounds=2)

    def program(node):
        rounds = 1 if node.rank == 1 else 2
        return until_error(node, (lambda i=i: node.collective.allreduce(xs[i][node.rank]) for i in range(rounds)))

    nodes = s.run(program)
    assert nodes[1].result[1] is None and nodes[1].collective.counters["hellos_sent"] == 0
    for r in (0, 2):
        done, err, began, failed = nodes[r].result
        assert len(done) == 1 and "rank 1 sent nothing for 0.5 s" in str(err), err
        assert 0.5 <= failed - began < 0.55, (began, failed)


@pytest.mark.parametrize("fill", ["stale", "local"])
def test_deadline_ends_below_bound_reported_and_filled(fill):
    """Rank 2 takes part in round 1 and not in round 2 (it only answers peers): ranks 0 and 1 end
    round 2 at its deadline, below the bound, and fill rank 2's shard (``stale``: round 1's mean,
    ``local``: their own input); in the shard that two contributions reached, the other's stands
    for the missing one too (``unbiased``: (own + 2 * other) / 3)."""
    s = sim(3, deadline=0.4, peer_timeout=2.0, fill=fill, estimator="unbiased", order="rows")  # (shards by row)
    xs = inputs(3, 30_000, rounds=2, seed=3)

    def program(node):
        c = node.collective
        first = c.allreduce(xs[0][node.rank])
        kept = first.copy()
        first[:] = np.nan  # the caller owns a result: changing it must not change the stale fill
        if node.rank == 2:
            return kept, None
        return kept, c.allreduce(xs[1][node.rank])

    nodes = s.run(program)
    assert not any(n.error for n in nodes)
    assert bool(nodes[0].collective.protocol.fill.stale) == (fill == "stale")  # the local fill keeps no copy
    for node in nodes[:2]:
        rec = node.records[-1]
        assert rec.below_bound and rec.min_delivered == 0.0 and 0.4 <= rec.latency < 0.45, rec
    C = nodes[0].collective.C
    T = -(-30_000 // C)
    a1, a2 = T // 3 * C, 2 * T // 3 * C  # shard 2 (owned by the absent rank) starts at a2
    first, out = nodes[0].result
    want = first if fill == "stale" else xs[1][0]
    np.testing.assert_array_equal(out[a2:], want[a2:])
    # shard 0 (rank 0's) was estimated from its own and rank 1's, which stands for rank 2's too
    np.testing.assert_allclose(out[:a1], (xs[1][0][:a1] + 2 * xs[1][1][:a1]) / 3, atol=1e-5)


# ---- lost STOPs, trailing all-gather messages, probes between rounds -----------------------

def _first_stop_of_each_message(dropped, r):
    def drop(h):
        hit = np.zeros(len(h), bool)
        for i in np.flatnonzero(h["kind"] == wire.Kind.STOP):
            key = (r, int(h["round"][i]), int(h["dst"][i]), int(h["flags"][i]))
            if key not in dropped:
                dropped.add(key)
                hit[i] = True
        return hit
    return drop


def test_a_lost_stop_holds_no_round():
    """A STOP goes out once, and losing it costs no round time: with the first STOP for every
    message lost, every round is exact and none waits for the probe timeout (fixed at 0.5 s: a
    round that waited would take that long).  A reduce-scatter message ends with its owner's
    all-gather (no probe); an all-gather message trails, is probed 0.5 s later and ends with the
    STOP that answers it."""
    s = sim(2, phase="static:0", probe_min=0.5, probe_max=0.5)
    dropped = set()  # (sender, round, dst, flags) of the messages whose first STOP was lost
    for r, node in enumerate(s.nodes):
        node.collective.protocol.estimate = 0.5
        lose_sent(node.collective.t, _first_stop_of_each_message(dropped, r))
    xs = inputs(2, 30_000, rounds=4)
    nodes = s.run(lambda node: [node.collective.allreduce(xs[i][node.rank]) for i in range(4)])
    assert not any(n.error for n in nodes)
    for i in range(4):
        for node in nodes:
            np.testing.assert_allclose(node.result[i], (xs[i][0] + xs[i][1]) / 2, rtol=1e-6)
    assert len(dropped) >= 8  # at least the all-gather STOP of every rank and round
    recs = [rec for n in nodes for rec in n.records]
    assert [rec.probes for rec in recs] == [0] * 8
    assert max(rec.latency for rec in recs) < 0.1
    # the run ends once nothing trails: each rank's last all-gather was probed and acknowledged
    assert not any(n.collective.trailing for n in nodes)
    assert all(n.collective.counters["trail_probes"] >= 1 for n in nodes)


def _allgather_tail(rnd, dst, k):
    """The first transmission of the last ``k`` chunks of an all-gather message of round ``rnd`` to ``dst``."""
    def hit(h):
        return ((h["kind"] == wire.Kind.DATA) & (h["round"] == rnd) & (h["dst"] == dst)
                & ((h["flags"] & (wire.Flag.ALLGATHER | wire.Flag.RETX)) == wire.Flag.ALLGATHER)
                & (h["chunk"].astype(np.int64) >= h["nchunks"].astype(np.int64) - k))
    return hit


@pytest.mark.parametrize("then", ["idle", "next round"])
def test_a_round_returns_before_its_allgather_is_acknowledged_and_repairs_it_after(then):
    """A rank returns once its result is in and its all-gather has gone out, without waiting for
    the STOPs: an all-gather message not acknowledged yet trails.  Here the tail of rank 0's
    all-gather to rank 1 is lost (tolerance 0: rank 1 needs it, and waits for rank 0's probe, 1 s
    after the last chunk).  Rank 0 has returned long before (and overwritten its result, which it
    owns now); between rounds, or in its next round's loop, it probes, gets the BITMAP and resends
    the tail from its own copy: both ranks end exact."""
    s = sim(2, phase="static:0", probe_min=1.0, probe_max=1.0)
    xs = inputs(2, 40_000, rounds=2)
    c0 = s.nodes[0].collective
    lose_sent(c0.t, _allgather_tail(c0.round + 1, 1, 5))

    def program(node):
        c = node.collective
        out = c.allreduce(xs[0][node.rank])
        got, returned = out.copy(), node.now
        out[:] = -1.0  # the caller owns its result: rank 0's trailing message must not read it
        if then == "next round":
            got = [got, c.allreduce(xs[1][node.rank])]
        return got, returned

    nodes = s.run(program)
    assert not any(n.error for n in nodes)
    assert nodes[0].result[1] < 0.1 <= 1.0 <= nodes[1].result[1]  # rank 0 returned; rank 1 waited for the probe
    for node in nodes:
        got = node.result[0] if then == "idle" else node.result[0][0]
        np.testing.assert_allclose(got, (xs[0][0] + xs[0][1]) / 2, rtol=1e-6)
        if then == "next round":
            np.testing.assert_allclose(node.result[0][1], (xs[1][0] + xs[1][1]) / 2, rtol=1e-6)
    assert c0.counters["trail_probes"] >= 1 and c0.counters["trail_retransmits"] >= 5
    assert c0.records[0].retransmits == 0 and not c0.records[0].below_bound  # (its own round: nothing resent)
    assert c0.trailing == 0  # rank 1's STOP ended the trailing message


def test_a_trailing_message_to_a_dead_peer_is_dropped_after_peer_timeout():
    """Rank 1 never acknowledges rank 0's all-gather (its STOPs are lost) and dies after its
    round: rank 0 has returned, probes between rounds, hears nothing, and ``peer_timeout`` after
    it last heard rank 1 drops the message (counted in ``trail_dropped``) instead of probing
    forever."""
    s = sim(2, peer_timeout=0.5)
    lose_sent(s.nodes[1].collective.t, lambda h: h["kind"] == wire.Kind.STOP)
    s.kill(1, at=0.01)
    xs = inputs(2, 20_000)

    def program(node):
        y = node.collective.allreduce(xs[0][node.rank])
        trailing = node.collective.trailing
        node.compute(1.0)
        return y, trailing

    nodes = s.run(program)
    assert nodes[1].error == "killed"
    y, trailing = nodes[0].result
    np.testing.assert_allclose(y, (xs[0][0] + xs[0][1]) / 2, rtol=1e-6)
    c0 = nodes[0].collective
    assert trailing == 1
    assert c0.counters["trail_dropped"] == 1 and c0.counters["trail_probes"] >= 1
    assert c0.trailing == 0


def test_a_probe_between_rounds_is_answered_while_the_peer_computes():
    """Rank 1's first STOP for rank 0's all-gather is lost and rank 1 then computes for 2 s: rank
    0's trailing message probes after the round, and rank 1, in no round, answers with the STOP
    (what the idle responder does between a real rank's rounds): the message ends within a
    second, long before rank 1's next round."""
    s = sim(2, probe_min=0.2, probe_max=0.2)
    dropped = set()
    lose_sent(s.nodes[1].collective.t, _first_stop_of_each_message(dropped, 1))
    xs = inputs(2, 20_000, rounds=2)

    def program(node):
        c = node.collective
        y = [c.allreduce(xs[0][node.rank])]
        node.compute(1.0 if node.rank == 0 else 2.0)
        seen = (c.trailing, c.counters["trail_probes"], node.now)
        y.append(c.allreduce(xs[1][node.rank]))
        return y, seen

    nodes = s.run(program)
    assert not any(n.error for n in nodes)
    assert any(src == 1 and flags & wire.Flag.ALLGATHER for src, _, _, flags in dropped)
    trailing, probes, at = nodes[0].result[1]
    assert trailing == 0 and probes >= 1 and at < 2.0  # acknowledged while rank 1 computed
    for i in range(2):
        for node in nodes:
            np.testing.assert_allclose(node.result[0][i], (xs[i][0] + xs[i][1]) / 2, rtol=1e-6)


# ---- neighbour rounds: silent, dead and mismatched neighbours ------------------------------

def test_a_silent_neighbour_is_skipped_then_taken_in_again():
    """Rank 3 of a ring of 4 computes for three timeouts before round 1: ranks 0 and 2 leave it
    out of round 1 (after at most two timeouts: one from when its round-0 message began arriving,
    plus one) without error, rank 1 is untouched; rank 3 then goes on and everyone has everyone
    again by the last round.  Every result is the exact weighted average over the neighbours
    reported as arrived."""
    world, timeout, rounds = 4, 2.0, 8
    s = sim(world, peer_timeout=15.0)
    rng = np.random.default_rng(1)
    xs = [[rng.standard_normal(20000).astype(np.float32) for _ in range(world)] for _ in range(rounds)]

    def program(node):
        out = []
        for i in range(rounds):
            if node.rank == 3 and i == 1:
                node.compute(3 * timeout)
            p = neighbours("ring", node.rank, world, i)
            out.append(node.collective.neighbours(xs[i][node.rank], p, [1 / 3, 1 / 3], timeout=timeout))
        return out

    nodes = s.run(program)
    assert not any(n.error for n in nodes)
    for r, node in enumerate(nodes):
        p = neighbours("ring", r, world, 0)
        for i in range(rounds):
            y, arrived = node.result[i]
            want = (xs[i][r] + sum(xs[i][j] for j in arrived)) / (1 + len(arrived))  # renormalised
            np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
            if i in (0, rounds - 1) or (i == 1 and r in (1, 3)):
                assert arrived == p, (r, i, arrived)
        recs = node.records
        if r in (0, 2):
            assert node.result[1][1] == [1]
            assert recs[1].left_out == [3] and timeout <= recs[1].latency < 2 * timeout + 0.01
        assert recs[-1].left_out == []


def test_a_dead_neighbour_costs_one_timeout_per_round_and_never_raises():
    """A neighbour dead from the start: every round returns one timeout after it began, without
    it, and the others' averages are exact over each other."""
    world, timeout = 3, 0.4
    s = sim(world, peer_timeout=2.0)
    s.kill(2, at=0.0)
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal(5000).astype(np.float32) for _ in range(world)]

    def program(node):
        r = node.rank
        return [node.collective.neighbours(xs[r], [q for q in range(world) if q != r], [0.25, 0.25], timeout=timeout)
                for _ in range(4)]

    nodes = s.run(program)
    assert nodes[2].error == "killed"
    for r in (0, 1):
        other = 1 - r
        for y, arrived in nodes[r].result:
            assert arrived == [other]
            np.testing.assert_allclose(y, (xs[r] * 0.5 + xs[other] * 0.25) / 0.75, rtol=1e-5, atol=1e-6)
        recs = nodes[r].records
        assert [rec.left_out for rec in recs] == [[2]] * 4
        assert all(timeout <= rec.latency < timeout + 0.01 for rec in recs), [rec.latency for rec in recs]


def test_a_neighbour_round_never_takes_an_allreduce_rounds_data():
    """Ranks calling rounds in different orders: the NEIGHBOUR flag keeps the two apart.  The
    neighbour round ends at its timeout with this rank's own value; the allreduce cannot complete
    and raises after ``peer_timeout``."""
    s = sim(2, peer_timeout=1.5)
    x = [np.full(4000, 1.0, np.float32), np.full(4000, 5.0, np.float32)]

    def program(node):
        c = node.collective
        if node.rank == 0:
            return c.neighbours(x[0], [1], [0.5], timeout=0.5), node.now
        return c.allreduce(x[1])

    nodes = s.run(program)
    (y, arrived), at = nodes[0].result
    assert arrived == [] and np.array_equal(y, x[0]) and 0.5 <= at < 0.55
    assert isinstance(nodes[1].error, CollectiveError) and "does not fit" in str(nodes[1].error)
    assert all(n.collective.counters["bad_payload"] > 0 for n in nodes)


# ---- the order of sends at switch ports --------------------------------------------------------

def switched_rounds(world, mib, queue, skew=0.0, **cfg):
    """Rounds of ``mib`` MiB over 1 Gbit/s links whose switch ports hold ``queue`` bytes, each rank
    starting each round after a seeded 0..``skew`` s of compute: (the rounds' median latency over
    the line rate's least, the switch ports' tail drops)."""
    n = mib * (1 << 20) // 4
    s = Sim(world, Config(phase="static:0.0", peer_timeout=5.0, **cfg), link=Link("1gbit", latency=20e-6, queue=queue),
            seed=1)

    def program(node):
        rng = np.random.default_rng(node.rank)
        x = np.full(n, node.rank + 1, np.float32)
        for _ in range(4):
            node.compute(rng.uniform(0, skew))
            y = node.collective.allreduce(x)
        return y

    nodes = s.run(program)
    for node in nodes:
        assert node.error is None and np.all(node.result == (world + 1) / 2), node.error
    least = 2 * (world - 1) / world * mib * (1 << 20) * (1408 + 74) / 1408 * 8 / 1e9
    return np.median([r.latency for node in nodes for r in node.records[1:]]) / least, s.network.drops["tail"]


@pytest.mark.parametrize("world,mib", [(4, 1), (8, 1)])
def test_ranks_in_step_never_send_to_one_port_at_once(world, mib):
    """Each rank sends its messages from its successor on, so ranks in step load every switch
    port with one sender at a time and a round takes what the links allow (before, every rank
    began with rank 0, then 1, ...: a port took several senders at once, and the last shard's
    owner finished its reduce late: 1.18x and 1.15x the least)."""
    over, drops = switched_rounds(world, mib, 1 << 20)
    assert over < 1.03 and drops == 0, (over, drops)


def test_spread_sends_spare_a_shallow_port_buffer_an_incast():
    """Ranks out of step (0-2 ms apart) send to one port at once whatever their order.  With
    ``Config.spread`` each sender gives each destination its share of the link (32 packets at a
    time, in turn), so a port never takes more than its rate: a 128 KiB buffer drops nothing and
    a round takes about what the links allow; without, the buffer drops hundreds of packets or
    more and the rounds, repairing them, take over 1.5x as long."""
    off, dropped = switched_rounds(4, 1, 128 << 10, skew=0.002)
    on, spared = switched_rounds(4, 1, 128 << 10, skew=0.002, spread=32)
    assert dropped > 100 and spared * 100 < dropped, (dropped, spared)
    assert on < 1.15 and on * 1.5 < off, (on, off)


# ---- determinism ------------------------------------------------------------------------------

def test_a_scenario_gives_the_same_records_on_every_run():
    """The same seed, config and program give the same round records, latencies included (the
    reason these tests may bound virtual latencies): a dead neighbour under 5% loss."""
    def once():
        s = sim(4, seed=7, peer_timeout=2.0)
        s.network.loss(0.05)
        s.kill(3, at=0.02)
        xs = inputs(4, 20_000)

        def program(node):
            out = []
            for i in range(4):
                p = neighbours("ring", node.rank, 4, i)
                out.append(node.collective.neighbours(xs[0][node.rank], p, [1 / 3, 1 / 3], timeout=0.3)[1])
                node.compute(0.01)
            return out

        nodes = s.run(program)
        return ([n.result for n in nodes[:3]], [[(r.latency, r.left_out, r.retransmits, r.delivered)
                                                 for r in n.records] for n in nodes[:3]], dict(s.network.drops))

    assert once() == once()
