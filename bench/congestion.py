#!/usr/bin/env python3
"""Congestion: pydblp on a shared bottleneck, with its rate control off and on (issue 47).

Every scenario puts a virtual queue on the switch port towards worker w0 (the fabric's
``tb.queue``: drains at ``--queue-rate``, default 1 Gbit/s, drop-tail beyond ``--buffer`` KiB,
ECN CE marks on ECN-capable frames admitted past ``--mark`` KiB, and with ``--mark-drop`` drops of the
Not-ECT ones there, as an ECN AQM; with ``--delay`` the frames it
admits also wait in a TBF at that rate, as at a switch's buffer, so TCP and pydblp see queueing
delay) and runs under each
``--cc`` setting in turn (``Config(cc="off")``: today's pydblp, loss within the bound ignored;
``Config(cc="ecn")``: senders send ECT(0), receivers echo CE counts in STOPs and each sender
paces each destination DCTCP-style, ``pydblp.collective.cc``).  The comparator is the other
setting, measured in the same run on the same testbed.

``tcp``     3 workers.  A 2-rank pydblp job on w0, w1 (back-to-back transpose allreduces of
            ``--size`` MiB) and an iperf-like TCP flow w2 -> w0 (one connection, ``sendall`` of
            64 KiB buffers; the sink counts bytes per 0.1 s) share the port to w0 for
            ``--seconds``.  Before it, each alone for ``--alone`` s (TCP once, pydblp under each
            setting): what each gets from this machine without the other.  Reported per second
            and over the run: TCP goodput, pydblp's bytes into w0 (rank 0's received DBLP bytes),
            TCP's share of the link (Mbit/s / queue rate) and of the bytes the port passed,
            tail drops and marks on the port, round p50/p99, CE marks pydblp received, and the
            sender's rate towards w0 (``cc.state()``; 0: not paced).  Issue 47's acceptance:
            TCP keeps >= 40 % of the link with cc=ecn.
``jobs``    3 workers.  Two pydblp jobs (ids 31 and 32, UDP ports P and P+1): A on w0, w1 and
            B on w0, w2, so w0 runs a rank of each and both jobs' data meets in the port to w0.
            Per 1 s and per 10 s window each job's bytes into w0 and Jain's fairness index
            ``(a + b)^2 / (2 (a^2 + b^2))``; acceptance >= 0.9 in every 10 s window.  Two AF_XDP
            jobs cannot share w0's NIC (its host program hands a receive queue's frames to one
            AF_XDP socket), so this scenario always runs on the UDP transport.
``incast``  N+1 workers for each N in ``--senders`` (default 3,7).  A parameter server
            (``Config(mode="ps")``, rank 0 on w0 reduces) runs ``--rounds`` back-to-back
            allreduces of ``--incast-size`` MiB: every round N senders at 1 Gbit/s each pour their
            tensor into the 1 Gbit/s queue to w0 at once.  Reported: queue drops (tail + early)
            and marks per round, round p50/p99 (last rank in -> last rank out) and the rounds'
            total time.  Acceptance: drops down >= 5x with cc=ecn at the same or shorter time.
            ``--repeats K`` runs each setting K times, in alternating order (off, ecn; ecn,
            off; ...), pairs the i-th runs and states both ratios as ratios of means with 90 %
            t intervals; the verdict then needs the whole interval on the right side.

``sim-incast`` the incast in the simulator (``pydblp.sim``, virtual time, deterministic for a
            seed; no root): the same N senders, the port to rank 0 with ``--buffer`` KiB
            marking past ``--mark`` KiB, 1 Gbit/s links.  Reported: tail drops, marks, round
            p50/p99 and the rounds' virtual time.  (The simulated port serves senders in the
            order they hand packets in: the first sender of a round is never marked.)

Rounds run under ``Config(phase="static:--tol", estimator="unbiased")`` (tolerance 5 %, as
``allreduce.py``); the AF_XDP ranks pace their transmit at the worker NIC's TBF rate (1 Gbit/s),
the UDP ones go through it.  Worker processes: ``bench/_congestion_worker.py`` (one per rank, TCP
source and sink), started in their worker's namespace with ``tb.popen``, talking JSON lines over
pipes; the fabric's counters are sampled by this process every ``--sample`` s.

What is counted: TCP goodput = bytes the sink read; pydblp = DBLP bytes (header + payload) the
w0 rank's transport received (``rx_bytes``), spread evenly over the round they arrived in;
port figures = frames and L2 bytes the fabric passed, dropped or marked on port w0.

Worst case: ``tcp`` (alone + 2 x (alone + seconds)) + ``jobs`` (2 x seconds) + ``incast``
(2 x 2 x rounds) plus ~10 s of set-up a run; with the defaults about 4.5 minutes on 2 vCPUs.
Every phase has a deadline after which its processes are killed by pid.  Needs root.

Examples:

    .venv/bin/python bench/congestion.py --seconds 5 --scenario tcp          # a smoke run
    .venv/bin/python bench/congestion.py --delay                              # a queue that delays
    .venv/bin/python bench/congestion.py --scenario tcp,jobs --seconds 30 --json tcp.json
    .venv/bin/python bench/congestion.py --scenario incast --senders 3,7 --rounds 30
    .venv/bin/python bench/congestion.py --scenario incast --senders 7 --repeats 3   # paired, with intervals
    .venv/bin/python bench/congestion.py --scenario tcp --tcp-ecn --cc ecn   # TCP with ECN too
    .venv/bin/python bench/congestion.py --scenario tcp --delay --mark-drop  # an AQM: Not-ECT dropped at the mark
    .venv/bin/python bench/congestion.py --scenario sim-incast --rounds 10  # the simulator, no root
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from pydblp import net, wire  # noqa: E402
from pydblp.cliutil import Parser, stop_unwinds  # noqa: E402
from pydblp.testbed import Testbed  # noqa: E402
from pydblp.testbed.fabric import DROP_CAUSES  # noqa: E402

MiB = 1 << 20
WORKER = Path(__file__).resolve().parent / "_congestion_worker.py"
SCENARIOS = ("tcp", "jobs", "incast", "sim-incast")
CCS = ("off", "ecn")
TCP_PORT = 5201
PORT = wire.DEFAULT_PORT
PYTHON = f"Python {sys.version.split()[0]} ({os.path.realpath(sys.executable)})"


class Failure(RuntimeError):
    pass


# ---- processes -------------------------------------------------------------------

class Procs:
    """Worker processes by name, each in its testbed worker, talking JSON lines over pipes."""

    def __init__(self, tb: Testbed, tmp: Path):
        self.tb, self.tmp = tb, tmp
        self.p: dict[str, subprocess.Popen] = {}
        self.err: dict[str, object] = {}
        self.buf: dict[str, bytes] = {}
        self.worker: dict[str, int] = {}

    def start(self, name: str, worker: int, argv: list[str]) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        err = open(self.tmp / f"{name}.err", "w+")
        self.err[name] = err
        self.buf[name] = b""
        self.worker[name] = worker
        self.p[name] = self.tb.popen(worker, [sys.executable, str(WORKER), *argv], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=err, env=env)

    def send(self, names, obj) -> None:
        line = (json.dumps(obj) + "\n").encode()
        for n in names:
            try:
                self.p[n].stdin.write(line)
                self.p[n].stdin.flush()
            except (BrokenPipeError, OSError):
                raise Failure(f"{n} has exited ({self.tail(n)})") from None

    def collect(self, names, key: str, deadline: float) -> dict:
        """The first message holding ``key`` from each of ``names``; Failure past the deadline."""
        want, got = set(names), {}
        fds = {self.p[n].stdout.fileno(): n for n in want}
        while want - set(got):
            left = deadline - time.monotonic()
            if left <= 0:
                raise Failure(f"timed out waiting for {key} from {sorted(want - set(got))}")
            ready, _, _ = select.select([fd for fd, n in fds.items() if n not in got], [], [], min(left, 1.0))
            for fd in ready:
                n = fds[fd]
                data = os.read(fd, 1 << 22)
                if not data:
                    self.p[n].wait(timeout=5)
                    raise Failure(f"{n} exited with status {self.p[n].returncode} ({self.tail(n)})")
                self.buf[n] += data
                while b"\n" in self.buf[n] and n not in got:
                    line, self.buf[n] = self.buf[n].split(b"\n", 1)
                    msg = json.loads(line)
                    if "error" in msg:
                        raise Failure(f"{msg['error']} ({self.tail(n)})")
                    if key in msg:
                        got[n] = msg[key] if key != "ready" else msg
        return got

    def tail(self, name: str, n: int = 500) -> str:
        f = self.err.get(name)
        try:
            f.flush()
            f.seek(0)
            text = f.read().strip()
        except (OSError, ValueError, AttributeError):
            return "no stderr"
        return f"stderr: ...{text[-n:]}" if text else "no stderr"

    def stop(self, names=None, timeout: float = 10.0) -> None:
        """Ask each to quit (ranks read stdin), then kill by pid whatever still runs."""
        names = list(self.p) if names is None else list(names)
        for n in names:
            p = self.p[n]
            if p.poll() is None:
                with contextlib.suppress(BrokenPipeError, OSError, ValueError):
                    p.stdin.write(b'{"cmd": "quit"}\n')
                    p.stdin.flush()
                    p.stdin.close()
        deadline = time.monotonic() + timeout
        for n in names:
            p = self.p.pop(n)
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)  # nsenter execs the worker: this pid is it
                p.wait(timeout=5)
                with contextlib.suppress(Exception):  # a killed AF_XDP rank leaves its host program
                    net.xdp_detach("eth0", netns=self.tb.ns(self.worker[n]))
            for stream in (p.stdin, p.stdout):
                with contextlib.suppress(Exception):
                    stream.close()
            self.err.pop(n).close()


class Sampler:
    """The fabric's counters on one port, every ``period`` s, in a thread: [(t, {cause: (pk, B)})]."""

    def __init__(self, tb: Testbed, port: str, period: float):
        self.tb, self.port, self.period = tb, port, period
        self.samples: list[tuple[float, dict]] = []
        self.peak = 0  # the port's peak backlog (bytes) over the samples
        self._stop = threading.Event()
        self._th = threading.Thread(target=self._run, daemon=True)

    def take(self) -> None:
        s = self.tb.stats().get(self.port, {})
        self.peak = max(self.peak, s.get("peak", 0))
        self.samples.append((time.monotonic(), {c: (v["packets"], v["bytes"]) for c, v in s.items()
                                                if isinstance(v, dict) and "packets" in v}))

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.take()

    def __enter__(self) -> "Sampler":
        self.take()
        self._th.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._th.join()
        self.take()

    def at(self, times, cause: str, field: int = 0) -> np.ndarray:
        """Cumulative ``cause`` count (0 packets, 1 bytes) at ``times``, interpolated linearly."""
        ts = np.array([t for t, _ in self.samples])
        vs = np.array([d.get(cause, (0, 0))[field] for _, d in self.samples], float)
        return np.interp(times, ts, vs)

    def drops_at(self, times) -> np.ndarray:
        return sum(self.at(times, c) for c in DROP_CAUSES)


