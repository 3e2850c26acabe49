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


def test_a_round_stamps_the_layer_classes_on_the_wire():
    """Two ranks, priority "layer": the DATA each sends carries the class given for its chunk."""
    world, C = 2, 16
    ts = [UdpTransport(port=0) for _ in range(world)]
    spy = []
    send = ts[0].send

    def record(batch, timeout=1.0):
        h = batch.headers[: len(batch)]
        d = h["kind"] == wire.Kind.DATA
        spy.extend(zip(h["chunk"][d].tolist(), h["prio"][d].tolist(), (h["flags"][d] & wire.Flag.ALLGATHER).tolist()))
        return send(batch, timeout)

    ts[0].send = record
    peers = [("127.0.0.1", t.port) for t in ts]
    cols = [Collective(ts[r], r, world, peers, Config(priority="layer", chunk_bytes=C * 4)) for r in range(world)]
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
    # rank 0 sends rank 1 its shard (reduce-scatter) and rank 1 the result of its own (all-gather):
    # chunk i of a message is chunk first + i of the tensor
    half = len(classes) // 2
    rs = {c: p for c, p, ag in spy if not ag}
    ag = {c: p for c, p, ag in spy if ag}
    assert rs and ag
    assert all(p == classes[half + c] for c, p in rs.items()), rs
    assert all(p == classes[c] for c, p in ag.items()), ag
