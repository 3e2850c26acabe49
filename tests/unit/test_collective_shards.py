"""Collective.reduce_scatter and Collective.all_gather over UDP on loopback: ranks are threads.

Checked against numpy: rank k's piece of the mean, the concatenation of the pieces, and an
allreduce equal to the all-gather of the reduce-scatter; under seeded loss
(:func:`tests.helpers.seeded_loss`) repaired to the exact result at bound 0, within the bound
otherwise.  A dead peer failing either: test_sim_protocol.py, in virtual time.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import seeded_loss

C = 1408 // 4  # values per chunk row (the default chunk_bytes)


def pieces(world: int, s: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(world * s).astype(np.float32) for _ in range(world)]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("s", [1, 1000, 3 * C])  # within a row, rows with padding, whole rows
def test_reduce_scatter_and_all_gather_match_numpy(ranks, world, s):
    rk = ranks(world)
    xs = pieces(world, s, seed=s)

    def run(r, c):
        mine = c.reduce_scatter(xs[r].reshape(world, s))  # (any shape: cut in flat order)
        return mine, c.reduce_scatter(xs[r], op="sum"), c.all_gather(mine), c.allreduce(xs[r])

    res, errs = rk.run(run)
    assert not errs, errs
    mean = np.mean(np.float64(xs), axis=0)
    for r in range(world):
        mine, total, gathered, reduced = res[r]
        assert mine.shape == (s,) and mine.dtype == np.float32 and gathered.shape == (world * s,)
        np.testing.assert_allclose(mine, mean[r * s: (r + 1) * s], atol=1e-5)
        np.testing.assert_allclose(total, mean[r * s: (r + 1) * s] * world, atol=1e-4)
        np.testing.assert_allclose(gathered, np.concatenate([res[q][0] for q in range(world)]), rtol=0, atol=0)
        np.testing.assert_allclose(gathered, reduced, atol=1e-5)  # allreduce == all_gather(reduce_scatter)
    recs = rk.cols[0].records
    assert sorted(recs[0].delivered) == [f"rs:{q}" for q in range(1, world)]  # a reduce-scatter alone
    assert sorted(recs[2].delivered) == [f"ag:{q}" for q in range(1, world)]  # an all-gather alone


@pytest.mark.parametrize("order", ["shuffle", "rows"])
def test_each_rank_gets_its_piece_in_the_tensor_s_order_whatever_the_mode(ranks, order):
    """Piece k is values k*s..(k+1)*s-1 in the tensor's own order, also under a shuffled order
    and with ``mode="ps"`` (whose allreduce has one shard): the pieces are the ranks' own."""
    world, s = 3, 5 * C + 7
    rk = ranks(world, order=order, mode="ps")
    xs = [np.arange(world * s, dtype=np.float32) * (r + 1) for r in range(world)]
    res, errs = rk.run(lambda r, c: c.all_gather(c.reduce_scatter(xs[r])))
    assert not errs, errs
    want = np.arange(world * s, dtype=np.float32) * 2  # the mean of 1x, 2x, 3x
    for r in range(world):
        np.testing.assert_allclose(res[r], want, rtol=1e-6)


def scatter_then_gather(c, x):
    """This rank's reduce-scatter piece of ``x``, and the all-gather of every rank's piece."""
    mine = c.reduce_scatter(x)
    return mine, c.all_gather(mine)


def test_loss_is_repaired_to_the_exact_result_at_bound_zero(ranks):
    world, s = 4, 20 * C
    rk = ranks(world)
    for r, t in enumerate(rk.ts):
        seeded_loss(t, 0.05, seed=40 + r)
    xs = pieces(world, s, seed=4)

    res, errs = rk.run(lambda r, c: scatter_then_gather(c, xs[r]))
    assert not errs, errs
    mean = np.mean(np.float64(xs), axis=0)
    for r in range(world):
        np.testing.assert_allclose(res[r][0], mean[r * s: (r + 1) * s], atol=1e-5)
        np.testing.assert_allclose(res[r][1], mean, atol=1e-5)
    assert any(rec.retransmits for c in rk.cols for rec in c.records)  # loss happened and was repaired


def test_loss_within_the_bound_is_tolerated_and_a_missing_value_is_zero(ranks):
    """Bound 20 %, 5 % loss, replicas allowed to differ: a reduce-scatter value is the mean of
    the contributions that arrived (this rank's own always does); an all-gather value is the
    owner's or, where its chunk did not arrive, 0."""
    world, s, tol = 4, 40 * C, 0.2
    rk = ranks(world, phase=f"static:{tol}", consistent=False, estimator="unbiased")
    for r, t in enumerate(rk.ts):
        seeded_loss(t, 0.05, seed=70 + r)
    xs = pieces(world, s, seed=7)

    res, errs = rk.run(lambda r, c: scatter_then_gather(c, xs[r]))
    assert not errs, errs
    mean = np.mean(np.float64(xs), axis=0)
    for r in range(world):
        mine, gathered = res[r]
        exact = np.isclose(mine, mean[r * s: (r + 1) * s], atol=1e-5)
        assert exact.mean() >= 1 - 3 * tol
        theirs = np.concatenate([res[q][0] for q in range(world)])
        assert ((gathered == theirs) | (gathered == 0)).all()
        assert (gathered == theirs).mean() >= 1 - tol - 1e-9
        np.testing.assert_array_equal(gathered[r * s: (r + 1) * s], mine)  # its own piece always
        for rec in rk.cols[r].records:
            assert rec.below_bound or rec.min_delivered >= 1 - rec.tol - 1e-9


def test_a_size_the_world_does_not_divide_is_refused(ranks):
    rk = ranks(2)
    with pytest.raises(ValueError, match="multiple of the world"):
        rk.cols[0].reduce_scatter(np.ones(7, np.float32))
    with pytest.raises(ValueError, match="op must be"):
        rk.cols[0].reduce_scatter(np.ones(8, np.float32), op="max")
