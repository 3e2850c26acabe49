"""Checkpoints: N steps, state_dict, torch.save / torch.load(weights_only=True), load into objects
built afresh (new collectives over new UDP transports on loopback), M steps: the N + M steps of an
uninterrupted run, bit for bit.  Without loss every round is exact, so the two runs' arithmetic is
the same whatever the timing.

Ranks are threads of this process (as tests/unit/test_sharded.py); every input is a function of
(rank, step) through seeded generators.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from pydblp.collective import Collective, Config, Dblp, Static
from pydblp.torch import DiLoCo, PydblpExchange, ShardedAdam, ShardedSGD, State, _arrays, _tensors
from pydblp.transport.udp import UdpTransport
from tests.helpers import run_threads

WORLD = 3
CHUNK = 512  # 128 values a row

OPTIMIZERS = {"sgd": lambda s, m: ShardedSGD(s, m, lr=0.1, momentum=0.9),
              "adam": lambda s, m: ShardedAdam(s, m, lr=0.01)}


def _states(**cfg) -> list[State]:
    ts = [UdpTransport(port=0) for _ in range(WORLD)]
    peers = [("127.0.0.1", t.port) for t in ts]
    return [State(Collective(ts[r], r, WORLD, peers, Config(job=45, chunk_bytes=CHUNK, peer_timeout=20.0, **cfg)))
            for r in range(WORLD)]


def _close(states: list[State]) -> None:
    for s in states:
        s.close(barrier=False)
        s.collective.close()


def _saved(obj):
    """``obj`` after torch.save and torch.load(weights_only=True): a copy, as a file would give it."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


# ---- sharded optimizers ----------------------------------------------------------

def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Tanh(), torch.nn.Linear(30, 5))


def _loss(model, rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(16, 40, generator=g), torch.randint(0, 5, (16,), generator=g)
    return torch.nn.functional.cross_entropy(model(x), y)


def _sharded(kind: str, steps: range, seed: int, load: dict | None = None, save_at: int | None = None):
    """Train ``steps`` with ``kind`` and a StepLR (lr halved every 2 steps) on new collectives,
    each rank first loading ``load[rank]`` if given; (final parameters, checkpoints taken after
    step ``save_at - 1``) by rank."""
    states = _states(phase="static:0")
    models = [_model(seed) for _ in range(WORLD)]  # (the global RNG: not from the threads)
    opts = [OPTIMIZERS[kind](states[r], models[r]) for r in range(WORLD)]
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in opts]
    ckpt = {}
    try:
        if load is not None:  # before any round, on every rank
            for r in range(WORLD):
                states[r].load_state_dict(load[r]["pydblp"])
                models[r].load_state_dict(load[r]["model"])
                opts[r].load_state_dict(load[r]["opt"])
                scheds[r].load_state_dict(load[r]["sched"])

        def go(r):
            for i in steps:
                if i == save_at:
                    ckpt[r] = _saved({"model": models[r].state_dict(), "opt": opts[r].state_dict(),
                                      "sched": scheds[r].state_dict(), "pydblp": states[r].state_dict()})
                opts[r].zero_grad()
                _loss(models[r], r, i).backward()
                opts[r].step()
                scheds[r].step()
            return _flat(models[r])

        out, errs = run_threads(go, range(WORLD), 60)
        assert not errs, errs
        if load is not None:  # another rank's state is refused, naming why
            with pytest.raises(ValueError, match="each rank loads its own"):
                opts[0].load_state_dict(load[1]["opt"])
    finally:
        _close(states)
    return out, ckpt


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_a_sharded_optimizer_resumed_from_a_checkpoint_takes_the_uninterrupted_steps(kind):
    """3 steps, a checkpoint (model, optimizer, scheduler, collective), 3 more: a run resumed from
    the checkpoint on new collectives, its model first built from another seed, ends with the
    uninterrupted run's parameters on every rank, bit for bit.  The lr changes on both sides of
    the checkpoint, and the owners' buffers (momentum; Adam's moments and step count) carry over."""
    n, m = 3, 3
    whole, ckpt = _sharded(kind, range(n + m), seed=0, save_at=n)
    assert ckpt[0]["opt"]["state"]["buffers"] and ckpt[0]["opt"]["state"]["steps"] == n
    resumed, _ = _sharded(kind, range(n, n + m), seed=1, load=ckpt)
    for r in range(WORLD):
        assert torch.equal(resumed[r], whole[r]), (r, float((resumed[r] - whole[r]).abs().max()))


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_an_lr_scheduler_sets_the_sharded_step(kind):
    """A MultiStepLR (lr / 10 from step 2) drives the sharded optimizer as it drives torch.optim's:
    every rank ends with torch's SGD (momentum 0.9) or Adam under the same schedule on the exact
    mean gradient, which is not where the constant lr leads."""
    steps = 4
    states = _states(phase="static:0")
    models = [_model(0) for _ in range(WORLD)]
    opts = [OPTIMIZERS[kind](states[r], models[r]) for r in range(WORLD)]
    scheds = [torch.optim.lr_scheduler.MultiStepLR(o, milestones=[2], gamma=0.1) for o in opts]

    def go(r):
        for i in range(steps):
            opts[r].zero_grad()
            _loss(models[r], r, i).backward()
            opts[r].step()
            scheds[r].step()
        return _flat(models[r])

    try:
        out, errs = run_threads(go, range(WORLD), 60)
        assert not errs, errs
    finally:
        _close(states)
    assert all(o.param_groups[0]["lr"] == pytest.approx(o.defaults["lr"] / 10) for o in opts)
    refs = []
    for scheduled in (True, False):
        ref = _model(0)
        opt = (torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9) if kind == "sgd"
               else torch.optim.Adam(ref.parameters(), lr=0.01))
        sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[2], gamma=0.1)
        for i in range(steps):
            grads = []
            for r in range(WORLD):
                ref.zero_grad()
                _loss(ref, r, i).backward()
                grads.append([p.grad.clone() for p in ref.parameters()])
            for p, *g in zip(ref.parameters(), *grads):
                p.grad = sum(g) / WORLD
            opt.step()
            if scheduled:
                sched.step()
        refs.append(_flat(ref))
    for r in range(WORLD):
        torch.testing.assert_close(out[r], refs[0], atol=2e-5, rtol=1e-4)
    assert float((refs[1] - refs[0]).abs().max()) > 1e-3  # the schedule changed the steps


