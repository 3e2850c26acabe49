"""The DDP hook against Gloo, at zero loss, in real processes on loopback."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pydblp.collective.config import TENSOR_WARM_UP

WORLD = 3
STEPS = 15


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 5))


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import pydblp.torch as ptorch
    from pydblp.collective import Config, Dblp

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    # k=0: the controller measures and decides, and tolerance stays 0 (results must match Gloo's)
    state = ptorch.State.from_process_group("udp", port=0, config=Config(job=3, phase=Dblp(0.0, k=0.0, freq=2)))
    try:
        ours = DDP(_model(0), bucket_cap_mb=0.01)  # small buckets: several rounds per step
        ours.register_comm_hook(state, ptorch.hook)
        state.warm_up(ours)  # (before the first backward: rounds of zeros the controller never sees)
        ref = DDP(_model(0), bucket_cap_mb=0.01)
        opt_a = torch.optim.SGD(ours.parameters(), lr=0.2)
        opt_b = torch.optim.SGD(ref.parameters(), lr=0.2)
        teacher = torch.randn(20, 5, generator=torch.Generator().manual_seed(5))  # learnable labels
        g = torch.Generator().manual_seed(100 + rank)
        log = {"grad_diff": [], "loss_ours": [], "loss_gloo": [], "gnorm_gloo": []}
        for _ in range(STEPS):
            x = torch.randn(32, 20, generator=g)
            y = (x @ teacher).argmax(dim=1)
            for model, opt, key in ((ours, opt_a, "loss_ours"), (ref, opt_b, "loss_gloo")):
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                log[key].append(loss.item())
            log["grad_diff"].append(max((pa.grad - pb.grad).abs().max().item()
                                        for pa, pb in zip(ours.parameters(), ref.parameters())))
            log["gnorm_gloo"].append(torch.cat([p.grad.reshape(-1) for p in ref.parameters()]).norm().item())
            opt_a.step()
            opt_b.step()
        log["rounds"] = len(state.collective.records)
        log["tensors"] = [r.tensor for r in state.collective.records]
        log["warm_bytes"] = [r.bytes_sent for r in list(state.collective.records)[:2]]
        log["history"] = list(state.collective.controller.history)
        with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
            json.dump(log, f)
    finally:
        state.close()
        dist.destroy_process_group()
    # a rank whose work is done ends without the interpreter's finalization: torch's teardown of
    # Gloo's and autograd's threads at exit now and then aborts the process ("terminate called
    # without an active exception"), as tests/unit/test_diloco.py's workers do
    os._exit(0)


def test_hook_matches_gloo_gradients_and_training_curve(tmp_path):
    mp.start_processes(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD,
                       join=True, start_method="spawn")
    logs = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(WORLD)]
    for log in logs:
        assert max(log["grad_diff"]) < 1e-5
        assert log["loss_ours"] == pytest.approx(log["loss_gloo"], abs=1e-4)
        assert log["rounds"] > STEPS + 2  # more than one bucket per step went through pydblp
        assert log["tensors"][:2] == [TENSOR_WARM_UP] * 2 and TENSOR_WARM_UP not in log["tensors"][2:]
        # sized to DDP's bucket cap (0.01 MiB: 2,621 values, 8 chunks; a rank sends ~12 of them),
        # not to the model's 5,829 values (17 chunks; ~23 a rank, 33 KB)
        assert all(0 < b < 25_000 for b in log["warm_bytes"]), log["warm_bytes"]
    assert logs[0]["loss_ours"][-1] < logs[0]["loss_ours"][0]  # it trained
    # the phase controller observes by step: G is the norm of the whole step's averaged gradient
    # (every bucket), measured every freq=2 steps, the same on every rank
    hist = logs[0]["history"]
    assert [h[0] for h in hist] == list(range(0, STEPS, 2))
    assert [h[1] for h in hist] == pytest.approx([logs[0]["gnorm_gloo"][s] for s, _, _ in hist], rel=1e-4)
    assert all(log["history"] == hist for log in logs[1:])


def test_from_process_group_rejects_bad_arguments_before_opening_anything(tmp_path):
    import pydblp.torch as ptorch
    from pydblp.collective import Config

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init1'}", rank=0, world_size=1)
    keys_before = dist.distributed_c10d._get_default_store().num_keys()
    try:
        with pytest.raises(ValueError, match="use udp, xsk or xsk-ktx"):
            ptorch.State.from_process_group("tcp")
        for kind in ("xsk", "xsk-ktx"):
            with pytest.raises(ValueError, match=f"the {kind} transport needs iface="):
                ptorch.State.from_process_group(kind)
        # a bad config is refused before a transport opens or this rank publishes itself in the store
        store = dist.distributed_c10d._get_default_store()
        with pytest.raises(ValueError, match="estimator 'median'"):
            ptorch.State.from_process_group("udp", config=Config(job=9, estimator="median"))
        with pytest.raises(ValueError, match="allgather 'broadcast' needs group="):
            ptorch.State.from_process_group("udp", config=Config(job=9, allgather="broadcast"))
        with pytest.raises(ValueError, match="group is used only with"):
            ptorch.State.from_process_group("udp", config=Config(job=9), group=("127.255.255.255", 9))
        assert store.num_keys() == keys_before
    finally:
        dist.destroy_process_group()


class _Bucket:
    """What the hook reads of a DDP GradBucket: the flat buffer, its index, whether it is the step's last."""

    def __init__(self, buf: torch.Tensor, index: int = 0):
        self._buf, self._index = buf, index

    def buffer(self) -> torch.Tensor:
        return self._buf

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return True


