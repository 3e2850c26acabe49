"""State.open's rendezvous in a torch.distributed store that outlives a run (a torchrun agent's
store is reused when a script destroys its process group and creates another)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch.distributed as dist

import pydblp.torch as ptorch
from pydblp.collective import Config

WORLD = 2


def _open_all(store, key_file, first_late: float):
    """Open every rank's State on ``store``, rank 0 ``first_late`` s after the others."""
    states, errors = [None] * WORLD, []

    def one(r):
        try:
            if r == 0:
                time.sleep(first_late)
            states[r] = ptorch.State.open(store, r, WORLD, transport="udp", port=0, key_file=key_file,
                                          config=Config(job=5, peer_timeout=3.0))
        except BaseException as e:  # (reported by the caller)
            errors.append(e)

    ts = [threading.Thread(target=one, args=(r,)) for r in range(WORLD)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors
    return states


def _mean(states):
    xs = [np.full(3000, r + 1, np.float32) for r in range(WORLD)]
    futs = [s.submit(lambda col, x: col.allreduce(x, exact=True), x) for s, x in zip(states, xs)]
    return [f.wait() for f in futs]


@pytest.mark.parametrize("keyed", [False, True])
def test_a_second_run_on_the_same_store_rendezvous_afresh(tmp_path, keyed):
    key_file = None
    if keyed:
        key_file = tmp_path / "job.key"
        key_file.write_bytes(bytes(range(32)))
        key_file.chmod(0o600)
    store = dist.HashStore()
    for run in range(3):
        # rank 0 draws the run's epoch: the others open first and must not take the last run's
        states = _open_all(store, key_file, first_late=0.0 if run == 0 else 0.3)
        try:
            for out in _mean(states):
                np.testing.assert_array_equal(out, np.full(3000, 1.5, np.float32))
        finally:
            closers = [threading.Thread(target=s.close) for s in states]
            for t in closers:
                t.start()
            for t in closers:
                t.join(30)