# ---- figures ---------------------------------------------------------------------

def spread(recs: list[dict], edges: np.ndarray, key: str = "rx") -> np.ndarray:
    """Bytes ``key`` of each round spread evenly over [t0, t1], summed into the bins ``edges``."""
    out = np.zeros(len(edges) - 1)
    for r in recs:
        t0, t1, b = r["t0"], r["t1"], r[key]
        if t1 <= t0:
            continue
        lo = np.clip(edges[:-1], t0, t1)
        hi = np.clip(edges[1:], t0, t1)
        out += b * (hi - lo) / (t1 - t0)
    return out


def latencies(ranks: list[list[dict]]) -> np.ndarray:
    """Per round: last rank out - last rank in (rounds run back to back, so these tile time)."""
    n = min(len(r) for r in ranks)
    t0 = np.array([[x["t0"] for x in r[:n]] for r in ranks])
    t1 = np.array([[x["t1"] for x in r[:n]] for r in ranks])
    return t1.max(0) - t0.max(0)


def pct(v, q):
    return float(np.percentile(v, q)) if len(v) else None


def jain(xs) -> float | None:
    xs = np.asarray(xs, float)
    den = len(xs) * float((xs ** 2).sum())
    return float(xs.sum() ** 2 / den) if den > 0 else None


def rate_series(recs: list[dict], dst: int, edges: np.ndarray) -> list:
    """Median per bin of the sender's rate towards ``dst`` at its rounds' ends (Mbit/s; 0: not paced)."""
    out = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        v = [r["rate"][dst] for r in recs if r.get("rate") and lo <= r["t1"] < hi]
        out.append(float(np.median(v)) / 1e6 if v else None)
    return out


def fmt(v, spec=".0f", none="-"):
    return none if v is None else format(v, spec)


def ms(v):
    return fmt(None if v is None else v * 1e3, ".1f")


# ---- scenario plumbing ---------------------------------------------------------

def rank_argv(tb: Testbed, args, *, rank: int, world: int, peers: list, job: int, cc: str, mode: str,
              size: int, transport: str) -> list[str]:
    argv = ["rank", "--rank", str(rank), "--world", str(world), "--transport", transport,
            "--peers", json.dumps(peers), "--job", str(job), "--mode", mode, "--cc", cc,
            "--tol", str(args.tol), "--size", str(size), "--peer-timeout", str(args.peer_timeout)]
    if args.cc_knobs:
        argv += ["--cc-knobs", args.cc_knobs]
    if transport == "xsk":
        argv += ["--rate", str(tb.rate_bps)]  # AF_XDP bypasses the TBF: pace at its rate
    return argv


def start_job(procs: Procs, tb: Testbed, args, *, tag: str, workers: list[int], job: int, port: int, cc: str,
              mode: str, size: int, transport: str) -> list[str]:
    peers = [[tb.addr(w), port, tb.mac(w)] for w in workers]
    names = []
    for r, w in enumerate(workers):
        name = f"{tag}-r{r}"
        procs.start(name, w, rank_argv(tb, args, rank=r, world=len(workers), peers=peers, job=job, cc=cc,
                                       mode=mode, size=size, transport=transport))
        names.append(name)
    return names


def set_queue(tb: Testbed, args, thresholds=None) -> None:
    tb.clear()
    tb.queue(f"{args.queue_rate:g}mbit", buffer=args.buffer * 1024,
             thresholds=(0,) * 8 if thresholds is None else thresholds, port="w0", mark=args.mark * 1024,
             mark_drop=args.mark_drop, delay=args.delay)
    tb.stats(reset=True)


