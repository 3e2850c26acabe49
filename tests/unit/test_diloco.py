"""DiLoCo (exact and gossip) and the Gloo exchange, in real processes on loopback."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pydblp.torch.exchange import neighbours

WORLD = 3
TIMEOUT = 3.0  # the exchange's per-round timeout in these tests (s): generous, the machine is shared


# ---- topologies (pure) ---------------------------------------------------------

@pytest.mark.parametrize("topology", ["ring", "exp", "random"])
@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_neighbours_are_symmetric_and_agreed(topology, world):
    for rnd in range(6):
        nb = {r: neighbours(topology, r, world, rnd, seed=7) for r in range(world)}
        for r, ps in nb.items():
            assert r not in ps
            for p in ps:
                assert r in nb[p], (topology, world, rnd, r, p)  # undirected: weights stay doubly stochastic
        if topology == "random":
            assert all(len(ps) <= 1 for ps in nb.values())
            assert sum(len(ps) == 0 for ps in nb.values()) == world % 2


def test_neighbours_shapes():
    assert neighbours("ring", 0, 5, 0) == [1, 4]
    assert neighbours("exp", 0, 8, 0) == [1, 2, 4, 6, 7]
    assert neighbours("exp", 1, 4, 0) == [0, 2, 3]          # complete at 4
    draws = {tuple(neighbours("random", 0, 8, r, seed=1)) for r in range(20)}
    assert len(draws) > 1                                  # a new peer across rounds
    with pytest.raises(ValueError, match="topology"):
        neighbours("star", 0, 4, 0)


# ---- workers -------------------------------------------------------------------

def _leave() -> None:
    """End a spawned rank whose work is done without the interpreter's finalization: torch's
    teardown of Gloo's and autograd's threads at exit now and then aborts such a process
    ("terminate called without an active exception"; pytorch/pytorch#190489)."""
    os._exit(0)


def _init(rank: int, init_file: str):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _train(rank: int, init_file: str, out_dir: str, mode: str, topology: str, blocking: int, overlap: int):
    from pydblp.torch import DiLoCo, GlooExchange

    _init(rank, init_file)
    ex = GlooExchange(timeout=20.0)
    try:
        model = _model()
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = torch.optim.SGD(model.parameters(), lr=1.0)   # lr 1, no momentum: the outer step lands on
        g = torch.Generator().manual_seed(10 + rank)           # anchor - mean(pseudo-gradients)
        locals_, after = [], []
        with DiLoCo(ex, model, inner, outer, sync_every=4, mode=mode, topology=topology,
                    blocking_rounds=blocking, overlap_rounds=overlap) as d:
            for step in range(12):
                x = torch.randn(8, 6, generator=g)
                inner.zero_grad()
                torch.nn.functional.mse_loss(model(x)[:, 0], x[:, rank]).backward()  # ranks disagree
                if (step + 1) % 4 == 0:
                    locals_.append([p.detach().clone() for p in model.parameters()])
                inner.step()
                if (step + 1) % 4 == 0:
                    after.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist())
        final = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
        with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
            json.dump({"after": after, "final": final, "records": [r.__dict__ for r in d.records],
                       "bytes": ex.bytes_sent}, f, default=str)
    finally:
        ex.close()
        dist.destroy_process_group()
    _leave()


def _run(fn, tmp_path, *args):
    init = str(tmp_path / "init")
    mp.start_processes(fn, args=(init, str(tmp_path), *args), nprocs=WORLD, start_method="spawn", join=True)
    return [json.load(open(tmp_path / f"{r}.json")) for r in range(WORLD)]


@pytest.mark.slow
@pytest.mark.parametrize("mode,topology,blocking,overlap", [("exact", "ring", 0, 0), ("gossip", "exp", 1, 0)])
def test_outer_step_averages_to_one_model(tmp_path, mode, topology, blocking, overlap):
    """Exact DiLoCo, and gossip over a complete graph (exp at 3 ranks), give every rank one model."""
    out = _run(_train, tmp_path, mode, topology, blocking, overlap)
    for k in range(3):
        a = torch.tensor(out[0]["after"][k])
        for r in (1, 2):
            assert torch.allclose(a, torch.tensor(out[r]["after"][k]), atol=1e-6), (mode, k, r)
    assert all(not rec["missing"] or rec["missing"] == "{}" for o in out for rec in o["records"])


