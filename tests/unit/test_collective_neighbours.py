"""Neighbour (gossip) rounds of the collective over real UDP sockets on loopback: ranks are threads.

Exact weighted averages at zero loss on every topology, neighbour and allreduce rounds
interleaved without mixing, argument checks and the per-chunk estimator.  Silent, dead and
mismatched neighbours (timing behaviour) are tested in virtual time on the simulator
(test_sim_protocol.py); loss is injected in tests/linux (test_collective_testbed.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from pydblp.collective import estimators
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
