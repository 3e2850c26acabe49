"""``dblp experiment``: Gloo vs static bounded loss vs DBLP under microbursts, on a testbed.

Brings up a ``workers``-worker testbed (each worker link rate-limited by a
TBF, ``rate_mbit``), sets the background loss (random or Gilbert-Elliott) on
every switch port, and for each seed trains the same model with the same seed
once per arm (Gloo, static tolerance, DBLP), arming microbursts at the same seeded random steps for
each (drop ratio uniform in ``burst_ratio``, lasting ``burst_ms`` or about
one Gloo round, on ``burst_ports``).  Writes ``report.json`` (per-seed
summaries and runs, mean and spread over seeds) and PNG plots to ``out_dir``.
``SCENARIOS`` holds the presets (``demo``, ``paper``); docs/experiment.md
describes them.
"""

from __future__ import annotations

import json
import logging
import os
import random
import select
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from pydblp import wire
from pydblp.collective.config import CCS, PLANS  # pydblp Config.cc of the pydblp runs, Config.plan of the dblp runs
from pydblp.experiment import stats

ARMS = ("gloo", "static", "dblp")  # Arm.method: Gloo, static tolerance, DBLP (the worker's --arm)
LOSS_MODELS = ("random", "ge")
PRIORITIES = ("magnitude", "layer", "none")  # pydblp Config.priority of the pydblp runs
DROP_POLICIES = ("priority", "tail")  # the virtual queue: priority-aware early drop or drop-tail
RELAX = ("none", "ef", "rotate", "both")  # the pydblp runs' relaxed rounds (the worker's --relax)
log = logging.getLogger(__name__)
CLOSE_S = 30.0  # s the ranks have to exit once the result is in
TARGET_AT = 0.8  # the default target: what lossless Gloo reaches at this fraction of its steps


@dataclass
class Options:
    workers: int = 4
    algo: str = "ddp"               # the worker's --algo: ddp (pydblp through DDP's hook) or fsdp (FSDP2
                                    # over a "dblp" process group; Gloo's for the gloo arm)
    via: str = "hook"               # ddp's pydblp runs: DDP's comm hook, or a "dblp" group DDP runs over
    model: str = "mlp"
    steps: int = 200
    arms: tuple = ARMS              # each pydblp one runs once per (priority, drop policy): arms()
    net: str = "xsk"                # pydblp data plane: xsk (AF_XDP), xsk-ktx (AF_XDP receive, kernel transmit) or udp
    seed: int = 0
    seeds: int = 1                  # runs seed, seed + 1, ... seed + seeds - 1
    rate_mbit: float | None = None  # each worker NIC's TBF rate (None: the testbed's 1 Gbit/s; 0: no limit)
    bursts: int = 15                # microbursts over the run (0: none)
    burst_ratio: tuple = (0.6, 0.9)
    burst_ms: float | None = 8.0    # None: the median clean round of the first arm's run (Gloo)
    burst_ports: tuple | str = (1,)   # worker ports a burst hits: "all" or worker indices
    loss: float = 0.10              # background loss: the mean loss rate on every port
    loss_model: str = "random"      # "random" (Bernoulli) or "ge" (Gilbert-Elliott, same mean)
    ge_len: float = 10.0            # ge: mean bad-state run, packets
    ge_bad: float = 0.8             # ge: drop ratio in the bad state (the good state drops nothing)
    p_low: float = 0.016            # static tolerance and DBLP's P_low
    k: float = 0.40                 # DBLP's P_high - P_low
    high: str = "fixed"             # DBLP's relaxed bound: P_low + k ("fixed") or P_low + the measured loss ("loss")
    freq: int = 10                  # DBLP measures G every freq steps
    eta: float = 0.5                # DBLP's critical threshold
    g_over: str = "step"            # DBLP's G: the measured step's ("step") or the window's mean ("window")
    estimator: str = "unbiased"
    order: str = "shuffle"          # pydblp Config.order: "shuffle" or "rows"
    stagger: str = "on"             # pydblp Config.stagger: "on" or "off"
    mode: str = "tar"               # pydblp Config.mode: "tar" or "ps" (DBLP's setup)
    allgather: str = "unicast"      # pydblp Config.allgather: "broadcast" sends to the testbed's group address
    consistency: str = "allgather"  # "allgather" (identical results: Config.consistent), "none" (the
                                    # all-gather tolerates loss) or "broadcast:N" (that, plus a
                                    # ParameterBroadcaster every N steps)
    priority: tuple = ("magnitude",)  # pydblp runs: one per Config.priority given ...
    drop_policy: tuple = ("priority",)  # ... times one per queue drop policy given ...
    cc: tuple = ("ecn",)            # ... times one per Config.cc given (congestion control) ...
    plan: tuple = ("auto",)         # ... and, for the dblp runs, one per Config.plan given ...
    relax: tuple = ("none",)        # ... times one per relaxation given: none, ef (error feedback),
                                    # rotate (random rotation) or both (the worker's --relax)
    static_relax: tuple | None = None  # the static arm's relaxations (None: relax's)
    queue_mbit: float | None = None  # a virtual queue (finite buffer) on queue_ports draining at this
                                    # rate; None: none (drops come only from the loss models)
    queue_kb: float = 128.0         # its buffer, KiB: beyond it every frame is dropped (tail)
    mark_kb: float | None = None    # its ECN threshold, KiB: ECN-capable frames admitted past it are marked
                                    # CE (pydblp's with Config.cc "ecn"); None: no marking
    queue_ports: tuple | str | None = None  # None: where the traffic converges (rank 0 in ps mode, else all)
    starve: tuple | None = None     # (rank, share): cap that rank's CPU at share of one core
    target: float | None = None     # held-out loss (nats) to reach; None: Gloo's smoothed loss at TARGET_AT
    gloo_from: str | None = None    # an earlier report.json: each seed's Gloo run taken from it, not run again
    out_dir: str = "dblp-experiment"
    batch: int | None = None        # samples per rank and step; None: the model's (32; lm 4)
    eval_every: int = 25
    grad_error_every: int = 10      # pydblp runs: compare the step's averaged gradient with the exact
                                    # mean (a Gloo allreduce, left out of the timings) every N steps
    spread: int = 0                 # pydblp Config.spread: packets per destination in turn (0: off)
    warm_up: int = 2                # pydblp runs over the hook or a sharded optimizer: State.warm_up rounds
    timeout: float = 600.0          # per arm
    scenario: str = "demo"