def tcp_ecn(tb: Testbed, workers, on: bool) -> None:
    for w in workers:
        tb.run(w, ["sysctl", "-q", "-w", f"net.ipv4.tcp_ecn={1 if on else 2}"], check=True)


def tcp_flow(procs: Procs, tb: Testbed, args, tag: str, src: int, dst: int, start: float,
             until: float, port: int = TCP_PORT) -> tuple[str, str]:
    sink, source = f"{tag}-sink", f"{tag}-source"
    common = ["--port", str(port), "--start", repr(start), "--until", repr(until)]
    procs.start(sink, dst, ["tcp-sink", "--addr", tb.addr(dst), *common])
    procs.collect([sink], "ready", time.monotonic() + 30)
    procs.start(source, src, ["tcp-source", "--dst", tb.addr(dst), "--cc", args.tcp_cc, *common])
    return sink, source


def sink_series(sink: dict, start: float, edges: np.ndarray) -> np.ndarray:
    """The sink's bins re-binned into ``edges`` (bytes)."""
    b = np.array(sink["bins"], float)
    t = start + (np.arange(len(b)) + 0.5) * sink["bin"]
    out = np.zeros(len(edges) - 1)
    k = np.searchsorted(edges, t, side="right") - 1
    ok = (k >= 0) & (k < len(out))
    np.add.at(out, k[ok], b[ok])
    return out


def ce_delta(phase: dict) -> int:
    return phase["counters"]["ce_received"] - phase["counters0"]["ce_received"]


def cc_delta(phase: dict) -> dict:
    if not phase.get("cc"):
        return {}
    a, b = phase["cc0"], phase["cc"]
    return {k: b[k] - a[k] for k in ("echoes", "marked_echoes", "marks", "cuts", "unpaced")}


def port_totals(smp: Sampler, t0: float, t1: float) -> dict:
    d = {c: float(np.diff(smp.at([t0, t1], c))[0]) for c in ("pass", "tail", "mark", "mark_drop", "bound")}
    d["early"] = float(sum(np.diff(smp.at([t0, t1], f"early{p}"))[0] for p in range(8)))
    d["pass_bytes"] = float(np.diff(smp.at([t0, t1], "pass", 1))[0])
    d["peak_backlog"] = smp.peak  # bytes: the most the queue held since set_queue (fabric's "peak")
    return d


# ---- scenarios -------------------------------------------------------------------

def phase_deadline(args, until: float) -> float:
    return until + args.peer_timeout + 30


def run_tcp_alone(procs: Procs, tb: Testbed, args) -> dict:
    set_queue(tb, args)
    start = time.monotonic() + 1.0
    until = start + args.alone
    with Sampler(tb, "w0", args.sample) as smp:
        sink, source = tcp_flow(procs, tb, args, "alone", 2, 0, start, until)
        s = procs.collect([sink], "sink", until + 15)[sink]
        src = procs.collect([source], "source", until + 15)[source]
    procs.stop([sink, source])
    edges = start + np.arange(0, args.alone + 1e-9, 1.0)
    tcp = sink_series(s, start, edges)
    port = port_totals(smp, start, until)
    return {"tcp_mbps": float(tcp.sum() * 8 / args.alone / 1e6), "tcp_per_s": (tcp * 8 / 1e6).tolist(),
            "source": src, "port": port}


def run_tcp_peer(procs: Procs, tb: Testbed, args) -> dict:
    """The peer: the same TCP flow (w2 -> w0) beside a second TCP flow (w1 -> w0, where pydblp's
    sender sits) on the same bottleneck, for --seconds: what TCP keeps against itself here."""
    set_queue(tb, args)
    start = time.monotonic() + 1.5
    until = start + args.seconds
    with Sampler(tb, "w0", args.sample) as smp:
        flows = [tcp_flow(procs, tb, args, f"peer{src}", src, 0, start, until, TCP_PORT + k)
                 for k, src in enumerate((2, 1))]
        got = [procs.collect([sink], "sink", until + 15)[sink] for sink, _ in flows]
        for _, source in flows:
            procs.collect([source], "source", until + 15)
    procs.stop([n for f in flows for n in f])
    edges = start + np.arange(0, args.seconds + 1e-9, 1.0)
    mbps = [float(sink_series(s, start, edges).sum() * 8 / args.seconds / 1e6) for s in got]
    return {"tcp_mbps": mbps[0], "other_tcp_mbps": mbps[1], "tcp_share_link": mbps[0] / args.queue_rate,
            "port": port_totals(smp, start, until)}


def run_tcp(procs: Procs, tb: Testbed, args, cc: str, transport: str) -> dict:
    """One cc setting of the tcp scenario: pydblp alone (--alone s), then with the TCP flow."""
    size = int(args.size * MiB) // 4 * 4
    names = start_job(procs, tb, args, tag=f"tcp-{cc}", workers=[0, 1], job=31, port=PORT, cc=cc, mode="tar",
                      size=size, transport=transport)
    out: dict = {}
    try:
        ready = procs.collect(names, "ready", time.monotonic() + 120)
        out["ect"] = [ready[n]["ect"] for n in names]
        if args.alone:
            set_queue(tb, args)
            start = time.monotonic() + 0.5
            until = start + args.alone
            with Sampler(tb, "w0", args.sample) as smp:
                procs.send(names, {"cmd": "phase", "start": start, "until": until})
                ph = procs.collect(names, "phase", phase_deadline(args, until))
            r0 = ph[names[0]]["recs"]
            end = max(r["t1"] for r in r0)
            lat = latencies([ph[n]["recs"] for n in names])
            out["alone"] = {"pydblp_mbps": sum(r["rx"] for r in r0) * 8 / (end - r0[0]["t0"]) / 1e6,
                            "rounds": len(lat), "p50": pct(lat, 50), "p99": pct(lat, 99),
                            "port": port_totals(smp, start, until), "ce": ce_delta(ph[names[0]]),
                            "cc": cc_delta(ph[names[1]])}
        set_queue(tb, args)
        start = time.monotonic() + 1.5
        until = start + args.seconds
        with Sampler(tb, "w0", args.sample) as smp:
            sink, source = tcp_flow(procs, tb, args, f"tcp-{cc}", 2, 0, start, until)
            procs.send(names, {"cmd": "phase", "start": start, "until": until})
            ph = procs.collect(names, "phase", phase_deadline(args, until))
            s = procs.collect([sink], "sink", until + 15)[sink]
            src = procs.collect([source], "source", until + 15)[source]
        procs.stop([sink, source])
    finally:
        procs.stop(names)
    edges = start + np.arange(0, args.seconds + 1e-9, 1.0)
    r0, r1 = ph[names[0]]["recs"], ph[names[1]]["recs"]
    tcp = sink_series(s, start, edges)
    pyd = spread(r0, edges)
    passb = np.diff(smp.at(edges, "pass", 1))
    tail = np.diff(smp.at(edges, "tail"))
    marks = np.diff(smp.at(edges, "mark"))
    drops = np.diff(smp.drops_at(edges))
    lat = latencies([r0, r1])
    inside = [i for i, r in enumerate(r0[: len(lat)]) if r["t0"] >= start and r["t1"] <= until]
    port = port_totals(smp, start, until)
    secs = args.seconds
    out.update({
        "per_s": {"tcp_mbps": (tcp * 8 / 1e6).tolist(), "pydblp_mbps": (pyd * 8 / 1e6).tolist(),
                  "port_mbps": (passb * 8 / 1e6).tolist(), "tail": tail.tolist(), "drops": drops.tolist(),
                  "marks": marks.tolist(), "rate_to_w0_mbps": rate_series(r1, 0, edges)},
        "tcp_mbps": float(tcp.sum() * 8 / secs / 1e6),
        "pydblp_mbps": float(pyd.sum() * 8 / secs / 1e6),
        "port_mbps": port["pass_bytes"] * 8 / secs / 1e6,
        "tcp_share_link": float(tcp.sum() * 8 / secs / (args.queue_rate * 1e6)),
        "tcp_share_port": float(tcp.sum() / port["pass_bytes"]) if port["pass_bytes"] else None,
        "port": port,
        "rounds": len(lat), "p50": pct(lat[inside], 50), "p99": pct(lat[inside], 99),
        "ce_received": ce_delta(ph[names[0]]) + ce_delta(ph[names[1]]),
        "cc_sender": cc_delta(ph[names[1]]), "cc_state_end": ph[names[1]]["cc"],
        "retx_per_round": float(np.mean([r["retx"] for r in r1])),
        "min_delivered": float(min(r["min_delivered"] for r in r0 + r1)),
        "source": src, "tcp_before_start_bytes": s["before"],
        "cpu_s": {n: ph[n]["cpu"] for n in names},
        "recs": {n: ph[n]["recs"] for n in names},
    })
    return out


