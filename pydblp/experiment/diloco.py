"""``dblp experiment --algo diloco``: DDP vs exact DiLoCo vs gossip DiLoCo, and a worker killed mid-run.

Brings up a ``workers``-worker testbed at a (low) link rate, optionally with
random loss and microbursts, and trains the same model from the same seed
once per run:

* ``ddp``: DDP over Gloo, gradients averaged every step (``outer_steps * H`` steps);
* ``exact``: DiLoCo, pseudo-gradients averaged over Gloo every H steps;
* ``exact-pydblp``: the same, averaged by pydblp's bounded-loss collective (UDP data plane);
* ``gossip``: Factored Gossip DiLoCo over :class:`~pydblp.torch.GlooExchange`;
* ``gossip-kill``: the same, with the last worker killed (SIGKILL) half way;
* ``gossip-pydblp``, ``gossip-kill-pydblp``: ``gossip`` and ``gossip-kill`` with the
  neighbour rounds run by pydblp's bounded-loss collective (``Collective.neighbours``).

Each worker writes its final parameters and a JSON summary to ``out_dir``;
the report (``report.json`` and a table) gives per run: final quality (the
mean of the surviving workers' own evaluations: accuracy for digits,
perplexity for text), wall time, bytes sent per inner step (the worker
NIC's transmitted bytes, headers included, over inner steps, mean over
workers), consensus distance (RMS distance of the workers' parameters from
their mean, per parameter), compute utilisation (inner steps times the
worker's median local step time, over wall time) and the outer steps that
ran without some neighbour.

Workers are this module run as ``python -m pydblp.experiment.diloco`` inside
the testbed's namespaces.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

RUNS = ("ddp", "exact", "exact-pydblp", "gossip", "gossip-kill", "gossip-pydblp", "gossip-kill-pydblp")


@dataclass
class Options:
    workers: int = 4
    model: str = "digits"
    outer_steps: int = 30
    sync_every: int = 20             # H
    runs: tuple = ("ddp", "exact", "gossip", "gossip-kill")
    topology: str = "random"
    overlap_rounds: int = 1
    blocking_rounds: int = 0
    rate: str = "20mbit"             # each worker NIC's TBF rate
    loss: float = 0.0                # background random loss on every switch port
    bursts: int = 0                  # microbursts over each run, every few seconds
    burst_ratio: float = 0.8
    burst_ms: float = 20.0
    timeout: float = 2.0             # a gossip neighbour's per-round timeout (s)
    seed: int = 0
    batch: int = 32
    out_dir: str = "dblp-experiment-diloco"
    run_timeout: float = 900.0       # per run


# ---- the worker ------------------------------------------------------------------

def _tx_bytes(iface: str) -> int:
    """Bytes ``iface`` transmitted, read from this process's network namespace."""
    for line in open("/proc/self/net/dev").read().splitlines()[2:]:
        name, rest = line.split(":", 1)
        if name.strip() == iface:
            return int(rest.split()[8])
    raise FileNotFoundError(f"no interface {iface} in this network namespace")


