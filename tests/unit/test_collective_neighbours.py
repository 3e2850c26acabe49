"""Neighbour (gossip) rounds of the collective over real UDP sockets on loopback: ranks are threads.

Exact weighted averages at zero loss on every topology, a silent neighbour skipped within its
timeout and taken in again the next round it answers, neighbour and allreduce rounds interleaved
without mixing, and the per-chunk estimator.  Loss is injected in tests/linux
(test_collective_testbed.py).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from pydblp.collective import CollectiveError, estimators
from pydblp.torch.exchange import neighbours


def weights_of(topology, r, world, rnd, seed=0):
    """The peers of rank r in round rnd and uneven weights (w_j = 1/(2 + deg + j)): any weights
    count, not only the uniform ones."""
    p = neighbours(topology, r, world, rnd, seed=seed)
    return p, [1.0 / (2 + len(p) + j) for j in p]


def expected(xs, r, peers, w):
    return (xs[r] * (1 - sum(w)) + sum(wj * xs[j] for j, wj in zip(peers, w)))


@pytest.mark.parametrize("topology", ["ring", "exp", "random"])
@pytest.mark.parametrize("world", [4, 5])
def test_zero_loss_gives_the_exact_weighted_average(ranks, topology, world):
    rk = ranks(world)
    rng = np.random.default_rng(world)
    rounds = 3
    xs = [[rng.standard_normal(3000 + 7 * world).astype(np.float32) for _ in range(world)] for _ in range(rounds)]

    def fn(r, c):
        out = []
        for i in range(rounds):
            p, w = weights_of(topology, r, world, i, seed=3)
            out.append(c.neighbours(xs[i][r], p, w, timeout=4.0))
        return out

    res, errs = rk.run(fn)
    assert not errs, errs
    for r in range(world):
        for i in range(rounds):
            p, w = weights_of(topology, r, world, i, seed=3)
            y, arrived = res[r][i]
            assert arrived == p
            np.testing.assert_allclose(y, expected(xs[i], r, p, w), rtol=1e-5, atol=1e-6)
        for rec in list(rk.cols[r].records):
            assert rec.left_out == [] and not rec.below_bound and rec.min_delivered == 1.0
            assert all(k.startswith("nb:") for k in rec.delivered)


def test_silent_neighbour_is_skipped_then_taken_in_again(ranks):
    """Rank 3 of a ring of 4 is silent in round 1 past what its neighbours wait (a timeout from
    when its round-0 message began arriving, plus one): ranks 0 and 2 leave it out, without
    error, rank 1 is untouched; rank 3 then goes on and everyone has everyone again by the last
    round (how many rounds in between still miss a late rank depends on scheduling).  Every result
    is the exact weighted average over the neighbours reported as arrived."""
    world, timeout, rounds = 4, 2.0, 8  # a timeout far above a loaded round trip
    rk = ranks(world, peer_timeout=15.0)
    rng = np.random.default_rng(1)
    xs = [[rng.standard_normal(20000).astype(np.float32) for _ in range(world)] for _ in range(rounds)]

    def fn(r, c):
        out = []
        for i in range(rounds):
            if r == 3 and i == 1:
                time.sleep(3 * timeout)
            p = neighbours("ring", r, world, i)
            out.append(c.neighbours(xs[i][r], p, [1 / 3, 1 / 3], timeout=timeout))
        return out

    res, errs = rk.run(fn)
    assert not errs, errs
    for r in range(world):
        p = neighbours("ring", r, world, 0)
        for i in range(rounds):
            y, arrived = res[r][i]
            want = (xs[i][r] + sum(xs[i][j] for j in arrived)) / (1 + len(arrived))  # renormalised
            np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
            if i in (0, rounds - 1) or (i == 1 and r in (1, 3)):
                assert arrived == p, (r, i, arrived)
        if r in (0, 2):
            assert res[r][1][1] == [1]
            recs = list(rk.cols[r].records)
            assert recs[1].left_out == [3] and recs[1].latency >= timeout
            assert recs[-1].left_out == []


def test_dead_neighbour_costs_one_timeout_per_round_and_never_raises(ranks):
    """A neighbour that never answers: every round returns after about the timeout without it."""
    world, timeout = 3, 0.4
    rk = ranks(world, peer_timeout=2.0)
    rng = np.random.default_rng(2)
    xs = [rng.standard_normal(5000).astype(np.float32) for _ in range(world)]

    def fn(r, c):
        return [c.neighbours(xs[r], [q for q in range(world) if q != r], [0.25, 0.25], timeout=timeout)
                for _ in range(4)]

    res, errs = rk.run(fn, ranks=[0, 1])  # rank 2 never calls
    assert not errs, errs
    for r in (0, 1):
        other = 1 - r
        for y, arrived in res[r]:
            assert arrived == [other]
            np.testing.assert_allclose(y, (xs[r] * 0.5 + xs[other] * 0.25) / 0.75, rtol=1e-5, atol=1e-6)
        assert [rec.left_out for rec in rk.cols[r].records] == [[2]] * 4


def test_neighbour_and_allreduce_rounds_interleave_without_mixing(ranks):
    """The same tensor id, alternating kinds of round: every result is exact."""
    world = 4
    rk = ranks(world)
    rng = np.random.default_rng(4)
    xs = [[rng.standard_normal(9000).astype(np.float32) for _ in range(world)] for _ in range(6)]

    def fn(r, c):
        out = []
        for i in range(6):
            if i % 2:
                out.append(c.allreduce(xs[i][r]))
            else:
                p, w = weights_of("exp", r, world, i)
                out.append(c.neighbours(xs[i][r], p, w, timeout=4.0))
        return out

    res, errs = rk.run(fn)
    assert not errs, errs
    for r in range(world):
        for i in range(6):
            if i % 2:
                np.testing.assert_allclose(res[r][i], np.mean(xs[i], axis=0), rtol=1e-5, atol=1e-6)
            else:
                p, w = weights_of("exp", r, world, i)
                y, arrived = res[r][i]
                assert arrived == p
                np.testing.assert_allclose(y, expected(xs[i], r, p, w), rtol=1e-5, atol=1e-6)
    assert all(c.counters["bad_payload"] == 0 for c in rk.cols)


def test_a_neighbour_round_never_takes_an_allreduce_rounds_data(ranks):
    """Ranks calling rounds in different orders: the NEIGHBOUR flag keeps the two apart.  The
    neighbour round ends at its timeout with this rank's own value; the allreduce cannot
    complete and raises."""
    rk = ranks(2, peer_timeout=1.5)
    x = [np.full(4000, 1.0, np.float32), np.full(4000, 5.0, np.float32)]

    def fn(r, c):
        if r == 0:
            return c.neighbours(x[0], [1], [0.5], timeout=0.5)
        return c.allreduce(x[1])

    res, errs = rk.run(fn)
    y, arrived = res[0]
    assert arrived == [] and np.array_equal(y, x[0])
    assert isinstance(errs.get(1), CollectiveError)
    assert rk.cols[0].counters["bad_payload"] > 0 and rk.cols[1].counters["bad_payload"] > 0


def test_neighbours_argument_errors(ranks):
    c = ranks(3, peer_timeout=2.0).cols[0]
    x = np.zeros(10, np.float32)
    for peers, w, t, says in (([0], [0.5], 1.0, "not this rank"), ([1, 1], [0.2, 0.2], 1.0, "distinct"),
                              ([3], [0.5], 1.0, "0..2"), ([1], [0.5, 0.1], 1.0, "one weight"),
                              ([1, 2], [0.7, 0.7], 1.0, "at most 1"), ([1], [-0.1], 1.0, ">= 0"),
                              ([1], [0.5], 2.0, "peer_timeout"), ([1], [0.5], -1.0, "timeout"),
                              ([1], [0.5], [1.0, 1.0], "one per peer")):
        with pytest.raises(ValueError, match=says):
            c.neighbours(x, peers, w, timeout=t)
    assert c.index == 0  # nothing started


def test_no_peers_still_takes_a_round_and_returns_the_input(ranks):
    rk = ranks(2)
    x = np.arange(100, dtype=np.float32)
    y, arrived = rk.cols[0].neighbours(x, [], [])
    assert arrived == [] and np.array_equal(y, x) and rk.cols[0].index == 1 and rk.cols[0].round == 1


def test_neighbour_mean_renormalises_per_chunk():
    """Chunk 0 came from both neighbours, chunk 1 from one, chunk 2 from none."""
    x = np.array([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]], np.float32)
    buf = np.array([[[3.0, 3.0], [3.0, 3.0], [9.0, 9.0]],
                    [[5.0, 5.0], [7.0, 7.0], [9.0, 9.0]]], np.float32)
    mask = np.array([[True, False, False], [True, True, False]])
    out = np.empty_like(x)
    estimators.neighbour_mean(x, 0.5, buf, mask, np.array([0.25, 0.25]), out)
    np.testing.assert_allclose(out[:, 0], [(0.5 + 0.75 + 1.25) / 1.0, (0.5 + 1.75) / 0.75, 1.0], rtol=1e-6)
    out0 = np.empty_like(x)  # no self weight and nothing arrived: the chunk keeps this rank's value
    estimators.neighbour_mean(x, 0.0, buf, np.zeros((2, 3), bool), np.array([0.5, 0.5]), out0)
    np.testing.assert_array_equal(out0, x)
