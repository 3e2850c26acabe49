"""The soak, short: bench/soak.py trains over AF_XDP with a job key, clean and then while a host
of the job's network sprays rank 0 with every hostile category (half of it spoofing rank 1's
address and MAC), and checks what its report promises.  The 10-minute run's figures are in
bench/results/ (``bench/soak.py --minutes 10``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pydblp.testbed.hostile import CATEGORIES

pytestmark = [pytest.mark.root, pytest.mark.bpf, pytest.mark.netns, pytest.mark.slow]

BENCH = Path(__file__).resolve().parents[2] / "bench" / "soak.py"


def test_a_sprayed_keyed_job_trains_as_a_clean_one_and_counts_every_frame(bpf_xdp, tmp_path):
    out = tmp_path / "soak.json"
    p = subprocess.run([sys.executable, str(BENCH), "--steps", "150", "--pps", "2000", "--pool", "1400",
                        "--sample", "1", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["identical"] and len(r["accuracy"]["sprayed"]) >= 5  # every evaluation, and the parameters' bits
    acc = r["accounting"]
    assert acc["sent"] > 1000 and all(r["sent_by_category"].get(c, 0) > 0 for c in CATEGORIES)
    assert acc["rx_errors"] == 0
    # every frame sent is in a drop counter, but for what the stack or the kernel took
    assert 0 <= acc["unaccounted"] <= acc["passed_to_stack"] + acc["kernel_drops"], acc
    by = acc["by_counter"]
    assert by.get("xdp drop spoof_ip", 0) > 0 and by.get("auth_epoch", 0) > 0 and by.get("auth_untagged", 0) > 0
    assert by.get("xdp drop length", 0) > 0 and by.get("xdp drop short", 0) > 0
