"""The ``dblp`` torch.distributed backend (pydblp.torch.backend) in real processes on loopback.

Each job runs tests/unit/backend_rank.py once per rank (the ``udp`` data plane, FileStore
rendezvous); ranks write what they saw, the test checks it against Gloo's run or against the
collective's definition.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import pydblp.torch
from pydblp.collective import CollectiveError, Config
from pydblp.jobkey import KeyLoadError
from pydblp.net import NetError

ROOT = Path(__file__).resolve().parents[2]
WORLD = 4


def _job(case: str, backend: str, tmp: Path, world: int = WORLD, env: dict | None = None,
         timeout: float = 120, logs: list | None = None) -> list[dict | list]:
    """Run ``case`` on ``world`` rank processes; each rank's output (None for a rank that wrote none).
    ``logs``: a list each rank's stdout and stderr are appended to."""
    e = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.unit.backend_rank", case, backend, str(r), str(world),
                               str(tmp)], env=e, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(world)]
    logs = [] if logs is None else logs
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    name = {"ddp": "params", "fsdp": "params"}.get(case, case)
    outs = []
    for r in range(world):
        f = tmp / f"{name}.{backend}.{r}.pt"
        outs.append(torch.load(f, weights_only=False) if f.exists() else None)
    for r, (p, o) in enumerate(zip(procs, outs)):
        if o is None and not (case in ("death", "lost", "crash") and r == world - 1):
            raise AssertionError(f"rank {r} wrote nothing (rc {p.returncode}):\n{logs[r][-3000:]}")
    return outs


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.slow
@pytest.mark.parametrize("case, tol", [("ddp", 1e-5), ("fsdp", 1e-5)])
def test_an_unmodified_script_trains_over_dblp_as_over_gloo(tmp_path, case, tol):
    """Only the backend string differs: DDP (50 steps; rank-dependent initial values, which DDP's
    broadcast must replace) and FSDP2 (20 steps) end with Gloo's parameters within 1e-5."""
    gloo = _job(case, "gloo", tmp_path)
    ours = _job(case, "dblp", tmp_path)
    assert _max_diff(gloo[0], ours[0]) < tol
    for r in range(1, WORLD):  # every replica the same
        assert _max_diff(ours[0], ours[r]) < tol


def test_every_collective_against_its_definition(tmp_path):
    W = WORLD
    outs = _job("ops", "dblp", tmp_path)
    base = torch.arange(5) * W + W * (W - 1) // 2  # sum over r of (arange(5) + r)
    for r, res in enumerate(outs):
        for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32):
            got = res[f"sum.{dt}"]
            assert got.dtype == dt and torch.equal(got, base.to(dt)), (dt, got)
        assert res[f"{dist.ReduceOp.MAX}"].tolist() == [W, 0, 7]
        assert res[f"{dist.ReduceOp.MIN}"].tolist() == [1, -(W - 1), 7]
        assert res[f"{dist.ReduceOp.PRODUCT}"].tolist() == [24, 0, 7 ** W]
        assert res["bor"].tolist() == [True, False, True]
        assert torch.allclose(res["avg"], torch.full((3,), (W - 1) / 2))
        assert torch.equal(res["avg.future"], res["avg"])
        full = sum(torch.arange(W * 3, dtype=torch.float32) * (k + 1) for k in range(W))
        assert torch.allclose(res["rs.sum"], full[r * 3: (r + 1) * 3])
        ints = sum(torch.arange(W * 3, dtype=torch.int64) + k for k in range(W))
        assert torch.equal(res["rs.int"], ints[r * 3: (r + 1) * 3])
        assert res["ag.int8"].tolist() == [10 * k + i for k in range(W) for i in range(3)]
        assert torch.equal(res["ag.list"], torch.stack([torch.full((2, 3), float(k)) for k in range(W)]))
        assert res["bcast"].tolist() == [i * W for i in range(7)]
        # the bits themselves: a NaN, a negative zero, a subnormal, an infinity
        want = torch.tensor([float("nan"), -0.0, 1e-40, float("inf")]).view(torch.int32)
        assert torch.equal(res["bcast.bits"], want)
        assert res["objects"] == list(range(W)) and res["bobj"] == {"k": "v"}
        assert (res["sub"].tolist() == [3.0] * 4) if r < 2 else "sub" not in res
        errs = res["errors"]
        assert set(errs) == {"premul", "avg.int", "band.float", "meta", "all_to_all", "all_to_all.list", "send"}, errs
        assert all(e.startswith("ValueError: dblp: ") for e in errs.values()), errs
        assert all("new_group(backend=" in errs[k] for k in ("all_to_all", "all_to_all.list", "send")), errs
        assert res["tols"] == [0.0]  # nothing outside backward tolerated loss


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["ddp", "fsdp", "fsdp-tolerant"])
def test_gradient_rounds_tolerate_loss_and_nothing_else_does(tmp_path, algo):
    """Under 10 % seeded loss with DBLP's controller (P_low 0.2, P_high 0.6): DDP's bucket rounds
    or FSDP2's reduce-scatters (in backward) carry a bound and some end below full delivery; an
    all_reduce after training is exact; the controller counted one step per backward pass and
    decided alike on every rank; every replica holds the same parameters (FSDP: one copy of each
    shard).  FSDP2's parameter all-gather is exact unless ``allgather="tolerant"``.  The job's
    last round (a barrier under the same loss, then ``destroy_process_group``) ends on every
    rank: none leaves while a peer still needs a retransmission of its part."""
    outs = _job("tolerant", "dblp", tmp_path, env={"LOSS": "0.1", "DBLP_PHASE": "dblp:0.2", "ALGO": algo})
    want = torch.arange(100_000, dtype=torch.float32) * sum(range(1, WORLD + 1))
    for res in outs:
        assert set(res["grad_tols"]) <= {51 / 255, 153 / 255}, res["grad_tols"]  # on the wire's 1/255 scale
        assert min(res["grad_delivered"]) < 1.0
        assert res["steps"] == 20 and res["decisions"] and res["decisions"] == outs[0]["decisions"]
        assert torch.equal(res["exact"], want) and res["exact_rec"] == 0.0
        if algo == "ddp":
            assert _max_diff(outs[0]["params"], res["params"]) == 0.0
        elif algo == "fsdp":
            assert res["ag_tols"] == [0.0] and min(res["ag_delivered"]) == 1.0
        else:
            assert set(res["ag_tols"]) <= {51 / 255, 153 / 255} and min(res["ag_delivered"]) < 1.0


