"""The CPU cap's cgroup has an owner: closed with its cap, or removed by the next cap when its
owner died without closing it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from pydblp.testbed.cpucap import CpuCap, CpuCapError

pytestmark = [pytest.mark.root]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

OWNER = """
import subprocess, sys, time
from pydblp.testbed.cpucap import CpuCap
p = subprocess.Popen(["sleep", "60"])
cap = CpuCap(p.pid, 0.5)
print(p.pid, cap.path, flush=True)
time.sleep(60)
"""


def _cap(pid, share):
    try:
        return CpuCap(pid, share)
    except CpuCapError as e:
        pytest.skip(f"the kernel has no CPU bandwidth control here: {e}")


def test_a_cap_whose_owner_was_killed_is_removed_by_the_next():
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": ROOT})
    capped = other = cap = None
    try:
        line = owner.stdout.readline().split()
        if not line:
            pytest.skip("no CPU bandwidth control here (the owner could not make its cap)")
        capped, stale = int(line[0]), line[1]
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        assert os.path.isdir(stale)  # SIGKILL left it, still holding the sleeper
        other = subprocess.Popen(["sleep", "60"])
        cap = _cap(other.pid, 0.5)
        assert not os.path.exists(stale)
        assert str(cap.path) not in open(f"/proc/{capped}/cgroup").read()  # released, not killed
        assert os.path.basename(stale) not in open(f"/proc/{capped}/cgroup").read()
        cap.close()
        assert not cap.path.exists() and os.path.basename(str(cap.path)) not in open(f"/proc/{other.pid}/cgroup").read()
    finally:
        for p in (owner,):
            if p.poll() is None:
                p.kill()
                p.wait()
        if cap is not None:
            cap.close()
        for pid in (capped, other.pid if other else None):
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if other is not None:
            other.wait()
