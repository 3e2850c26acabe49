"""The collective's lifecycle: the idle responder and close(), and the clock a protocol is given."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from pydblp import wire
from pydblp.collective import Collective, CollectiveError, Config
from pydblp.collective import engine
from pydblp.transport.base import Batch, Transport
from pydblp.transport.udp import UdpTransport


class Stuck(Transport):
    """A transport whose receive blocks until :attr:`go` is set; it polls readable at once."""

    kind = "stuck"
    netns = ifname = None
    queue, port = 0, 1

    def __init__(self):
        self._c = {"rx_errors": 0}
        self._fd = os.eventfd(1, os.EFD_CLOEXEC)  # readable: the idle responder receives at once
        self.entered, self.go = threading.Event(), threading.Event()
        self.closed_while_inside = False
        self._inside = False

    def add_peer(self, addr, port=wire.DEFAULT_PORT, mac=None) -> int:
        return 0

    def send(self, batch, timeout=1.0) -> int:
        return len(batch)

    def _recv(self, into, timeout, max, want, linger, copy) -> Batch:
        self._inside = True
        self.entered.set()
        self.go.wait(30)
        self._inside = False
        into.n = 0
        return into.view(0, 0)

    def stats(self) -> dict:
        return dict(self._c)

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        self.closed_while_inside |= self._inside
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def test_close_leaves_a_stuck_transport_to_the_idle_responder(monkeypatch):
    monkeypatch.setattr(engine, "CLOSE_JOIN", 0.2)
    t = Stuck()
    col = Collective(t, 0, 2, [("127.0.0.1", 1), ("127.0.0.1", 2)], Config())
    assert t.entered.wait(5)  # the idle responder woke (IDLE_GRACE after start) and is inside recv
    col.close()
    assert not t.closed and not t.closed_while_inside  # still in use: left open
    col.close()  # a second close while it is stuck closes nothing either
    assert not t.closed
    t.go.set()  # the call returns: the thread closes what close() left it
    end = time.monotonic() + 5
    while not t.closed and time.monotonic() < end:
        time.sleep(0.01)
    assert t.closed and not t.closed_while_inside
    assert col._alarm.fd < 0


def test_close_of_an_idle_collective_closes_at_once():
    t = Stuck()
    t.go.set()  # receives return at once
    col = Collective(t, 0, 2, [("127.0.0.1", 1), ("127.0.0.1", 2)], Config())
    time.sleep(0.05)
    col.close()
    assert t.closed and not col._idler.is_alive()
    np.testing.assert_equal(t.closed_while_inside, False)


def test_the_protocol_reads_the_clock_it_is_given():
    """Every "now" of a round comes from ``clock=``: a clock that advances 1 us a call makes a
    round's latency a whole number of its ticks, and the round still completes, exact."""
    from tests.helpers import run_threads

    lock, ticks = threading.Lock(), [0]

    def clock():
        with lock:
            ticks[0] += 1
            return ticks[0] * 1e-6

    ts = [UdpTransport(port=0) for _ in range(2)]
    peers = [("127.0.0.1", t.port) for t in ts]
    cols = [Collective(ts[r], r, 2, peers, Config(), clock=clock) for r in range(2)]
    try:
        xs = [np.full(10_000, r + 1, np.float32) for r in range(2)]
        res, errs = run_threads(lambda r: cols[r].allreduce(xs[r]), range(2), 60)
        assert not errs
        for r in range(2):
            np.testing.assert_array_equal(res[r], np.full(10_000, 1.5, np.float32))
        lat = [c.records[-1].latency for c in cols]
        assert all(0 < x < ticks[0] * 1e-6 for x in lat)
        assert all(abs(x * 1e6 - round(x * 1e6)) < 1e-3 for x in lat)  # whole ticks of the given clock
    finally:
        for c in cols:
            c.close()


def test_serve_is_for_a_collective_without_an_idle_thread():
    """serve() answers peers from the owner's thread only when the collective has no thread of
    its own doing it; after close() it raises as a round would."""
    peers = [("127.0.0.1", 9), ("127.0.0.1", 9)]
    threaded = Collective(UdpTransport(port=0), 0, 2, peers, Config())
    try:
        with pytest.raises(RuntimeError, match="idle_thread=False"):
            threaded.serve()
    finally:
        threaded.close()
    before = {t.name for t in threading.enumerate()}
    owned = Collective(UdpTransport(port=0), 0, 2, peers, Config(), idle_thread=False)
    assert {t.name for t in threading.enumerate()} == before  # no thread of its own
    assert owned.serve() is None  # nothing trailing: only a packet needs it next
    owned.close()
    assert owned.t.closed
    with pytest.raises(CollectiveError, match="closed"):
        owned.serve()


