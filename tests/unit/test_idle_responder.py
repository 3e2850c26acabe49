"""The idle responder and close(): close never closes a transport a live thread is using."""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from pydblp import wire
from pydblp.collective import Collective, Config
from pydblp.collective import engine
from pydblp.transport.base import Batch, Transport


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
