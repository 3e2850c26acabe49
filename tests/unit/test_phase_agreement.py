"""One phase for the job when replicas may differ: ranks agree on G through a one-chunk round.

With ``Config(consistent=False)`` the all-gather tolerates loss and each rank fills its misses
with its own stale values, so ranks hold different results.  ``Collective.end_step`` sums the
squared norms of the shards the ranks own (their exact reduce-scatter estimates) over every
rank, so each controller decides on the same G; calling the controller's own ``end_step``
instead (each rank measuring alone) gives every rank a different G.  Loss is seeded per packet
(:func:`tests.helpers.seeded_loss`), so a run repeats its losses.
"""

from __future__ import annotations

import numpy as np

from pydblp.collective import Dblp
from tests.helpers import seeded_loss

WORLD, STEPS, FREQ = 4, 12, 2
SIZES = (3000, 700)  # two tensors a step, as two DDP buckets


def _steps(rk, agree: bool):
    for col in rk.cols:  # a controller of its own per rank (a Config's phase object would be shared)
        col.protocol.controller = col.controller = Dblp(0.3, k=0.3, freq=FREQ, eta=0.4)
    lost = [seeded_loss(t, 0.1, seed=40 + r) for r, t in enumerate(rk.ts)]

    def go(r, col):
        col.controller.count_steps()
        rng = np.random.default_rng(7)  # the same draws on every rank: steps' norms rise and fall
        results = []
        for step in range(STEPS):
            scale = rng.uniform(0.2, 3.0)
            for tensor, n in enumerate(SIZES):
                x = (scale * np.sin(np.arange(n) * (r + 1 + tensor))).astype(np.float32)
                results.append(col.allreduce(x, tensor=tensor))
            if agree:
                col.end_step()
            else:
                col.controller.end_step()  # this rank's own measurement alone
        return list(col.controller.history), results

    outs, errs = rk.run(go, timeout=120)
    assert not errs, errs
    assert sum(map(len, lost)) > 0
    return outs


def test_ranks_decide_on_the_same_g_without_consistent_results(ranks):
    outs = _steps(ranks(WORLD, consistent=False), agree=True)
    hist = outs[0][0]
    assert [h[0] for h in hist] == list(range(0, STEPS, FREQ))
    assert all(outs[r][0] == hist for r in range(1, WORLD))  # the same G, the same decisions
    assert {h[2] for h in hist} == {True, False}  # the phase changed during the run
    # the all-gather's loss reached the results: the ranks' results differ, their decisions do not
    assert any(not np.array_equal(outs[0][1][i], outs[r][1][i]) for r in range(1, WORLD)
               for i in range(len(outs[0][1])))


def test_without_the_agreement_each_rank_measures_a_different_g(ranks):
    outs = _steps(ranks(WORLD, consistent=False), agree=False)
    gs = [[round(h[1], 6) for h in outs[r][0]] for r in range(WORLD)]
    assert len({tuple(g) for g in gs}) == WORLD  # every rank saw only its own shard