# Presets: every field not given on the command line comes from the scenario.  Both put a
# message's background loss between P_low and P_high (10 % random loss on every port: static
# repairs it, dblp's relaxed phase tolerates it in the reduce-scatter) and burst part of the
# messages (8 ms of a ~200 ms round, on one worker's link); "paper" runs longer, with more
# bursts.  Why 10 %: at 2 % Gloo's TCP repairs loss by fast retransmit and loses little, and
# pydblp's rounds on 2 vCPUs are CPU-bound (~95 ms against ~53 ms of link time at 1 Gbit/s), so
# neither the tolerance nor the reliable baseline's repair shows; at 10 % Gloo's tail losses
# become RTOs (round p50 ~315 ms, p99 ~1.8 s) while static's repairs cost it ~10 % over dblp.
# Slower links (--rate 500) kept dblp/static at the same 0.86x a round; a parameter server
# with a broadcast all-gather made dblp slower (each receiver's 10 % of the broadcast repaired
# by unicast).  Gilbert-Elliott background loss (--loss-model ge) at a 3 % mean made Gloo's
# steps ~40x longer here (TCP timeouts), too slow for a 20-minute run of 3 seeds.
# "demo" keeps identical replicas (pydblp.torch's default): the gradient all-gather is
# repaired whole, so a relaxed round is at best ~0.86x static's (paper scenario, six seeds:
# time to target 0.88x static's).  "paper" runs DBLP's own architecture: a sharded optimizer
# whose all-gather carries parameters and tolerates loss (a parameter not delivered keeps its
# value, replicas within 0.65-0.75 %), with G over the window since the last check ("--g-over
# window": one step's G jumped by more than eta late in training and read as critical):
# six seeds 0.80x static's time to target (0.83x with the paper's one-step G, 0.88x with
# identical replicas; bench/results/2026-12-04-sharded-optimizer.md).  Other ways of letting
# the gradient all-gather tolerate loss cost more steps than they saved: a stale fill
# (allgather:bound), the cut applied a round later (allgather:carry, 1.03x), replicas drifting
# until a broadcast (broadcast:10, 0.83x, replicas up to 7.4 % apart).
#
# "incast": no injected loss at all.  A parameter server (rank 0) receives every worker's
# gradient at once through a switch port with a finite buffer (128 KiB, draining at 2 Gbit/s
# while three workers send at 1 Gbit/s each), so drops come from the queue; the pydblp runs repeat with the port shedding by priority
# within each message's budget and as a plain drop-tail queue.  docs/experiment.md has figures.
SCENARIOS = {
    "demo": {},
    "paper": {"steps": 300, "bursts": 30, "eval_every": 10, "consistency": "sharded", "g_over": "window"},
    "incast": {"mode": "ps", "loss": 0.0, "bursts": 0, "queue_mbit": 2000.0, "queue_kb": 128.0,
               "arms": ("gloo", "dblp"), "drop_policy": DROP_POLICIES},
}