def test_every_op_and_dtype_gives_what_gloo_gives(tmp_path):
    """3 ranks, over Gloo and over the dblp group: all_reduce and reduce_scatter_tensor with every
    op (SUM, AVG, MIN, MAX, PRODUCT, BAND, BOR, BXOR), and broadcast, all_gather_into_tensor,
    reduce (at dst), gather and scatter, each of ten dtypes (float32, float16, bfloat16, float64,
    int8, uint8, int32, int64, bool, complex64); all_reduce and broadcast into strided
    (transposed, channels_last) tensors.  Where Gloo gives a result the dblp group gives
    the same: integers and bool exactly, floats within the mean's rounding (its float SUM/AVG is
    a mean times the world).  Where Gloo is refused, dblp is refused with a ValueError at the call
    (torch's own, or one of its own) or gives a result; a refusal never fails the group."""
    gloo = _job("matrix", "gloo", tmp_path, world=3)
    ours = _job("matrix", "dblp", tmp_path, world=3)
    compared = 0
    for g, d in zip(gloo, ours):
        for key, want in g.items():
            got = d[key]
            if isinstance(want, str):  # refused for Gloo: by torch itself (the same words), or by Gloo
                assert isinstance(got, torch.Tensor) or got == want or got.startswith("ValueError: dblp: "), (key, got)
                continue
            assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, (key, got)
            assert got.stride() == want.stride(), key  # (written into the caller's tensor)
            if want.is_floating_point() or want.is_complex():
                torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2, msg=str(key))
            else:
                assert torch.equal(got, want), (key, got, want)
            compared += 1
    assert compared > 3 * 100  # (most pairs have a result on both)


def test_fsdp2_checkpoints_with_torch_distributed_checkpoint(tmp_path):
    """dcp.save and dcp.load (which gather and scatter their plans) over the dblp group: a model
    built with other values loads the saved parameters exactly, on every rank."""
    for res in _job("checkpoint", "dblp", tmp_path):
        assert _max_diff(res["saved"], res["loaded"]) == 0.0
        assert _max_diff(res["saved"], [torch.zeros_like(p) for p in res["saved"]]) > 0  # (not all zeros)


def test_a_work_waits_for_its_future_and_raises_its_error():
    from pydblp.torch.backend import _Work

    ok, bad, slow = torch.futures.Future(), torch.futures.Future(), torch.futures.Future()
    ok.set_result([torch.ones(1)])
    bad.set_exception(CollectiveError("rank 0: rank 2 sent nothing"))
    assert _Work(ok).wait() and _Work(ok).is_completed() and _Work(ok).get_future() is ok
    with pytest.raises(CollectiveError, match="rank 2 sent nothing"):
        _Work(bad).wait()
    with pytest.raises(dist.DistError, match="did not complete within"):
        _Work(slow).wait(datetime.timedelta(milliseconds=50))
    assert not _Work(slow).is_completed()
    slow.set_result([])
    assert _Work(slow).wait(datetime.timedelta(seconds=5))