def _last_round_then_close(rank: int, init_file: str, out_dir: str):
    from pydblp.torch import GlooExchange

    _init(rank, init_file)
    ex = GlooExchange(timeout=TIMEOUT)
    try:
        dist.barrier()
        if rank == WORLD - 1:
            time.sleep(1.0)  # the others' messages are in its mailbox: its round ends at once
            send_loop = ex._send_loop

            def late(peer, q):  # its sender threads start late, as on a loaded machine
                time.sleep(0.3)
                send_loop(peer, q)

            ex._send_loop = late
        peers = [p for p in range(WORLD) if p != rank]
        _, arrived = ex.neighbours_average(torch.full((4,), float(rank)), peers, [0.3] * len(peers), round=0)
    finally:
        ex.close()  # the last rank closes right after queueing its message: it must still go out
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump({"arrived": arrived}, f)
    dist.destroy_process_group()
    _leave()


@pytest.mark.slow
def test_a_closing_exchange_delivers_its_last_round_first(tmp_path):
    """A rank whose last round ends at once (its neighbours' tensors already arrived) and which
    closes right away still delivers its own tensor: the others take it in."""
    out = _run(_last_round_then_close, tmp_path)
    for r in range(WORLD - 1):
        assert WORLD - 1 in out[r]["arrived"], out


@pytest.mark.slow
def test_gossip_ring_overlap_pulls_ranks_together(tmp_path):
    """Only non-blocking mixing (ring = complete graph at 3 ranks): leaving the context applies the
    last overlapped mixing, which makes the anchors, and so the models, one; without mixing they differ."""
    def spread(out, key="final"):
        x = torch.tensor([o[key] for o in out])
        return (x - x.mean(0)).norm().item()

    (tmp_path / "mixed").mkdir()
    mixed = _run(_train, tmp_path / "mixed", "gossip", "ring", 0, 1)
    (tmp_path / "none").mkdir()
    apart = _run(_train, tmp_path / "none", "gossip", "ring", 0, 0)

    assert spread(mixed) < 1e-5 < spread(apart)
    assert spread(mixed, "after") > 1e-3  # before that mixing: one inner phase of local progress apart
    assert mixed[0]["bytes"] > 0 and apart[0]["bytes"] == 0


# ---- skip and re-admit: a real process dies (Gloo) ---------------------------------

DIES_AFTER = 5  # rank 2's last round in the Gloo test below


def _rounds(rank: int, init_file: str, out_dir: str):
    from pydblp.torch import GlooExchange

    _init(rank, init_file)
    ex = GlooExchange(timeout=TIMEOUT, readmit_every=2)
    ex.LATE_KEEP = 2
    ex._box = box = _CountedChecks(ex._box)
    log = []
    try:
        for rnd in range(8):
            if rank == 2 and rnd == DIES_AFTER:
                os._exit(0)  # dies without closing anything
            peers = [r for r in range(WORLD) if r != rank]
            x = torch.full((1000,), float(rank))
            before = box.checks
            y, arrived = ex.neighbours_average(x, peers, [1 / 3, 1 / 3], rnd)
            log.append({"round": rnd, "arrived": arrived, "value": y[0].item(), "suspects": sorted(ex.suspects),
                        "checks": box.checks - before, "late": len(ex._late.get(2, ()))})
        with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
            json.dump(log, f)
    finally:
        ex.close()
    _leave()


class _CountedChecks:
    """A mailbox (TCPStore) that counts its ``check`` calls: the lookups a round makes."""

    def __init__(self, box):
        self.box, self.checks = box, 0

    def check(self, keys):
        self.checks += 1
        return self.box.check(keys)

    def __getattr__(self, name):
        return getattr(self.box, name)


def _run_rounds(tmp_path):
    init = str(tmp_path / "init")
    ctx = mp.start_processes(_rounds, args=(init, str(tmp_path)), nprocs=WORLD, start_method="spawn", join=False)
    while not ctx.join():
        pass
    return [json.load(open(tmp_path / f"{r}.json")) for r in range(2)]


@pytest.mark.slow
def test_dead_peer_is_skipped_and_training_goes_on(tmp_path):
    """Rank 2, a real process, dies (os._exit, nothing closed) after round 4: the others finish
    all rounds over Gloo without it, averaging each other.  (The protocol's side of slow and dead
    neighbours, with PydblpExchange, runs on the simulator below.)"""
    for log in _run_rounds(tmp_path):
        assert len(log) == 8
        assert all(2 in e["arrived"] for e in log[:DIES_AFTER])
        assert all(2 not in e["arrived"] and e["value"] == pytest.approx(0.5) for e in log[DIES_AFTER:])
        assert log[-1]["suspects"] == [2]
        # a dead peer's given-up rounds: at most LATE_KEEP remembered, and one lookup a round
        # for them however many there are (a round's lookups stay the same while it is dead)
        assert [e["late"] for e in log[DIES_AFTER:]] == [1, 2, 2]
        assert len({e["checks"] for e in log[DIES_AFTER + 1:]}) == 1, log


