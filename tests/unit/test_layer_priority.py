"""Priority from the model's structure: Config(priority="layer")."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from pydblp import wire
from pydblp.collective import Collective, Config, estimators
from pydblp.transport.udp import UdpTransport


def test_rule_output_layers_first_and_absolute_over_the_model():
    # 7 layers of 10 values each, chunks of 10: one chunk per layer, output (depth 6) class 1
    c = estimators.layer_classes([10] * 7, range(7), 7, 10)
    assert c.tolist() == [7, 6, 5, 4, 3, 2, 1]
    # 14 layers: two per class; a bucket of only early layers is all low priority (not banded anew)
    c = estimators.layer_classes([10, 10], [0, 1], 14, 10)
    assert c.tolist() == [7, 7]


def test_a_chunk_spanning_layers_takes_the_most_important():
    c = estimators.layer_classes([15, 5, 20], [6, 0, 3], 7, 10)  # chunks: [0,10) [10,20) [20,30) [30,40)
    assert c.tolist() == [1, 1, 4, 4]
    assert estimators.layer_classes([], [], 3, 10).tolist() == []
    with pytest.raises(ValueError, match="depths"):
        estimators.layer_classes([4], [3], 3, 2)
    with pytest.raises(ValueError, match="one depth per size"):
        estimators.layer_classes([4, 4], [0], 3, 2)


def test_chunk_priority_layer_slices_the_tensors_classes_or_falls_back_to_position():
    rows = np.zeros((6, 4), np.float32)
    layers = np.array([7, 7, 3, 3, 1, 1], np.uint8)
    assert estimators.chunk_priority(rows[:3], "layer", 2, 6, layers).tolist() == [3, 3, 1]
    assert (estimators.chunk_priority(rows, "layer", 0, 6) == estimators.chunk_priority(rows, "position", 0, 6)).all()


def test_depths_from_module_structure_same_on_every_build():
    import pydblp.torch as ptorch

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Sequential(
            torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)), torch.nn.Linear(8, 2))

    depths = []
    for _ in range(2):  # two "ranks": the same model built twice
        m = model()
        st = ptorch.State.__new__(ptorch.State)
        ptorch.State.register_model(st, m)
        depths.append([st.depth[id(p)] for p in m.parameters()])
    assert depths[0] == depths[1]
    assert [d for d, _ in depths[0]] == [0, 0, 1, 1, 2, 2, 3, 3] and {n for _, n in depths[0]} == {4}


@pytest.mark.parametrize("order", ["rows", "shuffle"])
def test_a_round_stamps_the_layer_classes_on_the_wire(order):
    """Two ranks, priority "layer": the DATA each sends carries the class of the tensor row it
    carries, in the tensor's order or shuffled (the row told by the payload: rows differ)."""
    world, C = 2, 16
    ts = [UdpTransport(port=0) for _ in range(world)]
    spy = []
    send = ts[0].send

    def record(batch, timeout=1.0):
        n = len(batch)
        h = batch.headers[:n]
        d = h["kind"] == wire.Kind.DATA
        first = [np.frombuffer(p[:4], np.float32)[0] for p, dd in zip(batch.payloads(), d) if dd]  # a row's first value
        spy.extend(zip(h["chunk"][d].tolist(), h["prio"][d].tolist(), (h["flags"][d] & wire.Flag.ALLGATHER).tolist(),
                       [float(v) for v in first]))
        return send(batch, timeout)

    ts[0].send = record
    peers = [("127.0.0.1", t.port) for t in ts]
    cfg = Config(priority="layer", chunk_bytes=C * 4, order=order)
    cols = [Collective(ts[r], r, world, peers, cfg) for r in range(world)]
    classes = np.array([7, 6, 5, 4, 3, 2, 1, 1, 2, 3], np.uint8)
    x = np.random.default_rng(1).standard_normal(len(classes) * C).astype(np.float32)
    try:
        for c in cols:
            c.set_layers(5, classes)
        with pytest.raises(ValueError, match="1..7"):
            cols[0].set_layers(6, np.array([0, 1], np.uint8))
        out = {}
        th = [threading.Thread(target=lambda r=r: out.__setitem__(r, cols[r].allreduce(x * (r + 1), tensor=5)))
              for r in range(world)]
        for t in th:
            t.start()
        for t in th:
            t.join(30)
        np.testing.assert_allclose(out[0], x * 1.5, rtol=1e-5)
    finally:
        for c in cols:
            c.close()
    # rank 0 sends rank 1 rows of rank 1's shard (reduce-scatter: x) and rank 1 those of its own
    # (all-gather: the mean, 1.5x); each packet's row is found by its first value
    rows = x.reshape(-1, C)[:, 0]
    rs = [(c, p, int(np.flatnonzero(rows == v)[0])) for c, p, ag, v in spy if not ag]
    ag = [(c, p, int(np.flatnonzero(np.isclose(rows * 1.5, v))[0])) for c, p, ag, v in spy if ag]
    assert rs and ag
    assert all(p == classes[row] for _, p, row in rs + ag), (rs, ag)
    half = len(classes) // 2
    moved = [c for c, _, row in rs if row != half + c] + [c for c, _, row in ag if row != c]
    assert bool(moved) == (order == "shuffle")  # chunk i of a message is the tensor's row first + i only in "rows"
