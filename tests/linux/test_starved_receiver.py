"""A receiver that cannot keep up: its CPU capped by a cgroup, the host program sheds by priority.

The receiver is a process of its own (an AF_XDP data plane on the host
program ``dblp load`` attached) capped at a few percent of a core with
:class:`pydblp.testbed.cpucap.CpuCap`.  The cap alone does not always starve
it (the compiled receive path keeps up with a slow sender at a few percent of
a core, as on a loaded CI machine), so it also works like an application
that is behind: it takes at most 32 packets, then computes (spins) for 2 ms.  A sender floods it with messages
whose chunks carry priorities 1..7.  The ring fills, the receiver publishes
pressure when it runs, and the program sheds: counted per priority (``dblp
stats`` shows ``shed:pN`` while it happens), the least important classes at
least as often as the most important, never past a message's budget.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from pydblp import wire
from pydblp.testbed.cpucap import CpuCap, CpuCapError
from pydblp.transport.udp import UdpTransport
from tests.helpers import ADDR, JOB, make_pair, packets

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns, pytest.mark.slow]

NCHUNKS, TOL, MESSAGES = 1400, 64, 120  # budget: floor(1400 * 64 / 255) = 351 per message

RECEIVER = textwrap.dedent("""
    import json, sys, time
    from pydblp.dataplane import open_dataplane
    from pydblp.transport import Batch
    ns, dev, job, messages = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    dp = open_dataplane("xsk", dev, netns=ns, job=job, rank=1, world=2)
    into = Batch.empty(32, 1500)
    print("ready", flush=True)
    got = 0
    import select
    while not select.select([sys.stdin], [], [], 0)[0]:
        got += len(dp.transport.recv(into, timeout=0.01))
        busy = time.monotonic() + 0.002  # (spinning: the cap throttles it)
        while time.monotonic() < busy:
            pass
    sheds = [dp.host.shed_count(job, r, 0, 0) for r in range(messages)]
    print(json.dumps({"got": got, "counters": dp.host.counters(), "sheds": sheds,
                      "stats": dp.transport.stats()}), flush=True)
    dp.close()
""")


def _dblp(*argv, **kw):
    return subprocess.run([sys.executable, "-m", "pydblp.cli", *argv], capture_output=True, text=True,
                          timeout=60, **kw)


def test_cpu_starved_receiver_sheds_by_priority_within_budgets():
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    a = b = recv = stats = cap = None
    try:
        a, b = make_pair()
        loaded = _dblp("load", "vb", "--netns", b, env=env)
        assert loaded.returncode == 0, loaded.stderr
        recv = subprocess.Popen([sys.executable, "-c", RECEIVER, b, "vb", str(JOB), str(MESSAGES)], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert recv.stdout.readline().strip() == "ready"
        try:
            cap = CpuCap(recv.pid, 0.05)
        except CpuCapError as e:
            pytest.skip(f"the kernel has no CPU bandwidth control here: {e}")
        # unbuffered: its header line, printed once it has read the baseline counters, arrives
        # at once; the flood starts only then, so every shed falls within its samples
        stats = subprocess.Popen([sys.executable, "-m", "pydblp.cli", "stats", "vb", "--netns", b, "0.5", "8"],
                                 env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        header = stats.stdout.readline()
        assert header.startswith("TIME"), (header, stats.stderr.read() if stats.poll() is not None else "")
        with UdpTransport("va", netns=a) as tx:
            peer = tx.add_peer(ADDR[4][1])
            for r in range(MESSAGES):
                bt = packets(0, NCHUNKS, 0, 1, peer=peer)
                c = np.arange(NCHUNKS)
                bt.headers["round"], bt.headers["tensor"], bt.headers["chunk"] = r, 0, c
                bt.headers["nchunks"], bt.headers["tol"] = NCHUNKS, TOL
                bt.headers["prio"] = 1 + c % wire.MAX_PRIO  # classes 1..7 interleaved
                sent = 0
                while sent < NCHUNKS:  # (a full socket buffer takes what it can: send the rest)
                    sent += tx.send(bt.view(sent), timeout=1.0)
        stats.wait(timeout=30)  # (8 short lines: it never blocks on the pipe)
        stats_out = header + stats.stdout.read()  # (through the reader that holds what readline took)
        assert cap.throttled() > 0  # the cap really held the receiver back
        cap.close()  # lift it: reading the counters and closing at 5 % of a core can take a minute
        out, _ = recv.communicate("stop\n", timeout=60)
        rep = json.loads(out.strip().splitlines()[-1])
    finally:
        for p in (recv, stats):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        if cap is not None:
            cap.close()
        from pydblp import net

        if b is not None:
            _dblp("unload", "vb", "--netns", b, env=env)  # also after a failed load: its pins, if any
        for ns in (a, b):
            if ns is not None:
                net.netns_del(ns)
    shed = rep["counters"]["shed"]
    budget = NCHUNKS * TOL // 255
    print(f"sheds by priority {shed}, most in one message {max(rep['sheds'])} of {budget}, "
          f"received {rep['got']}, ring full {rep['stats'].get('rx_ring_full')}")
    assert sum(shed) > 0 and shed[0] == 0, shed
    assert max(rep["sheds"]) <= budget  # no message lost more than its budget to shedding
    assert sum(rep["sheds"]) == sum(shed)
    # prio 7 sheds from the lowest pressure, prio 1 from the highest: the four least important
    # classes (4..7) are shed at least as often as the three most important (1..3)
    assert sum(shed[4:]) >= sum(shed[1:4]), shed
    assert "shed:p" in stats_out and "shed:p0" not in stats_out, stats_out
    assert not cap.path.exists()  # the cgroup went with the cap