def _subgroup(rank: int, init_file: str, out_dir: str):
    from pydblp.torch import GlooExchange

    _init(rank, init_file)
    g = dist.new_group([1, 2])  # (every rank creates it)
    res = {}
    try:
        if rank == 0:
            with pytest.raises(ValueError, match="not a member") as e:
                GlooExchange(group=g, tag="sub")
            res["error"] = str(e.value)
        else:
            ex = GlooExchange(group=g, tag="sub", timeout=TIMEOUT)
            try:
                res["rank"], res["world"] = ex.rank, ex.world
                res["mean"] = ex.allreduce_mean(torch.full((4,), float(rank))).tolist()
                peers = neighbours("ring", ex.rank, ex.world, 0)
                y, res["arrived"] = ex.neighbours_average(torch.full((4,), float(rank)), peers, [0.5], 0)
                res["average"] = y.tolist()
            finally:
                ex.close()
        with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
            json.dump(res, f)
    finally:
        dist.destroy_process_group()
    _leave()


@pytest.mark.slow
def test_an_exchange_on_a_subgroup_averages_within_it(tmp_path):
    """GlooExchange(group=[1, 2]) of 3 ranks: its ranks and world are the group's (0, 1 of 2),
    the exact mean and a ring average are over ranks 1 and 2 (1.5, not 1.0), and rank 0 is
    refused in one line."""
    out = _run(_subgroup, tmp_path)
    assert "not a member" in out[0]["error"]
    for r, res in ((1, out[1]), (2, out[2])):
        assert (res["rank"], res["world"]) == (r - 1, 2)
        assert res["mean"] == [1.5] * 4 and res["average"] == [1.5] * 4
        assert res["arrived"] == [2 - r]


# ---- skip and re-admit: PydblpExchange on the simulator (virtual time) -------------

class _Inline:
    """What PydblpExchange uses of a :class:`pydblp.torch.State`, on a simulated rank: each round
    runs at once in the rank's own program (not on a transport thread)."""

    def __init__(self, collective):
        self.collective = collective

    def submit(self, fn, *args):
        fut = torch.futures.Future()
        fut.set_result(fn(self.collective, *args))
        return fut


def _sim_rounds(stall: float = 0.0, dies: float | None = None, rounds: int = 8):
    """Three ranks, each averaging with the other two through PydblpExchange (``TIMEOUT``,
    ``readmit_every`` 2) for ``rounds`` rounds, 0.1 s of compute after each; rank 2 computes
    ``stall`` more before round 1, or dies at virtual time ``dies``.  The nodes; each program's
    result is its log, one entry per round (``at``: when the round began, ``took``: how long)."""
    from pydblp.collective import Config
    from pydblp.sim import Sim
    from pydblp.torch import PydblpExchange

    s = Sim(WORLD, Config(peer_timeout=2 * TIMEOUT), seed=1)
    if dies is not None:
        s.kill(2, at=dies)

    def program(node):
        ex = PydblpExchange(_Inline(node.collective), timeout=TIMEOUT, readmit_every=2)
        log = []
        for rnd in range(rounds):
            if node.rank == 2 and rnd == 1:
                node.compute(stall)
            peers = [r for r in range(WORLD) if r != node.rank]
            at = node.now
            y, arrived = ex.neighbours_average(torch.full((1000,), float(node.rank)), peers, [1 / 3, 1 / 3], rnd)
            log.append({"round": rnd, "arrived": arrived, "value": y[0].item(), "suspects": sorted(ex.suspects),
                        "at": at, "took": node.now - at})
            node.compute(0.1)
        return log

    return s.run(program)


