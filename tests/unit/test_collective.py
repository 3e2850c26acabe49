"""The collective over real UDP sockets on loopback: ranks are threads.

No root needed.  Loss is not injected here (see tests/linux for the
testbed's fabric faults); these tests cover exactness, modes, world sizes,
estimators, phase control, stray packets and the idle responder's thread.
Timing behaviour (dead and mismatched peers, deadlines, lost STOPs, trailing
all-gather messages) is tested in virtual time on the simulator:
test_sim_protocol.py.
"""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest

from pydblp import wire
from pydblp.collective import Collective, CollectiveError, Config, Dblp, Schedule, Static, config, estimators
from pydblp.collective.protocol import STOP_PAYLOAD, Protocol
from pydblp.transport.base import Batch
from pydblp.transport.udp import UdpTransport
from tests.helpers import Ranks, lose_sent, require_native, run_threads, settled


def inputs(world, n, rounds=1, seed=0):
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(n).astype(np.float32) for _ in range(world)] for _ in range(rounds)]


@pytest.mark.parametrize("mode", ["tar", "ps"])
@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_zero_loss_equals_exact_mean(ranks, world, mode):
    rk = ranks(world, mode=mode)
    xs = inputs(world, 50_000, rounds=2, seed=world)
    res, errs = rk.run(lambda r, c: [c.allreduce(xs[i][r]) for i in range(2)])
    assert not errs
    for i in range(2):
        exact = np.mean(np.float64(xs[i]), axis=0)
        for r in range(world):
            np.testing.assert_allclose(res[r][i], exact, rtol=0, atol=1e-5)
    rec = rk.cols[0].records[-1]
    assert rec.min_delivered == 1.0 and not rec.below_bound and rec.retransmits == 0


