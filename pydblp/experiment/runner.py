"""``dblp experiment``: Gloo vs static bounded loss vs DBLP under microbursts, on a testbed.

Brings up a ``workers``-worker testbed, trains the same model with the same
seed three times (one per transport), arms microbursts at the same seeded
random steps for each (drop ratio uniform in [0.6, 0.9], lasting about one
Gloo round), and writes ``report.json`` and PNG plots to ``out_dir``.
"""

from __future__ import annotations

import json
import os
import random
import select
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from pydblp import wire

TRANSPORTS = ("gloo", "static", "dblp")


@dataclass
class Options:
    workers: int = 4
    model: str = "digits"
    steps: int = 300
    transports: tuple = TRANSPORTS
    net: str = "xsk"                # pydblp data plane: xsk (AF_XDP), xsk-ktx (AF_XDP receive, kernel transmit) or udp
    seed: int = 0
    bursts: int = 30                # microbursts over the run (0: none)
    burst_ratio: tuple = (0.6, 0.9)
    burst_ms: float | None = None   # None: the median clean Gloo round
    loss: float = 0.0               # background random loss
    tol: float = 0.016              # static tolerance and DBLP's P_low
    estimator: str = "unbiased"
    mode: str = "tar"               # pydblp Config.mode: "tar" or "ps" (DBLP's setup)
    allgather: str = "unicast"      # pydblp Config.allgather: "broadcast" sends to the testbed's group address
    target: float | None = None     # accuracy (digits) or perplexity (text) to reach
    out_dir: str = "dblp-experiment"
    batch: int = 32
    timeout: float = 600.0          # per transport


@dataclass
class Run:
    transport: str
    steps: list = field(default_factory=list)    # rank 0 step records
    evals: list = field(default_factory=list)
    final: dict = field(default_factory=dict)
    bursts: list = field(default_factory=list)   # (start monotonic s, duration s, ratio)


