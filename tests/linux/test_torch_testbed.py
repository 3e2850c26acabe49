"""``pydblp.torch.State.from_process_group`` over a testbed, one process per worker namespace.

Each rank is a real process in its worker's namespace: Gloo (the control
plane) rendezvouses over the workers' links, then the state opens its data
plane on eth0 (``xsk``/``xsk-ktx`` attach the host XDP program themselves)
and the DDP hook runs a step.  Afterwards nothing may be left attached.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from pydblp import host
from pydblp.testbed import Testbed
from tests.helpers import run_in_workers, unique_name

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"}
WORLD = 2

RANK = r"""
import datetime, sys
import numpy as np, torch, torch.distributed as dist
import pydblp.torch as ptorch
from pydblp.collective import Config

rank, kind, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
chunk = None if sys.argv[4] == "link" else int(sys.argv[4])  # link: sized to the links' MTU
allgather = sys.argv[5] if len(sys.argv) > 5 else "unicast"
group = ("198.19.255.255", 47800) if allgather == "broadcast" else None  # the testbed's broadcast address
dist.init_process_group("gloo", init_method=f"tcp://198.18.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
state = ptorch.State.from_process_group(kind, iface="eth0", group=group,
                                        config=Config(job=7, peer_timeout=20.0, chunk_bytes=chunk,
                                                      allgather=allgather))
try:
    # 300k floats: ~850 packets a rank and round, both ways
    x = np.arange(300_000, dtype=np.float32) * (rank + 1)
    got = state.submit(lambda col: col.allreduce(x)).wait()
    assert np.array_equal(got, np.arange(300_000, dtype=np.float32) * 1.5), got[:4]
    # the DDP hook: one step, gradients equal Gloo's mean
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 4)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(state, ptorch.hook)
    inp = torch.full((8, 64), float(rank + 1))
    ddp(inp).sum().backward()
    ref = torch.nn.Linear(64, 4)
    ref.load_state_dict(model.state_dict())
    ref(torch.full((8, 64), 1.5)).sum().backward()  # the loss is linear in the input: mean of ranks' grads
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-5), (p.grad - q.grad).abs().max()
    recs = state.collective.records
    assert recs and all(r.min_delivered == 1.0 and not r.below_bound for r in recs)
    t = state.collective.t
    print(f"ok {rank} rounds {len(recs)} transport {type(t).__name__}:{getattr(t, 'tx', '-')} "
          f"chunk {state.collective.cfg.chunk_bytes} rx {t.stats()['rx_packets']} "
          f"allgather {state.collective.cfg.allgather}", flush=True)
finally:
    state.close()
    dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def tb(bpf_xdp):
    with Testbed(workers=WORLD, name=unique_name("tt")) as t:
        yield t


@pytest.mark.parametrize("kind, allgather", [("udp", "unicast"), ("xsk", "unicast"), ("xsk-ktx", "unicast"),
                                             ("udp", "broadcast"), ("xsk-ktx", "broadcast")])
def test_state_from_process_group_in_the_testbed(tb, kind, allgather):
    port = 29600 + ["udp", "xsk", "xsk-ktx"].index(kind) + 3 * (allgather == "broadcast")
    outs = run_in_workers(tb, lambda r: [sys.executable, "-c", RANK, str(r), kind, str(port), "1408", allgather],
                          ENV, 120, f"State.from_process_group({kind!r}, {allgather})")
    # the state attached the host program (xsk, xsk-ktx) and detached it on close
    for r in range(WORLD):
        assert host.attached_program("eth0", tb.ns(r)) is None
    want = {"udp": "UdpTransport:-", "xsk": "XskQueues:xsk", "xsk-ktx": "XskQueues:kernel"}[kind]
    assert all(f"transport {want}" in out and f"allgather {allgather}" in out for out in outs), outs


@pytest.mark.parametrize("kind", ["xsk", "xsk-ktx"])
def test_a_failed_open_detaches_what_it_attached(tb, kind, tmp_path):
    """The AF_XDP socket cannot bind (no queue 99 on a veth): the call raises, and the host
    program it had attached for that socket is gone again at once, not when the garbage
    collector gets to it (the caught exception's traceback still holds the call's frame)."""
    import torch.distributed as dist

    import pydblp.torch as ptorch

    assert host.attached_program("eth0", tb.ns(0)) is None
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        with pytest.raises(Exception, match="queue|bind|Invalid") as caught:
            ptorch.State.from_process_group(kind, iface="eth0", netns=tb.ns(0), queue=99)
        assert caught.tb is not None  # alive: the frames (and what they hold) too
        assert host.attached_program("eth0", tb.ns(0)) is None
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tb_jumbo(bpf_xdp):
    with Testbed(workers=WORLD, name=unique_name("tj"), mtu=9000) as t:
        yield t


def _chunks(outs) -> set[int]:
    return {int(out.split(" chunk ")[1].split()[0]) for out in outs}


@pytest.mark.parametrize("kind", ["udp", "xsk-ktx"])
def test_chunks_sized_to_jumbo_links(tb_jumbo, kind):
    """``Config(chunk_bytes=None)`` on MTU 9000 links: both ranks pick 8000-byte chunks (a rank
    receives ~5.7x fewer packets than at 1408) and the allreduce and the DDP hook stay exact."""
    port = 29610 + ["udp", "xsk-ktx"].index(kind)
    outs = run_in_workers(tb_jumbo, lambda r: [sys.executable, "-c", RANK, str(r), kind, str(port), "link"],
                          ENV, 120, f"State.from_process_group({kind!r}, chunk_bytes=None)")
    assert _chunks(outs) == {8000}, outs
    # 1.2 MB: 150 chunks of 8000 bytes, so a rank takes in 75 + 75 (at 1408 bytes: 853 chunks, ~855),
    # the DDP bucket's few and the control packets
    assert all(int(out.split(" rx ")[1].split()[0]) < 300 for out in outs), outs
    for r in range(WORLD):
        assert host.attached_program("eth0", tb_jumbo.ns(r)) is None


