"""The ``dblp`` torch.distributed backend under torchrun, four nodes on the testbed.

An unmodified DDP training script (tests/unit/backend_rank.py, case ``ddp``: 50 steps of SGD
with momentum, rank-dependent initial values that DDP's broadcast replaces) in which only the
backend string changes trains over ``dblp`` as over Gloo: each worker namespace runs
``python -m torch.distributed.run --nnodes 4 --nproc-per-node 1 --node-rank R`` with worker
0's data address as the master (``init_method="env://"``), Gloo once as the reference, then
``dblp`` on each data plane (``DBLP_TRANSPORT``/``DBLP_IFACE``/``DBLP_PORT``; the AF_XDP kinds
attach the host program themselves).  At zero loss (the fabric drops nothing) the parameters
equal Gloo's within 1e-5, every replica holds the same ones, and nothing is left attached.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from pydblp import host, wire
from pydblp.testbed import Testbed
from tests.helpers import run_in_workers, unique_name

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "unit" / "backend_rank.py"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"}
WORLD = 4
TOL = 1e-5
# DBLP_* per data plane: the AF_XDP kinds' host program filters DBLP_PORT (the default port, and
# another one to show the option reaches the program the backend attaches); udp picks free ports
PLANES = {
    "xsk": ({"DBLP_TRANSPORT": "xsk", "DBLP_PORT": str(wire.DEFAULT_PORT)}, "XskQueues:xsk"),
    "xsk-ktx": ({"DBLP_TRANSPORT": "xsk-ktx", "DBLP_PORT": str(wire.DEFAULT_PORT + 1)}, "XskQueues:kernel"),
    "udp": ({"DBLP_TRANSPORT": "udp"}, "UdpTransport:-"),
}


@pytest.fixture(scope="module")
def tb(bpf_xdp):
    with Testbed(workers=WORLD, name=unique_name("tk")) as t:
        yield t


def _torchrun(tb, backend: str, port: int, out: Path, env: dict | None = None) -> list[dict]:
    """Run the ``ddp`` case under torchrun on every worker (node rank = worker); by rank, what it
    wrote: ``{"params": [...], "group": {...}}``."""
    out.mkdir(exist_ok=True)
    left = set(Path(tempfile.gettempdir()).glob("torchelastic_*"))
    # (--log-dir: torchrun's per-run log directories go under the test's own, not the system's temp)
    run_in_workers(tb, lambda r: [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(WORLD),
                                  "--nproc-per-node", "1", "--node-rank", str(r), "--master-addr", tb.addr(0),
                                  "--master-port", str(port), "--log-dir", str(out / f"elastic-{r}"),
                                  str(SCRIPT), "ddp", backend, "env", "env", str(out)],
                   {**ENV, **(env or {})}, 150, f"torchrun ddp over {backend} {env or ''}")
    assert set(Path(tempfile.gettempdir()).glob("torchelastic_*")) <= left, "torchrun left a log directory behind"
    return [{name: torch.load(out / f"{name}.{backend}.{r}.pt", weights_only=False) for name in ("params", "group")}
            for r in range(WORLD)]


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.fixture(scope="module")
def gloo(tb, tmp_path_factory):
    """The reference: the same script over Gloo (its parameters after 50 steps, by rank)."""
    runs = _torchrun(tb, "gloo", 29700, tmp_path_factory.mktemp("gloo"))
    assert all(r["group"]["backend"] == "gloo" for r in runs)
    return [r["params"] for r in runs]


@pytest.mark.parametrize("kind", list(PLANES))
def test_torchrun_ddp_over_dblp_equals_gloo(tb, gloo, tmp_path, kind):
    env, transport = PLANES[kind]
    tb.clear()
    tb.stats(reset=True)
    port = 29701 + list(PLANES).index(kind)
    runs = _torchrun(tb, "dblp", port, tmp_path / kind, {**env, "DBLP_IFACE": "eth0"})
    for r, run in enumerate(runs):
        g = run["group"]
        # the data plane asked for, every round exact (the default phase tolerates no loss)
        assert g["backend"] == "dblp" and g["transport"] == transport, g
        assert g["rounds"] > 50 and g["tols"] == [0.0] and g["delivered"] == 1.0, g
        assert _max_diff(gloo[r], run["params"]) < TOL, (r, _max_diff(gloo[r], run["params"]))
        assert all(torch.equal(p, q) for p, q in zip(runs[0]["params"], run["params"])), f"rank {r}'s replica differs"
    stats = tb.stats()
    assert tb.fabric.dropped() == 0, stats  # zero loss
    assert all(stats[w].get("pass", {}).get("packets", 0) > 0 for w in tb.workers), stats  # over the fabric
    # the backend attached the host program (AF_XDP kinds) and detached it as the group was destroyed
    for r in range(WORLD):
        assert host.attached_program("eth0", tb.ns(r)) is None
