"""Sharded optimizers (pydblp.torch.ShardedSGD / ShardedAdam): exact without loss, bounded under it.

Ranks are threads of this process over UDP on loopback (as tests/unit/test_broadcaster.py);
loss is seeded per packet (:func:`tests.helpers.seeded_loss`), so a run repeats its losses.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pydblp.collective import Collective, Config
from pydblp.torch import ShardedAdam, ShardedSGD, State
from pydblp.transport.udp import UdpTransport
from tests.helpers import run_threads, seeded_loss

WORLD = 3
CHUNK = 512  # 128 values a row


def _states(cfg: dict, loss: float = 0.0):
    ts = [UdpTransport(port=0) for _ in range(WORLD)]
    if loss:
        for r, t in enumerate(ts):
            seeded_loss(t, loss, seed=900 + r)
    peers = [("127.0.0.1", t.port) for t in ts]
    cols = [Collective(ts[r], r, WORLD, peers, Config(job=24, chunk_bytes=CHUNK, peer_timeout=20.0, **cfg))
            for r in range(WORLD)]
    return cols, [State(c) for c in cols]


def _close(cols, states):
    for s in states:
        s.close(barrier=False)
    for c in cols:
        c.close()


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Tanh(), torch.nn.Linear(30, 5))


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(16, 40, generator=g), torch.randint(0, 5, (16,), generator=g)


def _loss(m, x, y):
    return torch.nn.functional.cross_entropy(m(x), y)


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_without_loss_a_sharded_optimizer_is_torch_s_on_the_exact_mean(kind):
    """Every rank ends each step with what torch.optim's SGD (momentum 0.9) or Adam gives on the
    exact mean of the ranks' gradients."""
    steps = 5
    cols, states = _states({"phase": "static:0.0"})
    make = (lambda s, m: ShardedSGD(s, m, lr=0.1, momentum=0.9)) if kind == "sgd" else \
        (lambda s, m: ShardedAdam(s, m, lr=0.01))
    out, opts = {}, {}
    models = [_model() for _ in range(WORLD)]  # (the global RNG: not from the threads)

    def go(r):
        m = models[r]
        opt = opts[r] = make(states[r], m)
        for i in range(steps):
            opt.zero_grad()
            _loss(m, *_batch(r, i)).backward()
            opt.step()
        out[r] = [p.detach().clone() for p in m.parameters()]

    try:
        _, errs = run_threads(go, range(WORLD), 60)
        assert not errs, errs
    finally:
        _close(cols, states)
    ref = _model()
    opt = (torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9) if kind == "sgd"
           else torch.optim.Adam(ref.parameters(), lr=0.01))
    for i in range(steps):
        grads = []
        for r in range(WORLD):
            ref.zero_grad()
            _loss(ref, *_batch(r, i)).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        for p, *g in zip(ref.parameters(), *grads):
            p.grad = sum(g) / WORLD
        opt.step()
    for r in range(WORLD):
        for got, want in zip(out[r], ref.parameters()):
            torch.testing.assert_close(got, want.detach(), atol=2e-5, rtol=1e-4)
    # each owner keeps optimizer state for its own rows only: together, the tensor's rows once
    rows = -(-sum(p.numel() for p in ref.parameters()) // (CHUNK // 4))
    for name in opts[0].STATE:
        assert sum(opts[r]._buffers[name].shape[0] for r in range(WORLD)) == rows


def test_under_loss_replicas_lag_their_owners_and_do_not_drift():
    """10 % seeded loss, bound 30 %, the all-gather tolerant (consistent=False): after every step
    each parameter row at each rank is its owner's value or that rank's own value from before the
    step (never anything else), and the ranks' largest difference does not grow over the run: a
    row that lags is set to its owner's value by the next round that delivers it."""
    steps = 60
    cols, states = _states({"phase": "static:0.3", "consistent": False}, loss=0.10)
    hist = {r: [] for r in range(WORLD)}
    models = [_model() for _ in range(WORLD)]

    def go(r):
        m = models[r]
        opt = ShardedSGD(states[r], m, lr=0.1, momentum=0.9)
        for i in range(steps):
            before = torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()
            opt.zero_grad()
            _loss(m, *_batch(r, i)).backward()
            opt.step()
            hist[r].append((before, torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()))

    try:
        _, errs = run_threads(go, range(WORLD), 120)
        assert not errs, errs
    finally:
        _close(cols, states)
    n = hist[0][0][1].numel()
    T = -(-n // (CHUNK // 4))
    bounds = [(k * T // WORLD * (CHUNK // 4), min(n, (k + 1) * T // WORLD * (CHUNK // 4))) for k in range(WORLD)]
    spread, lagging = [], 0
    for i in range(steps):
        after = torch.stack([hist[r][i][1] for r in range(WORLD)])
        for k, (a, b) in enumerate(bounds):
            owner = after[k, a:b]
            for j in range(WORLD):
                got, mine = after[j, a:b], hist[j][i][0][a:b]
                ok = (got == owner) | (got == mine)
                assert bool(ok.all()), (i, k, j)
                lagging += int((got != owner).sum())
        spread.append(float((after.max(0).values - after.min(0).values).max()))
    assert lagging > 0  # the loss reached the all-gather
    q = steps // 4
    assert np.mean(spread[-q:]) < 1.5 * np.mean(spread[:q]), spread


def test_bad_arguments_are_refused_with_one_line():
    cols, states = _states({})
    try:
        with pytest.raises(ValueError, match="momentum"):
            ShardedSGD(states[0], _model(), lr=0.1, momentum=1.0)
        with pytest.raises(ValueError, match="lr"):
            ShardedSGD(states[0], _model(), lr=0)
        with pytest.raises(ValueError, match="betas"):
            ShardedAdam(states[0], _model(), betas=(0.9, 1.0))
    finally:
        _close(cols, states)


def test_a_step_on_a_closed_state_raises_at_once():
    """An optimizer that outlives its State (closed by the user, or by the dblp group when it
    re-forms after a failure) raises at its next step instead of waiting forever for a
    transport thread that is gone; a second close does nothing."""
    cols, states = _states({"phase": "static:0.0"})
    models = [_model() for _ in range(WORLD)]
    opts = [ShardedSGD(states[r], models[r], lr=0.1) for r in range(WORLD)]
    _close(cols, states)
    states[0].close()

    def step(r):
        _loss(models[r], *_batch(r, 0)).backward()
        opts[r].step()

    _, errs = run_threads(step, range(WORLD), 30)
    assert set(errs) == set(range(WORLD))
    assert all(isinstance(e, RuntimeError) and "State is closed" in str(e) for e in errs.values()), errs


def test_float64_parameters_are_refused_in_one_line():
    """The sharded step is float32: a float64 model would be rounded at every step, so it is
    refused at construction, saying what to use."""
    with pytest.raises(ValueError, match=r"^torch.float64 parameters: a sharded optimizer steps float32"):
        ShardedSGD(None, _model().double(), lr=0.1)
