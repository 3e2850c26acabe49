"""Round records stay bounded: a collective keeps the latest ``Config.records_max`` and hands
every record to ``Config.on_record``, so memory stays flat over any number of rounds."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pydblp.collective import Collective, Config, RoundRecord
from pydblp.collective.config import RECORDS_MAX
from pydblp.transport.udp import UdpTransport
from tests.helpers import run_threads


def _pair(**cfg) -> list[Collective]:
    """Two collectives over UDP on loopback."""
    ts = [UdpTransport(port=0) for _ in range(2)]
    peers = [("127.0.0.1", t.port) for t in ts]
    return [Collective(ts[r], r, 2, peers, Config(**cfg)) for r in range(2)]


def _rounds(cols, n: int, size: int = 64) -> None:
    """``n`` allreduce rounds on both ranks (threads), of ``size`` float32 values; each result checked."""
    def go(r):
        x = np.full(size, r + 1, np.float32)
        for _ in range(n):
            y = cols[r].allreduce(x)
            if y[0] != 1.5:
                raise AssertionError(f"rank {r}: {y[0]}, not 1.5")

    _, errs = run_threads(go, range(2), 600)
    assert not errs, errs


def _rss() -> int:
    """This process's resident memory in bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_records_keep_the_latest_window_and_the_callback_sees_every_round():
    seen: list[RoundRecord] = []
    cols = _pair(records_max=8, on_record=seen.append)
    try:
        _rounds(cols, 20)
        c0 = cols[0]
        assert c0.index == 20
        assert [r.index for r in c0.records] == list(range(12, 20))  # the latest 8, oldest first
        assert [r.index for r in seen[::2]] == list(range(20))  # (both ranks share the callback)
        assert len(seen) == 40 and all(isinstance(r, RoundRecord) for r in seen)
        assert c0.records[-1] in seen
    finally:
        for c in cols:
            c.close()


def test_records_max_zero_keeps_none():
    cols = _pair(records_max=0)
    try:
        _rounds(cols, 3)
        assert cols[0].index == 3 and len(cols[0].records) == 0
    finally:
        for c in cols:
            c.close()


@pytest.mark.parametrize("bad,says", [({"records_max": -1}, "records_max -1"),
                                      ({"on_record": 5}, "on_record 5")])
def test_record_knobs_out_of_range_are_refused(bad, says):
    with pytest.raises(ValueError, match=says):
        Config(**bad).check()


@pytest.mark.slow
def test_memory_stays_flat_over_100k_rounds():
    """100,000 rounds of two ranks on loopback: after a warm-up that fills the record window,
    the process's resident memory grows by less than 4 MiB (one RoundRecord with its dict takes
    ~1 KiB: keeping every record would add ~90 MiB) and the window holds the latest rounds."""
    count = [0]

    def tally(rec):
        count[0] += 1

    cols = _pair(job=5, on_record=tally)
    try:
        warm = RECORDS_MAX + 1000
        _rounds(cols, warm)
        before = _rss()
        _rounds(cols, 100_000 - warm)
        grown = _rss() - before
        c0 = cols[0]
        assert c0.index == 100_000 and count[0] == 2 * 100_000
        assert len(c0.records) == RECORDS_MAX
        assert [c0.records[0].index, c0.records[-1].index] == [100_000 - RECORDS_MAX, 99_999]
        assert grown < 4 << 20, f"resident memory grew by {grown / 2**20:.1f} MiB over {100_000 - warm} rounds"
    finally:
        for c in cols:
            c.close()
