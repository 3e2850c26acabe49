"""The simulator against the testbed: one scenario, 4 ranks, 10 % loss and bursts, both ways.

The simulator is only worth its figures at 64 or 1,024 ranks if at 4 it repairs as the real
thing does.  The same rounds run over UDP in the 4-worker testbed (fabric faults on every
switch port) and in :mod:`pydblp.sim` (the same faults on the same ports, 1 Gbit/s links):
the fraction of rounds that repaired, the chunks resent per chunk sent and the fraction of
each message delivered must agree within the tolerances below.  The testbed's figures vary
run to run (real time, a shared CPU); the simulator's are fixed by its seed.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from pydblp.collective import Collective, Config
from pydblp.sim import Link, Sim
from pydblp.testbed import Testbed
from pydblp.transport.udp import UdpTransport
from tests.helpers import run_threads, unique_name

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns, pytest.mark.slow]

WORLD = 4
ROUNDS = 24
SIZE = 100_000            # floats per rank: 4 shards of ~71 chunks
LOSS = 0.10               # Bernoulli, every switch port
BURST = (0.002, 0.100)    # a 2 ms window in which every packet is lost, every 100 ms
GAP = 0.002               # s of "compute" between rounds
CFG = dict(job=31, phase="static:0.15", consistent=False, peer_timeout=20.0)
SEEDS = (1, 2, 3)         # the simulator's figures: their mean over these seeds
COST = 2e-6               # s of CPU per packet a simulated rank spends (the testbed's Python ranks do)
# |testbed - simulator| allowed, per figure.  Seen on 2026-12-04, six testbed runs: repaired
# 0.57-0.78, resent 0.025-0.063, delivered 0.913-0.918; the simulator (these seeds): 0.68, 0.023,
# 0.905.  The testbed's ranks are slower and share 2 vCPUs with the rest of the suite: more chunks
# past the bound arrive, and a rank descheduled past a probe timeout has chunks resent that were
# only late (timing, not loss), which the simulator's ranks never are: resent has the widest gap
TOLERANCE = {"repaired": 0.25, "resent": 0.1, "delivered": 0.04}


def figures(records: list) -> dict:
    """What the two runs are compared on, over every rank's rounds: the fraction of rounds that
    repaired (a chunk resent or a NACK sent), chunks resent per packet sent, the mean fraction
    of each message delivered."""
    resent = sum(r.retransmits for r in records)
    sent = sum(r.bytes_sent for r in records) / (Config().chunk_bytes + 32)
    return {"repaired": float(np.mean([r.retransmits > 0 or r.nacks > 0 for r in records])),
            "resent": resent / sent,
            "delivered": float(np.mean([np.mean(list(r.delivered.values())) for r in records]))}


def _inputs():
    rng = np.random.default_rng(7)
    return [rng.standard_normal(SIZE).astype(np.float32) for _ in range(WORLD)]


def simulate(xs: list, seed: int) -> dict:
    """The scenario in the simulator: its figures."""
    sim = Sim(WORLD, Config(**CFG), link=Link("1gbit", latency=20e-6, queue=256 << 10), seed=seed, cost=COST)
    sim.network.loss(LOSS)
    sim.network.burst(start=0.01, duration=BURST[0], every=BURST[1])

    def program(node):
        for _ in range(ROUNDS):
            node.collective.allreduce(xs[node.rank])
            node.compute(GAP)

    nodes = sim.run(program)
    assert not [n.error for n in nodes if n.error]
    return figures([r for n in nodes for r in n.records])


def test_a_simulated_run_repairs_as_the_testbed_does(bpf_xdp):
    xs = _inputs()
    runs = [simulate(xs, seed) for seed in SEEDS]
    simulated = {k: float(np.mean([f[k] for f in runs])) for k in TOLERANCE}

    with Testbed(workers=WORLD, name=unique_name("sa")) as tb:
        tb.loss(LOSS)
        tb.burst(ratio=1.0, duration=BURST[0], delay=0.01, every=BURST[1])
        ts = [UdpTransport("eth0", netns=tb.ns(r)) for r in range(WORLD)]
        peers = [(tb.addr(r), ts[r].port, tb.mac(r)) for r in range(WORLD)]
        cols = [Collective(ts[r], r, WORLD, peers, Config(**CFG)) for r in range(WORLD)]
        try:
            def rank(r):
                for _ in range(ROUNDS):
                    cols[r].allreduce(xs[r])
                    time.sleep(GAP)  # the same compute gap, in real time

            _, errs = run_threads(rank, range(WORLD), timeout=120)
            assert not errs, errs
            measured = figures([r for c in cols for r in c.records])
        finally:
            for c in cols:
                c.close()
    print("simulated", simulated, "testbed", measured)
    for k, tol in TOLERANCE.items():
        assert abs(simulated[k] - measured[k]) <= tol, (k, simulated, measured)