def run_jobs(procs: Procs, tb: Testbed, args, cc: str, transport: str) -> dict:
    size = int(args.size * MiB) // 4 * 4
    a = start_job(procs, tb, args, tag=f"jobA-{cc}", workers=[0, 1], job=31, port=PORT, cc=cc, mode="tar",
                  size=size, transport=transport)
    b = start_job(procs, tb, args, tag=f"jobB-{cc}", workers=[0, 2], job=32, port=PORT + 1, cc=cc, mode="tar",
                  size=size, transport=transport)
    out: dict = {}
    try:
        ready = procs.collect(a + b, "ready", time.monotonic() + 120)
        out["ect"] = [ready[n]["ect"] for n in a + b]
        set_queue(tb, args)
        start = time.monotonic() + 1.0
        until = start + args.seconds
        with Sampler(tb, "w0", args.sample) as smp:
            procs.send(a + b, {"cmd": "phase", "start": start, "until": until})
            ph = procs.collect(a + b, "phase", phase_deadline(args, until))
    finally:
        procs.stop(a + b)
    secs = args.seconds
    edges = start + np.arange(0, secs + 1e-9, 1.0)
    wedges = start + np.arange(0, secs + 1e-9, args.window)
    jobs = {"A": (a, 1), "B": (b, 2)}
    per_s, per_w, summ = {}, {}, {}
    for j, (names, w) in jobs.items():
        r0 = ph[names[0]]["recs"]
        per_s[j] = (spread(r0, edges) * 8 / 1e6).tolist()
        per_w[j] = (spread(r0, wedges) * 8 / args.window / 1e6).tolist()
        lat = latencies([ph[n]["recs"] for n in names])
        inside = [i for i, r in enumerate(r0[: len(lat)]) if r["t0"] >= start and r["t1"] <= until]
        summ[j] = {"mbps": float(spread(r0, edges[[0, -1]])[0] * 8 / secs / 1e6), "rounds": len(lat),
                   "p50": pct(lat[inside], 50), "p99": pct(lat[inside], 99),
                   "ce_received": ce_delta(ph[names[0]]), "cc_sender": cc_delta(ph[names[1]]),
                   "cc_state_end": ph[names[1]]["cc"], "rate_to_w0_mbps": rate_series(ph[names[1]]["recs"], 0, edges),
                   "retx_per_round": float(np.mean([r["retx"] for r in ph[names[1]]["recs"]])),
                   "min_delivered": float(min(r["min_delivered"] for n in names for r in ph[n]["recs"]))}
    port = port_totals(smp, start, until)
    jw = [jain(x) for x in zip(per_w["A"], per_w["B"])]
    out.update({"jobs": summ, "per_s": {**per_s, "jain": [jain(x) for x in zip(per_s["A"], per_s["B"])],
                                        "tail": np.diff(smp.at(edges, "tail")).tolist(),
                                        "marks": np.diff(smp.at(edges, "mark")).tolist()},
                "per_window": {**per_w, "jain": jw}, "cpu_s": {n: ph[n]["cpu"] for n in a + b}, "jain_min_window": min((x for x in jw if x is not None),
                                                                            default=None),
                "jain_total": jain([summ["A"]["mbps"], summ["B"]["mbps"]]), "port": port,
                "port_mbps": port["pass_bytes"] * 8 / secs / 1e6,
                "recs": {n: ph[n]["recs"] for n in a + b}})
    return out


def run_incast(procs: Procs, tb: Testbed, args, cc: str, senders: int, transport: str) -> dict:
    size = int(args.incast_size * MiB) // 4 * 4
    workers = list(range(senders + 1))
    names = start_job(procs, tb, args, tag=f"incast{senders}-{cc}", workers=workers, job=33, port=PORT, cc=cc,
                      mode="ps", size=size, transport=transport)
    out: dict = {}
    try:
        ready = procs.collect(names, "ready", time.monotonic() + 120)
        out["ect"] = [ready[n]["ect"] for n in names]
        set_queue(tb, args, None if args.incast_queue == "priority" else (0,) * 8)
        start = time.monotonic() + 1.0
        with Sampler(tb, "w0", args.sample) as smp:
            procs.send(names, {"cmd": "phase", "start": start, "rounds": args.rounds})
            ph = procs.collect(names, "phase", start + args.rounds * (args.peer_timeout + 5))
    finally:
        procs.stop(names)
    ranks = [ph[n]["recs"] for n in names]
    lat = latencies(ranks)
    t0 = np.array([[x["t0"] for x in r] for r in ranks]).max(0)
    t1 = np.array([[x["t1"] for x in r] for r in ranks]).max(0)
    bounds = np.concatenate([[t0[0]], t1])
    # the counters per round: the first round from the sampler's first sample, the last to its
    # last (nothing else sends before or after): the totals are then the counters' own, whatever
    # falls between two samples (interpolated at a round's start, a first round's drops were
    # mostly counted before it, and ECN's, nearly all in the first round, lost)
    edges = np.concatenate([[smp.samples[0][0]], t1[:-1], [smp.samples[-1][0]]])
    drops = np.diff(smp.drops_at(edges))
    tail = np.diff(smp.at(edges, "tail"))
    marks = np.diff(smp.at(edges, "mark"))
    port = port_totals(smp, bounds[0], bounds[-1])
    send = [cc_delta(ph[n]) for n in names[1:]]
    rates = [(ph[n]["cc"] or {}).get("rate", [0])[0] / 1e6 if ph[n]["cc"] else None for n in names[1:]]
    out.update({"senders": senders, "rounds": len(lat), "total_s": float(bounds[-1] - bounds[0]),
                "p50": pct(lat, 50), "p99": pct(lat, 99), "latency": lat.tolist(),
                "drops_per_round": float(drops.mean()), "tail_per_round": float(tail.mean()),
                "marks_per_round": float(marks.mean()), "drops": drops.tolist(), "marks": marks.tolist(),
                "drops_after_first": float(drops[1:].mean()) if len(drops) > 1 else None,
                "port": port, "ce_received": ce_delta(ph[names[0]]), "cpu_s": {n: ph[n]["cpu"] for n in names},
                "cuts": sum(d.get("cuts", 0) for d in send), "unpaced": sum(d.get("unpaced", 0) for d in send),
                "sender_rate_end_mbps": rates,
                "retx_per_round": float(sum(r["retx"] for rr in ranks[1:] for r in rr) / len(lat)),
                "min_delivered": float(min(r["min_delivered"] for rr in ranks for r in rr)),
                "recs_rank0": ranks[0], "rate_per_round_mbps": [
                    [(r["rate"][0] / 1e6 if r.get("rate") else None) for r in rr] for rr in ranks[1:]]})
    return out