def _emit(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def worker(argv=None) -> int:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pydblp.experiment import data, models

    p = argparse.ArgumentParser(prog="python -m pydblp.experiment.diloco")
    for name, typ in (("rank", int), ("world", int), ("master", str), ("run", str), ("model", str),
                      ("outer-steps", int), ("sync-every", int), ("topology", str), ("overlap-rounds", int),
                      ("blocking-rounds", int), ("timeout", float), ("seed", int), ("batch", int),
                      ("out", str), ("addr", str), ("iface", str)):
        p.add_argument(f"--{name}", type=typ, required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    dist.init_process_group("gloo", init_method=f"tcp://{a.master}", rank=a.rank, world_size=a.world,
                            timeout=datetime.timedelta(seconds=120))
    state = exchange = None
    try:
        if a.model == "digits":
            model = models.DigitsCNN()
            xtr, ytr, xte, yte = data.digits(seed=a.seed)
            mine = data.shard(len(xtr), a.rank, a.world, a.seed)
        else:
            tr, te, vocab = data.text()
            model = models.CharTransformer(vocab)
        gen = torch.Generator().manual_seed(a.seed * 1000 + a.rank)

        def loss_of(m):
            if a.model == "digits":
                idx = mine[torch.randint(0, len(mine), (a.batch,), generator=gen)]
                return torch.nn.functional.cross_entropy(m(xtr[idx]), ytr[idx])
            x, y = models.text_batch(tr, a.batch, model.context, gen)
            return torch.nn.functional.cross_entropy(m(x).reshape(-1, vocab), y.reshape(-1))

        # the local step's own cost, before any communication (compute utilisation's yardstick)
        import copy
        probe = copy.deepcopy(model)
        popt = torch.optim.AdamW(probe.parameters(), lr=1e-3)
        times = []
        for _ in range(12):
            t = time.monotonic()
            popt.zero_grad()
            loss_of(probe).backward()
            popt.step()
            times.append(time.monotonic() - t)
        step_s = float(np.median(times[2:]))
        del probe, popt
        gen.manual_seed(a.seed * 1000 + a.rank)

        lr = 2e-3 if a.model == "digits" else 3e-3
        steps = a.outer_steps * a.sync_every
        tx0, t0 = _tx_bytes(a.iface), time.monotonic()
        records = []
        if a.run == "ddp":
            net = DDP(model)
            inner = torch.optim.AdamW(net.parameters(), lr=lr)
            for s in range(steps):
                inner.zero_grad()
                loss_of(net).backward()
                inner.step()
                if a.rank == 0 and (s + 1) % a.sync_every == 0:
                    _emit({"outer": (s + 1) // a.sync_every, "t": time.monotonic() - t0})
        else:
            import pydblp.torch as ptorch

            if a.run.endswith("-pydblp"):
                from pydblp.collective import Config

                state = ptorch.State.from_process_group("udp", iface=a.iface, port=0,
                                                        config=Config(job=33, phase="static:0.016"))
                exchange = ptorch.PydblpExchange(state, timeout=a.timeout)
            else:
                exchange = ptorch.GlooExchange(addr=a.addr, timeout=a.timeout)
            inner = torch.optim.AdamW(model.parameters(), lr=lr)
            outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
            mode = "gossip" if a.run.startswith("gossip") else "exact"
            with ptorch.DiLoCo(exchange, model, inner, outer, sync_every=a.sync_every, mode=mode,
                               topology=a.topology, overlap_rounds=a.overlap_rounds,
                               blocking_rounds=a.blocking_rounds, seed=a.seed) as d:
                for s in range(steps):
                    inner.zero_grad()
                    loss_of(model).backward()
                    inner.step()
                    if a.rank == 0 and (s + 1) % a.sync_every == 0:
                        _emit({"outer": d.outer_steps, "t": time.monotonic() - t0})
            records = [asdict(r) for r in d.records]
        wall = time.monotonic() - t0
        tx = _tx_bytes(a.iface) - tx0
        model.eval()
        with torch.no_grad():
            metric = (models.accuracy(model, xte, yte) if a.model == "digits"
                      else models.perplexity(model, te, model.context))
        flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()]).numpy()
        np.save(Path(a.out) / f"{a.run}.rank{a.rank}.npy", flat)
        summary = {"rank": a.rank, "wall": wall, "tx_bytes": tx, "inner_steps": steps, "step_s": step_s,
                   "metric": metric, "blocking_s": sum(r["blocking_s"] for r in records),
                   "payload_bytes": exchange.bytes_sent if exchange else None,
                   "missing": {r["step"]: r["missing"] for r in records if r["missing"]}}
        (Path(a.out) / f"{a.run}.rank{a.rank}.json").write_text(json.dumps(summary))
        _emit({"final": True, **summary})
        return 0
    finally:
        if exchange is not None:
            exchange.close()
        if state is not None:
            state.close()  # barrier first: a peer may still need this rank's repairs
        dist.destroy_process_group()


# ---- the runner ------------------------------------------------------------------

def _run_one(tb, opt: Options, run: str) -> dict:
    out = Path(opt.out_dir)
    for f in out.glob(f"{run}.rank*"):
        f.unlink()
    port = 29600 + RUNS.index(run) * 7 + opt.seed % 7
    argv = lambda r: [sys.executable, "-m", "pydblp.experiment.diloco", "--rank", str(r), "--world",
                      str(opt.workers), "--master", f"{tb.addr(0)}:{port}", "--run", run, "--model", opt.model,
                      "--outer-steps", str(opt.outer_steps), "--sync-every", str(opt.sync_every),
                      "--topology", opt.topology, "--overlap-rounds", str(opt.overlap_rounds),
                      "--blocking-rounds", str(opt.blocking_rounds), "--timeout", str(opt.timeout),
                      "--seed", str(opt.seed), "--batch", str(opt.batch), "--out", str(out),
                      "--addr", tb.addr(r), "--iface", "eth0"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"}
    logs = [open(out / f"{run}.rank{r}.log", "w") for r in range(opt.workers)]
    procs = [tb.popen(r, argv(r), stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL, stderr=logs[r],
                      env=env, text=True) for r in range(opt.workers)]
    victim = opt.workers - 1 if run.startswith("gossip-kill") else None
    killed_at = None
    deadline = time.monotonic() + opt.run_timeout
    expired = []
    watchdog = threading.Timer(opt.run_timeout, lambda: (expired.append(1), [p.kill() for p in procs]))
    watchdog.start()
    if opt.bursts:  # spread over the run's expected length: one every few seconds
        tb.burst(ratio=opt.burst_ratio, duration=opt.burst_ms / 1e3, delay=2.0, every=3.0, count=opt.bursts)
    try:
        for line in procs[0].stdout:
            rec = json.loads(line)
            if "outer" in rec:
                sys.stderr.write(f"\r[{run:>12}] outer step {rec['outer']}/{opt.outer_steps}")
                if victim is not None and killed_at is None and rec["outer"] >= opt.outer_steps // 2:
                    os.kill(procs[victim].pid, signal.SIGKILL)  # (nsenter execs: the pid is the worker's)
                    killed_at = rec["outer"]
        for p in procs:
            p.wait(timeout=max(5.0, deadline - time.monotonic()))
    finally:
        watchdog.cancel()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
        if opt.bursts:
            tb.clear()
            if opt.loss:
                tb.loss(opt.loss)
        sys.stderr.write("\n")
    if expired:
        raise RuntimeError(f"{run}: no result within {opt.run_timeout:.0f} s (workers killed)")
    alive = [r for r in range(opt.workers) if r != victim]
    bad = [r for r in alive if procs[r].returncode != 0]
    if bad:
        tail = (out / f"{run}.rank{bad[0]}.log").read_text().strip().splitlines()[-3:]
        raise RuntimeError(f"{run}: rank(s) {bad} failed: " + " | ".join(tail))
    ws = [json.loads((out / f"{run}.rank{r}.json").read_text()) for r in alive]
    params = np.stack([np.load(out / f"{run}.rank{r}.npy") for r in alive])
    return {"run": run, "ranks": ws, "killed": victim, "killed_at_outer_step": killed_at,
            "consensus": float(np.sqrt(((params - params.mean(0)) ** 2).mean()))}


def summarize(res: dict, opt: Options) -> dict:
    ws = res["ranks"]
    steps = ws[0]["inner_steps"]
    wall = max(w["wall"] for w in ws)
    missing = {}
    for w in ws:
        for step, rounds in w["missing"].items():
            missing.setdefault(int(step), set()).update(p for left in rounds.values() for p in left)
    return {
        "run": res["run"],
        "metric": "accuracy" if opt.model == "digits" else "perplexity",
        "final_metric": float(np.mean([w["metric"] for w in ws])),
        "wall_s": wall,
        "bytes_per_inner_step": float(np.mean([w["tx_bytes"] for w in ws])) / steps,
        "consensus_distance": res["consensus"],
        # DiLoCo: the share of wall time not spent waiting in outer steps (measured); DDP, whose
        # communication runs inside backward(): inner steps x the local step's own time, over wall time
        "compute_utilisation": float(np.mean([
            steps * w["step_s"] / w["wall"] if res["run"] == "ddp" else 1 - w["blocking_s"] / w["wall"]
            for w in ws])),
        "blocking_s": float(np.mean([w["blocking_s"] for w in ws])),
        "killed": res["killed"],
        "killed_at_outer_step": res["killed_at_outer_step"],
        "outer_steps_without": {str(k): sorted(v) for k, v in sorted(missing.items())},
    }


def table(rep: dict) -> str:
    rows = [("run", rep["summary"][0]["metric"] if rep["summary"] else "metric", "wall s", "B/inner step",
             "consensus", "compute util", "blocking s", "steps w/o a peer")]
    for s in rep["summary"]:
        rows.append((s["run"], f"{s['final_metric']:.4f}", f"{s['wall_s']:.1f}", f"{s['bytes_per_inner_step']:.0f}",
                     f"{s['consensus_distance']:.2e}", f"{s['compute_utilisation']:.3f}", f"{s['blocking_s']:.2f}",
                     str(len(s["outer_steps_without"]))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in rows)


def run(opt: Options) -> dict:
    """All runs on one testbed; returns the report (also written to out_dir/report.json)."""
    from pydblp.testbed import Testbed

    out = Path(opt.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    with Testbed(workers=opt.workers, rate=opt.rate) as tb:
        if opt.loss:
            tb.loss(opt.loss)
        for r in opt.runs:
            results.append(_run_one(tb, opt, r))
    rep = {"options": asdict(opt), "summary": [summarize(r, opt) for r in results], "runs": results}
    (out / "report.json").write_text(json.dumps(rep, indent=1, default=float))
    return rep


if __name__ == "__main__":
    sys.exit(worker())