def test_an_operation_that_fails_outside_backward_raises(tmp_path):
    """The last rank leaves after one all_reduce.  The survivors' next all_reduce raises from its
    ``wait()`` (not: returns with the tensor unchanged), naming the silent rank; a later async
    broadcast's ``wait()`` and a later all_reduce's future raise too, naming the first failure."""
    outs = _job("lost", "dblp", tmp_path, env={"DBLP_PEER_TIMEOUT": "2"}, timeout=90)
    assert outs[-1] is None
    for res in outs[:-1]:
        assert res["first"] == [10.0] * 4
        assert res["all_reduce"].startswith("CollectiveError: ") and "rank 3 sent nothing" in res["all_reduce"], res
        for later in ("broadcast", "future"):
            assert "an earlier round failed" in res[later] and "rank 3" in res[later], res


def test_a_rank_that_crashes_closes_at_once_and_its_peers_fail_naming_it(tmp_path):
    """The last rank raises (uncaught, no destroy_process_group) after one all_reduce.  Its atexit
    close does not wait for the others (they are in a round it never joins: waiting would only
    end at its peer_timeout, with a warning); their next all_reduce fails naming it."""
    logs: list = []
    outs = _job("crash", "dblp", tmp_path, env={"DBLP_PEER_TIMEOUT": "2"}, timeout=90, logs=logs)
    assert outs[-1] is None and "SystemError: a bug in the training script" in logs[-1]
    assert "closing before every rank did" not in logs[-1], logs[-1][-2000:]
    for res in outs[:-1]:
        assert res.startswith("CollectiveError: ") and "rank 3 sent nothing" in res, res


@pytest.mark.slow
@pytest.mark.parametrize("survive", [False, True])
def test_a_dead_rank(tmp_path, survive):
    """The last rank exits at step 5 of 15.  Without ``survive`` the others' backward raises an
    error naming it (and nothing hangs); with it they drop that step, go on as three, and end
    with identical parameters."""
    env = {"DBLP_PEER_TIMEOUT": "2", "DBLP_SURVIVE": "1" if survive else "0"}
    outs = _job("death", "dblp", tmp_path, env=env, timeout=90)
    assert outs[-1] is None
    alive = outs[:-1]
    if not survive:
        for res in alive:
            assert res["done"] == 5 and "rank 3 sent nothing" in res["error"], res
        return
    for res in alive:
        assert "error" not in res, res
        assert res["done"] == 15 and res["members"] == [0, 1, 2]
        assert _max_diff(alive[0]["params"], res["params"]) == 0.0


@pytest.mark.parametrize("options, env, says", [
    (pydblp.torch.BackendOptions(transport="bogus"), {}, "transport 'bogus': use udp, xsk or xsk-ktx"),
    (pydblp.torch.BackendOptions(transport="xsk"), {}, "the xsk transport needs iface="),
    (pydblp.torch.BackendOptions(iface="nope0"), {}, "no interface 'nope0' (see `ip link`)"),
    (pydblp.torch.BackendOptions(tolerate="some"), {}, "tolerate 'some': use backward or none"),
    (pydblp.torch.BackendOptions(config=Config(phase="static:2")), {}, "tolerance"),
    (None, {"DBLP_SURVIVE": "yes"}, "DBLP_SURVIVE='yes': use 1 or 0"),
    (None, {"DBLP_ALLGATHER": "some"}, "allgather 'some': use exact or tolerant (set DBLP_ALLGATHER)"),
    (None, {"DBLP_PHASE": "fast"}, "DBLP_PHASE='fast': "),
    (None, {"DBLP_RATE": "10g"}, "DBLP_RATE='10g': bad rate"),
    (None, {"DBLP_PORT": "abc"}, "DBLP_PORT='abc': use an integer"),
    (None, {"DBLP_PEER_TIMEOUT": "inf"}, "DBLP_PEER_TIMEOUT='inf': peer_timeout inf: use a positive number"),
    (None, {"DBLP_TRANSPORT": "xsk"}, "needs iface= (set DBLP_TRANSPORT, DBLP_IFACE)"),
    (None, {"DBLP_KEY_FILE": "/nonexistent/key"}, "/nonexistent/key"),
    ("gloo-options", {}, "pg_options str: give pydblp.torch.BackendOptions(...)"),
])
def test_a_bad_option_is_refused_at_init_in_one_line(tmp_path, monkeypatch, options, env, says):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    before = {t.name for t in threading.enumerate()}
    with pytest.raises((ValueError, KeyLoadError, NetError)) as e:
        dist.init_process_group("dblp", init_method=f"file://{tmp_path}/store", rank=0, world_size=1,
                                pg_options=options, timeout=datetime.timedelta(seconds=10))
    msg = str(e.value)
    assert says in msg and "\n" not in msg, msg
    assert not dist.is_initialized()
    assert {t.name for t in threading.enumerate()} <= before  # nothing was left running