# ---- output ----------------------------------------------------------------------

def run_sim_incast(args, cc: str, senders: int, seed: int = 1) -> dict:
    """The incast in the simulator (see the module docstring)."""
    from pydblp.collective import Config
    from pydblp.sim import Link, Sim

    knobs = dict(kv.split("=") for kv in args.cc_knobs.split(",") if kv)
    sim = Sim(senders + 1, Config(job=1, mode="ps", cc=cc, phase=f"static:{args.tol:g}",
                                  **{k: float(v) for k, v in knobs.items()}),
              link=Link(f"{args.queue_rate:g}mbit", latency=20e-6, queue=args.buffer * 1024), seed=seed)
    sim.network.mark(args.mark * 1024, port=0)
    n = int(args.incast_size * MiB) // 4

    def program(node):
        x = np.full(n, node.rank + 1.0, np.float32)
        for _ in range(args.rounds):
            node.collective.allreduce(x)

    nodes = sim.run(program)
    lat = np.array([r.latency for r in nodes[0].records])
    return {"tail_drops": sim.network.drops["tail"], "marks": sim.network.marks, "p50": pct(lat, 50),
            "p99": pct(lat, 99), "virtual_s": sim.clock(), "rounds": len(lat),
            "rates_mbps": [float(nd.collective.protocol.cc.rate[0] / 1e6) if nd.collective.protocol.cc else None
                           for nd in nodes[1:]]}


def print_sim_incast(res: dict, args) -> None:
    print(f"\n## sim-incast: the simulator, parameter server and N senders, {args.incast_size:g} MiB allreduces, "
          f"{args.rounds} rounds; port to rank 0 {args.queue_rate:g} Mbit/s, {args.buffer} KiB, mark {args.mark} KiB\n")
    print("| N | cc | virtual s | round p50 ms | p99 ms | tail drops | marks | senders' rates at the end, Mbit/s |")
    print("|---|---|---|---|---|---|---|---|")
    for n, by in res.items():
        for cc, r in by.items():
            rates = ", ".join("-" if not v else f"{v:.0f}" for v in r["rates_mbps"])
            print(f"| {n} | {cc} | {r['virtual_s']:.3f} | {ms(r['p50'])} | {ms(r['p99'])} | {r['tail_drops']} "
                  f"| {r['marks']} | {rates} |")