def test_warm_up_runs_exact_rounds_on_its_own_id_and_keeps_nothing_of_them(ranks):
    """``Collective.warm_up``: two exact rounds of zeros on ``TENSOR_WARM_UP``, recorded, unseen by
    the phase controller.  Afterwards the fills and the per-tensor scratch hold nothing for that
    id, and the job's first round of tensor 0 runs in the shared scratch the warm-up faulted in
    (what it is for), exact, with no stale result of the warm-up to fill from."""
    from pydblp.collective.config import TENSOR_WARM_UP

    rk = ranks(3, phase="dblp")
    n = 20_000
    before = [{k: v for k, v in c.controller.state_dict().items() if k in ("critical", "history", "steps", "g_prev")}
              for c in rk.cols]
    _, errs = rk.run(lambda r, c: c.warm_up(n))
    assert not errs
    shared = []
    for c, b in zip(rk.cols, before):
        recs = list(c.records)
        assert [r.tensor for r in recs] == [TENSOR_WARM_UP] * 2
        assert all(r.tol == 0 and r.min_delivered == 1.0 and r.bytes_sent > 0 for r in recs)
        assert {k: v for k, v in c.controller.state_dict().items() if k in b} == b
        p = c.protocol
        assert TENSOR_WARM_UP not in p.fill.stale and not [k for k in p._bufs if k[1] == TENSOR_WARM_UP]
        assert 0 not in p.fill.stale
        shared.append({k: v for k, v in p._bufs.items() if k[1] is None})
        assert shared[-1]  # the round-only scratch every tensor id shares stays
    xs = inputs_of(3, n)
    res, errs = rk.run(lambda r, c: c.allreduce(xs[r], tensor=0, out=xs[r].copy()))
    assert not errs
    for r, c in enumerate(rk.cols):
        np.testing.assert_allclose(res[r], np.mean(xs, axis=0), atol=1e-5)
        kept = {k: v for k, v in c.protocol._bufs.items() if k[1] is None}
        assert any(np.may_share_memory(kept[k], shared[r][k]) for k in shared[r] if k in kept)
        assert [x.tensor for x in c.records][-1] == 0


def test_warm_up_checks_its_arguments_and_zero_rounds_do_nothing(ranks):
    rk = ranks(2)
    c = rk.cols[0]
    for size, rounds, says in ((0, 2, "size"), (-5, 2, "size"), (1.5, 2, "size"), (True, 2, "size"),
                               (10, -1, "rounds"), (10, 2.0, "rounds")):
        with pytest.raises(ValueError, match=f"warm_up: {says}"):
            c.warm_up(size, rounds)
    c.warm_up(10, 0)
    assert not c.records


def inputs_of(world, n, seed=5):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(np.float32) for _ in range(world)]


# ---- pydblp.torch.State.close: never under a running call, and whatever interrupts it ----

class _Owned:
    """Something a State owns (as its data plane): records its close."""

    closed = False

    def close(self):
        self.closed = True


def test_a_state_leaves_open_what_a_running_round_still_uses(monkeypatch, caplog):
    """close() waits peer_timeout (plus a margin) for the round in progress; if it still runs,
    nothing it uses is closed under it (the native path would touch unmapped rings), with a
    warning: the process's exit releases them."""
    import pydblp.torch as pt

    monkeypatch.setattr(pt, "CLOSE_MARGIN", 0.1)
    t, dp = Stuck(), _Owned()
    col = Collective(t, 0, 2, [("127.0.0.1", 1), ("127.0.0.1", 2)], Config(peer_timeout=0.5))
    state = pt.State(col, owned=[col, dp])
    t.entered.clear()
    fut = state.submit(lambda c: c.allreduce(np.ones(100, np.float32)))
    assert t.entered.wait(5)  # the round is inside its receive
    with caplog.at_level("WARNING", logger="pydblp.torch"):
        state.close(barrier=False)
    assert "a round is still running" in caplog.text
    assert not t.closed and not dp.closed
    t.go.set()
    with pytest.raises(CollectiveError):
        fut.wait()
    state._thread.join(5)  # (the rounds thread leaves once its round has failed)
    state._release()  # (what a later close would do once the round is over)
    assert t.closed and dp.closed and not t.closed_while_inside


def test_a_state_still_closes_when_its_close_is_interrupted():
    """Ctrl-C while close() waits for the other ranks' closes: what it owns is closed anyway,
    and a second close() has nothing left to do."""
    import pydblp.torch as pt

    class Interrupting:
        def set(self, key, value):
            pass

        def wait(self, keys, timeout):
            raise KeyboardInterrupt

    t, dp = Stuck(), _Owned()
    t.go.set()
    col = Collective(t, 0, 2, [("127.0.0.1", 1), ("127.0.0.1", 2)], Config())
    state = pt.State(col, owned=[col, dp], closing=(Interrupting(), "pydblp/1/0/close"))
    with pytest.raises(KeyboardInterrupt):
        state.close()
    assert t.closed and dp.closed
    state.close()


def test_a_state_closes_its_data_plane_after_the_collective_and_never_under_it(monkeypatch):
    """When the collective's idle responder is stuck in a transport call, the data plane stays
    open (the responder uses it); the transport closes when the call returns."""
    import pydblp.torch as pt

    monkeypatch.setattr(engine, "CLOSE_JOIN", 0.2)
    t, dp = Stuck(), _Owned()
    col = Collective(t, 0, 2, [("127.0.0.1", 1), ("127.0.0.1", 2)], Config())
    state = pt.State(col, owned=[col, dp])
    assert t.entered.wait(5)  # the idle responder is inside recv
    state.close(barrier=False)
    assert not t.closed and not dp.closed
    t.go.set()
    end = time.monotonic() + 5
    while not t.closed and time.monotonic() < end:
        time.sleep(0.01)
    assert t.closed and not t.closed_while_inside