def burst_plan(opt: Options) -> list[tuple[int, float]]:
    """(step, ratio) pairs, seeded: the same steps for every transport."""
    if opt.bursts <= 0:
        return []
    rng = random.Random(opt.seed)
    warm = min(20, opt.steps // 5)
    steps = sorted(rng.sample(range(warm, opt.steps), min(opt.bursts, opt.steps - warm)))
    return [(s, rng.uniform(*opt.burst_ratio)) for s in steps]


def _progress(name: str, done: int, total: int, extra: str, final: bool = False) -> None:
    width = 30
    fill = int(width * done / max(total, 1))
    line = f"\r[{name:>6}] {'#' * fill}{'.' * (width - fill)} {done}/{total} {extra}"
    if sys.stderr.isatty():
        sys.stderr.write(line + ("\n" if final else ""))
    elif final or done % max(total // 5, 1) == 0:
        sys.stderr.write(line.lstrip("\r") + "\n")
    sys.stderr.flush()


def run_transport(tb, opt: Options, transport: str, plan: list, burst_s: list) -> Run:
    """Train once with ``transport``; arm the planned bursts as rank 0 reaches their steps.

    ``burst_s[0]`` is the burst duration; if None it is set from this run's
    clean rounds before the first burst (and kept for the next transports).
    """
    port = 29500 + random.Random(opt.seed + len(transport)).randrange(1000)
    master = f"{tb.addr(0)}:{port}"
    argv = lambda r: [sys.executable, "-m", "pydblp.experiment.worker", "--rank", str(r), "--world",
                      str(opt.workers), "--master", master, "--transport", transport, "--net", opt.net,
                      "--iface", "eth0", "--model", opt.model, "--steps", str(opt.steps), "--seed",
                      str(opt.seed), "--tol", str(opt.tol), "--estimator", opt.estimator,
                      "--batch", str(opt.batch), "--rate", str(tb.rate_bps), "--mode", opt.mode,
                      "--allgather", opt.allgather,
                      "--group", json.dumps(tb.group(wire.DEFAULT_PORT))]  # (the workers' --port)
    # GLOO_SOCKET_IFNAME: Gloo would otherwise bind what the hostname resolves to (loopback)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"}
    errs = [open(Path(opt.out_dir) / f"{transport}.rank{r}.log", "w") for r in range(opt.workers)]
    procs = [tb.popen(r, argv(r), stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                      stderr=errs[r], env=env, text=True) for r in range(opt.workers)]
    run = Run(transport)
    pending = dict(plan)
    deadline = time.monotonic() + opt.timeout
    try:
        out = procs[0].stdout
        while True:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{transport}: no result within {opt.timeout:.0f} s")
            ready, _, _ = select.select([out], [], [], 1.0)
            dead = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if dead:  # one rank failed: the others would wait for it until their timeouts
                break
            if not ready:
                if procs[0].poll() is not None:
                    break
                continue
            line = out.readline()
            if not line:
                break
            rec = json.loads(line)
            if "step" in rec and "sync" in rec:
                run.steps.append(rec)
                nxt = rec["step"] + 1
                if nxt in pending:
                    if burst_s[0] is None:  # about one round: this run's clean median so far
                        burst_s[0] = float(np.median([x["sync"] for x in run.steps[3:]] or [0.02]))
                    start = tb.burst(ratio=pending.pop(nxt), duration=burst_s[0])
                    run.bursts.append((start, burst_s[0], nxt))
                extra = f"loss {rec['loss']:.3f}"
                if run.evals:
                    extra += f"  {run.evals[-1]['metric']} {run.evals[-1]['eval']:.3f}"
                _progress(transport, nxt, opt.steps, extra)
            elif "eval" in rec:
                run.evals.append(rec)
            elif rec.get("final"):
                run.final = rec
        if not any(p.poll() not in (None, 0) for p in procs):
            for p in procs:
                p.wait(timeout=max(5.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in errs:
            f.close()
    bad = [r for r, p in enumerate(procs) if p.returncode not in (0, None) and p.returncode > 0] or \
        [r for r, p in enumerate(procs) if p.returncode]
    if bad or not run.final:
        log = Path(opt.out_dir) / f"{transport}.rank{bad[0] if bad else 0}.log"
        tail = log.read_text().strip().splitlines()[-3:] if log.exists() else []
        raise RuntimeError(f"{transport}: rank(s) {bad or [0]} failed: " + " | ".join(tail))
    _progress(transport, opt.steps, opt.steps, "done", final=True)
    return run


def summarize(run: Run, opt: Options, target: float | None) -> dict:
    sync = np.array([s["sync"] for s in run.steps])
    t0 = np.array([s["t0"] for s in run.steps])
    in_burst = np.zeros(len(sync), bool)
    for start, dur, _ in run.bursts:
        in_burst |= (t0 < start + dur) & (t0 + sync > start)
    metric = run.evals[-1]["metric"] if run.evals else None
    better = (lambda v: v >= target) if metric == "accuracy" else (lambda v: v <= target)
    reached = next((e["t"] for e in run.evals if target is not None and better(e["eval"])), None)
    rounds = run.final.get("rounds", [])
    return {
        "transport": run.transport,
        "wall_s": run.final.get("wall"),
        "time_to_target_s": reached,
        "final_metric": run.evals[-1]["eval"] if run.evals else None,
        "metric": metric,
        "round_p50_ms": float(np.percentile(sync, 50) * 1e3),
        "round_p99_ms": float(np.percentile(sync, 99) * 1e3),
        "round_max_ms": float(sync.max() * 1e3),
        "burst_rounds": int(in_burst.sum()),
        "burst_round_ms": float(np.median(sync[in_burst]) * 1e3) if in_burst.any() else None,
        "clean_round_ms": float(np.median(sync[~in_burst]) * 1e3) if (~in_burst).any() else None,
        "delivered": float(np.mean([r["delivered"] for r in rounds])) if rounds else 1.0,
        "retransmits": int(sum(r["retx"] for r in rounds)) + run.final.get("trail_retransmits", 0) if rounds else None,
        "tcp_retransmits": run.final.get("tcp_retransmits"),
        "below_bound_rounds": int(sum(r["below"] for r in rounds)) if rounds else 0,
    }


def run(opt: Options) -> dict:
    """The whole experiment; returns the report (also written to out_dir/report.json)."""
    from pydblp.experiment import report
    from pydblp.testbed import Testbed

    out = Path(opt.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plan = burst_plan(opt)
    target = opt.target if opt.target is not None else (0.9 if opt.model == "digits" else 8.0)
    runs: dict[str, Run] = {}
    burst_s = [opt.burst_ms / 1e3 if opt.burst_ms else None]
    with Testbed(workers=opt.workers) as tb:
        if opt.loss:
            tb.loss(opt.loss)
        for tr in opt.transports:  # the first (Gloo by default) sizes the bursts
            runs[tr] = run_transport(tb, opt, tr, plan, burst_s)
        fabric_stats = tb.stats()
    summary = {tr: summarize(r, opt, target) for tr, r in runs.items()}
    rep = {
        "options": asdict(opt),
        "target": target,
        "burst_ms": burst_s[0] * 1e3 if burst_s[0] else None,
        "burst_plan": plan,
        "summary": summary,
        "speedup": report.speedups(summary),
        "runs": {tr: asdict(r) for tr, r in runs.items()},
        "fabric": {port: {k: v for k, v in st.items() if isinstance(v, dict) and "packets" in v}
                   for port, st in fabric_stats.items()},
    }
    (out / "report.json").write_text(json.dumps(rep, indent=1, default=float))
    report.plots(rep, out)
    return rep