def test_a_slow_neighbour_is_skipped_suspected_then_readmitted():
    """Rank 2 computes three timeouts before round 1 (past the two a neighbour may get when its
    previous round's message began a timeout late): left out of round 1 and suspect, waited for
    again every second round, and back in (no longer suspect, in every average) once it
    catches up."""
    nodes = _sim_rounds(stall=3 * TIMEOUT)
    assert not any(n.error for n in nodes)
    for log in (n.result for n in nodes[:2]):
        assert log[0]["value"] == pytest.approx(1.0) and 2 in log[0]["arrived"]  # (0+1+2)/3
        r1 = log[1]
        assert 2 not in r1["arrived"] and r1["suspects"] == [2]
        assert r1["value"] == pytest.approx(0.5)  # renormalised over ranks 0 and 1
        back = next(e["round"] for e in log[2:] if 2 in e["arrived"])  # re-admitted
        assert all(2 in e["arrived"] and e["value"] == pytest.approx(1.0) and e["suspects"] == []
                   for e in log[back:]), log
    assert all(e["arrived"] == [0, 1] for e in nodes[2].result)  # the others waited, or their tensors were there


def test_a_dead_neighbour_is_skipped_and_waited_for_every_second_round():
    """Rank 2 dies after round 2: the others finish every round without it, averaging each other,
    never raising; once suspect it is waited for (a full timeout) only every second round, and
    the rounds between take no time waiting for it."""
    nodes = _sim_rounds(dies=0.25)  # rounds begin every ~0.1 s: during rank 2's compute after round 2
    assert nodes[2].error == "killed"
    for log in (n.result for n in nodes[:2]):
        assert len(log) == 8
        assert all(2 in e["arrived"] for e in log[:3])
        assert all(2 not in e["arrived"] and e["value"] == pytest.approx(0.5) for e in log[3:])
        assert all(e["suspects"] == [2] for e in log[3:])
        # round 3: at most two timeouts (its round-2 message began late enough to be waiting out
        # a dead peer of its own); then one timeout in every second round, none in between
        assert TIMEOUT <= log[3]["took"] <= 2 * TIMEOUT
        assert [e["took"] >= TIMEOUT for e in log[4:]] == [False, True, False, True]
        assert all(e["took"] < TIMEOUT + 0.01 for e in log[4:])
        assert all(e["took"] < 0.01 for e in log[4::2])


# ---- the CLI's checks (before any testbed is built) -------------------------------

