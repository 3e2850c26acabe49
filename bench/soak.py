#!/usr/bin/env python3
"""Soak: train over AF_XDP with a job key while a host of the job's network sprays rank 0.

Two runs of the same training, the same seed, on one testbed (``--workers`` ranks plus one
sprayer host, the testbed's 1 Gbit/s links): ``clean``, then ``sprayed`` while the sprayer sends
``--pps`` frames a second of every category of :mod:`pydblp.testbed.hostile` (malformed,
forged, replayed, oversized, IPv6, other jobs...) at rank 0's data port, from the moment the ranks
start training until they finish.  The training is the main job's digits MLP
(:mod:`pydblp.experiment.worker`, DDP with pydblp's hook, ``static:0``: every round exact), so
the sprayed run must give the clean run's accuracy at every evaluation and end with the same
parameters, bit for bit (forged packets change nothing, malformed ones are dropped).

Reported (stdout, and ``--json``): accuracy at each evaluation, both runs; each rank's RSS,
sampled every ``--sample`` seconds (the bound: max - min after the first minute, against the
run's own start); and the accounting of what was sprayed: every frame sent, by category,
against the counters that dropped it at rank 0 (the host program's drops by reason and its
passes to the stack, the transport's ``rx_invalid`` and ``auth_*``, the collective's ``stray``
and ``foreign``), with any remainder the kernel's own drops explain (``rx_dropped``).

    .venv/bin/python bench/soak.py [--minutes 10] [--workers 3] [--pps 2000] [--seed 0]
                                   [--steps N] [--sample 5] [--json out.json]

``--steps`` fixes the training length (default: from a 30-step calibration run, the steps that
take ``--minutes``).  Needs root.  Bounded: each run ends by itself or is ended after twice its
expected time; the testbed goes at exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pydblp import net  # noqa: E402
from pydblp.cliutil import Parser, stop_unwinds  # noqa: E402
from pydblp.testbed import Testbed  # noqa: E402
from pydblp.testbed.core import MAX_WORKERS  # noqa: E402
from pydblp.testbed.hostile import CATEGORIES, Sprayer, Target, mutants  # noqa: E402

JOB = 11  # pydblp.experiment.worker's Config(job=11)


def parse(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)  # (a mistake: one line)
    p.add_argument("--minutes", type=float, default=10.0, help="length of each run (sets --steps)")
    p.add_argument("--steps", type=int, help="training steps (default: what --minutes allows)")
    p.add_argument("--workers", type=int, default=3, help="ranks (one more testbed host sprays)")
    p.add_argument("--pps", type=float, default=2000.0, help="frames a second sprayed at rank 0")
    p.add_argument("--pool", type=int, default=14_000, help="distinct mutants, sent round and round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--net", choices=["xsk", "xsk-ktx"], default="xsk")
    p.add_argument("--json", help="write the report here too")
    a = p.parse_args(argv)
    pool = 2 * len(CATEGORIES)  # (half from the sprayer's address, half spoofing rank 1's: every category in each)
    for bad, what in ((not 2 <= a.workers < MAX_WORKERS,
                       f"--workers {a.workers}: use 2..{MAX_WORKERS - 1} (one more testbed host sprays)"),
                      (not 0 < a.pps < math.inf, f"--pps {a.pps:g}: use frames a second above 0, e.g. --pps 2000"),
                      (not 0 < a.minutes < math.inf, f"--minutes {a.minutes:g}: use minutes above 0, e.g. --minutes 10"),
                      (a.steps is not None and a.steps < 30,
                       f"--steps {a.steps}: use 30 or more, as a calibrated run (the spray stops 5 steps before the "
                       f"end), e.g. --steps 150"),
                      (a.pool < pool, f"--pool {a.pool}: use {pool} or more (every category, from both addresses), "
                                      f"e.g. --pool 14000"),
                      (a.seed < 0, f"--seed {a.seed}: use 0 or more"),
                      (not 0 < a.sample < math.inf, f"--sample {a.sample:g}: use seconds above 0, e.g. --sample 5")):
        if bad:
            p.error(what)
    return a


def link_drops(tb) -> int:
    """Frames dropped on the way to rank 0 before its XDP program: its NIC's and its switch port's
    drop counters (a veth's XDP ring full, a queue full)."""
    total = 0
    for ns, dev in ((tb.ns(0), "eth0"), (tb.switch_ns, "w0")):
        with net.ipr(ns) as ip:
            st = ip.get_links(ip.link_lookup(ifname=dev)[0])[0].get_attr("IFLA_STATS64")
        total += st["rx_dropped"] + st["tx_dropped"]
    return total


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def train(tb, a, steps: int, key_file: str, spray: bool, timeout: float, logs: str) -> dict:
    """One training run; its evaluations, final record, RSS samples and (sprayed) what was sent."""
    W = a.workers
    port = 29500 + random.Random(f"{a.seed}/{spray}").randrange(1000)
    argv = lambda r: [sys.executable, "-m", "pydblp.experiment.worker", "--rank", str(r), "--world", str(W),
                      "--master", f"{tb.addr(0)}:{port}", "--arm", "static", "--p-low", "0",
                      "--net", a.net, "--iface", "eth0", "--steps", str(steps), "--seed", str(a.seed),
                      "--rate", str(tb.rate_bps), "--eval-every", str(max(steps // 10, 1)), "--peer-timeout", "30",
                      "--no-round-records"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0",
           "DBLP_KEY_FILE": key_file}
    errs = [open(os.path.join(logs, f"{'sprayed' if spray else 'clean'}.rank{r}.log"), "w+") for r in range(W)]
    procs = [tb.popen(r, argv(r), stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                      stderr=errs[r], env=env, text=True) for r in range(W)]
    run = {"evals": [], "rss": [], "final": None, "steps": 0, "sent": {}}
    stop_early = max(5, steps // 50)  # steps before the end the spray stops
    sprayer = None
    try:
        out = procs[0].stdout
        t0 = time.monotonic()
        next_sample = t0
        while True:
            now = time.monotonic()
            if now - t0 > timeout:
                raise RuntimeError(f"no result within {timeout:.0f} s")
            if now >= next_sample:
                run["rss"].append([round(now - t0, 1)] + [rss_kib(p.pid) for p in procs])
                next_sample += a.sample
            if any(p.poll() not in (None, 0) for p in procs):
                r = next(r for r, p in enumerate(procs) if p.poll() not in (None, 0))
                errs[r].seek(0)
                raise RuntimeError(f"rank {r} failed ({procs[r].returncode}): {errs[r].read()[-2000:]}")
            ready, _, _ = select.select([out], [], [], 0.5)
            if not ready:
                continue
            line = out.readline()
            if not line:
                break
            rec = json.loads(line)
            if "step" in rec and spray and sprayer is None:  # training has begun: every rank's tags verified
                key = Path(key_file).read_bytes()
                # half from the sprayer's own address (the host program drops every packet claiming a
                # rank from it: anti-spoofing), half spoofing rank 1's address and MAC, which the tag
                # check alone stops
                pool = [x for own, spoofed in zip(*(
                    mutants(Target(tb.mac(0), tb.addr(0), 47800, tb.mac(w), tb.addr(w), job=JOB, world=W,
                                   key=key, epoch=0, rounds=(0, 1 << 16)), a.pool // 2, a.seed + w)
                    for w in (W, 1))) for x in (own, spoofed)]
                sprayer = Sprayer(tb.ns(W), "eth0", pool, count=10 ** 9, duration=timeout, pps=a.pps).start()
                run["spray_t0"] = time.monotonic()
                run["link0"] = link_drops(tb)
            if "step" in rec and "sync" in rec:
                run["steps"] = rec["step"] + 1
                run["step_s"] = rec["t"] / (rec["step"] + 1)
                if sprayer is not None and "spray_s" not in run and rec["step"] + 1 >= steps - stop_early:
                    # stop before the ranks take their counters: every frame sent is in them
                    sprayer.close()
                    run["spray_s"] = time.monotonic() - run["spray_t0"]
                    time.sleep(0.2)  # (the last frames through the switch)
                    run["link1"] = link_drops(tb)
            elif "eval" in rec:
                run["evals"].append([rec["step"], rec["eval"]])
                print(f"  {'sprayed' if spray else 'clean'}: step {rec['step'] + 1}/{steps} accuracy "
                      f"{rec['eval']:.4f}" + (f", {sprayer.total:,} frames sprayed" if sprayer else ""), flush=True)
            elif rec.get("final"):
                run["final"] = {k: rec[k] for k in ("wall", "host", "counters", "params_sha256") if k in rec}
        for p in procs:
            p.wait(timeout=60)
    finally:
        if sprayer is not None:
            sprayer.close()
            run["sent"] = dict(sprayer.sent)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in errs:
            f.close()
    return run


def accounting(run: dict, clean: dict) -> dict:
    """What rank 0's counters say became of the frames sprayed at it.  Its host program's drops
    (only hostile frames are malformed: the job's own tolerance is 0, nothing is shed), the
    transport's ``rx_invalid`` and ``auth_*`` and the collective's ``stray``/``foreign``/
    ``bad_payload`` (for comparison with the clean run: with the key no sprayed packet reaches
    the collective) are the drops; ``nosock`` counts DBLP frames for a queue without a socket.  Frames the host program
    does not take for DBLP pass to the stack, where the control plane's TCP goes too: the
    sprayed run's passes beyond the clean run's bound what is left."""
    h, hc = run["final"]["host"][0], clean["final"]["host"][0]
    t, c = run["final"]["counters"][0]["transport"], run["final"]["counters"][0]["collective"]
    rows = {f"xdp drop {k}": v for k, v in h["drop"].items() if v}
    rows["xdp nosock"] = h["nosock"]
    rows.update({k: t.get(k, 0) for k in ("rx_invalid", "auth_untagged", "auth_epoch", "auth_bad_tag",
                                          "auth_truncated") if t.get(k, 0)})
    counted = sum(rows.values())
    # with the key nothing sprayed reaches the collective: what it ignored is the job's own traffic
    # (a STOP for a message already done, ...), as in the clean run
    cc = clean["final"]["counters"][0]["collective"]
    passed = max(0, h["pass"] + h["dblp_pass"] - hc["pass"] - hc["dblp_pass"])
    sent = sum(run["sent"].values())
    kernel = t.get("rx_dropped", 0) + t.get("rx_ring_full", 0) + run["link1"] - run["link0"]
    return {"sent": sent, "counted": counted, "by_counter": rows, "passed_to_stack": passed,
            "kernel_drops": kernel, "rx_errors": t.get("rx_errors", 0) + c.get("rx_errors", 0),
            "unaccounted": sent - counted,
            "collective": {k: [cc[k], c[k]] for k in ("stray", "foreign", "bad_payload", "late", "duplicate")}}


def rss_bound(run: dict, after: float = 60.0) -> list[dict]:
    """Per rank: RSS at the first sample past ``after`` s, its min and max from there on, and its
    growth, the max less that first sample (KiB)."""
    out = []
    for r in range(1, len(run["rss"][0])):
        xs = [row[r] for row in run["rss"] if row[0] >= after and row[r] is not None]
        if not xs:
            xs = [row[r] for row in run["rss"] if row[r] is not None]
        out.append({"start_kib": xs[0], "min_kib": min(xs), "max_kib": max(xs), "growth_kib": max(xs) - xs[0]})
    return out


def main(argv=None) -> int:
    a = parse(argv)
    if os.geteuid() != 0:
        print("soak: needs root (a testbed, AF_XDP)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp, Testbed(workers=a.workers + 1) as tb:
        key_file = os.path.join(tmp, "job.key")
        with open(key_file, "wb") as f:
            f.write(os.urandom(32))
        steps = a.steps
        if steps is None:
            cal = train(tb, a, 30, key_file, False, 300, tmp)
            steps = max(30, int(a.minutes * 60 / cal["step_s"]))
            print(f"soak: {cal['step_s'] * 1000:.0f} ms a step: {steps} steps for {a.minutes:g} minutes", flush=True)
        timeout = 2 * steps * 0.5 + 300
        clean = train(tb, a, steps, key_file, False, timeout, tmp)
        sprayed = train(tb, a, steps, key_file, True, timeout, tmp)
    acc = accounting(sprayed, clean)
    report = {
        "steps": steps, "workers": a.workers, "pps": a.pps, "seed": a.seed, "net": a.net,
        "wall_s": {"clean": clean["final"]["wall"], "sprayed": sprayed["final"]["wall"]},
        "accuracy": {"clean": clean["evals"], "sprayed": sprayed["evals"]},
        "identical": (clean["evals"] == sprayed["evals"]
                      and clean["final"]["params_sha256"] == sprayed["final"]["params_sha256"]),
        "sent_by_category": sprayed["sent"], "spray_s": sprayed["spray_s"], "accounting": acc,
        "rss": {"clean": rss_bound(clean), "sprayed": rss_bound(sprayed)},
        "rss_samples": sprayed["rss"],
    }
    print(f"\nsoak: {steps} steps, {a.workers} ranks over {a.net} with a job key; "
          f"wall clean {clean['final']['wall']:.0f} s, sprayed {sprayed['final']['wall']:.0f} s")
    print(f"  frames sprayed at rank 0: {acc['sent']:,} in {sprayed['spray_s']:.0f} s "
          f"({len(sprayed['sent'])} categories of {len(CATEGORIES)})")
    print(f"  final accuracy clean {clean['evals'][-1][1]:.4f}, sprayed {sprayed['evals'][-1][1]:.4f}; "
          f"every evaluation and the final parameters identical: {report['identical']}")
    print(f"  the collective's stray, foreign, bad_payload, late, duplicate (clean, sprayed): {acc['collective']}")
    print(f"  counted dropped at rank 0: {acc['counted']:,}; the rest {acc['unaccounted']:,} against "
          f"{acc['passed_to_stack']:,} more passed to the stack than in the clean run and "
          f"{acc['kernel_drops']:,} kernel receive drops; rx_errors {acc['rx_errors']}")
    assert sprayed["evals"][0][0] < sprayed["evals"][-1][0]
    for k, v in sorted(acc["by_counter"].items(), key=lambda kv: -kv[1]):
        print(f"    {k:28s} {v:>10,}")
    for r, (c, s) in enumerate(zip(report["rss"]["clean"], report["rss"]["sprayed"])):
        print(f"  rank {r} RSS after the first minute: clean {c['start_kib'] / 1024:.0f} MiB +{c['growth_kib'] / 1024:.1f}, "
              f"sprayed {s['start_kib'] / 1024:.0f} MiB +{s['growth_kib'] / 1024:.1f} MiB")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    ok = (report["identical"] and acc["rx_errors"] == 0
          and 0 <= acc["unaccounted"] <= acc["passed_to_stack"] + acc["kernel_drops"])
    return 0 if ok else 1


if __name__ == "__main__":
    with stop_unwinds():  # (Ctrl-C and SIGTERM unwind; a second one cannot cut the clean-up short)
        sys.exit(main())