@pytest.mark.parametrize("dtype,strided", [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)])
def test_the_hook_writes_the_mean_into_the_bucket_itself(ranks, dtype, strided):
    """As DDP's own allreduce hook: the future's value is the bucket's buffer, holding the mean
    (float32: the round ran in place, reading and writing that memory; another dtype or a strided
    buffer: through a contiguous float32 copy, written back).  Two ranks over loopback, a bucket
    of a partial last chunk."""
    import pydblp.torch as ptorch

    rk = ranks(2)
    states = [ptorch.State(c) for c in rk.cols]
    try:
        n = 5 * 352 + 17
        g = torch.Generator().manual_seed(3)
        xs = [torch.randn(n, generator=g).to(dtype) for _ in range(2)]
        bufs = [torch.zeros(2 * n, dtype=dtype)[::2].copy_(x) if strided else x.clone() for x in xs]
        ptrs = [b.data_ptr() for b in bufs]
        futs = [ptorch.hook(states[r], _Bucket(bufs[r])) for r in range(2)]
        got = [f.wait() for f in futs]
        want = (xs[0].float() + xs[1].float()) / 2
        for r in range(2):
            assert got[r] is bufs[r] and got[r].data_ptr() == ptrs[r] and got[r].dtype == dtype
            torch.testing.assert_close(got[r].float(), want.to(dtype).float(), rtol=0, atol=1e-6)
    finally:
        for s in states:
            s.close(barrier=False)


def test_state_warm_up_sizes_its_rounds_to_the_model_and_refuses_bad_arguments_without_failing(ranks):
    """``State.warm_up(model)``: rounds as large as the model's trainable parameters (a frozen
    layer does not count); a bad argument is refused in the caller's thread with ValueError, and
    the state's rounds go on (a failure on the transport thread would have ended them)."""
    import pydblp.torch as ptorch
    from tests.helpers import run_threads

    rk = ranks(2)
    states = [ptorch.State(c) for c in rk.cols]
    try:
        model = torch.nn.Sequential(torch.nn.Linear(30, 40), torch.nn.Linear(40, 7))
        model[0].requires_grad_(False)
        for s in states:
            with pytest.raises(ValueError, match="warm_up: rounds"):
                s.warm_up(model, rounds=-1)
            with pytest.raises(ValueError, match="no trainable parameters"):
                s.warm_up(torch.nn.Linear(3, 3).requires_grad_(False))
        _, errs = run_threads(lambda r: states[r].warm_up(model, rounds=1), range(2), 60.0)
        assert not errs
        for c in rk.cols:
            (rec,) = c.records
            assert rec.tensor == TENSOR_WARM_UP
            # 287 values (40 * 7 + 7): one chunk, which each rank sends once (a retransmission
            # allowed); the frozen layer's 1,240 more would make it five chunks, 7,200 bytes a rank
            assert 0 < rec.bytes_sent < 4 * 1500
        bufs = [torch.full((500,), float(r)) for r in range(2)]
        got = [f.wait() for f in [ptorch.hook(states[r], _Bucket(bufs[r])) for r in range(2)]]
        assert all(torch.equal(g, torch.full((500,), 0.5)) for g in got)
    finally:
        for s in states:
            s.close(barrier=False)