@pytest.mark.parametrize("argv,says", [
    (["--runs", "gossip,bogus"], "--runs takes ddp, exact, exact-pydblp, gossip, gossip-kill"),
    (["--workers", "2"], "gossip-kill needs --workers 3 or more"),
    (["--outer-steps", "1"], "--outer-steps 1: use 2 or more"),
    (["--peer-timeout", "0"], "--peer-timeout 0: use a positive number of seconds"),
])
def test_experiment_diloco_usage_errors_are_one_line(capsys, argv, says):
    from pydblp import cli

    assert cli.main(["experiment", "--algo", "diloco", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


# ---- gossip over pydblp's collective (ranks are threads, UDP on loopback) ----------

@pytest.mark.parametrize("topology,overlap", [("exp", 0), ("exp", 1), ("random", 1)])
def test_gossip_over_pydblp_mixes_like_over_gloo(topology, overlap):
    """PydblpExchange's neighbour rounds: on a complete graph (exp at 3 ranks) one blocking round
    gives every rank one model after each outer step; a random matching (odd rank out: a round
    with no peers, still numbered) pulls them together.  No neighbour is left out."""
    import threading

    from pydblp.torch import DiLoCo, PydblpExchange, State
    from tests.helpers import Ranks

    rk = Ranks(WORLD)
    states = [State(c) for c in rk.cols]
    models = [_model() for _ in range(WORLD)]  # (here: _model seeds torch's global generator)
    out, errs = {}, {}

    def go(rank):
        try:
            ex = PydblpExchange(states[rank], timeout=3.0)
            model = models[rank]
            inner = torch.optim.SGD(model.parameters(), lr=0.1)
            outer = torch.optim.SGD(model.parameters(), lr=1.0)
            g = torch.Generator().manual_seed(10 + rank)
            after = []
            with DiLoCo(ex, model, inner, outer, sync_every=4, mode="gossip", topology=topology,
                        blocking_rounds=1, overlap_rounds=overlap, seed=5) as d:
                for step in range(12):
                    x = torch.randn(8, 6, generator=g)
                    inner.zero_grad()
                    torch.nn.functional.mse_loss(model(x)[:, 0], x[:, rank]).backward()
                    inner.step()
                    if (step + 1) % 4 == 0:
                        after.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
            out[rank] = (after, d.records, ex.bytes_sent)
        except Exception as e:  # asserted below
            errs[rank] = e

    th = [threading.Thread(target=go, args=(r,)) for r in range(WORLD)]
    try:
        for t in th:
            t.start()
        for t in th:
            t.join(60)
        assert not any(t.is_alive() for t in th), "a rank hung"
        assert not errs, errs
    finally:
        for s in states:
            s.close(barrier=False)
    assert all(not rec.missing for r in out for rec in out[r][1])
    assert all(out[r][2] > 0 for r in out)
    spread = [max(float((out[r][0][k] - out[0][0][k]).abs().max()) for r in out) for k in range(3)]
    if topology == "exp":
        assert max(spread) < 1e-5, spread
    else:
        apart = float((out[1][0][0] - out[0][0][0]).abs().max())
        assert all(s > 0 for s in spread) and apart < 1.0, spread  # mixed, not one model, not blown apart


# ---- one process: what DiLoCo does around its exchange --------------------------------

class _Echo:
    """An exchange of rank 0 of 2 whose peer always holds this rank's values: an average gives
    back the tensor; counts 4 bytes a value sent to each peer.  ``fail``: neighbour averages raise."""

    rank, world, supports_neighbours = 0, 2, True

    def __init__(self, fail: bool = False):
        self.bytes_sent, self.suspects, self.fail = 0, {}, fail

    def neighbours_average(self, tensor, peers, weights, round):
        if self.fail:
            raise RuntimeError("the network is gone")
        self.bytes_sent += 4 * tensor.numel() * len(peers)
        return tensor.clone(), list(peers)

    def allreduce_mean(self, tensor):
        self.bytes_sent += 4 * tensor.numel()
        return tensor.clone()


def _outer_steps(model, ex, steps: int = 8, lr: float = 0.1, **kw):
    from pydblp.torch import DiLoCo

    inner = torch.optim.SGD(model.parameters(), lr=lr)
    outer = torch.optim.SGD(model.parameters(), lr=1.0)
    g = torch.Generator().manual_seed(3)
    with DiLoCo(ex, model, inner, outer, sync_every=2, **kw) as d:
        for _ in range(steps):
            x = torch.randn(4, 6, generator=g, dtype=next(model.parameters()).dtype)
            inner.zero_grad()
            model(x).square().mean().backward()
            inner.step()
    return d


def test_each_record_counts_the_background_rounds_it_applied():
    """Gossip with one background and one blocking round per outer step: each record counts its
    blocking round and the background round it applied (none before the first); only the last
    background round, applied on leaving the context, is in no record."""
    ex = _Echo()
    d = _outer_steps(_model(), ex, mode="gossip", overlap_rounds=1, blocking_rounds=1)
    size = 4 * sum(p.numel() for p in _model().parameters())
    assert [r.bytes_sent for r in d.records] == [size, 2 * size, 2 * size, 2 * size]
    assert sum(r.bytes_sent for r in d.records) + size == ex.bytes_sent


def test_a_float64_model_keeps_its_precision_through_outer_steps():
    """The anchor is float64 for a float64 model: with no inner progress (lr 0) and an exact
    mean of one worker's own pseudo-gradient, every parameter comes back bit for bit (a float32
    anchor would round 1 + 1e-12 to 1)."""
    model = _model().double()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1 + 1e-12)
    _outer_steps(model, _Echo(), lr=0.0, mode="exact")
    assert all(bool((p == 1 + 1e-12).all()) for p in model.parameters())


def test_a_parameter_unfrozen_after_construction_fails_the_outer_step():
    """DiLoCo synchronises the parameters that trained when it was built: unfreezing another
    one later raises at the next outer step, naming the fix (it would drift unseen)."""
    from pydblp.torch import DiLoCo

    model = _model()
    model[0].weight.requires_grad_(False)
    inner = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    outer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    with pytest.raises(ValueError, match="trainable parameters changed.*build DiLoCo after"):
        with DiLoCo(_Echo(), model, inner, outer, sync_every=1, mode="exact"):
            model[0].weight.requires_grad_(True)
            model(torch.ones(2, 6)).sum().backward()
            inner.step()


def test_a_background_error_behind_the_callers_own_is_logged(caplog):
    """Leaving the context on the caller's exception while background rounds failed: the
    caller's exception goes on, and the background one is logged, not dropped."""
    from pydblp.torch import DiLoCo

    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=1.0)
    with caplog.at_level("ERROR", logger="pydblp.torch.diloco"), pytest.raises(KeyError):
        with DiLoCo(_Echo(fail=True), model, inner, outer, sync_every=1, mode="gossip", blocking_rounds=0):
            model(torch.ones(2, 6)).sum().backward()
            inner.step()  # the outer step: starts the background round, which fails
            raise KeyError("the caller's own")
    assert "background mixing rounds failed too: the network is gone" in caplog.text