def options(scenario: str = "demo", **given) -> Options:
    """The scenario's preset, overridden by ``given`` (fields of :class:`Options` not None)."""
    if scenario not in SCENARIOS:
        raise ValueError(f"scenario {scenario!r}: use {', '.join(SCENARIOS)}")
    fields = {**SCENARIOS[scenario], **{k: v for k, v in given.items() if v is not None}}
    return Options(scenario=scenario, **fields)


# Options that only the pydblp arms read: an earlier report's Gloo runs carry over whatever they were
# (gloo_from); every other option shapes what Gloo trains or the network it runs over, and must match.
PYDBLP_ONLY = frozenset({"arms", "net", "p_low", "k", "high", "freq", "eta", "g_over", "estimator", "order",
                         "stagger", "allgather", "priority", "drop_policy", "cc", "plan", "relax", "static_relax",
                         "mark_kb", "target", "out_dir", "seed", "seeds", "grad_error_every", "warm_up", "spread",
                         "timeout",
                         "gloo_from"})


def earlier_gloo(opt: Options) -> dict[int, dict]:
    """Each seed's Gloo run from ``opt.gloo_from`` (a report.json of an earlier run), by seed: its
    summary, target, curve targets and burst length.

    Gloo's training depends on the seed, the model and the network, not on what the pydblp arms
    beside it do, and its target is a loss at a step, not a time: so a reused Gloo run is the run
    this one would make, up to the machine's speed, which moves its times as it moves any two runs'.

    Raises:
        ValueError: the arms include Gloo, the file is not a report, an option that shapes
            Gloo's run differs from the report's (an option the report predates counts as its
            default), or a seed has no Gloo run there; the message names it.
    """
    path = Path(opt.gloo_from)
    if "gloo" in opt.arms:
        raise ValueError(f"--gloo-from {path}: Gloo's runs come from the report; leave gloo out of --arms")
    try:
        rep = json.loads(path.read_text())
        theirs, seeds = rep["options"], rep["seeds"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--gloo-from {path}: not a dblp experiment report.json ({type(e).__name__}: {e})") from None
    mine, default = json.loads(json.dumps(asdict(opt))), json.loads(json.dumps(asdict(Options())))
    for key, v in mine.items():
        if key in PYDBLP_ONLY:
            continue
        was = theirs.get(key, default[key])
        if was != v:
            flag = "--" + key.replace("_", "-")
            raise ValueError(f"--gloo-from {path}: its runs had {flag} {was} and this one {v}: Gloo's runs carry "
                             f"over only between runs that train and load the network alike")
    have = {s.get("seed"): s for s in seeds if "gloo" in (s.get("summary") or {})}
    out = {}
    for seed in range(opt.seed, opt.seed + opt.seeds):
        s = have.get(seed)
        if s is None:
            got = ", ".join(str(k) for k in sorted(have)) or "none"
            raise ValueError(f"--gloo-from {path}: no Gloo run of seed {seed} there (its seeds with one: {got})")
        # (a report that reused Gloo's runs itself names the one they were measured in)
        out[seed] = {"summary": {"reused_from": str(path), **s["summary"]["gloo"]}, "target": s.get("target"),
                     "curve_targets": s.get("curve_targets") or [], "burst_ms": s.get("burst_ms")}
    return out


def reused_gloo(was: dict, target: float | None) -> dict:
    """An earlier Gloo run's summary (:func:`earlier_gloo`), its time to ``target`` read off its own
    smoothed held-out loss curve (the same crossing :func:`summarize` takes)."""
    g = dict(was["summary"])
    ts, loss = (g.get("loss_curve") or [[], []])[:2]
    g["time_to_target_s"] = stats.first_crossing(ts, loss, target) if target is not None and ts else None
    return g


def ge_params(loss: float, length: float, bad: float) -> tuple[float, float]:
    """Gilbert-Elliott (p, r) whose long-run loss is ``loss`` with mean bad runs of ``length`` packets.

    r = 1/length; loss = p*bad/(p + r) gives p = loss*r/(bad - loss) (needs loss < bad).
    """
    r = 1.0 / length
    return loss * r / (bad - loss), r


@dataclass(frozen=True)
class Arm:
    """One training run of a seed: how it synchronises (``method``: gloo, static or dblp, the
    worker's ``--arm``), and for pydblp its priority rule and the queue's policy."""
    name: str
    method: str
    priority: str = "magnitude"
    drop_policy: str = "priority"
    cc: str = "ecn"
    relax: str = "none"
    plan: str = "auto"


def arms(opt: Options) -> list[Arm]:
    """The runs of one seed, in the report's order (:func:`run_order`: the order they run in).  A
    pydblp arm runs once per (priority, drop policy) pair; its name is the method's alone when
    there is one pair, else ``dblp/layer/tail``."""
    many = len(opt.priority) * len(opt.drop_policy) > 1
    static = opt.relax if opt.static_relax is None else opt.static_relax
    named = len(opt.relax) > 1 or len(static) > 1 or static != opt.relax  # (names say the relaxation)
    out = []
    for m in opt.arms:
        ways = static if m == "static" else opt.relax
        plans = opt.plan if m == "dblp" else opt.plan[:1]  # (one static run: its bound, below the loss, never plans)
        if m == "gloo":  # TCP is not DBLP: never early-dropped, the policy does not apply
            out.append(Arm("gloo", "gloo", "none", opt.drop_policy[0]))
            continue
        for pr in opt.priority:
            for pol in opt.drop_policy:
                for cc in opt.cc:
                    for rx in ways:
                        for pl in plans:
                            name = f"{m}/{pr}/{pol}" if many else m
                            name = f"{name}/cc-{cc}" if len(opt.cc) > 1 else name
                            name = f"{name}/plan-{pl}" if len(plans) > 1 else name
                            out.append(Arm(f"{name}/{rx}" if named else name, m, pr, pol, cc, rx, pl))
    return out


def run_order(runs: list[Arm], nth: int, sized: bool) -> list[Arm]:
    """The order the runs of the ``nth`` seed (0, 1, ...) go in: as given on even seeds,
    reversed on odd ones, so that a run's place in the sequence weighs on every arm alike over
    an even number of seeds (on this machine kind, of two dblp runs in one invocation the second
    took ~5 % longer a relaxed round, whichever it was: 2026-12-07-error-feedback-cost.md).
    While the bursts are not ``sized`` yet, the first run sizes them and stays first."""
    if nth % 2 == 0 or len(runs) < 2:
        return list(runs)
    return runs[::-1] if sized else [runs[0], *runs[:0:-1]]


def queue_ports(opt: Options):
    """The ports the virtual queue sits on: rank 0's in ps mode (the incast), else every port."""
    if opt.queue_ports is not None:
        return opt.queue_ports
    return (0,) if opt.mode == "ps" else "all"


@dataclass
class Run:
    arm: str                                     # the Arm's name
    steps: list = field(default_factory=list)    # rank 0 step records
    evals: list = field(default_factory=list)
    divs: list = field(default_factory=list)     # replica divergence at evaluation points
    gerrs: list = field(default_factory=list)    # {"gerr", "step"}: relative error of the averaged gradient
    calibrate: float | None = None               # s of compute (forward + backward, no sync) a step
    final: dict = field(default_factory=dict)
    bursts: list = field(default_factory=list)   # (start monotonic s, duration s, step)
    setup: dict = field(default_factory=dict)    # the Arm's fields
    fabric: dict = field(default_factory=dict)   # this run's drops on the queue ports, by cause
    host: list = field(default_factory=list)     # every rank's host-program counters (AF_XDP)


def burst_plan(opt: Options, seed: int) -> list[tuple[int, float]]:
    """(step, ratio) pairs, seeded: the same steps for every arm."""
    if opt.bursts <= 0:
        return []
    rng = random.Random(seed)
    warm = min(20, opt.steps // 5)
    steps = sorted(rng.sample(range(warm, opt.steps), min(opt.bursts, opt.steps - warm)))
    return [(s, rng.uniform(*opt.burst_ratio)) for s in steps]


def target_step(opt: Options) -> int:
    """The step after which the Gloo run's metric becomes the default target."""
    return max(1, round(opt.steps * TARGET_AT))


def _progress(name: str, done: int, total: int, extra: str, final: bool = False) -> None:
    width = 30
    fill = int(width * done / max(total, 1))
    line = f"\r[{name:>6}] {'#' * fill}{'.' * (width - fill)} {done}/{total} {extra}"
    if sys.stderr.isatty():
        sys.stderr.write(line + ("\n" if final else ""))
    elif final or done % max(total // 5, 1) == 0:
        sys.stderr.write(line.lstrip("\r") + "\n")
    sys.stderr.flush()


def _exits(p: subprocess.Popen, seconds: float) -> bool:
    """Whether ``p`` ends within ``seconds``."""
    try:
        p.wait(timeout=seconds)
        return True
    except subprocess.TimeoutExpired:
        return False


def run_arm(tb, opt: Options, arm: Arm, seed: int, plan: list, burst_s: list) -> Run:
    """Train once as ``arm`` says; arm the planned bursts as rank 0 reaches their steps.

    ``burst_s[0]`` is the burst duration; if None it is set from this run's
    clean rounds before the first burst (and kept for the next arms).
    """
    port = 29500 + random.Random(f"{seed}/{arm.name}").randrange(1000)
    align = tempfile.mkdtemp(prefix="dblp-align-")  # the ranks' HostBarrier (all on this host)
    master = f"{tb.addr(0)}:{port}"
    argv = lambda r: [sys.executable, "-m", "pydblp.experiment.worker", "--rank", str(r), "--world",
                      str(opt.workers), "--master", master, "--arm", arm.method, "--algo", opt.algo, "--via", opt.via,
                      "--net", opt.net,
                      "--iface", "eth0", "--model", opt.model, "--steps", str(opt.steps), "--seed",
                      str(seed), "--p-low", str(opt.p_low), "--k", str(opt.k), "--high", opt.high,
                      "--freq", str(opt.freq),
                      "--eta", str(opt.eta), "--g-over", opt.g_over, "--estimator", opt.estimator,
                      "--order", opt.order, "--stagger", opt.stagger, "--consistency", opt.consistency,
                      *(("--batch", str(opt.batch)) if opt.batch else ()), "--relax", arm.relax,
                      "--rate", str(tb.rate_bps), "--mode", opt.mode,
                      "--allgather", opt.allgather, "--eval-every", str(opt.eval_every),
                      "--priority", arm.priority, "--cc", arm.cc, "--plan", arm.plan, "--grad-error-every", str(opt.grad_error_every),
                      "--warm-up", str(opt.warm_up), "--spread", str(opt.spread),
                      "--eval-at", str(target_step(opt)), "--align", align,
                      "--group", json.dumps(tb.group(wire.DEFAULT_PORT))]  # (the workers' --port)
    # GLOO_SOCKET_IFNAME: Gloo would otherwise bind what the hostname resolves to (loopback)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"}
    name = f"{arm.name.replace('/', '-')}.seed{seed}"
    run = Run(arm.name, setup=asdict(arm))
    pending = dict(plan)
    starved = None
    ports = None if opt.burst_ports == "all" else list(opt.burst_ports)
    deadline = time.monotonic() + opt.timeout
    errs, procs = [], []  # (filled inside the try: a rank that fails to start ends the ones before it)
    try:
        for r in range(opt.workers):
            errs.append(open(Path(opt.out_dir) / f"{name}.rank{r}.log", "w"))
            procs.append(tb.popen(r, argv(r), stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                                  stderr=errs[r], env=env, text=True))
        if opt.starve:
            from pydblp.testbed.cpucap import CpuCap

            starved = CpuCap(procs[opt.starve[0]].pid, opt.starve[1])
        out = procs[0].stdout

        def handle(line: str) -> None:
            rec = json.loads(line)
            if "step" in rec and "sync" in rec:
                run.steps.append(rec)
                nxt = rec["step"] + 1
                if nxt in pending:
                    if burst_s[0] is None:  # about one round: this run's clean median so far
                        burst_s[0] = float(np.median([x["sync"] for x in run.steps[3:]] or [0.02]))
                    start = tb.burst(ratio=pending.pop(nxt), duration=burst_s[0], port=ports)
                    run.bursts.append((start, burst_s[0], nxt))
                extra = f"loss {rec['loss']:.3f}"
                if run.evals:
                    extra += f"  {run.evals[-1]['metric']} {run.evals[-1]['eval']:.3f}"
                _progress(arm.name, nxt, opt.steps, extra)
            elif "eval" in rec:
                run.evals.append(rec)
            elif "div" in rec:
                run.divs.append(rec)
            elif "gerr" in rec:
                run.gerrs.append(rec)
            elif "calibrate" in rec:
                run.calibrate = rec["calibrate"]
            elif rec.get("final"):
                run.final = rec
                run.host = rec.pop("host", [])

        while True:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{arm.name}: no result within {opt.timeout:.0f} s")
            ready, _, _ = select.select([out], [], [], 1.0)
            dead = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if dead:  # one rank failed: the others would wait for it until their timeouts
                if procs[0].poll() is not None:  # (what rank 0 wrote before it ended still counts)
                    for line in out.read().splitlines():
                        handle(line)
                break
            if not ready:
                if procs[0].poll() is not None:
                    break
                continue
            line = out.readline()
            if not line:  # rank 0 closed its output: it is exiting (its status may not be in yet)
                _exits(procs[0], CLOSE_S)
                break
            handle(line)
        if run.final:  # every rank is past its last collective: they only close their sockets
            for p in procs:
                if not _exits(p, CLOSE_S):
                    log.warning("%s: a rank still runs %.0f s after the result; stopping it", arm.name, CLOSE_S)
        elif not any(p.poll() not in (None, 0) for p in procs):
            for p in procs:
                p.wait(timeout=max(5.0, deadline - time.monotonic()))
    finally:
        ended = [p.poll() for p in procs]  # (before the ones still running are stopped)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if starved is not None:
            starved.close()
        for f in errs:
            f.close()
        shutil.rmtree(align, ignore_errors=True)
    if not run.final:
        bad = [r for r, code in enumerate(ended) if code] or [0]  # (the ones that ended by themselves)
        path = Path(opt.out_dir) / f"{name}.rank{bad[0]}.log"
        tail = path.read_text().strip().splitlines()[-3:] if path.exists() else []
        raise RuntimeError(f"{arm.name}: rank(s) {bad} failed: " + " | ".join(tail))
    for r, p in enumerate(procs):  # the result came after every rank's last collective: a crash while
        if p.returncode:            # closing (seen once: Gloo's teardown, SIGABRT) costs no figure
            log.warning("%s: rank %d exited with status %d after the run's result came in; result kept, "
                        "its log: %s", arm.name, r, p.returncode, Path(opt.out_dir) / f"{name}.rank{r}.log")
    _progress(arm.name, opt.steps, opt.steps, "done", final=True)
    return run


def loss_curve(run: Run) -> tuple[list, list, np.ndarray]:
    """The run's held-out loss curve: (training seconds, steps done, loss smoothed) per evaluation."""
    ev = [e for e in run.evals if "loss" in e]
    return [e["t"] for e in ev], [e["step"] + 1 for e in ev], stats.smooth([e["loss"] for e in ev])


def gloo_target(run: Run, opt: Options) -> float | None:
    """The smoothed held-out loss the (lossless: TCP repairs everything) Gloo run had after
    :func:`target_step` steps (interpolated between evaluations)."""
    _, steps, loss = loss_curve(run)
    return stats.value_at(steps, loss, target_step(opt))


def summarize(run: Run, opt: Options, target: float | None) -> dict:
    sync = np.array([s["sync"] for s in run.steps])
    t0 = np.array([s["t0"] for s in run.steps])
    dt = np.array([s.get("dt", s["sync"]) for s in run.steps])
    in_burst = np.zeros(len(sync), bool)
    for start, dur, _ in run.bursts:
        in_burst |= (t0 < start + dur) & (t0 + sync > start)
    metric = run.evals[-1]["metric"] if run.evals else None
    ts, _, loss = loss_curve(run)
    reached = stats.first_crossing(ts, loss, target) if target is not None and ts else None
    curve = [[float(t) for t in ts], [float(v) for v in loss]]
    rounds = run.final.get("rounds", [])
    compute = (run.calibrate or 0.0) + float(np.median([s.get("opt", 0.0) for s in run.steps]))
    by_phase: dict[str, list] = {}
    bound: dict[str, list] = {}
    for r in rounds:
        by_phase.setdefault(r["phase"], []).append(r["delivered"])
        bound.setdefault(r["phase"], []).append(r["tol"])
    retx = int(sum(r["retx"] for r in rounds)) + run.final.get("trail_retransmits", 0) if rounds else None
    ph = run.final.get("phase") or {}
    hist = ph.get("history") or []
    cpu = run.final.get("cpu")
    cpu = float(sum(cpu)) if cpu and all(isinstance(c, (int, float)) for c in cpu) else None
    wall = run.final.get("wall")
    return {
        "arm": run.arm,
        "wall_s": wall,
        "cpu_s": cpu,  # every rank's process CPU over the training steps, summed
        # of the machine's CPUs over the wall (the ranks share this host): near 1, CPU-bound
        "cpu_busy": cpu / (wall * (os.cpu_count() or 1)) if cpu is not None and wall else None,
        "time_to_target_s": reached,
        "final_metric": run.evals[-1]["eval"] if run.evals else None,
        "final_loss": run.evals[-1].get("loss") if run.evals else None,
        "loss_curve": curve,  # (training s, smoothed held-out loss) per evaluation: report.ratios' curve ratio
        "metric": metric,
        "step_ms": float(np.median(dt) * 1e3),
        "compute_ms": compute * 1e3,
        "comm_share": float(max(0.0, 1.0 - compute / np.median(dt))) if len(dt) else None,
        "round_p50_ms": float(np.percentile(sync, 50) * 1e3),
        "round_p99_ms": float(np.percentile(sync, 99) * 1e3),
        "round_max_ms": float(sync.max() * 1e3),
        "burst_rounds": int(in_burst.sum()),
        "burst_round_ms": float(np.median(sync[in_burst]) * 1e3) if in_burst.any() else None,
        "clean_round_ms": float(np.median(sync[~in_burst]) * 1e3) if (~in_burst).any() else None,
        "delivered": float(np.mean([r["delivered"] for r in rounds])) if rounds else 1.0,
        "delivered_by_phase": {k: float(np.mean(v)) for k, v in by_phase.items()},
        "bound_by_phase": {k: float(np.mean(v)) for k, v in bound.items()},  # the mean loss bound
        "rounds_by_phase": {k: len(v) for k, v in by_phase.items()},
        "retransmits": retx,
        "ce_received": int(sum(r.get("ce", 0) for r in rounds)) if rounds else None,  # (rank 0's)
        "paced_share": float(np.mean([r.get("paced", 0) > 0 for r in rounds])) if rounds else None,
        "retransmit_bytes": retx * run.final.get("chunk_bytes", 0) if retx is not None else None,
        "tcp_retransmits": run.final.get("tcp_retransmits"),
        "below_bound_rounds": int(sum(r["below"] for r in rounds)) if rounds else 0,
        "divergence_max": max((d["div"] for d in run.divs), default=None),
        "divergence_rel_max": max((d["div_rel"] for d in run.divs), default=None),
        "divergence_final": run.divs[-1]["div"] if run.divs else None,
        "grad_error": float(np.mean([g["gerr"] for g in run.gerrs])) if run.gerrs else None,
        "grad_error_by_phase": grad_error_by_phase(run),
        "relaxed_share": (sum(not c for _, _, c in hist) / len(hist)) if hist else None,
        "phase_identical": ph.get("identical") if ph else None,
        **drop_summary(run),
    }


def grad_error_by_phase(run: Run) -> dict:
    """Mean gradient error per phase: a measured step's phase is that of its first round (a
    step's rounds share one tolerance: the controller decides between steps)."""
    rounds = run.final.get("rounds") or []
    if not run.gerrs or not rounds or not run.steps:
        return {}
    per_step = len(rounds) / len(run.steps)
    by: dict[str, list] = {}
    for g in run.gerrs:
        i = int(g["step"] * per_step)
        if i < len(rounds):
            by.setdefault(rounds[i]["phase"], []).append(g["gerr"])
    return {ph: float(np.mean(v)) for ph, v in by.items()}


def drop_summary(run: Run) -> dict:
    """The run's drops in the switch queue (tail, early by priority, early refused: budget spent)
    and its receivers' host-program sheds by priority, summed over ranks; None where not measured."""
    fab = run.fabric
    nprio = wire.MAX_PRIO + 1
    host = [h for h in run.host if h]
    return {
        "queue_tail_drops": fab.get("tail") if fab else None,
        "queue_early_drops": sum(fab.get(f"early{p}", 0) for p in range(nprio)) if fab else None,
        "queue_early_by_prio": [fab.get(f"early{p}", 0) for p in range(nprio)] if fab else None,
        "queue_bound_refusals": fab.get("bound") if fab else None,
        "queue_marks": fab.get("mark") if fab else None,
        "host_shed": sum(sum(h["shed"]) for h in host) if host else None,
        "host_shed_by_prio": [sum(h["shed"][p] for h in host) for p in range(nprio)] if host else None,
        "host_shed_by_rank": [sum(h["shed"]) if h else None for h in run.host] if host else None,
    }


QUEUE_CAUSES = ("pass", "tail", "bound", "mark") + tuple(f"early{p}" for p in range(wire.MAX_PRIO + 1))


def shed_thresholds(buffer: int) -> tuple:
    """Early-drop thresholds of the ``priority`` policy: prio p sheds once the backlog passes
    buffer * (16 - p) / 16 (prio 7 from 9/16 full, prio 1 from 15/16; prio 0 never).  High in the
    buffer, so shedding mostly takes the place of the tail drops a full buffer would make, and the
    delivered fraction stays near drop-tail's; the fabric's own default (from 1/8 full) sheds
    earlier and more."""
    from pydblp.testbed.fabric import NPRIO

    return (0,) + tuple(buffer * (2 * NPRIO - p) // (2 * NPRIO) for p in range(1, NPRIO))


def set_queue(tb, opt: Options, arm: Arm) -> None:
    """The queue ports' virtual queue for ``arm``: :func:`shed_thresholds`, or all 0 (drop-tail)."""
    from pydblp.testbed.fabric import NPRIO

    if opt.queue_mbit:
        ports = queue_ports(opt)
        size = int(opt.queue_kb * 1024)
        tb.queue(f"{opt.queue_mbit:g}mbit", buffer=size,
                 thresholds=shed_thresholds(size) if arm.drop_policy == "priority" else (0,) * NPRIO,
                 port=None if ports == "all" else list(ports),
                 mark=None if opt.mark_kb is None else int(opt.mark_kb * 1024))


def queue_drops(tb, opt: Options) -> dict:
    """Packets by cause on the queue ports since the last reset: pass, tail, bound, early0..7."""
    if not opt.queue_mbit:
        return {}
    ports = queue_ports(opt)
    names = list(tb.ports) if ports == "all" else [f"w{p}" for p in ports]
    st = tb.stats(reset=True)
    return {c: sum(st.get(n, {}).get(c, {}).get("packets", 0) for n in names) for c in QUEUE_CAUSES}


def aggregate(per_seed: list[dict]) -> tuple[dict, dict]:
    """(mean, standard deviation) over seeds of every numeric summary field, per arm."""
    mean, spread = {}, {}
    for name in per_seed[0]:
        rows = [s[name] for s in per_seed if name in s]
        m, sd = dict(rows[0]), {}
        for key, v0 in rows[0].items():
            if isinstance(v0, list) and all(isinstance(r.get(key), list) and len(r[key]) == len(v0)
                                            and all(isinstance(x, (int, float)) for x in r[key]) for r in rows):
                m[key] = [float(x) for x in np.mean([r[key] for r in rows], axis=0)]  # (per priority, per rank)
                continue
            if key.endswith("_by_phase"):  # per phase, over the seeds that measured it
                phases = {ph for r in rows for ph in (r.get(key) or {})}
                m[key] = {ph: float(np.mean([r[key][ph] for r in rows if ph in (r.get(key) or {})]))
                          for ph in sorted(phases)}
                continue
            if isinstance(v0, bool) or not isinstance(v0, (int, float)) and v0 is not None:
                if isinstance(v0, bool):
                    m[key] = all(r.get(key) for r in rows)
                continue
            vals = [r.get(key) for r in rows if r.get(key) is not None]
            m[key] = float(np.mean(vals)) if vals else None
            sd[key] = float(np.std(vals)) if len(vals) > 1 else None
            m[key + "_n"] = len(vals)
        mean[name], spread[name] = m, sd
    return mean, spread


def run(opt: Options) -> dict:
    """The whole experiment; returns the report (also written to out_dir/report.json)."""
    from pydblp.experiment import report
    from pydblp.testbed import Testbed

    earlier = earlier_gloo(opt) if opt.gloo_from else {}
    out = Path(opt.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seeds = []
    rate = None if opt.rate_mbit is None else f"{opt.rate_mbit:g}mbit"  # (0: no limit)
    with Testbed(workers=opt.workers, rate=rate) as tb:
        if opt.loss and opt.loss_model == "ge":
            p, r = ge_params(opt.loss, opt.ge_len, opt.ge_bad)
            tb.ge(p, r, loss_bad=opt.ge_bad)
        elif opt.loss:
            tb.loss(opt.loss)
        for seed in range(opt.seed, opt.seed + opt.seeds):
            plan = burst_plan(opt, seed)
            was = earlier.get(seed)
            burst_ms = opt.burst_ms or (was or {}).get("burst_ms")  # (None: sized by this seed's Gloo run)
            burst_s = [burst_ms / 1e3 if burst_ms else None]
            done: dict[str, Run] = {}
            given = arms(opt)
            order = run_order(given, seed - opt.seed, burst_s[0] is not None)
            for arm in order:  # the first sizes the bursts if no length is given (Gloo by default)
                set_queue(tb, opt, arm)
                queue_drops(tb, opt)  # (resets the counters: each run's own)
                done[arm.name] = run_arm(tb, opt, arm, seed, plan, burst_s)
                done[arm.name].fabric = queue_drops(tb, opt)
            runs = {arm.name: done[arm.name] for arm in given}  # (the report's order: as given)
            target = opt.target
            if target is None:
                target = gloo_target(runs["gloo"], opt) if "gloo" in runs else was["target"] if was else None
            curve_targets = was["curve_targets"] if was else []  # the curve ratio's: Gloo's smoothed loss at
            if "gloo" in runs:                                      # stats.CURVE_AT of its steps
                _, steps, loss = loss_curve(runs["gloo"])
                curve_targets = [stats.value_at(steps, loss, opt.steps * f) for f in stats.CURVE_AT]
            summary = {name: summarize(r, opt, target) for name, r in runs.items()}
            if was:
                summary = {"gloo": reused_gloo(was, target), **summary}
            seeds.append({"seed": seed, "run_order": [arm.name for arm in order],
                          "target": target, "curve_targets": curve_targets, "burst_ms": burst_s[0] * 1e3 if burst_s[0] else None,
                          "burst_plan": plan, "summary": summary,
                          "speedup": {**report.speedups(summary), **report.policy_ratios(summary)},
                          "runs": {name: asdict(r) for name, r in runs.items()}})
        fabric_stats = tb.stats()
    mean, spread = aggregate([s["summary"] for s in seeds])
    speed = {**report.speedups(mean), **report.policy_ratios(mean)}  # (over seeds: ratios of the means)
    rep = {
        "options": asdict(opt),
        "target": [s["target"] for s in seeds] if len(seeds) > 1 else seeds[0]["target"],
        "summary": mean,
        "spread": spread,
        "speedup": speed,
        "seeds": seeds,
        "ratios": report.ratios(seeds),
        "runs": seeds[0]["runs"],
        "fabric": {port: {k: v for k, v in st.items() if isinstance(v, dict) and "packets" in v}
                   for port, st in fabric_stats.items()},
    }
    (out / "report.json").write_text(json.dumps(rep, indent=1, default=float))
    report.plots(rep, out)
    return rep