def test_a_rank_busy_between_steps_is_waited_for_up_to_the_groups_timeout(tmp_path):
    """Rank 0 alone is busy 3 x ``peer_timeout`` between two DDP steps: the others wait for it in
    the next step (its group's thread says it is alive) and every rank ends with the same
    parameters; the group's ``timeout`` (60 s) is how long they would wait (``join_timeout``)."""
    outs = _job("busy", "dblp", tmp_path, world=3, env={"DBLP_PEER_TIMEOUT": "1"}, timeout=90)
    assert [o["join_timeout"] for o in outs] == [60.0] * 3
    assert all(o["hellos"] >= 1 for o in outs[1:])
    assert all(_max_diff(o["params"], outs[0]["params"]) == 0 for o in outs[1:])


def test_options_from_the_environment():
    """Every documented variable reaches its option (DBLP_RATE with units, as tc writes them);
    a tolerant all-gather brings the inconsistent collective it needs."""
    o = pydblp.torch.BackendOptions.from_env({"DBLP_RATE": "10gbit", "DBLP_PORT": "47801", "DBLP_SURVIVE": "1",
                                              "DBLP_ALLGATHER": "tolerant", "DBLP_PHASE": "static:0.1",
                                              "DBLP_JOB": "9", "DBLP_PEER_TIMEOUT": "3.5"})
    assert (o.rate, o.port, o.survive, o.allgather) == (10**10, 47801, True, "tolerant")
    assert (o.config.consistent, o.config.job, o.config.peer_timeout) == (False, 9, 3.5)
    assert pydblp.torch.BackendOptions.from_env({}) == pydblp.torch.BackendOptions()


def test_a_list_of_interfaces_gives_each_local_rank_its_own():
    """The AF_XDP kinds take one rank per interface: on a host of four ranks, one ``DBLP_IFACE``
    for all of them names four interfaces, and torchrun's ``LOCAL_RANK`` picks; a list that
    cannot be read is one line saying what to set."""
    env = {"DBLP_TRANSPORT": "xsk", "DBLP_IFACE": "eth1, eth2,eth3,eth4"}
    got = [pydblp.torch.BackendOptions.from_env({**env, "LOCAL_RANK": str(r)}).iface for r in range(4)]
    assert got == ["eth1", "eth2", "eth3", "eth4"]
    assert pydblp.torch.BackendOptions.from_env({**env, "DBLP_IFACE": "eth7", "LOCAL_RANK": "3"}).iface == "eth7"
    for extra, message in (({"LOCAL_RANK": "4"}, r"lists 4 interfaces and LOCAL_RANK is 4: list one per rank"),
                           ({}, r"LOCAL_RANK=None is not a rank: launch with torchrun, or set LOCAL_RANK"),
                           ({"DBLP_IFACE": "eth1,,eth3", "LOCAL_RANK": "0"}, r"an empty name in the list")):
        with pytest.raises(ValueError, match=message) as e:
            pydblp.torch.BackendOptions.from_env({**env, **extra})
        assert "\n" not in str(e.value)


def test_a_misspelt_variable_is_named_with_the_one_meant(caplog):
    """``DBLP_PEER_TIMOUT`` would leave the default timeout in place unnoticed: it is logged with
    the variable meant.  Variables read elsewhere in pydblp, and names close to none, are not."""
    with caplog.at_level("WARNING", logger="pydblp.torch.backend"):
        o = pydblp.torch.BackendOptions.from_env({"DBLP_PEER_TIMOUT": "3", "DBLP_NATIVE": "0",
                                                  "DBLP_KEY_FILE": "/x", "DBLP_SOMETHING_ELSE": "1"})
    assert o == pydblp.torch.BackendOptions()
    said = [r.getMessage() for r in caplog.records]
    assert said == ["DBLP_PEER_TIMOUT is ignored: no such dblp variable; did you mean DBLP_PEER_TIMEOUT?"], said


@pytest.mark.parametrize("spec", ["dblp", "cpu:dblp,cuda:nccl"])
def test_destroy_releases_the_group(tmp_path, spec):
    """A one-rank group: its thread and data plane go with ``destroy_process_group``.  A device
    map naming dblp for the CPU makes the same group (a Python group serves every device)."""
    dist.init_process_group(spec, init_method=f"file://{tmp_path}/store", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=10))
    try:
        pg = dist.group.WORLD
        assert isinstance(pg, pydblp.torch.ProcessGroupDblp) and dist.get_backend() == spec
        assert pg.state.collective.cfg.join_timeout == 10.0  # init_process_group's timeout
        t = torch.arange(4.0)
        dist.all_reduce(t)
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
        thread = pg.state._thread
        assert thread.is_alive()
    finally:
        dist.destroy_process_group()
    thread.join(5)
    assert not thread.is_alive()
    assert pg.state._owned == []  # collective and data plane closed