def print_tcp(res: dict, args) -> None:
    alone = res.get("tcp_alone")
    print(f"\n## tcp: pydblp (w1 -> w0, {args.size:g} MiB allreduces) and one TCP flow (w2 -> w0) sharing "
          f"the port to w0 ({args.queue_rate:g} Mbit/s, drop-tail {args.buffer} KiB, mark {args.mark} KiB"
          f"{', Not-ECT dropped past it' if args.mark_drop else ''}{', delaying' if args.delay else ''}), "
          f"{args.seconds:g} s, TCP {args.tcp_cc}" + (" with ECN" if args.tcp_ecn else ""))
    if alone:
        line = f"alone ({args.alone:g} s each): TCP {alone['tcp_mbps']:.0f} Mbit/s"
        for cc in args.ccs:
            al = res.get(cc, {}).get("alone")
            if al:
                line += (f"; pydblp cc={cc} {al['pydblp_mbps']:.0f} Mbit/s (p50 {ms(al['p50'])} ms, "
                         f"{al['port']['mark']:.0f} marks, {al['port']['tail']:.0f} tail drops, peak backlog "
                         f"{al['port']['peak_backlog'] / 1024:.0f} KiB)")
        print(line)
    print()
    print("| cc | TCP Mbit/s | TCP share of link | TCP share of port bytes | pydblp Mbit/s into w0 | port Mbit/s "
          "| tail drops | marks | mark drops | peak backlog KiB | CE received | round p50 ms | p99 ms | rounds "
          "| TCP retrans |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for cc in args.ccs:
        r = res.get(cc)
        if not r or "error" in r:
            print(f"| {cc} | FAILED: {(r or {}).get('error', 'not run')[:100]} |")
            continue
        print(f"| {cc} | {r['tcp_mbps']:.0f} | {r['tcp_share_link']:.1%} | {fmt(r['tcp_share_port'], '.1%')} "
              f"| {r['pydblp_mbps']:.0f} | {r['port_mbps']:.0f} | {r['port']['tail']:.0f} | {r['port']['mark']:.0f} "
              f"| {r['port']['mark_drop']:.0f} | {r['port']['peak_backlog'] / 1024:.0f} | {r['ce_received']} | {ms(r['p50'])} | {ms(r['p99'])} | {r['rounds']} "
              f"| {r['source']['total_retrans']} |")
    for cc in args.ccs:
        r = res.get(cc)
        if not r or "error" in r:
            continue
        ps = r["per_s"]
        print(f"\nper second, cc={cc}" + (f" (sender's cc: {r['cc_sender']})" if r["cc_sender"] else ""))
        print("| s | TCP Mbit/s | pydblp Mbit/s | port Mbit/s | tail drops | marks | pydblp rate to w0 Mbit/s |")
        print("|---|---|---|---|---|---|---|")
        for i in range(len(ps["tcp_mbps"])):
            rt = ps["rate_to_w0_mbps"][i]
            print(f"| {i} | {ps['tcp_mbps'][i]:.0f} | {ps['pydblp_mbps'][i]:.0f} | {ps['port_mbps'][i]:.0f} "
                  f"| {ps['tail'][i]:.0f} | {ps['marks'][i]:.0f} | "
                  f"{'-' if rt is None else ('unpaced' if rt == 0 else f'{rt:.0f}')} |")
    if "off" in res and "ecn" in res and "error" not in res["off"] and "error" not in res["ecn"]:
        o, e = res["off"], res["ecn"]
        print(f"\necn / off: TCP Mbit/s {e['tcp_mbps'] / max(o['tcp_mbps'], 1e-9):.2f}x, pydblp Mbit/s "
              f"{e['pydblp_mbps'] / max(o['pydblp_mbps'], 1e-9):.2f}x, tail drops "
              f"{e['port']['tail'] / max(o['port']['tail'], 1):.2f}x, round p50 "
              f"{(e['p50'] or 0) / max(o['p50'] or 1e-9, 1e-9):.2f}x")
    if "ecn" in res and "error" not in res["ecn"]:
        v = res["ecn"]["tcp_share_link"]
        print(f"acceptance (issue 47): TCP keeps >= 40 % of the link with cc=ecn: {v:.1%} "
              f"{'met' if v >= 0.4 else 'MISSED'}")
        peer = res.get("tcp_peer")
        if peer and "error" not in peer:
            print(f"the peer, the same TCP flow beside a second TCP flow: {peer['tcp_share_link']:.1%} of the link "
                  f"(the other flow {peer['other_tcp_mbps']:.0f} Mbit/s); beside pydblp cc=ecn it keeps "
                  f"{v / max(peer['tcp_share_link'], 1e-9):.2f}x that")


def print_jobs(res: dict, args) -> None:
    print(f"\n## jobs: job A (w1 -> w0) and job B (w2 -> w0), {args.size:g} MiB allreduces each, sharing the port to "
          f"w0 ({args.queue_rate:g} Mbit/s, drop-tail {args.buffer} KiB, mark {args.mark} KiB), {args.seconds:g} s, "
          f"transport {res.get('transport')}\n")
    print(f"| cc | A Mbit/s | B Mbit/s | Jain (run) | Jain, worst {args.window:g} s window | port Mbit/s | tail drops | marks "
          "| CE A, B | A p50/p99 ms | B p50/p99 ms | rounds A, B |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for cc in args.ccs:
        r = res.get(cc)
        if not r or "error" in r:
            print(f"| {cc} | FAILED: {(r or {}).get('error', 'not run')[:100]} |")
            continue
        A, B = r["jobs"]["A"], r["jobs"]["B"]
        print(f"| {cc} | {A['mbps']:.0f} | {B['mbps']:.0f} | {fmt(r['jain_total'], '.3f')} "
              f"| {fmt(r['jain_min_window'], '.3f')} | {r['port_mbps']:.0f} | {r['port']['tail']:.0f} "
              f"| {r['port']['mark']:.0f} | {A['ce_received']}, {B['ce_received']} | {ms(A['p50'])}/{ms(A['p99'])} "
              f"| {ms(B['p50'])}/{ms(B['p99'])} | {A['rounds']}, {B['rounds']} |")
    for cc in args.ccs:
        r = res.get(cc)
        if not r or "error" in r:
            continue
        pw = r["per_window"]
        print(f"\n{args.window:g} s windows, cc={cc}: " + "; ".join(
            f"A {a:.0f}, B {b:.0f} Mbit/s, Jain {fmt(j, '.3f')}" for a, b, j in zip(pw["A"], pw["B"], pw["jain"])))
        ps = r["per_s"]
        print("| s | A Mbit/s | B Mbit/s | Jain | tail drops | marks | A rate to w0 | B rate to w0 |")
        print("|---|---|---|---|---|---|---|---|")
        ra, rb = r["jobs"]["A"]["rate_to_w0_mbps"], r["jobs"]["B"]["rate_to_w0_mbps"]

        def rt(v):
            return "-" if v is None else ("unpaced" if v == 0 else f"{v:.0f}")
        for i in range(len(ps["A"])):
            print(f"| {i} | {ps['A'][i]:.0f} | {ps['B'][i]:.0f} | {fmt(ps['jain'][i], '.3f')} | {ps['tail'][i]:.0f} "
                  f"| {ps['marks'][i]:.0f} | {rt(ra[i])} | {rt(rb[i])} |")
    if "ecn" in res and "error" not in res["ecn"]:
        v = res["ecn"]["jain_min_window"]
        print(f"acceptance (issue 47): Jain's index >= 0.9 in every {args.window:g} s window with cc=ecn: "
              f"{fmt(v, '.3f')} {'met' if v is not None and v >= 0.9 else 'MISSED'}")


def print_incast(res: dict, args) -> None:
    print(f"\n## incast: parameter server on w0, N senders, {args.incast_size:g} MiB allreduces, {args.rounds} rounds; "
          f"queue to w0 {args.queue_rate:g} Mbit/s, {args.buffer} KiB "
          f"{'drop-tail' if args.incast_queue == 'tail' else 'priority early drop'}, mark {args.mark} KiB\n")
    print("| N | cc | total s | round p50 ms | p99 ms | drops/round (tail+early) | after round 1 | marks/round "
          "| CE received | cuts | retx/round | senders' rate to w0 at the end, Mbit/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n in args.senders:
        for cc in args.ccs:
            for i, r in enumerate(res.get(str(n), {}).get(cc) or [None]):
                rep = f"{cc} #{i + 1}" if args.repeats > 1 else cc
                if not r or "error" in r:
                    print(f"| {n} | {rep} | FAILED: {(r or {}).get('error', 'not run')[:100]} |")
                    continue
                rates = ", ".join("-" if v is None else ("unpaced" if v == 0 else f"{v:.0f}")
                                  for v in r["sender_rate_end_mbps"])
                print(f"| {n} | {rep} | {r['total_s']:.2f} | {ms(r['p50'])} | {ms(r['p99'])} "
                      f"| {r['drops_per_round']:.0f} | {fmt(r['drops_after_first'])} | {r['marks_per_round']:.0f} "
                      f"| {r['ce_received']} | {r['cuts']} | {r['retx_per_round']:.0f} | {rates} |")
    for n in args.senders:
        for cc in args.ccs:
            for i, r in enumerate(res.get(str(n), {}).get(cc) or []):
                if r and "error" not in r:
                    print(f"N={n} cc={cc}{f' #{i + 1}' if args.repeats > 1 else ''} per round: ms "
                          + " ".join(f"{v * 1e3:.0f}" for v in r["latency"])
                          + "; drops " + " ".join(f"{v:.0f}" for v in r["drops"])
                          + "; marks " + " ".join(f"{v:.0f}" for v in r["marks"]))
    for n in args.senders:
        v = incast_verdict(res.get(str(n), {}), args.rounds)
        if v is not None:
            print(f"N={n}: {v['says']}")


def incast_verdict(res: dict, rounds: int) -> dict | None:
    """Issue 47's incast acceptance over the repeats that ran both settings (pairs ``i``: the
    i-th ``off`` run with the i-th ``ecn`` run, made one after the other on one testbed):
    time ecn/off and drops off/ecn as ratios of means with 90 % t intervals (one pair: none).
    None without a complete pair."""
    from pydblp.experiment.stats import ratio_interval

    pairs = [(o, e) for o, e in zip(res.get("off") or [], res.get("ecn") or [])
             if o and e and "error" not in o and "error" not in e]
    if not pairs:
        return None
    time = ratio_interval([e["total_s"] for _, e in pairs], [o["total_s"] for o, _ in pairs])
    off = [o["drops_per_round"] for o, _ in pairs]
    ecn = [e["drops_per_round"] for _, e in pairs]

    def span(r, spec=".2f"):
        return f"{r['ratio']:{spec}}x" + (f" ({r['lo']:{spec}}-{r['hi']:{spec}})" if r["lo"] is not None else "")

    if sum(ecn) * rounds < 1:  # none at all under ecn (the totals are the counters' own)
        down, drops = float("inf"), f"none with ecn against {np.mean(off):.0f} a round"
    else:
        d = ratio_interval(off, ecn)
        down, drops = (d["lo"] if d["lo"] is not None else d["ratio"]), f"off/ecn {span(d, '.1f')}"
    slower = time["hi"] if time["hi"] is not None else time["ratio"]
    ok = down >= 5 and slower <= 1.0
    return {"pairs": len(pairs), "time": time, "drops_down": down, "met": ok,
            "says": f"drops {drops}, time ecn/off {span(time)} over {len(pairs)} pair(s) -> acceptance (drops "
                    f"down >= 5x at the same or shorter time{', the interval included' if len(pairs) > 1 else ''}): "
                    f"{'met' if ok else 'MISSED'}"}


# ---- main ------------------------------------------------------------------------

def main(argv=None) -> int:
    ap = Parser(description=__doc__.split("\n\n")[0],  # (a mistake: one line, exit status 2)
                epilog="\n\n".join(__doc__.split("\n\n")[-2:]), formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", default="tcp,jobs,incast", help="comma-separated, of tcp, jobs, incast, sim-incast (default tcp,jobs,incast)")
    ap.add_argument("--cc", default="off,ecn", help="Config.cc settings, each run in turn (default off,ecn)")
    ap.add_argument("--seconds", type=float, default=30.0, help="tcp and jobs: seconds of shared traffic (default 30)")
    ap.add_argument("--alone", type=float, default=5.0,
                    help="tcp: seconds TCP, then pydblp under each cc, run alone first (default 5; 0: skip)")
    ap.add_argument("--size", type=float, default=8.0, help="tcp and jobs: MiB of float32 per allreduce (default 8)")
    ap.add_argument("--incast-size", type=float, default=2.0,
                    help="incast: MiB per allreduce (default 2: a 7-sender round moves 14 MiB in and out of w0)")
    ap.add_argument("--rounds", type=int, default=30, help="incast: rounds per run (default 30)")
    ap.add_argument("--senders", default="3,7", help="incast: sender counts, one testbed each (default 3,7)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="incast: runs of each --cc setting, in alternating order; with 2 or more the verdict "
                         "takes the ratios' 90%% intervals (default 1)")
    ap.add_argument("--incast-queue", default="tail", choices=("tail", "priority"),
                    help="incast: the queue drops at its tail (default) or early by DBLP priority (the fabric's "
                         "default thresholds, as dblp experiment --scenario incast)")
    ap.add_argument("--transport", default="xsk", choices=("xsk", "udp"),
                    help="pydblp's transport for tcp and incast (default xsk; jobs always runs udp)")
    ap.add_argument("--mark", type=int, default=32, help="KiB of backlog past which the queue marks CE (default 32)")
    ap.add_argument("--buffer", type=int, default=256, help="KiB the queue holds before it drops (default 256)")
    ap.add_argument("--mark-drop", action="store_true",
                    help="past --mark the queue drops the IP frames that cannot be marked (Not-ECT), as an ECN AQM "
                         "(Testbed.queue(mark_drop=True)); default: they meet only the tail drop")
    ap.add_argument("--delay", action="store_true",
                    help="the queue also holds frames (a TBF behind the fabric's virtual queue, "
                         "Testbed.queue(delay=True)): TCP and pydblp see queueing delay, as at a switch's buffer")
    ap.add_argument("--queue-rate", type=float, default=1000.0, metavar="MBIT",
                    help="Mbit/s the queue to w0 drains at (default 1000, the worker links' rate)")
    ap.add_argument("--tcp-cc", default="cubic",
                    help="tcp: the TCP flow's congestion control (default cubic, Linux's; bbr ignores loss "
                         "and ECN alike)")
    ap.add_argument("--tcp-ecn", action="store_true",
                    help="tcp: the TCP flow negotiates ECN (net.ipv4.tcp_ecn=1 in its workers' namespaces)")
    ap.add_argument("--tol", type=float, default=0.05, help="pydblp static tolerance (default 0.05)")
    ap.add_argument("--cc-knobs", default="", help="more Config cc_* knobs for every rank: 'cc_gain=0.5,...'")
    ap.add_argument("--window", type=float, default=10.0, help="jobs: seconds of a fairness window (default 10)")
    ap.add_argument("--sample", type=float, default=0.2, help="seconds between samples of the fabric's counters")
    ap.add_argument("--peer-timeout", type=float, default=30.0)
    ap.add_argument("--json", help="also write every figure here")
    args = ap.parse_args(argv)
    scenarios = [s for s in args.scenario.split(",") if s]
    args.ccs = [c for c in args.cc.split(",") if c]
    senders = args.senders
    try:
        args.senders = [int(n) for n in args.senders.split(",") if n]
    except ValueError:
        ap.error(f"--senders {args.senders!r}: use counts like 3,7")
    if not scenarios or not set(scenarios) <= set(SCENARIOS):
        ap.error(f"--scenario: within {', '.join(SCENARIOS)}")
    if not args.ccs or not set(args.ccs) <= set(CCS):
        ap.error(f"--cc: within {', '.join(CCS)}")
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: use 1 or more")
    if not all(1 <= n <= 15 for n in args.senders):
        ap.error("--senders: 1..15 each (a testbed of N+1 workers)")
    if not args.senders and {"incast", "sim-incast"} & set(scenarios):
        ap.error(f"--senders {senders!r}: give sender counts for the incast, e.g. --senders 3,7")
    if not 1 <= args.mark <= args.buffer:
        ap.error(f"--mark {args.mark}: use 1..--buffer ({args.buffer}) KiB")
    from pydblp.collective import Config
    from pydblp.collective.config import TIMEOUT_MAX

    for bad, what in (
            (not 0 < args.seconds < math.inf, f"--seconds {args.seconds:g}: use seconds above 0, e.g. --seconds 30"),
            (not 0 <= args.alone < math.inf, f"--alone {args.alone:g}: use seconds >= 0 (0: skip), e.g. --alone 5"),
            (not 0 < args.window < math.inf, f"--window {args.window:g}: use seconds above 0, e.g. --window 10"),
            (not 0 < args.sample < math.inf, f"--sample {args.sample:g}: use seconds above 0, e.g. --sample 0.2"),
            (not (math.isfinite(args.size) and int(args.size * MiB) >= 4),
             f"--size {args.size:g}: use MiB above 0 (a float32 at least), e.g. --size 8"),
            (not (math.isfinite(args.incast_size) and int(args.incast_size * MiB) >= 4),
             f"--incast-size {args.incast_size:g}: use MiB above 0 (a float32 at least), e.g. --incast-size 2"),
            (args.rounds < 1, f"--rounds {args.rounds}: use 1 or more"),
            (args.buffer * 1024 > 2**32 - 1, f"--buffer {args.buffer}: use at most {(2**32 - 1) // 1024} KiB "
                                             f"(the fabric's 32-bit field), e.g. --buffer 256"),
            (not 0 < args.queue_rate <= 34000,
             f"--queue-rate {args.queue_rate:g}: use Mbit/s in (0, 34000] (the TBF's limit), e.g. 1000"),
            (not 0 <= args.tol < 1, f"--tol {args.tol:g}: use a tolerance in [0, 1), e.g. --tol 0.05"),
            (not 0 < args.peer_timeout <= TIMEOUT_MAX,
             f"--peer-timeout {args.peer_timeout:g}: use seconds in (0, {TIMEOUT_MAX:g}], e.g. 30"),
            (args.seconds < args.window and "jobs" in scenarios,
             f"--seconds {args.seconds:g} is shorter than one --window ({args.window:g} s)")):
        if bad:
            ap.error(what)
    try:  # (as the workers and the simulator take them: Config's cc_* knobs, numbers, in their ranges)
        pairs = [kv.split("=", 1) for kv in args.cc_knobs.split(",") if kv]
        if any(len(kv) != 2 for kv in pairs):
            raise ValueError("each knob needs a value")
        knobs = dict(pairs)
        unknown = [k for k in knobs if not k.startswith("cc_") or not hasattr(Config, k)]
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not a Config cc_* knob")
        Config(**{k: float(v) for k, v in knobs.items()}).check()
    except ValueError as e:
        ap.error(f"--cc-knobs {args.cc_knobs!r}: {e}; use knob=value pairs, e.g. --cc-knobs cc_gain=0.5")
    if os.geteuid() != 0 and scenarios != ["sim-incast"]:
        print("bench/congestion.py needs root (namespaces, XDP, AF_XDP); sim-incast does not", file=sys.stderr)
        return 2
    if "tcp" in scenarios:  # (what the TCP source will ask of its socket: a name this kernel has)
        with socket.socket() as s:
            try:
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, args.tcp_cc.encode())
            except OSError:
                have = Path("/proc/sys/net/ipv4/tcp_available_congestion_control").read_text().split()
                ap.error(f"--tcp-cc {args.tcp_cc}: not a TCP congestion control of this kernel; use one of "
                         f"{', '.join(have)}, e.g. --tcp-cc cubic")
    t_begin = time.monotonic()
    print(f"bench/congestion.py: scenarios {scenarios}, cc {args.ccs}, transport {args.transport}, queue to w0 "
          f"{args.queue_rate:g} Mbit/s / {args.buffer} KiB / mark {args.mark} KiB"
          f"{' / Not-ECT dropped past the mark' if args.mark_drop else ''}{' / delaying' if args.delay else ''}, "
          f"{os.cpu_count()} CPUs "
          f"(workers not pinned), {PYTHON}", flush=True)
    results: dict = {}
    failures: list[str] = []
    tmp = Path(tempfile.mkdtemp(prefix="dblp-congestion-"))

    def attempt(label: str, fn):
        t = time.monotonic()
        try:
            r = fn()
        except Failure as e:
            print(f"  FAILED {label}: {e}", flush=True)
            failures.append(f"{label}: {e}")
            return {"error": str(e)}
        r["wall_s"] = time.monotonic() - t
        return r

    try:
        if "tcp" in scenarios or "jobs" in scenarios:
            with Testbed(workers=3, name=f"cg{os.getpid() % 100000}") as tb:
                procs = Procs(tb, tmp)
                try:
                    if "tcp" in scenarios:
                        tcp_ecn(tb, [0, 2], args.tcp_ecn)
                        res = results["tcp"] = {"transport": args.transport}
                        if args.alone:
                            res["tcp_alone"] = attempt("tcp alone", lambda: run_tcp_alone(procs, tb, args))
                            if "error" not in res["tcp_alone"]:
                                print(f"  tcp alone: {res['tcp_alone']['tcp_mbps']:.0f} Mbit/s", flush=True)
                        r = res["tcp_peer"] = attempt("tcp beside tcp", lambda: run_tcp_peer(procs, tb, args))
                        if "error" not in r:
                            print(f"  tcp beside a second TCP flow: {r['tcp_mbps']:.0f} Mbit/s ({r['tcp_share_link']:.1%} "
                                  f"of the link), the other {r['other_tcp_mbps']:.0f} Mbit/s", flush=True)
                        for cc in args.ccs:
                            r = res[cc] = attempt(f"tcp cc={cc}", lambda: run_tcp(procs, tb, args, cc, args.transport))
                            if "error" not in r:
                                print(f"  tcp cc={cc}: TCP {r['tcp_mbps']:.0f} Mbit/s ({r['tcp_share_link']:.1%} of the "
                                      f"link), pydblp {r['pydblp_mbps']:.0f} Mbit/s, tail {r['port']['tail']:.0f}, "
                                      f"marks {r['port']['mark']:.0f}, p50 {ms(r['p50'])} ms "
                                      f"({r['wall_s']:.0f} s)", flush=True)
                        tcp_ecn(tb, [0, 2], False)
                    if "jobs" in scenarios:
                        res = results["jobs"] = {"transport": "udp"}
                        if args.transport != "udp":
                            print("  jobs: on the udp transport (two AF_XDP jobs cannot share w0's NIC)", flush=True)
                        for cc in args.ccs:
                            r = res[cc] = attempt(f"jobs cc={cc}", lambda: run_jobs(procs, tb, args, cc, "udp"))
                            if "error" not in r:
                                if cc == "ecn" and not all(r["ect"]):
                                    print("  jobs: WARNING: the udp transport sends no ECT here (Transport.ect "
                                          "False): no marks, the rate control cannot act", flush=True)
                                print(f"  jobs cc={cc}: A {r['jobs']['A']['mbps']:.0f}, B {r['jobs']['B']['mbps']:.0f} "
                                      f"Mbit/s, Jain worst window {fmt(r['jain_min_window'], '.3f')} "
                                      f"({r['wall_s']:.0f} s)", flush=True)
                finally:
                    procs.stop()
        if "sim-incast" in scenarios:
            res = results["sim-incast"] = {}
            for n in args.senders:
                for cc in args.ccs:
                    r = res.setdefault(str(n), {})[cc] = run_sim_incast(args, cc, n)
                    print(f"  sim-incast N={n} cc={cc}: {r['virtual_s']:.3f} virtual s, tail drops {r['tail_drops']}, "
                          f"marks {r['marks']}", flush=True)
        if "incast" in scenarios:
            res = results["incast"] = {"transport": args.transport}
            for n in args.senders:
                with Testbed(workers=n + 1, name=f"ci{os.getpid() % 100000}") as tb:
                    procs = Procs(tb, tmp)
                    try:
                        runs = res[str(n)] = {cc: [] for cc in args.ccs}
                        for i in range(args.repeats):  # (the order alternates: neither setting always first)
                            for cc in (args.ccs if i % 2 == 0 else args.ccs[::-1]):
                                r = attempt(f"incast N={n} cc={cc} #{i + 1}",
                                            lambda: run_incast(procs, tb, args, cc, n, args.transport))
                                runs[cc].append(r)
                                if "error" not in r:
                                    print(f"  incast N={n} cc={cc} #{i + 1}: {r['total_s']:.2f} s for {r['rounds']} "
                                          f"rounds, p50 {ms(r['p50'])} ms, drops/round {r['drops_per_round']:.0f}, "
                                          f"marks/round {r['marks_per_round']:.0f} ({r['wall_s']:.0f} s)", flush=True)
                    finally:
                        procs.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    if "tcp" in results:
        print_tcp(results["tcp"], args)
    if "jobs" in results:
        print_jobs(results["jobs"], args)
    if "incast" in results:
        print_incast(results["incast"], args)
    if "sim-incast" in results:
        print_sim_incast(results["sim-incast"], args)
    wall = time.monotonic() - t_begin
    print(f"\ntotal {wall:.0f} s" + (f"; {len(failures)} failure(s)" if failures else ""))
    if args.json:
        opts = {k: v for k, v in vars(args).items()}
        Path(args.json).write_text(json.dumps({"options": opts, "ncpu": os.cpu_count(), "kernel": os.uname().release,
                                               "python": PYTHON, "results": results, "failures": failures,
                                               "wall_s": wall}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    with stop_unwinds():  # (Ctrl-C and SIGTERM unwind; a second one cannot cut the clean-up short)
        sys.exit(main())