@pytest.mark.parametrize("n", [1, 351, 352, 353, 8 * 1024 * 1024 // 4])
def test_sizes_and_shapes(ranks, n):
    rk = ranks(4)
    xs = inputs(4, n)[0]
    res, errs = rk.run(lambda r, c: c.allreduce(xs[r].reshape(-1, 1) if n > 1 else xs[r]))
    assert not errs
    exact = np.mean(xs, axis=0)
    for r in range(4):
        assert res[r].shape == (xs[r].reshape(-1, 1) if n > 1 else xs[r]).shape
        np.testing.assert_allclose(res[r].reshape(-1), exact, atol=1e-5)


def test_sum_op_and_many_rounds_with_tolerance(ranks):
    rk = ranks(3, phase="static:0.05", estimator="zero")
    xs = inputs(3, 20_000, rounds=20)
    res, errs = rk.run(lambda r, c: [c.allreduce(xs[i][r], op="sum") for i in range(20)])
    assert not errs
    for i in range(20):
        # with no loss, tolerance may end a message before its last chunks land;
        # every chunk that arrived is exact, so compare the delivered fraction too
        rec = rk.cols[0].records[i]
        assert rec.min_delivered >= 1 - rec.tol - 1e-9
        exact = np.sum(xs[i], axis=0)
        close = np.isclose(res[0][i], exact, atol=1e-4)
        assert close.mean() >= 1 - 3 * 0.05
    assert [r.tol for r in rk.cols[0].records] == [int(0.05 * 255) / 255] * 20


def _pair(ranks, *cfgs):
    """Two ranks on loopback with a Config each."""
    rk = ranks(0)
    rk.world, rk.ts = 2, [UdpTransport(port=0) for _ in range(2)]
    peers = [("127.0.0.1", t.port) for t in rk.ts]
    rk.cols = [Collective(rk.ts[r], r, 2, peers, cfgs[r]) for r in range(2)]
    return rk


def test_ranks_of_other_jobs_fail_the_round_saying_so(ranks):
    rk = _pair(ranks, Config(job=1, peer_timeout=0.5), Config(job=2, peer_timeout=0.5))
    _, errs = rk.run(lambda r, c: c.allreduce(np.ones(10_000, np.float32)), timeout=10)
    assert set(errs) == {0, 1}
    for r, e in errs.items():
        assert isinstance(e, CollectiveError) and f"rank {1 - r} sent nothing" in str(e), e
        assert "packets of another job or for another rank came meanwhile" in str(e), e


def test_a_rank_busy_between_rounds_is_waited_for_by_its_idle_responders_hello(ranks):
    """Rank 1 sleeps 3 x ``peer_timeout`` between two rounds while rank 0 waits in the second:
    rank 1's idle responder thread says HELLO, so rank 0's round waits and ends exact (before, it
    failed at ``peer_timeout`` naming rank 1 as dead)."""
    rk = ranks(2, peer_timeout=1.0)
    xs = inputs(2, 10_000, rounds=2)

    def fn(r, c):
        out = [c.allreduce(xs[0][r])]
        if r == 1:
            time.sleep(3.0)
        out.append(c.allreduce(xs[1][r]))
        return out

    res, errs = rk.run(fn, timeout=30)
    assert not errs, errs
    for i in range(2):
        for r in range(2):
            np.testing.assert_allclose(res[r][i], np.mean(xs[i], axis=0), atol=1e-5)
    assert rk.cols[0].counters["hellos"] >= 1 and rk.cols[1].counters["hellos_sent"] >= 1


def test_peers_silent_together_are_all_named(ranks):
    """Two of three ranks are gone before the round (closed: alive between rounds they would say
    HELLO): rank 0's error names the first and lists the other as silent as long (it cannot tell
    which of them is the cause)."""
    rk = ranks(3, peer_timeout=0.5)
    for c in rk.cols[1:]:
        c.close()
    _, errs = rk.run(lambda r, c: c.allreduce(np.ones(10_000, np.float32)), ranks=[0], timeout=10)
    e = errs[0]
    assert isinstance(e, CollectiveError), e
    assert "rank 0: rank 1 sent nothing for 0.5 s" in str(e) and "(also silent as long: rank 2)" in str(e), e


def test_a_peer_with_other_chunk_bytes_fails_the_round_saying_so(ranks):
    """Ranks with another ``chunk_bytes`` are alive and keep probing, so no peer goes silent: each
    must still fail the round with a clear error after ``peer_timeout`` (before, they probed and
    retransmitted forever).  Another tensor size or tensor id, and the time the error takes, are
    tested on the simulator (test_sim_protocol.py); this case needs a Config per rank."""
    rk = _pair(ranks, Config(peer_timeout=0.5, chunk_bytes=1408), Config(peer_timeout=0.5, chunk_bytes=1024))
    _, errs = rk.run(lambda r, c: c.allreduce(np.ones(30_000, np.float32)), timeout=10)
    assert set(errs) == {0, 1}, errs
    for r, e in errs.items():
        assert isinstance(e, CollectiveError), e
        assert f"rank {1 - r}'s data in round 0 does not fit" in str(e), e
        assert f"{(1408, 1024)[1 - r]}-byte chunks where" in str(e), e
    assert all(c.counters["bad_payload"] > 0 for c in rk.cols)


def test_foreign_job_and_garbage_are_ignored_and_counted(ranks):
    rk = ranks(2)
    port = rk.ts[1].port
    stray = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for i in range(50):
        stray.sendto(wire.encode(wire.Header(job=99, src=0, dst=1, nchunks=4, chunk=i % 4), b"\0" * 1408),
                     ("127.0.0.1", port))
    stray.sendto(b"garbage", ("127.0.0.1", port))
    stray.close()
    xs = inputs(2, 10_000)[0]
    res, errs = rk.run(lambda r, c: c.allreduce(xs[r]))
    assert not errs
    np.testing.assert_allclose(res[1], np.mean(xs, axis=0), atol=1e-5)
    assert rk.cols[1].counters["foreign"] == 50
    assert rk.ts[1].stats()["rx_invalid"] == 1


def test_stray_data_of_the_round_is_dropped_and_counted(ranks):
    """DATA of the right job, round and destination that does not fit the round (another chunk
    count, tensor or payload size, or this rank's own id as source) is dropped and counted, both
    in a batch of many (matched in numpy) and one by one; the result stays exact."""
    rk = ranks(2)
    port = rk.ts[1].port

    def stray(payload=b"\x7f" * 1408, **kw):
        h = dict(round=1, src=0, dst=1, nchunks=99, chunk=0)  # round 1: the collectives' first
        h.update(kw)
        return wire.encode(wire.Header(**h), payload)

    pkts = [stray(chunk=i) for i in range(20)]  # a chunk count no message of the round has
    pkts += [stray(tensor=5, nchunks=15), stray(b"\x7f" * 100, nchunks=15)]  # another tensor; short
    own = stray(src=1, dst=1, nchunks=15)  # "from" the receiver itself
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for p in pkts + [own]:
        s.sendto(p, ("127.0.0.1", port))
    s.close()
    c1 = rk.cols[1]
    end = time.monotonic() + 10
    while c1.counters["stashed"] < len(pkts) and time.monotonic() < end:  # kept for round 1
        time.sleep(0.01)
    assert c1.counters["stashed"] == len(pkts)
    xs = inputs(2, 10_000)[0]  # 29 chunks: rank 1's shard is 15 of them
    res, errs = rk.run(lambda r, c: c.allreduce(xs[r]))
    assert not errs
    np.testing.assert_allclose(res[1], np.mean(xs, axis=0), atol=1e-5)
    np.testing.assert_allclose(res[0], np.mean(xs, axis=0), atol=1e-5)
    assert c1.counters["bad_payload"] == len(pkts)
    assert c1.counters["foreign"] == 1


def test_unbiased_estimator_is_unbiased_and_zero_shrinks():
    """Workers' gradients are noisy samples of the true gradient g.  With random
    arrival, ``unbiased`` averages to g (mean error -> 0 like 1/sqrt(rounds));
    ``zero`` shrinks it to E[arrived]/W * g."""
    rng = np.random.default_rng(7)
    W, n, C, rounds, p, sigma = 4, 32, 8, 3000, 0.7, 1.0
    g = rng.uniform(0.5, 2.0, (n, C)).astype(np.float32)
    err_u = np.zeros((n, C))
    est_z = np.zeros((n, C))
    for _ in range(rounds):
        x = (g + sigma * rng.standard_normal((W, n, C))).astype(np.float32)
        mask = rng.random((W, n)) < p
        mask[0] = True  # the owner's own contribution always arrives
        err_u += estimators.reduce_mean(x, mask, "unbiased") - g
        est_z += estimators.reduce_mean(x, mask, "zero")
    bias_u = err_u / rounds
    # per element: each round's error has std <= sigma, so the mean's std <= sigma/sqrt(rounds)
    tol = 5 * sigma / np.sqrt(rounds)
    assert np.abs(bias_u).max() < tol, (np.abs(bias_u).max(), tol)
    assert abs(bias_u.mean()) < tol / np.sqrt(n * C) * 2
    shrink = (1 + p * (W - 1)) / W  # own always + each other with probability p
    np.testing.assert_allclose(est_z / rounds, shrink * g, atol=tol)
    assert shrink < 0.8


def test_unbiased_estimator_weighs_the_owner_like_any_other():
    """Ranks whose contributions differ (each sees other data), the owner's most: with random
    arrival of the others (80 %) and its own always there, the estimate averages to the true
    mean.  Counting the owner's own as one more arrival (``sum / arrived``) pulls it towards
    the owner's: weight E[1/arrived] = 0.31 instead of 1/4 here.  What is left (0.018, within
    the tolerance) is the rows where no other arrived (0.8 %), which can only be the owner's."""
    rng = np.random.default_rng(11)
    W, n, C, rounds, p = 4, 16, 4, 4000, 0.8
    x = rng.uniform(-2, 2, (W, n, C)).astype(np.float32)
    x[0] += 3
    truth = x.mean(axis=0)
    est, alike = np.zeros((n, C)), np.zeros((n, C))
    for _ in range(rounds):
        mask = rng.random((W, n)) < p
        mask[0] = True
        est += estimators.reduce_mean(x, mask, "unbiased", own=0)
        alike += estimators.reduce_mean(x, mask, "unbiased")
    bias, pulled = est / rounds - truth, alike / rounds - truth
    assert abs(bias.mean()) < 0.04 and np.abs(bias).max() < 0.1, (bias.mean(), np.abs(bias).max())
    assert pulled.mean() > 0.12  # (the check that fails without ``own``)
    whole = np.ones((W, n), bool)  # every chunk in: the same bits as before
    np.testing.assert_array_equal(estimators.reduce_mean(x, whole, "unbiased", own=0),
                                  estimators.reduce_mean(x, whole, "unbiased"))


def test_reduce_mean_ignores_whatever_masked_entries_hold():
    rng = np.random.default_rng(5)
    buf = rng.standard_normal((4, 30, 8)).astype(np.float32)
    mask = rng.random((4, 30)) < 0.7
    clean = np.where(mask[:, :, None], buf, 0)
    garbage = buf.copy()
    garbage[~mask] = np.nan
    for est in ("zero", "unbiased"):
        want = estimators.reduce_mean(clean, mask, est)
        kept = garbage.copy()
        np.testing.assert_allclose(estimators.reduce_mean(garbage, mask, est), want, rtol=1e-6)
        np.testing.assert_array_equal(garbage, kept)  # not scratch: the input is left alone
        np.testing.assert_allclose(estimators.reduce_mean(kept, mask, est, scratch=True), want, rtol=1e-6)
        into = np.full((32, 8), np.nan, np.float32)  # (stale contents, as the owner's y holds)
        got = estimators.reduce_mean(garbage.copy(), mask, est, scratch=True, out=into[1:31])
        assert got.base is into
        np.testing.assert_array_equal(into[1:31], estimators.reduce_mean(garbage, mask, est))  # bit for bit
        assert np.isnan(into[[0, 31]]).all()  # nothing written past it
    whole = np.ones_like(mask)  # every chunk in: unbiased is sum / W per chunk, bit for bit
    per_chunk = buf.sum(axis=0, dtype=np.float32) / np.full((30, 1), 4, np.float32)
    np.testing.assert_array_equal(estimators.reduce_mean(buf, whole, "unbiased"), per_chunk)
    with pytest.raises(ValueError):
        estimators.reduce_mean(buf, mask, "median")


def test_priorities_magnitude_and_position():
    rows = np.arange(14, dtype=np.float32)[:, None] * np.ones((1, 4), np.float32)
    p = estimators.chunk_priority(rows, "magnitude")
    assert p[-1] == 1 and p[0] == 7 and np.all(np.diff(p.astype(int)) <= 0)
    q = estimators.chunk_priority(rows, "position", 0, 14)
    assert q[0] == 1 and q[-1] == 7 and np.all(np.diff(q.astype(int)) >= 0)
    assert set(estimators.chunk_priority(rows, "none")) == {1}
    assert p.min() >= 1  # prio 0 is never given to data


def test_magnitude_priority_bands_and_ties():
    """Seven equal bands of the ranking by norm, largest first; equal norms rank in tensor order."""
    rows = np.random.default_rng(3).standard_normal((700, 8)).astype(np.float32)
    p = estimators.chunk_priority(rows, "magnitude")
    assert np.bincount(p, minlength=8).tolist() == [0] + [100] * 7
    norms = np.einsum("ij,ij->i", rows, rows)
    for c in range(1, 7):  # every chunk of a class outweighs every chunk of the next
        assert norms[p == c].min() >= norms[p == c + 1].max()
    same = estimators.chunk_priority(np.ones((14, 4), np.float32), "magnitude")
    assert same.tolist() == [1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7]
    few = estimators.chunk_priority(rows[:5], "magnitude")  # fewer chunks than classes: bands skip
    assert few[np.argsort(-norms[:5])].tolist() == [1, 2, 3, 5, 6]


def test_dblp_controller_switches_on_gradient_norm_change():
    c = Dblp(p_low=0.02, k=0.4, freq=2, eta=0.5)
    assert c.tol(0) == 0.02 and c.phase() == "critical"
    norms = {0: 10.0, 2: 9.0, 4: 8.5, 6: 2.0, 8: 1.9}
    tols = []
    for i in range(10):
        tols.append(c.tol(i))
        c.observe(i, np.full(4, norms.get(i, 123.0) / 2, np.float32))
    # 0: first measurement, stays critical; 2: -10 % -> relaxed; 6: -76 % -> critical; 8: relaxed
    assert tols == pytest.approx([0.02, 0.02, 0.02, 0.42, 0.42, 0.42, 0.42, 0.02, 0.02, 0.42])
    assert Static(0.1).tol(5) == 0.1 and Schedule(lambda i: i / 100).tol(7) == 0.07
    with pytest.raises(ValueError):
        Static(1.0)


def test_dblp_controller_by_step_measures_each_steps_whole_gradient():
    """After count_steps(), G is the norm over all of a step's rounds (DDP: one per bucket), taken
    every freq steps; tolerance changes only between steps."""
    c = Dblp(p_low=0.02, k=0.4, freq=2, eta=0.5)
    c.count_steps()
    norms = {0: 10.0, 2: 9.0, 4: 2.0}  # per step, split over two rounds of 3 and 4 values
    tols = []
    for step in range(6):
        g = norms.get(step, 50.0)
        for i, n in enumerate((3, 4)):
            tols.append(c.tol(2 * step + i))
            c.observe(2 * step + i, np.full(n, g / np.sqrt(7), np.float32))
        c.end_step()
    assert [(s, round(g, 4), crit) for s, g, crit in c.history] == [(0, 10.0, True), (2, 9.0, False), (4, 2.0, True)]
    assert tols == pytest.approx([0.02] * 6 + [0.42] * 4 + [0.02] * 2)
    with pytest.raises(RuntimeError):
        Dblp().end_step()
    with pytest.raises(ValueError):
        Dblp(k=-0.1)


def test_dblp_high_loss_relaxes_by_the_measured_loss_up_to_k():
    """high="loss": a relaxed round's bound is P_low plus the running share of DATA the network
    lost (echo by echo, negative spans included), capped at k; critical rounds keep P_low."""
    c = Dblp(p_low=0.02, k=0.3, high="loss")
    assert c.hears_loss and not Dblp().hears_loss and not Static().hears_loss
    c.critical = False
    assert c.tol(0) == 0.02 and c.loss() == 0.0  # no echo yet: nothing lost that it knows of
    c.observe_loss(100, 60)  # the first span sets the scale, as lossless (mostly still in flight)
    assert c.loss() == 0.0
    for _ in range(400):
        c.observe_loss(100, 12)
        c.observe_loss(100, 8)
    assert c.loss() == pytest.approx(0.10, abs=1e-3) and c.tol(1) == pytest.approx(0.12, abs=1e-3)
    c.critical = True
    assert c.tol(2) == 0.02
    c.critical = False
    for _ in range(400):  # in-flight packets counted lost at one echo arrive by the next
        c.observe_loss(100, 40)
        c.observe_loss(0, -40)
    assert c.loss() == pytest.approx(0.0, abs=0.01)
    for _ in range(400):
        c.observe_loss(50, 45)
    assert c.loss() == pytest.approx(0.3) and c.tol(3) == pytest.approx(0.32)  # at most k
    fixed = Dblp(p_low=0.02, k=0.3)
    fixed.critical = False
    fixed.observe_loss(100, 90)
    assert fixed.tol(0) == pytest.approx(0.32)
    d = Dblp(p_low=0.02, k=0.3, high="loss")
    d.load_state_dict(c.state_dict())
    assert d.tol(4) == c.tol(4) and d.loss() == c.loss()
    with pytest.raises(ValueError, match="high 'auto': use fixed or loss"):
        Dblp(high="auto")


def test_dblp_window_measures_the_mean_gradient_since_the_last_measurement():
    """g_over="window": G at a measured step is the norm of the mean, over the steps since the
    last measurement, of each step's vectors (two rounds a step here): noise that cancels
    across steps does not read as a change of regime, where the measured step alone would."""
    rng = np.random.default_rng(4)
    signal = [np.full(3, 1.0), np.full(4, 1.0)]
    steps = [[sig + rng.standard_normal(sig.size) * 0.1 for sig in signal] for s in range(9)]
    for s in (3, 4):  # a noisy measured step: alone it jumps, in its window the noise cancels
        steps[s] = [sig + (-1) ** s * np.full(sig.size, 3.0) for sig in signal]
    got = {}
    for g_over in ("step", "window"):
        c = Dblp(freq=4, g_over=g_over)
        c.count_steps()
        for vecs in steps:
            for i, v in enumerate(vecs):
                c.observe(0, v.astype(np.float32))
            c.end_step()
        got[g_over] = list(c.history)
    win = [np.concatenate(v) for v in steps]
    want = [np.linalg.norm(win[0]), np.linalg.norm(np.mean(win[1:5], axis=0)), np.linalg.norm(np.mean(win[5:9], axis=0))]
    assert [s for s, _, _ in got["window"]] == [0, 4, 8]
    assert [g for _, g, _ in got["window"]] == pytest.approx(want, rel=1e-5)
    assert [crit for _, _, crit in got["window"]] == [True, False, False]
    assert got["step"][1][2]  # the measured step alone: 4.0 against 1.0, critical
    c = Dblp(g_over="window")
    with pytest.raises(RuntimeError, match="count_steps"):
        c.observe(0, np.ones(3, np.float32))
    c.count_steps()
    for _ in range(2):  # (step 0 is measured and starts a new window)
        c.observe(0, np.ones(3, np.float32))
        c.end_step()
    with pytest.raises(ValueError, match="gave 5 values, earlier steps 3"):
        c.observe(0, np.ones(5, np.float32))
    with pytest.raises(ValueError, match="g_over 'epoch'"):
        Dblp(g_over="epoch")


@pytest.mark.parametrize("kind", ["sharded", "allreduce", "allreduce_into"])
def test_dblp_window_sums_each_row_with_itself(ranks, kind):
    """Shuffled rows, no consistent replicas (each rank measures the shard it owns, summed over
    ranks in end_step), g_over="window", no loss: each owner's estimate is summed over steps in
    the tensor's row order, whatever each round's shuffle, so every rank's G is the norm of the
    mean of the steps' exact mean gradients.  Over sharded updates (the estimate kept in the
    round's order, put back), allreduce rounds (the result, in order as the round ends) and
    allreduce rounds into the caller's array."""
    world, n = 3, 30_000
    rk = ranks(world, consistent=False, phase="dblp")
    for c in rk.cols:
        c.controller = c.protocol.controller = Dblp(freq=3, g_over="window")
    xs = inputs(world, n, rounds=4, seed=31)

    def job(r, c):
        if kind == "sharded":  # (it counts steps and ends each itself)
            return [c.sharded_update(xs[i][r], np.zeros(n, np.float32), _sgd(0.1)) for i in range(4)]
        c.controller.count_steps()
        for i in range(4):
            _allreduce(c, xs[i][r], kind == "allreduce_into")
            c.end_step()

    _, errs = rk.run(job)
    assert not errs
    means = [np.mean(np.float64(x), axis=0) for x in xs]
    for c in rk.cols:
        (s0, g0, _), (s3, g3, _) = c.controller.history
        assert (s0, s3) == (0, 3)
        assert g0 == pytest.approx(np.linalg.norm(means[0]), rel=1e-4)
        assert g3 == pytest.approx(np.linalg.norm(np.mean(means[1:4], axis=0)), rel=1e-4)


def test_dblp_tolerance_reaches_the_wire(ranks):
    rk = ranks(2, phase=Schedule(lambda i: [0.0, 0.4][i % 2]))
    xs = inputs(2, 5000, rounds=4)
    _, errs = rk.run(lambda r, c: [c.allreduce(xs[i][r]) for i in range(4)])
    assert not errs
    assert [round(r.tol, 3) for r in rk.cols[1].records] == [0.0, round(int(0.4 * 255) / 255, 3)] * 2


@pytest.mark.parametrize("slow_ranks,want", [((0,), 0.002), ((0, 1), 0.03)])
def test_probe_timeout_is_agreed_across_ranks(ranks, slow_ranks, want, monkeypatch):
    """Each STOP carries the sender's estimate; every rank uses the median of all ranks' estimates."""
    monkeypatch.setattr(Protocol, "_out_done", lambda self, o, now: setattr(o, "done", True))  # (no adapting)
    rk = ranks(3)
    for r, c in enumerate(rk.cols):
        c.cfg.probe_min, c.cfg.probe_max = 0.002, 0.03
        c.protocol.estimate = 0.03 if r in slow_ranks else 0.002
    xs = inputs(3, 20_000, rounds=3)
    _, errs = rk.run(lambda r, c: [c.allreduce(xs[i][r]) for i in range(3)])
    assert not errs
    for r, c in enumerate(rk.cols):
        assert c.protocol.timeouts == pytest.approx([0.03 if q in slow_ranks else 0.002 for q in range(3)])
        assert c.probe_timeout == pytest.approx(want)


@pytest.mark.parametrize("carried", [0, 0xFFFF])
def test_a_peers_estimate_is_taken_within_this_ranks_bounds(rank0, carried):
    """A STOP's estimate of 0 would make the median 0 (a probe at every timer); 6.5 s, probes
    as rare as ``probe_max`` allows only through the back-off's cap.  Both are held to the
    bounds this rank's own estimate keeps, and only a STOP that ends a live message sets it
    (a replayed old STOP is stray)."""
    h = wire.empty_batch(1)[0]
    h["kind"], h["job"], h["src"], h["dst"], h["round"] = wire.Kind.STOP, 1, 1, 0, rank0.st.round
    h["tensor"] = rank0.st.tensor
    pay = np.frombuffer(STOP_PAYLOAD.pack(carried, 0, 0), np.uint8)
    before = rank0.col.timeouts[1]
    old = h.copy()
    old["round"] = (rank0.st.round - 3) & 0xFFFFFFFF
    rank0.col.control(rank0.st, old.item(), pay, 100.0, current=False)  # ends no live message: ignored
    assert rank0.col.timeouts[1] == before
    rank0.col.control(rank0.st, h.item(), pay, 100.0, current=True)  # ends the reduce-scatter message
    assert rank0.st.outs[(False, 1)].done
    cfg = rank0.col.cfg
    assert rank0.col.timeouts[1] == (cfg.probe_min if carried == 0 else cfg.probe_max)
    assert cfg.probe_min <= rank0.col.probe_timeout <= cfg.probe_max


class Rank0:
    """Rank 0 of a 2-rank collective whose protocol state the test drives by hand (no peer runs).
    Rank 1's messages come in chunk order (``stagger`` False) unless ``stagger``: then rank 1's
    reduce-scatter message starts at chunk 50 of 100."""

    def __init__(self, tol=0.05, stagger=False):
        self.t = UdpTransport(port=0)
        self.col = Protocol(self.t, 0, 2, [("127.0.0.1", 1), ("127.0.0.1", 1)],
                            Config(phase=f"static:{tol}", stagger=stagger))
        self.st = self.col.start(np.zeros(200 * self.col.C, np.float32), 0, True)

    def data(self, chunks, now, ag=False):
        """DATA of rank 1's reduce-scatter message to rank 0 (chunks of shard 0, 100 rows), or with
        ``ag`` of its all-gather message (shard 1, 100 rows)."""
        st, n, width = self.st, 100, self.col.C * 4
        h = wire.empty_batch(len(chunks))
        h["kind"], h["job"], h["round"], h["src"], h["dst"] = wire.Kind.DATA, 1, st.round, 1, 0
        h["flags"] = wire.Flag.ALLGATHER if ag else 0
        h["chunk"], h["nchunks"], h["tol"], h["len"], h["dtype"] = chunks, n, st.tol8, width, wire.Dtype.F32
        self.col.process(st, h, np.zeros((len(chunks), width), np.uint8), np.full(len(chunks), width), now)

    def hello(self, number, now, ask=False, rnd=None, out=2500):
        """A HELLO from rank 1 (with ``ask``: flag ASK) for round ``rnd`` (default this round), ``out``
        ms out of rounds (0: an answer on behalf of a busy rank)."""
        h = wire.empty_batch(1)
        h["kind"], h["job"], h["src"], h["dst"], h["nchunks"] = wire.Kind.HELLO, 1, 1, 0, 1
        h["round"], h["tensor"] = self.st.round if rnd is None else rnd, self.st.tensor
        h["flags"], h["len"] = wire.Flag.ASK if ask else 0, wire.HELLO_PAYLOAD.size
        pay = np.zeros((1, self.col.C * 4), np.uint8)
        pay[0, : wire.HELLO_PAYLOAD.size] = np.frombuffer(wire.HELLO_PAYLOAD.pack(number, out), np.uint8)
        self.col.process(self.st, h, pay, np.array([wire.HELLO_PAYLOAD.size]), now)

    def sent(self):
        """Control packets queued since the last call, as (kind, dst, first chunk, bits)."""
        out = [(c.kind, c.dst, c.chunk, np.unpackbits(np.frombuffer(c.payload, np.uint8), bitorder="little"))
               for c in self.col.ctrl]
        self.col.ctrl.clear()
        return out

    def close(self):
        self.t.close()


@pytest.fixture
def rank0():
    r = Rank0()
    yield r
    r.close()


def test_a_hello_is_news_once_per_number_and_only_for_this_round(rank0):
    """A HELLO from rank 1 for this round refreshes it and marks it busy (between rounds); the same
    number again (a replay), a lower one, or one for an earlier round is no news (``stray``)."""
    st, c = rank0.st, rank0.col.counters
    rank0.hello(5, 100.0)
    assert c["hellos"] == 1 and st.heard[1] == 100.0 and st.hello == {1: 100.0}
    for number, rnd in ((5, None), (4, None), (6, (st.round - 1) & 0xFFFFFFFF)):
        rank0.hello(number, 101.0, rnd=rnd)
    assert c["hellos"] == 1 and c["stray"] == 3 and st.heard[1] == 100.0
    rank0.hello(6, 102.0)
    assert c["hellos"] == 2 and st.heard[1] == 102.0


def test_a_hello_in_the_batch_that_brings_the_peers_data_does_not_mark_it_busy(rank0):
    """A busy rank's last HELLO and its first DATA of the round can arrive in one receive batch
    (the data is handled first), or the HELLO later: the peer has joined, it is heard, not busy."""
    st, col, width = rank0.st, rank0.col, rank0.col.C * 4
    h = wire.empty_batch(2)
    h["job"], h["round"], h["src"], h["dst"], h["tensor"] = 1, st.round, 1, 0, st.tensor
    h["kind"] = [wire.Kind.HELLO, wire.Kind.DATA]
    h["nchunks"], h["tol"], h["dtype"] = [1, 100], [0, st.tol8], [0, wire.Dtype.F32]
    h["len"] = [wire.HELLO_PAYLOAD.size, width]
    pay = np.zeros((2, width), np.uint8)
    pay[0, : wire.HELLO_PAYLOAD.size] = np.frombuffer(wire.HELLO_PAYLOAD.pack(1, 2500), np.uint8)
    col.process(st, h, pay, h["len"].astype(np.int64), 100.0)
    assert col.counters["hellos"] == 1 and st.heard[1] == 100.0 and st.busy() == []
    rank0.hello(2, 100.5)  # (one sent before its data, reordered behind it: stale, not busy)
    assert col.counters["hellos"] == 2 and st.heard[1] == 100.5 and st.busy() == []


def test_a_hello_marks_a_peer_busy_only_before_its_data(rank0):
    """A HELLO from between rounds marks rank 1 busy while nothing of its data of this round
    came; one that arrives after some did (sent just before it joined, reordered) is stale."""
    st = rank0.st
    rank0.hello(1, 100.0)
    assert st.busy() == [1]
    rank0.data([0, 1], 100.1)
    assert st.busy() == []
    rank0.hello(2, 100.2)
    assert st.busy() == [] and st.heard[1] == 100.2


def test_an_answer_on_behalf_keeps_a_peer_alive_not_busy(rank0):
    """A HELLO with 0 ms out of rounds answers this rank's ask from a peer in the round that waits
    there for a busy one: it is heard (alive), not taken for busy (it is in the round: it neither
    earns the join_timeout wait nor makes this round watch others on its account)."""
    st = rank0.st
    rank0.hello(1, 100.0, out=0)
    assert rank0.col.counters["hellos"] == 1 and st.heard[1] == 100.0 and st.busy() == []
    rank0.hello(2, 100.1)
    assert st.busy() == [1]


def test_an_ask_is_answered_only_by_a_rank_waiting_for_a_busy_one(rank0):
    """A HELLO with ASK from a peer in this round is never news.  It is answered with a HELLO (not
    asking) only while this rank waits in the round for a rank busy between rounds (its latest
    news from it a HELLO): two ranks that wait only for each other must not keep each other alive."""
    rank0.hello(1, 100.0, ask=True)
    assert rank0.sent() == [] and rank0.col.counters["hellos"] == 0 and rank0.st.heard[1] == rank0.st.t0
    rank0.st.hello[1] = rank0.st.heard[1] = 100.0  # (rank 1's latest news a HELLO: busy)
    rank0.hello(2, 100.1, ask=True)
    (kind, dst, _, _), = rank0.sent()
    assert (kind, dst) == (wire.Kind.HELLO, 1) and not rank0.col.ctrl
    rank0.data([0], 100.2)  # rank 1 joined: its latest news is data, not a HELLO
    rank0.sent()  # (what the data made due)
    rank0.hello(3, 100.3, ask=True)
    assert rank0.sent() == []


@pytest.mark.parametrize("n", [1, 40], ids=["one-by-one", "batch"])
@pytest.mark.parametrize("native", [False, True])
def test_a_peer_ahead_is_heard_once_per_message_not_per_replay(native, n):
    """DATA of the next round from rank 1 (a peer ahead, alive) refreshes it once per message: the
    same packets again (a replay: a keyed job's tags verify on one) do not keep it alive; its next
    message does.  Whatever sorts the batch: one by one, numpy, or the compiled absorb's rest."""
    from pydblp.collective import matcher

    if native and matcher.native_lib() is None:
        require_native("matcher")
    r = Rank0()
    try:
        r.col.matcher = matcher.Matcher(0, 2, 1, r.col.cfg.chunk_bytes, False, r.col.counters, native=native)
        st, width = r.st, r.col.C * 4

        def ahead(rnd, now):
            h = wire.empty_batch(n)
            h["kind"], h["job"], h["round"], h["src"], h["dst"] = wire.Kind.DATA, 1, rnd, 1, 0
            h["chunk"], h["nchunks"], h["tol"], h["len"], h["dtype"] = np.arange(n), 100, st.tol8, width, wire.Dtype.F32
            r.col.process(st, h, np.zeros((n, width), np.uint8), np.full(n, width), now)

        ahead(st.round + 1, 100.0)
        assert st.heard[1] == 100.0 and r.col.counters["stashed"] == n
        ahead(st.round + 1, 101.0)
        assert st.heard[1] == 100.0 and r.col.counters["stashed"] == 2 * n  # (kept: not the heard's concern)
        ahead(st.round + 2, 102.0)
        assert st.heard[1] == 102.0
    finally:
        r.close()


@pytest.mark.parametrize("native", [False, True])
def test_a_staggered_message_is_counted_from_its_first_chunk(native):
    """Rank 1 starts at chunk 50: its chunks 50..99 then 0..29 arrived (80 sent in its order),
    so the receiver counts hi 80, not 100, and waits for 20 more before it NACKs; a gap inside
    what was sent (40..44 of the wrap-around) is out of reach as in chunk order."""
    from pydblp.collective import matcher

    if native and matcher.native_lib() is None:
        require_native("matcher")
    r = Rank0(stagger=True)
    try:
        r.col.matcher = matcher.Matcher(0, 2, 1, r.col.cfg.chunk_bytes, False, r.col.counters, native=native,
                                        stagger=True)
        r.data([*range(50, 100), *range(0, 30)], 100.0)
        inn = r.st.ins[(False, 1)]
        assert (inn.count, inn.hi, inn.need) == (80, 80, 96)
        r.col.nacks(r.st, 100.01)
        assert r.sent() == []  # the 20 not sent yet can still make the bound
        r.data([*range(30, 40), *range(45, 50)], 100.011)
        assert (inn.count, inn.hi) == (95, 100)
        r.col.nacks(r.st, 100.02)
        (kind, dst, first, bits), = r.sent()
        assert (kind, dst, first) == (wire.Kind.BITMAP, 1, 0)
        np.testing.assert_array_equal(np.flatnonzero(~bits[:100].astype(bool)), [40, 41, 42, 43, 44])
    finally:
        r.close()


def test_receiver_nacks_once_the_bound_is_out_of_reach(rank0):
    """Chunks 0..99 of 100, 40 lost in the middle: after 2 ms of silence the receiver sends an
    unsolicited BITMAP of what arrived; it backs off (4 ms) while nothing new comes."""
    lost = set(range(30, 70))
    t = 100.0
    rank0.data([c for c in range(100) if c not in lost], t)
    inn = rank0.st.ins[(False, 1)]
    assert (inn.count, inn.hi, inn.need) == (60, 100, 96)
    rank0.col.nacks(rank0.st, t + 0.001)
    assert rank0.sent() == []  # not quiet long enough
    rank0.col.nacks(rank0.st, t + 0.0025)
    (kind, dst, first, bits), = rank0.sent()
    assert (kind, dst, first) == (wire.Kind.BITMAP, 1, 0)
    np.testing.assert_array_equal(bits[:100].astype(bool), [c not in lost for c in range(100)])
    rank0.col.nacks(rank0.st, t + 0.005)
    assert rank0.sent() == []  # 4 ms after the first NACK, not 2
    rank0.col.nacks(rank0.st, t + 0.007)
    assert len(rank0.sent()) == 1 and rank0.st.nacks == 2


def test_nack_backs_off_its_interval_not_the_silence(rank0):
    """After a NACK whose repair comes back thin (a burst still eating it), the next one needs
    2 ms of silence since the last trickle and 4 ms since the last NACK, not 4 ms of silence;
    the ones after it 4 ms too (not 8)."""
    lost = set(range(30, 70))
    t = 100.0
    rank0.data([c for c in range(100) if c not in lost], t)
    rank0.col.nacks(rank0.st, t + 0.0025)
    assert len(rank0.sent()) == 1
    rank0.data([30, 31], t + 0.005)  # 2 of the 40 asked for
    rank0.col.nacks(rank0.st, t + 0.0065)
    assert rank0.sent() == []  # 1.5 ms of silence
    rank0.col.nacks(rank0.st, t + 0.0071)
    (kind, dst, first, bits), = rank0.sent()  # 2.1 ms of silence, 4.6 ms since the last NACK
    assert kind == wire.Kind.BITMAP and bits[30] and bits[31] and not bits[32]
    rank0.col.nacks(rank0.st, t + 0.0110)
    assert rank0.sent() == []  # 3.9 ms since the last NACK
    rank0.col.nacks(rank0.st, t + 0.0112)
    assert len(rank0.sent()) == 1  # 4.1 ms: the interval stays at 2x, it does not grow to 4x


def test_an_owner_holds_back_half_its_allgather_in_a_round_that_repairs(rank0):
    """Once a round has repaired loss (a NACK went out), an owner's all-gather goes half at its
    reduce and the rest AG_SPLIT later, so a retransmission asked for meanwhile is not queued
    behind the whole message; without loss it goes at once."""
    t = time.monotonic()
    rank0.data([c for c in range(100) if not 30 <= c < 70], t - 0.01)
    rank0.col.nacks(rank0.st, t)
    assert rank0.st.repair
    rank0.data(list(range(30, 70)), t)
    rank0.col.reduce(rank0.st)
    o = rank0.st.outs[(True, 1)]
    assert o.n == 100
    rank0.col.send_some(rank0.st, time.monotonic())
    assert o.sent == 50 and rank0.col.tx_wait > 0
    rank0.col.send_some(rank0.st, time.monotonic() + config.AG_SPLIT)
    assert o.sent == 100


def test_an_owner_whose_own_messages_are_done_sends_its_whole_allgather(rank0):
    """The split is for retransmissions this owner may still be asked for: once every
    reduce-scatter message it sent is done (the last owner to reduce), its all-gather goes at once
    even in a round that repairs."""
    t = time.monotonic()
    rank0.data([c for c in range(100) if not 30 <= c < 70], t - 0.01)
    rank0.col.nacks(rank0.st, t)
    assert rank0.st.repair
    rank0.data(list(range(30, 70)), t)
    rank0.st.outs[(False, 1)].done = True  # rank 1 has reduced (its STOP or all-gather came)
    rank0.col.reduce(rank0.st)
    rank0.col.send_some(rank0.st, time.monotonic())
    assert rank0.st.outs[(True, 1)].sent == 100


def test_an_owner_sends_its_whole_allgather_in_a_clean_round(rank0):
    rank0.data(list(range(100)), time.monotonic())
    rank0.col.reduce(rank0.st)
    rank0.col.send_some(rank0.st, time.monotonic())
    assert rank0.st.outs[(True, 1)].sent == 100


def test_a_probe_for_a_round_finished_before_the_last_one_gets_a_stop(rank0):
    """A sender whose STOPs were all lost may probe for a round this rank finished two or more
    rounds ago (its record of it is gone): such a round is done, so it gets a STOP.  A probe for
    the last round names a message that round's record does not hold (none here), and one for a
    round not reached yet: nothing."""
    h = wire.empty_batch(1)[0]
    h["kind"], h["job"], h["src"], h["dst"], h["nchunks"], h["tol"] = wire.Kind.PROBE, 1, 1, 0, 77, 12
    for rnd, answered in ((rank0.st.round - 2, True), (rank0.st.round - 5, True), (rank0.st.round - 1, False),
                          (rank0.st.round + 3, False)):
        h["round"] = rnd & 0xFFFFFFFF
        rank0.col.control(rank0.st, h.item(), np.zeros(0, np.uint8), 100.0, current=False)
        got = rank0.sent()
        assert [k for k, *_ in got] == ([wire.Kind.STOP] if answered else []), rnd
    # the STOP carries the probe's chunk count and tolerance
    h["round"] = (rank0.st.round - 2) & 0xFFFFFFFF
    rank0.col.control(rank0.st, h.item(), np.zeros(0, np.uint8), 100.0, current=False)
    assert {(c.kind, c.nchunks, c.tol8) for c in rank0.col.ctrl} == {(wire.Kind.STOP, 77, 12)}


def test_chunks_already_received_count_past_the_bound():
    """A message is done at its bound, but chunks already in the socket when the owner reduces
    still count: rank 1's chunks 60..99 (the bound was reached at 60 of 100, tol 0.5) are queued;
    the round (ending at its deadline: rank 1 is not there to all-gather) reduces with them."""
    r = Rank0(tol=0.5)
    try:
        st, inn = r.st, r.st.ins[(False, 1)]
        r.data(list(range(60)), time.monotonic())  # payload zeros
        assert inn.done and inn.count == 60
        C, n = r.col.C, 40
        h = wire.empty_batch(n)
        h["kind"], h["job"], h["round"], h["src"], h["dst"] = wire.Kind.DATA, 1, st.round, 1, 0
        h["chunk"], h["nchunks"], h["tol"], h["len"], h["dtype"] = np.arange(60, 100), 100, st.tol8, C * 4, wire.Dtype.F32
        vals = np.arange(n * C, dtype=np.float32).reshape(n, C) + 1
        with UdpTransport(port=0) as tx:
            peer = tx.add_peer("127.0.0.1", r.t.port)
            assert tx.send(Batch(h, vals.view(np.uint8), np.full(n, C * 4, np.int32), np.full(n, peer, np.int32), n)) == n
        r.col.cfg.deadline = 0.05
        r.col.run(st)
        assert inn.count == 100
        np.testing.assert_array_equal(st.y[60:100], vals / 2)  # (rank 0's zeros + rank 1's) / 2 arrived
        np.testing.assert_array_equal(st.y[:60], 0)
    finally:
        r.close()


def test_a_receive_lingers_only_for_data_on_its_way(rank0):
    """A receive may wait for the rest of a stream that flows, not for an all-gather that has not
    begun (its owner is still reducing) nor for a stream silent past NACK_QUIET (stalled)."""
    t = 100.0
    rank0.data(list(range(60)), t)
    inn = rank0.st.ins[(False, 1)]
    assert (True, 1) in rank0.st.ins and rank0.st.ins[(True, 1)].count == 0
    assert rank0.st.expected(t + 0.001) == inn.need - 60  # 36: the all-gather is not counted
    assert rank0.st.expected(t + 0.0025) == 1


def test_a_receive_before_the_reduce_lingers_for_the_reduce_scatter_only(rank0):
    """Until the owner has reduced, all-gather data flowing in does not make a receive wait: only
    what its reduce waits for does; after the reduce, only the all-gather counts."""
    t = 100.0
    rank0.data(list(range(60)), t)
    rank0.data(list(range(50)), t, ag=True)  # rank 1 reduced first: its all-gather flows
    rs, ag = rank0.st.ins[(False, 1)], rank0.st.ins[(True, 1)]
    assert ag.count == 50 and not rank0.st.reduced
    assert rank0.st.expected(t + 0.001) == rs.need - 60  # 36, not 36 + 46
    rank0.data(list(range(60, 100)), t + 0.001)
    rank0.col.reduce(rank0.st)
    assert rank0.st.expected(t + 0.0015) == ag.need - 50  # 46: the all-gather now


def test_a_nacked_message_nacks_its_lost_tail_too(rank0):
    """Chunks 30..69 and the tail 90..99 lost: one NACK; its repair brings 30..69 back and the
    tail stays lost.  Chunks not seen (90..99) would then still make the bound (90 + 10 >= 96),
    but the sender was asked for everything it sent, so after the silence the receiver asks
    again (before, it waited for the sender's probe timeout)."""
    t = 100.0
    rank0.data([c for c in range(90) if not 30 <= c < 70], t)
    rank0.col.nacks(rank0.st, t + 0.0025)
    assert len(rank0.sent()) == 1
    rank0.data(list(range(30, 70)), t + 0.004)
    inn = rank0.st.ins[(False, 1)]
    assert (inn.count, inn.hi, inn.need) == (90, 90, 96)
    rank0.col.nacks(rank0.st, t + 0.0055)
    assert rank0.sent() == []  # 1.5 ms of silence
    rank0.col.nacks(rank0.st, t + 0.0065)
    (kind, dst, first, bits), = rank0.sent()
    assert kind == wire.Kind.BITMAP
    np.testing.assert_array_equal(bits[:100].astype(bool), np.arange(100) < 90)


def test_receiver_never_nacks_loss_within_the_bound(rank0):
    """A sender half-way through its message (chunks 0..49 seen, 2 of them lost, 50..99 still
    coming) leaves the bound within reach: no NACK however long it stays silent."""
    t = 100.0
    rank0.data([c for c in range(50) if c not in (3, 4)], t)
    rank0.col.nacks(rank0.st, t + 1.0)
    assert rank0.sent() == []
    rank0.data([c for c in range(50, 100) if c not in (70, 71)], t + 2.0)  # 4 lost: the bound allows 4
    rank0.col.nacks(rank0.st, t + 3.0)
    assert [k for k, *_ in rank0.sent()] == [wire.Kind.STOP] and rank0.st.nacks == 0


def test_all_gather_data_ends_the_senders_reduce_scatter_message(rank0):
    """An owner's all-gather data ends the sender's reduce-scatter message to it (the owner has
    reduced: it needs nothing more), without its STOP, and that message is never probed."""
    o = rank0.st.outs[(False, 1)]
    o.sent, o.t_sent_all, o.t_last = o.n, 100.0, 100.0
    rank0.data([0], 100.001, ag=True)
    assert o.done
    rank0.col.timers(rank0.st, 101.0)
    assert [k for k, *_ in rank0.sent()] == []


def test_sender_retransmits_only_what_has_gone_out(rank0):
    """A BITMAP can arrive while the sender is still sending (an unsolicited one): chunks not yet
    sent are never queued for retransmission; an answer resets the probe backoff."""
    o = rank0.st.outs[(False, 1)]
    assert o.n == 100
    o.sent, o.timeouts = 30, 3
    h = wire.empty_batch(1)[0]
    h["kind"], h["job"], h["round"], h["src"], h["dst"], h["chunk"] = wire.Kind.BITMAP, 1, rank0.st.round, 1, 0, 0
    bits = np.zeros(104, bool)
    bits[:10] = True  # chunks 0..9 arrived, 10..99 did not
    rank0.col.control(rank0.st, h.item(), np.packbits(bits, bitorder="little"), 100.0, current=True)
    assert np.flatnonzero(o.retx).tolist() == list(range(10, 30))
    assert o.nretx == 20 and o.timeouts == 0 and not o.done


@pytest.fixture
def rank0_exact():
    r = Rank0(tol=0.0)  # every chunk needed: no BITMAP here ends a message
    yield r
    r.close()


def test_sender_resends_what_is_lost_not_what_is_on_its_way(rank0_exact, monkeypatch):
    """A BITMAP that crosses a repair on its way (a long one queued at line rate, or a probe's
    answer) must not queue it again: a missing chunk counts as lost once one sent after it has
    arrived (one path, in order) or once it went 1.5 round trips ago; chunks a BITMAP shows in
    leave the queue.  Before this, ~40 % of the retransmissions of 8 and 32 MiB burst rounds
    arrived as duplicates."""
    monkeypatch.setattr(rank0_exact.t, "send", lambda batch, timeout=1.0: len(batch))
    o = rank0_exact.st.outs[(False, 1)]
    o.sent, o.t_sent_all = 100, 100.0
    h = wire.empty_batch(1)[0]
    h["kind"], h["job"], h["round"], h["src"], h["dst"], h["chunk"] = wire.Kind.BITMAP, 1, rank0_exact.st.round, 1, 0, 0

    def bitmap(have, t):
        bits = np.zeros(104, bool)
        bits[list(have)] = True
        rank0_exact.col.control(rank0_exact.st, h.item(), np.packbits(bits, bitorder="little"), t, current=True)
        return np.flatnonzero(o.retx).tolist()

    every = set(range(100))
    assert bitmap(every - set(range(10, 30)), 100.010) == list(range(10, 30))  # no round trip known: all
    rank0_exact.col.send_some(rank0_exact.st, 100.011)  # 10..29 resent, numbers 100..119
    assert o.nretx == 0 and o.seq[10:30].tolist() == list(range(100, 120))
    # 10..19 are in, 4 ms after they went: 20..29, sent after 19, may still be on their way
    assert bitmap(every - set(range(20, 30)), 100.015) == [] and o.rtt == pytest.approx(0.004)
    # 25..29 are in too: 20..24, sent before them, are lost
    assert bitmap(every - set(range(20, 25)), 100.016) == [20, 21, 22, 23, 24]
    assert bitmap(every - {23, 24}, 100.0162) == [23, 24]  # shown in: out of the queue before they go
    assert o.rtt == pytest.approx(0.0052)  # 20..22 went at 100.011
    rank0_exact.col.send_some(rank0_exact.st, 100.017)
    assert bitmap(every - {23, 24}, 100.024) == []  # 7 ms after they went: on their way
    assert bitmap(every - {23, 24}, 100.0252) == [23, 24]  # 8.2 ms (> 1.5 x 5.2): lost


def test_sender_waits_the_probe_timeout_for_chunks_on_their_way_before_a_round_trip(rank0_exact, monkeypatch):
    """Before any round trip is measured, a missing chunk sent after the highest one that arrived
    may still sit in this rank's pacer or on the wire (a receiver NACKs after 2 ms of silence,
    e.g. while the sender was descheduled): it is queued only once it went the probe timeout
    ago.  Chunks sent before one that arrived are lost at once.  Before this, every missing
    chunk was resent: 25-30 % of the first sends at 2 % loss on the testbed."""
    o = rank0_exact.st.outs[(False, 1)]
    o.sent, o.t_sent_all = 100, 100.0
    assert rank0_exact.col.probe_timeout == pytest.approx(0.005)
    h = wire.empty_batch(1)[0]
    h["kind"], h["job"], h["round"], h["src"], h["dst"], h["chunk"] = wire.Kind.BITMAP, 1, rank0_exact.st.round, 1, 0, 0
    bits = np.zeros(104, bool)
    bits[:50] = True
    bits[10:20] = False  # 10..19 lost; 50..99 not seen yet

    def bitmap(t):
        rank0_exact.col.control(rank0_exact.st, h.item(), np.packbits(bits, bitorder="little"), t, current=True)
        return np.flatnonzero(o.retx).tolist()

    assert bitmap(100.002) == list(range(10, 20))  # 50..99 went 2 ms ago: on their way
    assert bitmap(100.006) == list(range(10, 20)) + list(range(50, 100))  # 6 ms > 5 ms: lost


def test_sender_hands_a_pacing_transport_about_txq_limit_a_turn(rank0, monkeypatch):
    """A pacing transport gets about TXQ_LIMIT of data a turn, not a whole Config.burst: what a
    packet adds to its backlog is learnt from the first batch.  Before this a turn could queue
    58 ms at 200 Mbit/s, and every other peer heard nothing meanwhile (NACK storms)."""
    sent, backlog = [], [0.0]
    per_packet = 1e-4  # 0.1 ms a packet: TXQ_LIMIT (2 ms) is 20 packets

    def send(batch, timeout=1.0):
        sent.append(len(batch))
        backlog[0] += len(batch) * per_packet
        return len(batch)
    monkeypatch.setattr(rank0.t, "send", send)
    monkeypatch.setattr(rank0.t, "tx_backlog", lambda: backlog[0])
    o = rank0.st.outs[(False, 1)]
    o.avail = 40
    rank0.col.send_some(rank0.st, 100.0)
    assert sent == [40] and rank0.col.pkt_s == pytest.approx(per_packet)
    backlog[0], o.avail = 0.0, o.n  # drained
    rank0.col.send_some(rank0.st, 100.01)
    assert sent == [40, 20] and o.sent == 60


def test_sender_keeps_a_pacing_transports_queue_short(rank0, monkeypatch):
    """A transport that paces itself (tx_backlog > 0) gets no more data while it holds more than
    TXQ_LIMIT, so a STOP queued next waits at most that long; once it drains, sending resumes."""
    sent = []
    monkeypatch.setattr(rank0.t, "send", lambda batch, timeout=1.0: sent.append(len(batch)) or len(batch))
    o = rank0.st.outs[(False, 1)]
    monkeypatch.setattr(rank0.t, "tx_backlog", lambda: config.TXQ_LIMIT + 0.004)
    assert rank0.col.send_some(rank0.st, 100.0) is False
    assert sent == [] and o.sent == 0
    assert rank0.col.tx_wait == pytest.approx(0.002)  # capped: the loop still wakes up for packets
    monkeypatch.setattr(rank0.t, "tx_backlog", lambda: config.TXQ_LIMIT / 2)
    rank0.col.send_some(rank0.st, 100.0)
    assert sent == [100] and o.sent == 100 and rank0.col.tx_wait is None


def test_a_paced_destination_is_sent_quanta_and_the_sender_sleeps_between(rank0, monkeypatch):
    """Congestion control's rate: a paced destination gets nothing until its tokens cover a
    quantum (``cc.WAIT_FRAMES``, or what its message has left), and the sender meanwhile sleeps
    a whole millisecond (the transports' poll(2) counts them: a shorter wait would not sleep).
    Before, whatever the tokens covered went at once: a paced sender sent 2-3 frames every
    ~70 µs, spinning its CPU (a 7-sender incast used 1.55x cc=off's CPU)."""
    from pydblp.collective import cc as ccmod

    sent = []
    monkeypatch.setattr(rank0.t, "send", lambda batch, timeout=1.0: sent.append(len(batch)) or len(batch))
    cc, o = rank0.col.cc, rank0.st.outs[(False, 1)]
    frame_s = cc.frame * 8 / 100e6  # a frame's time at the rate
    cc.rate[1], cc.tokens[1], cc.t_tok[1] = 100e6, 3 * cc.frame, 100.0  # covers 3 frames
    assert rank0.col.send_some(rank0.st, 100.0) is False
    assert sent == [] and o.sent == 0
    assert rank0.col.tx_wait == 0.001 and (ccmod.WAIT_FRAMES - 3) * frame_s < 0.001
    rank0.col.send_some(rank0.st, 100.001)  # a millisecond's tokens more: a quantum or more
    assert len(sent) == 1 and sent[0] == o.sent >= ccmod.WAIT_FRAMES
    assert o.sent == int(3 + 0.001 / frame_s)  # all the tokens covered, no more
    o.sent = o.n - 2  # the message's last 2 frames: a quantum of 2
    cc.tokens[1], cc.t_tok[1] = 2 * cc.frame, 100.002
    rank0.col.send_some(rank0.st, 100.002)
    assert sent[-1] == 2 and o.sent == o.n
    o.sent, cc.tokens[1], cc.t_tok[1] = 0, 3 * cc.frame, 100.003  # a transport that sleeps exactly (the
    monkeypatch.setattr(rank0.t, "timeout_unit", 0.0, raising=False)  # simulator's) is not rounded
    rank0.col.send_some(rank0.st, 100.003)
    assert rank0.col.tx_wait == pytest.approx((ccmod.WAIT_FRAMES - 3) * frame_s + ccmod.WAIT_MARGIN)


def test_a_round_that_repairs_keeps_the_kernel_queue_short(rank0, monkeypatch):
    """In a round that repairs (a NACK or BITMAP seen), no data goes while the kernel's send queue
    holds more than TXQ_REPAIR (a retransmission asked for next would wait behind it); in a clean
    round the queue is not looked at (nothing waits behind it, and each look costs a loop turn)."""
    sent, queued = [], [config.TXQ_REPAIR + 1]
    monkeypatch.setattr(rank0.t, "send", lambda batch, timeout=1.0: sent.append(len(batch)) or len(batch))
    monkeypatch.setattr(rank0.t, "tx_queued", lambda: queued[0])
    o = rank0.st.outs[(False, 1)]
    o.avail = 40
    rank0.col.send_some(rank0.st, 100.0)
    assert sent == [40] and not rank0.st.repair  # clean: the queue does not matter
    o.avail = o.n
    rank0.st.repair = True
    assert rank0.col.send_some(rank0.st, 100.0) is False
    assert sent == [40] and o.sent == 40 and rank0.col.tx_wait == pytest.approx(0.001)
    queued[0] = config.TXQ_REPAIR // 2
    rank0.col.send_some(rank0.st, 100.0)
    assert sent == [40, 60] and o.sent == 100 and rank0.col.tx_wait is None


def test_a_turn_grows_where_the_path_keeps_up(monkeypatch):
    """A turn sends ``burst`` packets over its messages.  Soon after a full turn the protocol looks
    at the kernel's send queue once.  Empty at two looks in a row (no link limit: loopback,
    veths, a NIC faster than the CPU): later turns send up to a burst to each of up to
    TURN_DESTS destinations (fewer turns, each with its Python and numpy cost).  Holding data at
    one look (a link limit): one burst in all again, so STOPs and repairs never wait behind
    more.  A look long after the turn tells nothing (a link may have drained it by then) and
    changes nothing."""
    t = UdpTransport(port=0)
    try:
        now = [100.0]
        col = Protocol(t, 0, 4, [("127.0.0.1", 1)] * 4, Config(phase="static:0.05", burst=30),
                       clock=lambda: now[0])
        st = col.start(np.zeros(4000 * col.C, np.float32), 0, True)  # 3 messages of 1000 chunks
        sent, queued = [], [0]
        monkeypatch.setattr(t, "send", lambda batch, timeout=1.0: sent.append(len(batch)) or len(batch))
        monkeypatch.setattr(t, "tx_queued", lambda: queued[0])

        def turn(dt, q=None):
            now[0] += dt
            if q is not None:
                queued[0] = q
            col.send_some(st, now[0])
            return sent[-1]

        assert config.DRAINED_LOOKS == 2
        assert turn(0.0) == 30  # nothing learnt yet: one burst
        assert turn(0.001) == 30 and not col.keeps_up  # the full turn left at once: once is not enough
        assert turn(0.001) == 90 and col.keeps_up  # twice in a row: a burst to each of 3
        assert turn(0.001, config.TXQ_DRAINED + 1) == 30 and not col.keeps_up  # the link holds it
        assert turn(0.01, 0) == 30  # 10 ms after the turn: an empty queue says nothing about the link
        assert turn(0.001) == 30 and turn(0.001) == 90  # soon after full turns, empty twice again
        monkeypatch.setattr(t, "reports_tx_queue", False, raising=False)  # AF_XDP transmit: its 0 is
        assert turn(0.001) == 30 and turn(0.001) == 30  # "cannot tell", and its turns never grow
        monkeypatch.setattr(t, "reports_tx_queue", True, raising=False)
        col.pkt_s = 1e-5  # a pacing transport: its backlog sizes the turn, never the kernel's queue
        assert turn(0.001) == 30
    finally:
        t.close()


def test_nack_backoff_holds_while_a_burst_eats_the_repair(rank0):
    """After a NACK, a repair that brings less than half of the missing chunks (a burst is still
    on) keeps the backoff (next NACK after 4 ms of quiet, not 2); one that brings most resets it."""
    t = 100.0
    lost = list(range(20, 60))
    rank0.data([c for c in range(100) if c not in lost], t)
    rank0.col.nacks(rank0.st, t + 0.0025)
    assert len(rank0.sent()) == 1  # first NACK: 40 missing
    t2 = t + 0.003
    rank0.data(lost[:10], t2)  # 10 of 40 got through
    rank0.col.nacks(rank0.st, t2 + 0.0025)
    assert rank0.sent() == []  # still backing off: 2.5 ms < 4 ms
    rank0.col.nacks(rank0.st, t2 + 0.0041)
    assert len(rank0.sent()) == 1  # second NACK: 30 missing
    t3 = t2 + 0.005
    rank0.data(lost[10:35], t3)  # 25 of 30: the repair got through, but 5 still missing > bound (4)
    assert rank0.st.ins[(False, 1)].nacks == 0
    rank0.col.nacks(rank0.st, t3 + 0.0025)
    assert len(rank0.sent()) == 1  # back to the 2 ms quiet


@pytest.mark.parametrize("args,cfg,says", [
    ((0, 2), {"mode": "ring"}, "mode 'ring'"), ((0, 2), {"estimator": "median"}, "estimator 'median'"),
    ((0, 2), {"fill": "zero"}, "fill 'zero'"), ((0, 2), {"priority": "size"}, "priority 'size'"),
    ((0, 2), {"chunk_bytes": 3}, "chunk_bytes 3"), ((0, 2), {"job": 0}, "job 0"),
    ((0, 2), {"peer_timeout": 0}, "peer_timeout 0"), ((0, 2), {"deadline": -1}, "deadline -1"),
    ((0, 2), {"join_timeout": float("inf")}, "join_timeout inf"), ((0, 2), {"join_timeout": 0}, "join_timeout 0"),
    ((0, 2), {"probe_min": 0.01, "probe_max": 0.005}, "probe_max 0.005"), ((0, 2), {"burst": 0}, "burst 0"),
    ((0, 2), {"spread": -1}, "spread -1"), ((0, 2), {"spread": True}, "spread True"),
    ((2, 2), {}, "rank 2: use 0..1"), ((-1, 2), {}, "rank -1"), ((0, 0), {}, "world 0"),
    ((0, 3), {}, "2 peers for world 3"), ((0, 2), {"phase": "static:1.5"}, "tolerance 1.5"),
    ((0, 2), {"allgather": "multicast"}, "allgather 'multicast'"),
    ((0, 2), {"allgather": "broadcast"}, "allgather 'broadcast' needs group="),
    ((0, 2), {"phase": Dblp(g_over="window"), "allgather_bound": True}, "use g_over 'step' or fill 'carry'"),
    ((0, 2), {"phase": Dblp(high="loss"), "allgather_bound": True}, "gives each rank its own bound")])
def test_config_refusals_name_the_knob_and_register_nothing(args, cfg, says):
    """Each bad knob gets its own ValueError naming it, before any peer is added to the transport."""
    t = UdpTransport(port=0)
    try:
        with pytest.raises(ValueError, match=says.replace(".", r"\.")):
            Collective(t, *args, [("127.0.0.1", 9), ("127.0.0.1", 9)], Config(**cfg))
        assert t.add_peer("127.0.0.1", 9) == 0  # the first peer: the refusal registered none
    finally:
        t.close()


def test_a_group_without_a_broadcast_allgather_is_refused():
    t = UdpTransport(port=0)
    try:
        with pytest.raises(ValueError, match="group is used only with Config.allgather='broadcast'."):
            Collective(t, 0, 2, [("127.0.0.1", 9), ("127.0.0.1", 9)], group=("127.255.255.255", 9))
        assert t.add_peer("127.0.0.1", 9) == 0  # the first peer: the refusal registered none
    finally:
        t.close()


def test_a_closed_transport_is_refused_before_anything_starts():
    """A collective over a transport already closed fails at once with a clear error, before its
    idle responder starts (it would die on the closed descriptor)."""
    t = UdpTransport(port=0)
    t.close()
    threads = threading.active_count()
    with pytest.raises(ValueError, match="transport is closed"):
        Collective(t, 0, 2, [("127.0.0.1", 9), ("127.0.0.1", 9)])
    assert threading.active_count() == threads


def _responder(rank: int) -> threading.Thread:
    """The idle responder of rank ``rank`` of the one collective alive (``pydblp-idle-<rank>``)."""
    (t,) = [t for t in threading.enumerate() if t.name == f"pydblp-idle-{rank}"]
    return t


def _switches(thread: threading.Thread) -> int:
    """Voluntary context switches of ``thread`` so far (each sleep that ended: a wake-up)."""
    with open(f"/proc/self/task/{thread.native_id}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))


def test_the_idle_responder_sleeps_while_nothing_arrives(ranks):
    """Between rounds with no traffic the idle responder is woken by nothing (the one that
    polled the transport in 1 ms slices, after a 200 us spin, woke 214-246 times in 0.2 s)."""
    rk = ranks(2)
    xs = inputs(2, 5000)
    _, errs = rk.run(lambda r, c: c.allreduce(xs[0][r]))
    assert not errs
    # until the last STOPs are in and served (on a loaded machine they may take a while): then
    # the responders sleep; one that polls never settles and fails below, after 5 s
    for r in range(2):
        settled(lambda: _switches(_responder(r)), quiet=0.1, timeout=5.0)
    before = [_switches(_responder(r)) for r in range(2)]
    time.sleep(0.2)
    woke = [_switches(_responder(r)) - b for r, b in enumerate(before)]
    # a stray wake-up or two (a late duplicate, the GIL) is not the polling, which wakes ~200 times
    assert max(woke) <= 3, woke


def test_a_round_after_a_pause_never_waits_for_the_idle_responder(ranks):
    """While the responder serves an idle transport it holds the transport's lock only to take
    packets that came, never while it waits for them: a round that begins finds it free."""
    rk = ranks(2)
    xs = inputs(2, 5000, rounds=2)
    _, errs = rk.run(lambda r, c: c.allreduce(xs[0][r]))
    assert not errs
    time.sleep(0.02)  # past IDLE_GRACE: the responder serves the transport
    col = rk.cols[0]
    for _ in range(50):
        assert col._poll_lock.acquire(blocking=False)
        col._poll_lock.release()
        time.sleep(0.001)
    res, errs = rk.run(lambda r, c: c.allreduce(xs[1][r]))
    assert not errs
    np.testing.assert_allclose(res[0], (xs[1][0] + xs[1][1]) / 2, rtol=1e-6)


def test_back_to_back_rounds_leave_the_idle_responder_asleep(ranks, monkeypatch):
    """A round sets the responder's alarm as it ends and clears it as the next begins: rounds
    that follow each other within IDLE_GRACE never wake it (the responder woken by events woke
    two to five times a round).  The grace is 0.5 s here, not 2 ms: two ranks share one
    interpreter, and on a loaded machine a rank waiting for the GIL (5 ms slices) is held past
    2 ms between rounds often enough to wake it (14 of 40 rounds in one CI run)."""
    from pydblp.collective import engine

    monkeypatch.setattr(engine, "IDLE_GRACE", 0.5)
    rk = ranks(2)
    rounds = 40
    xs = inputs(2, 20_000, rounds=rounds)
    _, errs = rk.run(lambda r, c: c.allreduce(xs[0][r]))
    assert not errs
    before = [_switches(_responder(r)) for r in range(2)]
    _, errs = rk.run(lambda r, c: [c.allreduce(xs[i][r]) for i in range(rounds)])
    assert not errs
    woken = [_switches(_responder(r)) - b for r, b in enumerate(before)]
    assert max(woken) < rounds // 4, woken  # (a rank held up past the grace wakes it: rare)


def test_the_idle_responder_answers_a_probe_for_the_finished_round(ranks):
    """A sender whose STOP was lost probes after the round; the receiver's caller is not in a
    round (computing, say), and its idle responder answers with the STOP."""
    rk = ranks(2)
    xs = inputs(2, 5000)
    _, errs = rk.run(lambda r, c: c.allreduce(xs[0][r]))
    assert not errs
    c1 = rk.cols[1]
    c1._running = True  # rank 1's responder leaves its transport to this test
    os.eventfd_write(c1._wake, 1)
    with c1._poll_lock:
        t1, rnd = rk.ts[1], c1.round
        while t1.recv(Batch.empty(16, 64), timeout=0.05).n:  # late copies of the round's own STOPs
            pass
        h = wire.empty_batch(1)
        h["kind"], h["job"], h["round"], h["src"], h["dst"] = wire.Kind.PROBE, 1, rnd, 1, 0
        shard0 = -(-5000 // c1.C) // 2  # chunks of rank 1's reduce-scatter message to rank 0
        h["chunk"], h["nchunks"], h["tol"], h["dtype"] = 0, shard0, 0, wire.Dtype.RAW
        to0 = t1.add_peer("127.0.0.1", rk.ts[0].port)
        assert t1.send(Batch.fill(h, np.zeros((1, 0), np.uint8), peer=to0)) == 1
        got, deadline = [], time.monotonic() + 2.0
        while not got and time.monotonic() < deadline:
            b = t1.recv(Batch.empty(16, 64), timeout=0.1)
            got = [f for f in b.headers[: b.n].tolist() if f[wire.F_KIND] == wire.Kind.STOP]
    c1._running = False
    assert got and got[0][wire.F_ROUND] == rnd and got[0][wire.F_SRC] == 0 and not got[0][wire.F_FLAGS] & wire.Flag.ALLGATHER


def test_close_ends_the_idle_responder_and_leaves_no_descriptor():
    """close() wakes the responder wherever it sleeps, joins it and closes every descriptor the
    collective opened (its transport's included)."""
    fds = set(os.listdir("/proc/self/fd"))
    rk = Ranks(2)
    xs = inputs(2, 5000)
    _, errs = rk.run(lambda r, c: c.allreduce(xs[0][r]))
    assert not errs
    idlers = [_responder(r) for r in range(2)]
    rk.cols[0]._running = True  # one responder asleep on its alarm, one serving
    time.sleep(0.01)
    rk.close()
    assert not any(t.is_alive() for t in idlers)
    assert set(os.listdir("/proc/self/fd")) == fds


def test_link_chunk_bytes_fits_the_mtu_over_ipv6():
    from pydblp.collective import link_chunk_bytes

    assert link_chunk_bytes(1500) == Config().chunk_bytes == 1408
    assert link_chunk_bytes(9000) == 8000  # Config.check's ceiling
    assert link_chunk_bytes(1280) == 1152  # IPv6's minimum MTU
    for mtu in (144, 576, 1500, 3000, 4000, 8999):
        c = link_chunk_bytes(mtu)
        assert c % 64 == 0 and c + wire.DATAGRAM_OVERHEAD <= mtu < c + 64 + wire.DATAGRAM_OVERHEAD or c == 8000
        Config(chunk_bytes=c).check()
    with pytest.raises(ValueError, match="mtu 143"):
        link_chunk_bytes(143)


def test_chunk_bytes_none_is_for_the_torch_rendezvous_only():
    with pytest.raises(ValueError, match="chunk_bytes None.*from_process_group"):
        Config(chunk_bytes=None).check()
    t = UdpTransport(port=0)
    try:
        with pytest.raises(ValueError, match="chunk_bytes None"):
            Collective(t, 0, 2, [("127.0.0.1", 1), ("127.0.0.1", 2)], Config(chunk_bytes=None))
    finally:
        t.close()


@pytest.mark.parametrize("order", ["rows", "shuffle"])
def test_a_bound_cut_falls_on_other_rows_each_round_when_shuffled(ranks, order):
    """Bound 30 %, and the last 20 % of every reduce-scatter message's first pass is lost (within
    the bound: never repaired).  In the tensor's order those are the same rows every round: their
    mean never includes the other rank.  Shuffled, the lost positions hold other rows each round,
    so over 8 rounds every row gets an exact mean in some round."""
    rk = ranks(2, phase="static:0.3", order=order)
    lose_sent(rk.ts[0], lambda h: ((h["kind"] == wire.Kind.DATA) & ((h["flags"] & (wire.Flag.ALLGATHER | wire.Flag.RETX)) == 0)
                                    & (h["chunk"].astype(np.int64) * 5 >= h["nchunks"].astype(np.int64) * 4)))
    xs = inputs(2, 60_000, rounds=8, seed=5)
    res, errs = rk.run(lambda r, c: [c.allreduce(xs[i][r]) for i in range(8)])
    assert not errs
    C = rk.cols[0].C
    T = -(-60_000 // C)
    exact = np.zeros(T, int)  # rounds in which a row's mean (at rank 1, which owns shard 1) is exact
    for i in range(8):
        want = np.zeros(T * C, np.float32)
        got = np.zeros(T * C, np.float32)
        want[:60_000], got[:60_000] = (xs[i][0] + xs[i][1]) / 2, res[1][i]
        exact += np.isclose(got, want, atol=1e-6).reshape(T, C).all(axis=1)
    shard = slice(T // 2, T)  # rank 0's contributions to it are what is lost
    lost_rows = (exact[shard] == 0).sum()
    if order == "rows":
        assert lost_rows >= (T - T // 2) // 5 - 1  # the tail of the shard, every round
    else:
        assert lost_rows == 0 and exact[shard].min() >= 1
        assert exact[shard].mean() < 8  # (and some rows did lose a round's contribution)


@pytest.mark.parametrize("stagger", [False, True])
def test_a_cut_after_the_same_share_of_every_sender_leaves_no_row_to_its_owner_alone(ranks, stagger):
    """4 ranks, bound 40 %, unbiased estimator: every reduce-scatter message loses its sends past
    the first 70 % (as when an owner STOPs senders going at one pace).  In chunk order that is
    the same 30 % of rows from every sender: their estimate is the owner's own contribution.
    Staggered, each sender's lost 30 % starts elsewhere: every row has another rank's."""
    W = 4
    rk = ranks(W, phase="static:0.4", stagger=stagger)

    def late(h):
        n = h["nchunks"].astype(np.int64)
        order = h["chunk"].astype(np.int64)
        if stagger:
            order = (order - h["src"].astype(np.int64) * n // W) % n
        return ((h["kind"] == wire.Kind.DATA) & ((h["flags"] & (wire.Flag.ALLGATHER | wire.Flag.RETX)) == 0)
                & (order * 10 >= n * 7))

    for t in rk.ts:
        lose_sent(t, late)
    xs = inputs(W, 40_000, seed=9)[0]
    res, errs = rk.run(lambda r, c: c.allreduce(xs[r]))
    assert not errs
    C = rk.cols[0].C
    T = -(-40_000 // C)
    bounds = [k * T // W for k in range(W + 1)]  # the shards (rows stay in theirs when shuffled)
    pad = np.zeros((W, T * C), np.float32)
    for r in range(W):
        pad[r, :40_000] = xs[r]
    got = np.zeros(T * C, np.float32)
    got[:40_000] = res[0]
    alone = 0  # rows whose estimate is their owner's contribution, none of the others'
    for k in range(W):
        rows = slice(bounds[k], bounds[k + 1])
        own = pad[k].reshape(T, C)[rows]
        alone += np.isclose(got.reshape(T, C)[rows], own, atol=1e-6).all(axis=1).sum()
    if stagger:
        assert alone == 0
    else:
        assert alone >= 0.25 * T


def _allreduce(c, x, into: bool):
    """``c.allreduce(x)``, or with ``into`` in place (``out=``: the all-gather and the fill write
    the result in the tensor's order through the round's permutation, into the caller's array
    itself when of whole rows)."""
    if not into:
        return c.allreduce(x)
    y = x.copy()
    return c.allreduce(y, out=y)


@pytest.mark.parametrize("n,into", [(30_000, False), (30_000, True), (352 * 85, True)])  # (352 * 85: whole rows)
@pytest.mark.parametrize("mode", ["tar", "ps"])
def test_the_carry_fill_applies_what_the_allgather_cut_a_round_later(ranks, mode, n, into):
    """Fill "carry" (error feedback), bound 30 %, no loss.  Every rank holds the same result; a
    row the all-gather cut is zero in it, and its owner adds it to the row's next estimate: each
    round's result plus what owners still carry equals the exact means summed so far, so nothing
    cut is lost.  The first round is cut too (nothing to fill from is needed), and a whole round
    (bound 0) hands out everything carried.  The same in place."""
    world, rounds = 3, 4
    rk = ranks(world, mode=mode, allgather_bound=True, fill="carry")
    tols = [0.3, 0.3, 0.3, 0.0]

    class Steps(Static):  # a bound per round: relaxed, then a whole round
        def tol(self, index):
            return tols[index]

    for c in rk.cols:
        c.controller = c.protocol.controller = Steps(0.3)
    xs = inputs(world, n, rounds=rounds, seed=11)
    held = [[None] * rounds for _ in range(world)]  # what each rank carries after each round

    def run(r, c):
        out = []
        for i in range(rounds):
            out.append(_allreduce(c, xs[i][r], into))
            acc = c.protocol.fill.carried.get(0)
            held[r][i] = None if acc is None else acc.copy()
        return out

    res, errs = rk.run(run)
    assert not errs
    C = rk.cols[0].C
    T = -(-n // C)
    nsh = world if mode == "tar" else 1
    tol8 = int(0.3 * 255)
    cut = sum((b - a) * tol8 // 255 for a, b in ((k * T // nsh, (k + 1) * T // nsh) for k in range(nsh)))
    pad = lambda v: np.concatenate([v, np.zeros(T * C - n, np.float32)]).reshape(T, C)
    applied = np.zeros((T, C))
    exact = np.zeros((T, C))
    for i in range(rounds):
        for r in range(1, world):
            np.testing.assert_array_equal(res[r][i], res[0][i])  # identical replicas
        got = pad(res[0][i])
        zero = (got == 0).all(axis=1)
        assert zero.sum() == (cut if tols[i] else 0), (i, zero.sum(), cut)
        applied += got
        exact += pad(np.mean(np.float64(xs[i]), axis=0))
        owed = np.zeros((T, C))
        for k in range(nsh):  # what the owners carry, in the tensor's order
            a, b = k * T // nsh, (k + 1) * T // nsh
            if held[k][i] is not None:
                owed[a:b] += held[k][i]
        np.testing.assert_allclose((applied + owed).reshape(-1)[:n], exact.reshape(-1)[:n], atol=1e-4)
        assert (owed != 0).any() == bool(tols[i])  # a whole round hands out everything carried
        assert ((owed != 0).any(axis=1) == zero).all()  # carried: exactly the rows zeroed now


def test_with_the_carry_fill_every_rank_measures_g_on_the_step_s_own_mean(ranks):
    """Fill "carry": a round's result mixes in rows cut earlier and zeroes the rows cut now, so G
    is the sum over owners of their shard's estimate before anything carried was added, agreed in
    end_step's one-chunk round: every rank's controller gets the exact mean's norm (no loss),
    not the result's."""
    world, n, steps = 3, 30_000, 3
    rk = ranks(world, allgather_bound=True, fill="carry")

    class Relaxed(Dblp):  # bound 30 % every round; measures every step
        def tol(self, index):
            return 0.3

    for c in rk.cols:
        c.controller = c.protocol.controller = Relaxed(freq=1)
        c.controller.count_steps()
    xs = inputs(world, n, rounds=steps, seed=5)

    def run(r, c):
        out = []
        for i in range(steps):
            out.append(c.allreduce(xs[i][r]))
            c.end_step()
        return out

    res, errs = rk.run(run)
    assert not errs
    for i in range(steps):
        want = np.linalg.norm(np.mean(np.float64(xs[i]), axis=0))
        for c in rk.cols:
            step, g, _ = c.controller.history[i]
            assert step == i and g == pytest.approx(want, rel=1e-4)
        assert np.linalg.norm(res[0][i]) != pytest.approx(want, rel=1e-2)  # (the result's is not it)


def test_the_carry_fill_needs_a_consistent_bounded_allgather():
    with pytest.raises(ValueError, match="fill 'carry'"):
        Config(fill="carry").check()
    with pytest.raises(ValueError, match="fill 'carry'"):
        Config(fill="carry", allgather_bound=True, consistent=False).check()
    Config(fill="carry", allgather_bound=True).check()


@pytest.mark.parametrize("n,into", [(30_000, False), (30_000, True), (352 * 85, True)])  # (352 * 85: whole rows)
@pytest.mark.parametrize("bound", [True, False])
def test_a_consistent_allgather_stops_at_the_bound_and_every_rank_fills_alike(ranks, bound, n, into):
    """Bound 30 %, consistent replicas, no loss.  With ``allgather_bound`` each owner's all-gather
    carries the first ``need`` rows of its shuffled shard and every rank, the owner too, fills the
    rest from the previous result: identical results on every rank, each row either this round's
    exact mean or last round's result, and exactly the bound's share of rows stale (the first
    round, with nothing to fill from, goes whole).  Without it every row is exact.  The same in
    place."""
    world = 3  # (small: each reduce-scatter message goes out in one turn, before any STOP)
    rk = ranks(world, allgather_bound=bound)

    class Seen(Static):  # bound 30 %; records the vectors the collective hands the controller
        def __init__(self):
            super().__init__(0.3)
            self.seen = []

        def observe(self, index, result):
            self.seen.append(result.copy())

    for c in rk.cols:
        c.controller = c.protocol.controller = Seen()
    xs = [[v * (1 + i) for v in r] for i, r in enumerate(inputs(world, n, rounds=3, seed=7))]  # (stale rows: smaller)
    res, errs = rk.run(lambda r, c: [_allreduce(c, xs[i][r], into) for i in range(3)])
    assert not errs
    C = rk.cols[0].C
    T = -(-n // C)
    tol8 = int(0.3 * 255)
    cut = sum((b - a) * tol8 // 255 for a, b in ((k * T // world, (k + 1) * T // world) for k in range(world)))
    pad = lambda v: np.concatenate([v, np.zeros(T * C - n, np.float32)]).reshape(T, C)
    for i in range(3):
        for r in range(1, world):
            np.testing.assert_array_equal(res[r][i], res[0][i])  # identical replicas
        got, exact = pad(res[0][i]), pad(sum(xs[i]) / world)
        fresh = np.isclose(got, exact, atol=1e-6).all(axis=1)
        if i == 0 or not bound:
            assert fresh.all()
            continue
        stale = ~fresh
        assert stale.sum() == cut, (stale.sum(), cut)
        np.testing.assert_array_equal(got[stale], pad(res[0][i - 1])[stale])
        # the controller's G: this round's rows only, scaled to the whole; the same on every rank
        seen = [c.controller.seen[i] for c in rk.cols]
        for v in seen[1:]:
            np.testing.assert_array_equal(v, seen[0])
        g, want = np.linalg.norm(seen[0]), np.linalg.norm(got[fresh]) * np.sqrt(T / fresh.sum())
        assert g == pytest.approx(want, rel=1e-5) and g != pytest.approx(np.linalg.norm(got), rel=1e-3)


def _sgd(lr):
    """A sharded update's rule: plain SGD on the owner's rows."""
    return lambda rows, g, p: p - np.float32(lr) * g


def _sharded_steps(rk, xs, p0, lr):
    """Every rank runs a sharded SGD step per round of inputs ``xs`` from ``p0``; per rank, its
    parameters after each step."""
    def run(r, c):
        p, out = p0.copy(), []
        for x in xs:
            p = c.sharded_update(x[r], p, _sgd(lr))
            out.append(p.copy())
        return out

    res, errs = rk.run(run)
    assert not errs
    return res


@pytest.mark.parametrize("mode", ["tar", "ps"])
@pytest.mark.parametrize("consistent", [True, False])
def test_a_sharded_update_without_loss_is_the_exact_step_on_every_rank(ranks, mode, consistent):
    """No loss: every rank ends each step with the owners' values, the exact SGD step from the
    exact mean gradient, and every rank's controller measured G on that mean."""
    world, n, steps = 3, 30_000, 3
    rk = ranks(world, mode=mode, consistent=consistent, phase="dblp")
    for c in rk.cols:
        c.controller.freq = 1
    xs = inputs(world, n, rounds=steps, seed=21)
    p0 = np.random.default_rng(3).standard_normal(n).astype(np.float32)
    res = _sharded_steps(rk, xs, p0, 0.1)
    want = np.float64(p0)
    for i in range(steps):
        mean = np.mean(np.float64(xs[i]), axis=0)
        want = want - 0.1 * mean
        for r in range(world):
            np.testing.assert_allclose(res[r][i], want, atol=1e-5)
        for c in rk.cols:  # (end_step's one-chunk round summed the owners' squared norms)
            step, g, _ = c.controller.history[i]
            assert step == i and g == pytest.approx(np.linalg.norm(mean), rel=1e-4)


def test_a_parameter_the_sharded_allgather_loses_keeps_its_value_until_delivered(ranks):
    """Bound 30 %, all-gather tolerant (consistent=False), and the last 20 % of rank 0's
    all-gather first pass lost (within the bound: never repaired).  At rank 1 each row of rank
    0's shard is either the owner's new value or rank 1's own previous value, never anything
    else; the lost rows are others each round (shuffled), so no row lags more than a round or
    two; rank 0's own shard is always current; and the shard rank 1 owns is the same on both."""
    world, n, steps = 2, 60_000, 6
    rk = ranks(world, phase="static:0.3", consistent=False)
    lose_sent(rk.ts[0], lambda h: ((h["kind"] == wire.Kind.DATA)
                                    & ((h["flags"] & (wire.Flag.ALLGATHER | wire.Flag.RETX)) == wire.Flag.ALLGATHER)
                                    & (h["chunk"].astype(np.int64) * 5 >= h["nchunks"].astype(np.int64) * 4)))
    xs = inputs(world, n, rounds=steps, seed=23)
    p0 = np.zeros(n, np.float32)
    res = _sharded_steps(rk, xs, p0, 1.0)
    C = rk.cols[0].C
    T = -(-n // C)
    half = (T // 2) * C  # rank 0 owns rows 0..T//2
    lag = np.zeros(half, int)  # rounds each of shard 0's values at rank 1 has lagged rank 0's
    prev1 = p0[:half].astype(np.float64)
    behind = 0
    for i in range(steps):
        own, got = res[0][i][:half], res[1][i][:half]
        new = np.isclose(got, own, atol=1e-6)
        old = np.isclose(got, prev1, atol=1e-6)
        assert (new | old).all()  # the owner's value or its own previous one
        np.testing.assert_allclose(res[0][i][half:], res[1][i][half:], atol=1e-6)  # rank 1's shard
        lag = np.where(new, 0, lag + 1)
        behind += int((~new).sum())
        prev1 = got.astype(np.float64)
    assert behind > 0 and lag.max() <= 3
    # rank 0's own shard is the exact step from the mean (within the reduce-scatter's bound)
    exact = -np.sum([np.mean(np.float64(x), axis=0) for x in xs], axis=0)[:half]
    assert np.isclose(res[0][-1][:half], exact, atol=1e-4).mean() > 0.5


def test_a_sharded_update_refuses_a_bounded_allgather_and_sizes_that_differ(ranks):
    rk = ranks(2, allgather_bound=True)
    with pytest.raises(ValueError, match="allgather_bound=False"):
        rk.cols[0].sharded_update(np.zeros(10, np.float32), np.zeros(10, np.float32), _sgd(0.1))
    rk2 = ranks(2)
    with pytest.raises(ValueError, match="grad has 10 values, params 9"):
        rk2.cols[0].sharded_update(np.zeros(10, np.float32), np.zeros(9, np.float32), _sgd(0.1))


@pytest.mark.parametrize("order", ["rows", "shuffle"])
@pytest.mark.parametrize("n", [352 * 40, 10_001])  # whole rows of the default chunk, and not
def test_allreduce_into_out_and_in_place(ranks, order, n):
    """``out=``: the result lands in the caller's array (``x`` itself: in place, as Gloo's), equal
    to the default's new array, for whole rows (written there by the round) and not (copied in);
    op "sum" scales it there; a wrong ``out`` is refused before any round."""
    rk = ranks(3, order=order)
    xs = inputs(3, n, rounds=1, seed=4)[0]

    def job(r, c):
        ref = c.allreduce(xs[r].copy())
        inplace = xs[r].copy()
        got = c.allreduce(inplace, out=inplace)
        other = np.full(n, np.nan, np.float32)
        got2 = c.allreduce(xs[r].copy(), out=other, op="sum")
        return ref, got is inplace, inplace, got2 is other, other

    res, errs = rk.run(job)
    assert not errs, errs
    mean = sum(xs) / 3
    for r in range(3):
        ref, same, inplace, same2, other = res[r]
        assert same and same2
        assert np.allclose(ref, mean, atol=1e-6) and np.array_equal(inplace, ref)
        assert np.allclose(other, 3 * mean, atol=1e-5)
    c = rk.cols[0]
    for bad in (np.zeros(n, np.float64), np.zeros(n + 1, np.float32), np.zeros((n, 2), np.float32)[:, 0]):
        with pytest.raises(ValueError, match="out: a writeable C-contiguous float32"):
            c.allreduce(xs[0], out=bad)


@pytest.mark.parametrize("n", [352 * 40, 352 * 40 - 17])  # whole rows, and a partial last row
def test_an_allreduce_read_in_place_sends_and_keeps_what_a_copy_would(n):
    """A transport that reads addresses lets a shuffled allreduce read its input where it lies
    (no copy in the round's order): each reduce-scatter message's rows at their addresses, the
    owner's own contribution, the magnitude priorities and the rows the fill "local" takes are
    byte for byte what the round built on a copy (a transport that does not read addresses)
    holds, the partial last row padded with zeros."""
    import ctypes

    with UdpTransport(port=0) as t:
        if not t.reads_addresses:
            require_native("udp")

    x = np.random.default_rng(5).standard_normal(n).astype(np.float32)
    cols = [Collective(UdpTransport(port=0, native=native), 1, 3, [("127.0.0.1", 9)] * 3, Config(job=3),
                       idle_thread=False) for native in (True, False)]
    try:
        direct, copy = (c.protocol.start(x, 0, True) for c in cols)
        assert direct.flat is x and direct.x is None and copy.flat is None and copy.x is not None
        assert np.array_equal(direct.perm, copy.perm)
        assert np.array_equal(direct.rbuf[1], copy.rbuf[1])
        C = cols[0].C
        for key, o in direct.outs.items():
            ref = copy.outs[key]
            assert o.rows is None and o.n == ref.n and np.array_equal(o.prio, ref.prio)
            got = b"".join(ctypes.string_at(int(a), C * 4) for a in o.addrs)
            assert got == ref.rows.tobytes(), key
        mask = np.random.default_rng(6).random(len(copy.x)) < 0.4
        mask[np.argmax(copy.perm == len(copy.x) - 1)] = True  # (the last row among them)
        assert np.array_equal(direct.input_rows(mask), copy.x[mask])
        assert np.array_equal(direct.input_rows(slice(3, 9)), copy.x[3:9])
    finally:
        for c in cols:
            c.close()


def test_a_smaller_round_of_a_tensor_reuses_its_buffers_and_trailing_rows_keep_their_bytes(ranks):
    """DDP rebuilds its buckets after the first step: a tensor id's next round is smaller.  Its
    scratch buffers then reuse the larger round's memory (no new pages), and an earlier round's
    all-gather messages still trailing on that memory keep a copy of their own rows, whatever
    the new round's shape."""
    from pydblp.collective.messages import OutMessage

    rk = ranks(2)
    p = rk.cols[0].protocol
    big = p._scratch("y", 0, (40, p.C))
    small = p._scratch("y", 0, (30, p.C))
    assert small.shape == (30, p.C) and np.shares_memory(big, small)
    assert p._scratch("y", 0, (30, p.C)) is small  # (the same shape again: the same array)
    bigger = p._scratch("y", 0, (50, p.C))
    assert not np.shares_memory(big, bigger)

    # a trailing all-gather message of a 40-row round, its rows on the "trail" buffer
    rows = p._scratch("trail", 7, (40, p.C))
    rows[:] = np.arange(rows.size, dtype=np.float32).reshape(rows.shape)
    want = rows.copy()
    old = OutMessage(True, 1, rows, np.zeros(40, np.uint8), 0, 5, 7)
    old.sent = old.n
    p.trail[(5, True, 1)] = old
    # the next round of tensor 7 (20 rows) leaves its own all-gather trailing: it takes that memory
    new_rows = np.full((20, p.C), -1.0, np.float32)
    msg = OutMessage(True, 1, new_rows, np.zeros(20, np.uint8), 0, 6, 7)
    msg.sent = msg.n

    class St:
        tensor = 7
        outs = {(True, 1): msg}

    p._trail_from(St())
    assert np.shares_memory(msg.rows, rows)  # (the new message's rows: the reused memory)
    np.testing.assert_array_equal(msg.rows, new_rows)
    assert not np.shares_memory(old.rows, rows)
    np.testing.assert_array_equal(old.rows, want)  # (the old message: its own bytes, unchanged)


def test_tensors_share_the_scratch_no_round_leaves_behind(ranks):
    """Rounds of several tensor ids, of several sizes, alternating: the inbox and the input's
    copy are one buffer for all of them (a job holds its largest round's, not one per bucket),
    what outlives a round (the result kept for the stale fill: a round may end at its deadline)
    stays per tensor id, and every round is the exact mean."""
    rk = ranks(3, order="rows", deadline=30.0)
    sizes = {0: 30_001, 1: 7_000, 2: 19_500}
    xs = {t: inputs(3, n, rounds=2, seed=10 + t) for t, n in sizes.items()}

    def job(r, c):
        got = []
        for i in range(2):
            for t in (0, 1, 2):
                got.append(c.allreduce(xs[t][i][r], tensor=t).copy())
        return got

    res, errs = rk.run(job)
    assert not errs, errs
    for r in range(3):
        k = 0
        for i in range(2):
            for t in (0, 1, 2):
                np.testing.assert_allclose(res[r][k], sum(xs[t][i]) / 3, rtol=1e-5, atol=1e-6)
                k += 1
    bufs = rk.cols[0].protocol._bufs
    assert ("rbuf", None) in bufs and ("x", None) in bufs
    assert not any(name in ("rbuf", "x") and t is not None for name, t in bufs)
    assert rk.cols[0].protocol.fill.stale.keys() == {0, 1, 2}  # (fill "stale": each tensor's last result)


@pytest.mark.parametrize("cfg,kept", [({}, False), ({"deadline": 30.0}, True), ({"consistent": False}, True),
                                      ({"allgather_bound": True, "phase": "static:0.2"}, True)])
@pytest.mark.parametrize("n", [352 * 40, 10_001])  # whole rows of the default chunk, and not
def test_the_stale_fill_keeps_a_snapshot_only_where_a_row_may_go_missing(ranks, cfg, kept, n):
    """Fill "stale" keeps each tensor's last result for rows a later round may miss: an all-gather
    that tolerates loss, is cut at the bound or may end at a deadline.  Where every row arrives or
    the round fails (the default) it keeps none, and the round costs no pass to copy it.  The
    snapshot is the result the caller got (in place, its partial last row padded with zeros)."""
    rk = ranks(3, **cfg)
    xs = inputs(3, n, rounds=1, seed=12)[0]

    def job(r, c):
        v = xs[r].copy()
        return c.allreduce(v, out=v).copy()

    res, errs = rk.run(job)
    assert not errs, errs
    for r, c in enumerate(rk.cols):
        stale = c.protocol.fill.stale
        assert (0 in stale) == kept, (cfg, stale.keys())
        if kept:
            snap = stale[0].reshape(-1)
            np.testing.assert_array_equal(snap[:n], res[r])
            assert not snap[n:].any()
        if not cfg:
            np.testing.assert_allclose(res[r], sum(xs) / 3, rtol=1e-5, atol=1e-6)


def turn_rows(seed: int):
    """A seeded generator, 40 rows of 352 floats and their priorities, for a send turn compared on
    both paths (skipped, or failed where CI requires it, without the compiled matcher)."""
    from pydblp.collective import matcher

    if matcher.native_lib() is None:
        require_native("matcher")
    rng = np.random.default_rng(seed)
    return rng, rng.standard_normal((40, 352)).astype(np.float32), rng.integers(1, 8, 40).astype(np.uint8)


def test_a_turns_headers_and_a_receives_counts_are_the_same_on_both_paths(monkeypatch):
    """The compiled DATA headers of a send turn (``Protocol._send_batch``: a reduce-scatter part
    from a chunk past the message's first, retransmissions of an all-gather, a trailing message of
    an earlier round and tensor, a message read where it lies (by address), behind a control
    packet) with the payloads their addresses point to, and the compiled per-sender counts of a
    receive (``Protocol._count_rx``: DATA from peers, from a rank past the world, control packets,
    CE-marked and not) are byte for byte and count for count the Python path's."""
    import ctypes

    from pydblp.collective import matcher
    from pydblp.collective.messages import OutMessage

    rng, rows, prio = turn_rows(8)
    C = rows.shape[1]
    h = wire.empty_batch(64)
    h["kind"] = rng.choice([wire.Kind.DATA] * 5 + [wire.Kind.STOP, wire.Kind.PROBE], 64)
    h["src"] = rng.choice([0, 2, 3, 7], 64)  # (3 and 7: past the world)
    ecn = rng.integers(0, 4, 64).astype(np.uint8)
    sent, counts = {}, {}
    for native in (True, False):
        with monkeypatch.context() as m:
            if not native:
                m.setattr(matcher, "native_lib", lambda: None)
            col = Collective(UdpTransport(port=0), 1, 3, [("127.0.0.1", 9)] * 3, Config(job=77), idle_thread=False)
        try:
            p = col.protocol
            assert p.matcher.native is native
            if not p.t.reads_addresses:
                require_native("udp")
            got = []

            def send(b, timeout=1.0):
                got.append(b.headers[: b.n].tobytes())
                got.append(b"".join(ctypes.string_at(int(a), int(n)) for a, n in zip(b.addr[: b.n], b.lengths[: b.n])))
                return b.n

            monkeypatch.setattr(p.t, "send", send)
            rs = OutMessage(False, 2, rows, prio, 12, 0x1234ABCD, 5, first=7)
            ag = OutMessage(True, 0, rows[:30], prio[:30], 0, 0x1234ABCD, 5)
            old = OutMessage(True, 2, rows[:9], prio[:9], 3, 0x1234ABCC, 4)
            at = np.uint64(rows.ctypes.data) + np.arange(39, -1, -1, dtype=np.uint64) * np.uint64(C * 4)
            lies = OutMessage(False, 0, None, prio, 12, 0x1234ABCD, 5, addrs=at)
            p._ctrl_packet(0x1234ABCD, 5, wire.Kind.STOP, 0, 2, 40, 12)
            p._send_batch(None, [(rs, rs.chunks(3, 20), 0), (ag, np.array([2, 9, 29]), wire.Flag.RETX),
                                 (old, np.arange(9), 0), (lies, np.array([5, 1, 7, 2, 30]), 0)])
            sent[native] = got
            for e in (ecn, None):
                p._count_rx(Batch(h, np.zeros((64, 8), np.uint8), np.zeros(64, np.int32), np.zeros(64, np.int32),
                                  64, None, e))
            counts[native] = (p.rx_from.tolist(), p.ce_from.tolist(), p.counters["ce_received"])
        finally:
            col.close()
    assert sent[True] == sent[False] and len(sent[True]) == 2
    h = np.frombuffer(sent[True][0], wire.HEADER_DTYPE)
    assert (h["prio"][1:18] == prio[(7 + np.arange(3, 20)) % 40]).all()
    pays = np.frombuffer(sent[True][1][int(h["len"][0]):], np.float32)  # (past the STOP's payload)
    assert np.array_equal(pays.reshape(-1, C)[:17], rows[(7 + np.arange(3, 20)) % 40])
    assert np.array_equal(pays.reshape(-1, C)[-5:], rows[39 - np.array([5, 1, 7, 2, 30])])
    assert len(h) == 1 + 17 + 3 + 9 + 5 and h["kind"][0] == wire.Kind.STOP and (h["kind"][1:] == wire.Kind.DATA).all()
    assert h["chunk"][1:18].tolist() == [(7 + c) % 40 for c in range(3, 20)] and (h["round"][-14:-5] == 0x1234ABCC).all()
    assert counts[True] == counts[False] and counts[True][0][3] > 0 and counts[True][2] > 0


def test_a_spread_turn_takes_its_parts_in_turns_on_both_paths(monkeypatch):
    """``Config.spread`` 4 on a link-bound path: a send turn's DATA packets (after its control
    packet) take up to 4 packets of each part in turn, each part's in its own order, with each
    header's payload still its own chunk's row, byte for byte the same on the compiled and the
    Python path; a path that keeps up sends each part whole."""
    import ctypes

    from pydblp.collective import matcher, protocol
    from pydblp.collective.messages import OutMessage

    _, rows, prio = turn_rows(9)
    sent = {}
    for native, bound in ((True, True), (False, True), (True, False)):
        with monkeypatch.context() as m:
            if not native:
                m.setattr(matcher, "native_lib", lambda: None)
            col = Collective(UdpTransport(port=0), 1, 3, [("127.0.0.1", 9)] * 3, Config(job=77, spread=4),
                             idle_thread=False)
        try:
            p = col.protocol
            if not p.t.reads_addresses:
                require_native("udp")
            got = []

            def send(b, timeout=1.0):
                got.append((b.headers[: b.n].copy(), [ctypes.string_at(int(a), int(n))
                                                      for a, n in zip(b.addr[: b.n], b.lengths[: b.n])]))
                return b.n

            monkeypatch.setattr(p.t, "send", send)
            monkeypatch.setattr(protocol.Protocol, "link_bound", property(lambda self: bound))
            a = OutMessage(False, 2, rows, prio, 12, 0x1234ABCD, 5)
            b = OutMessage(True, 0, rows[:30], prio[:30], 0, 0x1234ABCD, 5)
            p._ctrl_packet(0x1234ABCD, 5, wire.Kind.STOP, 0, 2, 40, 12)
            p._send_batch(None, [(a, np.arange(10), 0), (b, np.array([2, 9, 29]), wire.Flag.RETX),
                                 (a, np.arange(10, 15), 0)])
            sent[native, bound] = got
        finally:
            col.close()
    (h, pays), = sent[True, True]
    (h2, pays2), = sent[False, True]
    assert h.tobytes() == h2.tobytes() and pays == pays2
    d = h[1:]
    assert h["kind"][0] == wire.Kind.STOP and (d["kind"] == wire.Kind.DATA).all()
    runs = [(0, [0, 1, 2, 3]), (1, [2, 9, 29]), (2, [10, 11, 12, 13]), (0, [4, 5, 6, 7]), (2, [14]), (0, [8, 9])]
    want = [c for _, cs in runs for c in cs]
    assert d["chunk"].tolist() == want
    assert d["dst"].tolist() == [{0: 2, 1: 0, 2: 2}[k] for k, cs in runs for _ in cs]
    assert [bytes(x) for x in pays[1:]] == [rows[c].tobytes() for c in want]
    (h3, _), = sent[True, False]
    assert h3["chunk"][1:].tolist() == list(range(10)) + [2, 9, 29] + list(range(10, 15))


def test_a_round_ended_at_its_deadline_stops_a_trailing_message_at_its_first_probe():
    """Rank 1 ends its round at the deadline without chunk 0 of rank 0's all-gather (lost every
    time it is sent).  Rank 0's message then trails and probes; a round that is over takes
    nothing more, so rank 1 answers STOP, not a BITMAP asking for the chunk again (which it
    would drop as late, probe after probe, until its next round)."""
    from tests.helpers import Ranks, lose_sent

    rk = Ranks(2, deadline=0.3, peer_timeout=5.0, cc="off", order="rows")
    try:
        lose_sent(rk.ts[0], lambda h: (h["kind"] == wire.Kind.DATA) & ((h["flags"] & wire.Flag.ALLGATHER) != 0)
                  & (h["dst"] == 1) & (h["chunk"] == 0))
        x = np.arange(4000, dtype=np.float32)
        _, errs = rk.run(lambda r, c: c.allreduce(x))
        assert not errs, errs
        assert rk.cols[1].records[-1].min_delivered < 1.0  # (the round did end short)
        c0 = rk.cols[0].protocol.counters
        sent = c0["trail_retransmits"]  # (while rank 1's round still ran, it asked for them)
        end = time.monotonic() + 3.0
        while rk.cols[0].trailing and time.monotonic() < end:
            time.sleep(0.05)
        time.sleep(0.5)  # (what a loop would have sent meanwhile)
        assert rk.cols[0].trailing == 0, "the message still trails"
        assert c0["trail_retransmits"] - sent <= 2, c0["trail_retransmits"] - sent
    finally:
        rk.close()


def test_a_peer_whose_all_gather_does_not_fit_fails_the_round_in_peer_timeout():
    """Ranks at different tolerances with allgather_bound cut their all-gathers at different
    lengths: each refuses the other's, while their reduce-scatters fit.  The round fails with
    the "does not fit" error once the all-gather has not moved for peer_timeout; it never hangs."""
    from pydblp.transport.udp import UdpTransport

    ts = [UdpTransport(port=0) for _ in range(2)]
    peers = [("127.0.0.1", t.port) for t in ts]
    cols = [Collective(ts[r], r, 2, peers, Config(allgather_bound=True, fill="carry", consistent=True, cc="off",
                                                  phase=f"static:{0.10 if r == 0 else 0.12}", peer_timeout=1.0))
            for r in range(2)]
    try:  # (a rank still in its round after 30 s fails the test: it hung)
        _, errs = run_threads(lambda r: cols[r].allreduce(np.ones(40_000, np.float32)), range(2), 30)
        assert set(errs) == {0, 1}, errs
        assert all(isinstance(e, CollectiveError) and "does not fit" in str(e) for e in errs.values()), errs
    finally:
        for c in cols:
            c.close()


def test_what_the_wire_cannot_carry_is_refused_before_the_round_is_numbered():
    """A tensor id past 16 bits, or a message of more chunks than 24 bits count, is a ValueError
    naming the limit, raised before the round takes a number: the ranks' next rounds still match."""
    rk = Ranks(2, chunk_bytes=64)
    try:
        x = np.ones(1000, np.float32)
        _, errs = rk.run(lambda r, c: c.allreduce(x, tensor=70_000))
        assert all(isinstance(e, ValueError) and "tensor id 70000: use 0..65535" in str(e) for e in errs.values()), errs
        big = np.zeros(wire.MAX_NCHUNKS * 16 + 16, np.float32)  # (16 values a 64-byte chunk: one chunk too many)
        with pytest.raises(ValueError, match="at most 16777216"):
            rk.cols[0].neighbours(big, [1], [0.5])
        res, errs = rk.run(lambda r, c: c.allreduce(x * (r + 1)))
        assert not errs, errs
        np.testing.assert_allclose(res[0], 1.5)
    finally:
        rk.close()


def test_a_trailing_message_keeps_to_the_rate_control_between_rounds(ranks):
    """What a trailing message still sends between rounds (retransmissions, a plan's growth)
    goes out no faster than the rate control lets its destination be sent, as a round's sends
    do; :meth:`trail_due` says when the tokens will cover a quantum."""
    from pydblp.collective import cc as ccmod
    from pydblp.collective.messages import OutMessage

    rk = ranks(2)
    col = rk.cols[0]
    p = col.protocol
    with col._poll_lock:  # (the idle responder stays out)
        o = OutMessage(True, 1, np.zeros((40, p.C), np.float32), np.zeros(40, np.uint8), 0, 5, 7)
        p.trail[(5, True, 1)] = o
        now = p.clock()
        o.t_heard = o.t_last = now  # (its receiver is alive)
        p.cc.rate[1] = 10e6  # 10 Mbit/s, an empty bucket: a quantum is ms away
        p.cc.tokens[1], p.cc.t_tok[1] = 0.0, now
        p.serve_trail(now)
        assert o.sent == 0
        due = p.trail_due(now)
        assert due == pytest.approx(ccmod.WAIT_FRAMES * p.frame * 8 / 10e6, rel=0.01)
        p.serve_trail(now + due)
        assert o.sent == ccmod.WAIT_FRAMES  # (what the tokens covered)
        p.cc.rate[1] = 0  # not paced: a burst at once
        p.serve_trail(now + due)
        assert o.sent == min(o.n, ccmod.WAIT_FRAMES + p.cfg.burst)
        del p.trail[(5, True, 1)]