# ---- DiLoCo -----------------------------------------------------------------------

def _small(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _diloco(mode: str, steps: range, seed: int, load: dict | None = None, save_at: int | None = None):
    """Train ``steps`` inner steps of DiLoCo (H = 4; gossip: random matchings, one overlapped and
    one blocking round) over PydblpExchange on new collectives, each rank first loading
    ``load[rank]``; (final parameters, checkpoints taken after inner step ``save_at - 1``) by rank."""
    states = _states()
    models = [_small(seed) for _ in range(WORLD)]
    inners = [torch.optim.Adam(m.parameters(), lr=0.01) for m in models]
    dilocos = [DiLoCo(PydblpExchange(states[r], timeout=8.0), models[r], inners[r],
                      torch.optim.SGD(models[r].parameters(), lr=0.7, momentum=0.9, nesterov=True),
                      sync_every=4, mode=mode, topology="random", overlap_rounds=1, blocking_rounds=1, seed=5)
               for r in range(WORLD)]
    ckpt = {}
    try:
        if load is not None:
            for r in range(WORLD):
                states[r].load_state_dict(load[r]["pydblp"])
                models[r].load_state_dict(load[r]["model"])
                inners[r].load_state_dict(load[r]["inner"])
                dilocos[r].load_state_dict(load[r]["diloco"])

        def go(r):
            model, inner = models[r], inners[r]
            with dilocos[r] as d:
                for i in steps:
                    if i == save_at:
                        ckpt[r] = _saved({"model": model.state_dict(), "inner": inner.state_dict(),
                                          "diloco": d.state_dict(), "pydblp": states[r].state_dict()})
                    g = torch.Generator().manual_seed(100 * i + r)
                    x = torch.randn(8, 6, generator=g)
                    inner.zero_grad()
                    torch.nn.functional.mse_loss(model(x)[:, 0], x[:, r]).backward()  # ranks disagree
                    inner.step()
            assert all(not rec.missing for rec in d.records)
            return _flat(model)

        out, errs = run_threads(go, range(WORLD), 60)
        assert not errs, errs
    finally:
        _close(states)
    return out, ckpt


@pytest.mark.parametrize("mode", ["exact", "gossip"])
def test_diloco_resumed_from_a_checkpoint_takes_the_uninterrupted_steps(mode):
    """6 inner steps (an outer step after the 4th), a checkpoint half way through the second
    inner phase (gossip: the overlapped mixing's result not applied yet), 6 more on new
    collectives and a new DiLoCo: every rank's parameters are the uninterrupted run's, bit for
    bit (the anchor, the outer momentum, the counters naming the mixing rounds and matchings, and
    the pending mixing carried over)."""
    n, m = 6, 6
    whole, ckpt = _diloco(mode, range(n + m), seed=0, save_at=n)
    state = ckpt[0]["diloco"]
    assert state["outer_steps"] == 1 and state["local_step"] == n and state["outer"]["state"]
    assert (state["overlap"] is not None) == (mode == "gossip")
    resumed, _ = _diloco(mode, range(n, n + m), seed=1, load=ckpt)
    for r in range(WORLD):
        assert torch.equal(resumed[r], whole[r]), (r, float((resumed[r] - whole[r]).abs().max()))


def test_an_exchange_s_suspects_survive_a_checkpoint():
    """A neighbour suspect when the exchange was saved is suspect in the exchange loaded from it,
    as many rounds from its next wait (the checkpoints above have none)."""
    states = _states()
    try:
        ex = PydblpExchange(states[0], timeout=8.0)
        ex.suspects = {2: 1}
        fresh = PydblpExchange(states[0], timeout=8.0)
        fresh.load_state_dict(_saved(ex.state_dict()))
        assert fresh.suspects == {2: 1}
    finally:
        _close(states)


# ---- phase control and the collective's counters ---------------------------------

def _grads(steps: int, rounds: int) -> list[list[np.ndarray]]:
    """Per step, its rounds' averaged gradients: a norm that holds (relaxed), jumps x4 at step 12
    (critical at the measurement there, or, observing rounds, relaxed again at the next: both on
    G against the one before), holds, falls x20 at step 35."""
    rng = np.random.default_rng(3)
    scale = [1.0 if s < 12 else 4.0 if s < 35 else 0.2 for s in range(steps)]
    return [[rng.normal(0, scale[s], 40 + 10 * k) for k in range(rounds)] for s in range(steps)]


def _decide(c: Dblp, grads, by_step: bool) -> list[tuple[float, str]]:
    """Feed ``grads`` (per step, its rounds') to ``c``: the tolerance and phase of every round."""
    out = []
    for step in grads:
        for g in step:
            index = len(out)
            out.append((c.tol(index), c.phase()))
            c.observe(index, g)
        if by_step:
            c.end_step()
    return out


@pytest.mark.parametrize("g_over", [None, "step", "window"])
def test_a_dblp_controller_resumed_from_its_state_decides_alike(g_over):
    """A Dblp measuring every 3rd round (None), or every 3rd step (two rounds a step) on the step's
    or the window's G, saved part way through a measured step (after the first of its two rounds)
    and a window, sent through torch.save as tensors and loaded into a new Dblp, makes the
    decisions the saved one makes, with the same G; a Static refuses its state."""
    by_step = g_over is not None
    grads = _grads(50, 2 if by_step else 1)
    make = (lambda: Dblp(freq=3, g_over=g_over)) if by_step else (lambda: Dblp(freq=3))
    a = make()
    if by_step:
        a.count_steps()
    _decide(a, grads[:12], by_step)
    _decide(a, [grads[12][:1]], False)  # (the first round of step 12: a measured step under way)
    b = make()
    b.load_state_dict(_arrays(_saved(_tensors(a.state_dict()))))
    rest = [grads[12][1:]] + grads[13:]
    want, got = _decide(a, rest, by_step), _decide(b, rest, by_step)
    assert got == want
    assert list(b.history) == list(a.history) and len(a.history) > 10
    phases = {p for _, p in want}
    assert phases == {"critical", "relaxed"}, phases
    with pytest.raises(ValueError, match="'dblp' controller's state given to a 'static' one"):
        Static().load_state_dict(a.state_dict())


def _rounds(rounds: range, load: dict | None = None, save_at: int | None = None):
    """Allreduce rounds ``rounds`` (768 values: two rows a shard, none of which a bound of 41 %
    leaves out) under Config(phase="dblp"), observing every round, on new collectives loaded from
    ``load``; (per rank: results, records (round, index, tol, phase), history; checkpoints)."""
    states = _states(phase="dblp")
    ckpt = {}
    try:
        if load is not None:
            with pytest.raises(ValueError, match="each rank loads its own"):
                states[0].load_state_dict(load[1])
            for r in range(WORLD):
                states[r].load_state_dict(load[r])

        def go(r):
            col, ys = states[r].collective, []
            for i in rounds:
                if i == save_at:
                    ckpt[r] = _saved(states[r].state_dict())
                scale = 1.0 if i < 15 else 4.0 if i < 35 else 0.2
                x = np.random.default_rng((i, r)).normal(0, scale, 768).astype(np.float32)
                ys.append(states[r].submit(lambda c, x=x: c.allreduce(x)).wait())
            recs = [(rec.round, rec.index, rec.tol, rec.phase) for rec in col.records]
            return ys, recs, list(col.controller.history)

        out, errs = run_threads(go, range(WORLD), 60)
        assert not errs, errs
        if load is not None:
            with pytest.raises(RuntimeError, match="before the first round"):
                states[0].load_state_dict(load[0])
    finally:
        _close(states)
    return out, ckpt


def test_a_collective_resumed_from_its_state_numbers_and_decides_its_rounds_alike():
    """45 rounds under a Dblp that measures every 10th (by index), a checkpoint after 23: the
    resumed collectives go on with the round numbers (the shuffle's permutations) and indices of
    the uninterrupted run, decide the same tolerances, and give the same results; a state is
    refused by another rank, and after the first round."""
    n, m = 23, 22
    whole, ckpt = _rounds(range(n + m), save_at=n)
    assert ckpt[0]["round"] == n and ckpt[0]["index"] == n
    resumed, _ = _rounds(range(n, n + m), load=ckpt)
    for r in range(WORLD):
        ys_w, recs_w, hist_w = whole[r]
        ys_r, recs_r, hist_r = resumed[r]
        assert recs_r == recs_w[n:]
        assert all(np.array_equal(a, b) for a, b in zip(ys_r, ys_w[n:]))
        assert hist_r == hist_w
    assert {p for _, _, _, p in recs_w[n:]} == {"critical", "relaxed"}