def test_chunks_sized_to_the_smallest_link(tb_jumbo):
    """One rank's NIC at MTU 1500 among jumbo links: every rank agrees on its size, 1408, and
    the rounds are exact (a rank choosing by its own MTU would send 8000-byte chunks it cannot
    receive, or that the other reads as another tensor)."""
    from pydblp import net

    with net.ipr(tb_jumbo.ns(1)) as ip:
        ip.link("set", index=net.ifindex("eth0", tb_jumbo.ns(1)), mtu=1500)
    try:
        outs = run_in_workers(tb_jumbo, lambda r: [sys.executable, "-c", RANK, str(r), "udp", "29615", "link"],
                              ENV, 120, "State.from_process_group('udp', chunk_bytes=None), mixed MTUs")
    finally:
        with net.ipr(tb_jumbo.ns(1)) as ip:
            ip.link("set", index=net.ifindex("eth0", tb_jumbo.ns(1)), mtu=9000)
    assert _chunks(outs) == {1408}, outs


KEYED = r"""
import datetime, sys, time
import numpy as np, torch.distributed as dist
import pydblp.torch as ptorch
from pydblp.collective import CollectiveError, Config

rank, kind, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://198.18.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
state = ptorch.State.from_process_group(kind, iface="eth0", config=Config(job=9, peer_timeout=10.0))
try:
    x = np.arange(300_000, dtype=np.float32) * (rank + 1)
    t0 = time.monotonic()
    try:
        got = state.submit(lambda col: col.allreduce(x)).wait()
        assert np.array_equal(got, np.arange(300_000, dtype=np.float32) * 1.5), got[:4]
        s = state.collective.t.stats()
        print(f"ok {rank} exact {type(state.collective.t).__name__} verified {s['auth_verified']}", flush=True)
    except CollectiveError as e:
        print(f"ok {rank} failed after {time.monotonic() - t0:.1f} s: {e}", flush=True)
finally:
    state.close(barrier=False)
    dist.destroy_process_group()
"""


@pytest.mark.parametrize("kind", ["udp", "xsk-ktx"])
@pytest.mark.parametrize("same", [True, False])
def test_state_with_a_job_key(tb, tmp_path, kind, same):
    """Each rank reads the job key from its own file (``DBLP_KEY_FILE``), never the store: with
    the same key the rounds are exact and every packet was verified; with different keys both
    ranks fail their round with one error naming the cause, well within the peer timeout."""
    keys = [tmp_path / f"k{r}" for r in range(WORLD)]
    for r, k in enumerate(keys):
        k.write_bytes(bytes(range(32)) if same or r == 0 else bytes(range(1, 33)))
        k.chmod(0o600)
    port = 29620 + 2 * ["udp", "xsk-ktx"].index(kind) + same
    procs_env = [{**ENV, "DBLP_KEY_FILE": str(k)} for k in keys]
    import subprocess

    procs = [tb.popen(w, [sys.executable, "-c", KEYED, str(r), kind, str(port)], env=procs_env[r],
                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r, w in enumerate(tb.workers)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=90)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"a keyed rank hung: {p.communicate()[0][-3000:]}")
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"ok {r}" in out, out[-3000:]
        if same:
            assert "exact AuthTransport" in out and int(out.split(" verified ")[1].split()[0]) > 0, out
        else:
            assert "failed authentication" in out and "different job keys" in out, out
            assert float(out.split(" failed after ")[1].split()[0]) < 10.0, out
    for r in range(WORLD):
        assert host.attached_program("eth0", tb.ns(r)) is None


SHARDED = r"""
import datetime, sys
import torch, torch.distributed as dist
import pydblp.torch as ptorch
from pydblp.collective import Config

rank, kind, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://198.18.0.1:{port}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
cfg = Config(job=8, peer_timeout=20.0, consistent=False, phase="static:0")  # (exact: no tolerance)
state = ptorch.State.from_process_group(kind, iface="eth0", config=cfg)
try:
    torch.manual_seed(rank)  # different starting values: the optimizer broadcasts rank 0's
    model = torch.nn.Linear(300, 200)  # 60k parameters: ~170 chunks, 85 per owner
    opt = ptorch.ShardedSGD(state, model, lr=0.1, momentum=0.9)
    torch.manual_seed(0)
    ref = torch.nn.Linear(300, 200)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        opt.zero_grad()
        model(torch.full((4, 300), float(rank + 1 + step))).sum().backward()
        opt.step()
        ref_opt.zero_grad()
        ref(torch.full((4, 300), 1.5 + step)).sum().backward()  # linear in the input: the ranks' mean
        ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-5), (p - q).abs().max()
    print(f"ok {rank} rounds {len(state.collective.records)}", flush=True)
finally:
    state.close()
    dist.destroy_process_group()
"""


@pytest.mark.parametrize("kind", ["xsk", "xsk-ktx"])
def test_a_sharded_optimizer_over_af_xdp_is_torch_s_sgd(tb, kind):
    """``ShardedSGD`` on the AF_XDP data plane: ranks that start from different values end each of
    three steps with torch.optim.SGD's (momentum 0.9) on the mean gradient; nothing is left attached."""
    port = 29620 + ["xsk", "xsk-ktx"].index(kind)
    run_in_workers(tb, lambda r: [sys.executable, "-c", SHARDED, str(r), kind, str(port)], ENV, 120,
                   f"ShardedSGD over {kind}")
    for r in range(WORLD):
        assert host.attached_program("eth0", tb.ns(r)) is None
