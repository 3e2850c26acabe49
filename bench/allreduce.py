#!/usr/bin/env python3
"""Allreduce benchmark: pydblp (AF_XDP, UDP) vs Gloo in a 4-worker testbed, with fabric faults.

One run brings up a testbed of ``--workers`` workers (default 4; pydblp.testbed:
netns workers behind a bridge, 1 Gbit/s TBF on every worker NIC, the fabric XDP
program on the switch ports) and, for each transport in turn, starts one set of
worker processes (``bench/_allreduce_worker.py``, one per worker namespace) that
stays up for all of that transport's blocks:

  ``xsk``   pydblp Collective over XskTransport (host XDP program on eth0)
  ``xsk-ktx`` the same, transmitting through a kernel UDP socket (``XskTransport(tx="kernel")``:
            GSO, the NIC's TBF paces) instead of the AF_XDP tx ring and a Python pacer
  ``udp``   pydblp Collective over UdpTransport (no XDP on the worker)
  ``xsk-bc``, ``xsk-ktx-bc``, ``udp-bc``  the same with a broadcast all-gather
            (``Config(allgather="broadcast")``, ``group`` the testbed's broadcast address: an
            owner sends its all-gather once, the fabric replicates it); not in the default set
  ``xsk-key``, ``xsk-ktx-key``, ``udp-key``  the same with a job key: every packet tagged and
            verified (``pydblp.transport.auth``; a key file made for the run); not in the default
            set.  ``--transports udp,udp-key`` measures what a key costs, in the same run
  ``gloo``  ``torch.distributed.all_reduce`` on a gloo process group (TCP over eth0), then /world
  ``floor`` the least a Python allreduce over plain UDP sockets does here: pydblp's chunks,
            shards and schedule, GSO sends and GRO receives, an 8-byte header and nothing else
            (no loss handling: clean blocks only).  A peer, not a transport: pydblp / floor is
            what the protocol costs, floor / Gloo what Python and this testbed's kernel path do

A block is one (size, condition): float32 tensors of ``--sizes`` MiB
(default 1, 8, 32) under

  ``clean``  no injected loss
  ``loss``   ``--loss`` random loss on every port (default 1 %)
  ``burst``  microbursts of ``--burst-ratio`` loss (default 80 %) lasting one clean
             round of the baseline: Gloo's clean p50 for that size, measured earlier in
             the same run (Gloo runs first), the same burst for every transport
             (``--burst-len own``: each transport's own clean p50 instead, a longer burst
             for a slower transport; a number: that many ms); a burst on every port starts as measured rounds
             1, 1+k, 1+2k, ... start (``--burst-every`` k, default 3, or 2 for blocks of
             fewer than 9 rounds): the last rank to
             enter such a round arms it (the worker's docstring says how)

Each block runs 1 warm-up round, ``--rounds`` measured rounds back to back
and one unmeasured tail round, all under the fault; the parent clears the
fault once the first rank reports the tail done (every rank has then
finished the measured rounds).  Blocks of a transport run clean, loss,
burst for each size in turn.

What is measured: a round's latency is from the moment the last rank enters
``allreduce`` to the moment the last rank returns (CLOCK_MONOTONIC stamps
of all ranks; rounds run back to back, so these spans tile the timeline).
p50/p99 are over the measured rounds of a block (numpy's linear
interpolation: with 12 rounds or fewer p99 is close to the maximum).  A *burst
round* is the round a burst window overlaps most (CLOCK_MONOTONIC is the
clock of bpf_ktime_get_ns, the fabric's clock); ``burst med`` is the median
over those rounds.  Ratios are pydblp/Gloo between figures of this run.
Beside each burst target the output gives the most any transport could reach
in that run: Gloo's burst median over the shortest burst round the links
allow (``burst_round_least``: ``1 - tol`` of a rank's ``2 (W-1)/W x tensor``
through its rate limit, while the burst lasts with ``--burst-ratio`` of it lost).

pydblp runs ``Config(mode=--mode, phase="static:TOL", estimator="unbiased")``
(``--mode`` tar, the default, or ps: a parameter server, rank 0) with ``--tol``
(default 0.05: a round completes once 95 % of every message arrived; more loss
is repaired by PROBE/BITMAP retransmission) and ``peer_timeout`` ``--peer-timeout``
(30 s), transports with ``spin=--spin`` (default 0: no busy-polling, the ranks share
the CPUs).  Gloo runs its default
allreduce with ``GLOO_SOCKET_IFNAME=eth0``.  Every worker calls
``torch.set_num_threads(1)``; workers are not pinned (4 ranks share the
machine's CPUs; ``--workers 2`` gives each rank a vCPU of its own on this
2-vCPU machine kind, which separates what the ranks' CPU costs from the rest).

Rates: the TBF limit sits in the worker's qdisc, which the UDP socket and
Gloo's TCP go through but AF_XDP copy-mode transmit does not (the kernel
hands those frames straight to the driver).  So the AF_XDP workers pace
themselves at the same rate and burst (``XskTransport(rate=...)``, a token
bucket releasing tx-ring frames, as the TBF releases its queue), and every
transport meets the same 1 Gbit/s link; ``--no-pace`` turns that off (then
AF_XDP runs at CPU speed, faster than the link Gloo and UDP see).

Repeats: the machine's speed drifts over minutes (the same 1 MiB clean block of the same code
measured 19-26 ms within an hour), and a transport's blocks run a minute or more after Gloo's,
so one run's ratio moves with the drift.  ``--repeats N`` runs every transport's blocks N
times, interleaved (gloo, floor, udp, ..., gloo, floor, udp, ...; each repeat with fresh
worker sets, its bursts sized by its own Gloo clean p50), takes each ratio within its repeat
and reports their median, min-max and how many repeats met each target; the table's figures
are medians over repeats.

Bounded: each block has a timeout (``--block-timeout`` or 30 s + 3 s per
round per 8 MiB); a worker set that fails or overruns is killed by pid,
the block is reported as failed, and a fresh set continues with the next
block.  A default run (5 transports x 3 sizes x 3 conditions) takes about
4 minutes on 2 vCPUs (~150 s for gloo, floor, udp and xsk-ktx; 60 rounds a 1 MiB block since
2026-12-01, 20 before), ``--repeats N`` N times that; at worst ~45 block timeouts a repeat.
Needs root.

    .venv/bin/python bench/allreduce.py [--workers 4] [--sizes 1,8,32] [--rounds N] [--tol 0.05]
                                        [--transports xsk,xsk-ktx,udp,gloo,floor] [--conditions clean,loss,burst]
                                        [--mode tar|ps]
                                        [--repeats 1] [--json out.json]
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from pydblp import net, wire  # noqa: E402
from pydblp.cliutil import Parser, stop_unwinds  # noqa: E402
from pydblp.collective.config import TIMEOUT_MAX, link_chunk_bytes  # noqa: E402
from pydblp.testbed import Testbed  # noqa: E402
from pydblp.testbed.fabric import NPRIO  # noqa: E402

MiB = 1 << 20
WORKER = Path(__file__).resolve().parent / "_allreduce_worker.py"
TRANSPORTS = ("xsk", "xsk-ktx", "udp", "gloo", "floor")  # the default set
BROADCAST = ("xsk-bc", "xsk-ktx-bc", "udp-bc")  # pydblp with a broadcast all-gather (opt in)
KEYED = ("xsk-key", "xsk-ktx-key", "udp-key")  # pydblp with a job key (opt in)
CONDITIONS = ("clean", "loss", "burst")
# the workers' interpreter (theirs is this one): its build moves pydblp's CPU-bound rounds (bench/README)
PYTHON = f"Python {sys.version.split()[0]} ({os.path.realpath(sys.executable)})"


class WorkerFailure(RuntimeError):
    pass


class WorkerSet:
    """The ranks of one transport, one per testbed worker, talking JSON lines over pipes."""

    def __init__(self, tb: Testbed, transport: str, args, tmp: Path, generation: int):
        self.tb, self.transport = tb, transport
        self.world = tb.n
        self.tag = f"{transport}{generation}"
        peers = [[tb.addr(r), wire.DEFAULT_PORT, tb.mac(r)] for r in range(self.world)]
        fabric = json.dumps({"pin_dir": tb.state["pin_dir"], "ports": tb.ports})
        store = tmp / f"store-{self.tag}"
        sync = tmp / f"sync-{self.tag}"
        sync.mkdir()
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.procs, self.errs, self.bufs = [], [], []
        for r in range(self.world):
            argv = [sys.executable, str(WORKER), "--rank", str(r), "--world", str(self.world),
                    "--transport", transport, "--peers", json.dumps(peers), "--tol", str(args.tol),
                    "--mode", args.mode, "--peer-timeout", str(args.peer_timeout), "--store", str(store)]
            if args.send_burst:
                argv += ["--send-burst", str(args.send_burst)]
            if args.spread:
                argv += ["--spread", str(args.spread)]
            if args.chunk_bytes:
                argv += ["--chunk-bytes", str(args.chunk_bytes)]
            argv += ["--spin", str(args.spin)]
            if transport.endswith("-key"):
                argv += ["--key-file", str(self.key_file(tmp)), "--epoch", "1"]
            if transport.removesuffix("-key").removesuffix("-bc") == "xsk" and not args.no_pace:
                argv += ["--rate", str(tb.rate_bps)]  # AF_XDP bypasses the TBF: pace at its rate
            if transport.endswith("-bc"):
                argv += ["--group", json.dumps(tb.group(wire.DEFAULT_PORT))]
            argv += ["--fabric", fabric, "--sync", str(sync)]
            err = open(tmp / f"{self.tag}-rank{r}.err", "w+")
            self.errs.append(err)
            self.procs.append(tb.popen(r, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       stderr=err, env=env))
            self.bufs.append(b"")

    @staticmethod
    def key_file(tmp: Path) -> Path:
        """A job key for the -key transports: 32 random bytes, readable by the owner only."""
        path = tmp / "job.key"
        if not path.exists():
            path.touch(0o600)
            path.write_bytes(os.urandom(32))
        return path

    def send(self, obj) -> None:
        line = (json.dumps(obj) + "\n").encode()
        for p in self.procs:
            try:
                p.stdin.write(line)
                p.stdin.flush()
            except (BrokenPipeError, OSError):
                raise WorkerFailure(f"{self.transport}: a worker has exited ({self.stderr_tail()})") from None

    def messages(self, deadline: float):
        """Yield (rank, message) until the deadline; raises WorkerFailure past it."""
        fds = {p.stdout.fileno(): r for r, p in enumerate(self.procs)}
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WorkerFailure(f"{self.transport}: timed out")
            ready, _, _ = select.select(list(fds), [], [], min(left, 1.0))
            for fd in ready:
                r = fds[fd]
                data = os.read(fd, 1 << 20)
                if not data:
                    self.procs[r].wait(timeout=5)
                    raise WorkerFailure(f"{self.transport}: rank {r} exited with status "
                                        f"{self.procs[r].returncode} ({self.stderr_tail(r)})")
                self.bufs[r] += data
                while b"\n" in self.bufs[r]:
                    line, self.bufs[r] = self.bufs[r].split(b"\n", 1)
                    msg = json.loads(line)
                    if "error" in msg:
                        raise WorkerFailure(f"{self.transport}: {msg['error']} ({self.stderr_tail(r)})")
                    yield r, msg

    def wait_ready(self, timeout: float) -> None:
        ready = set()
        for r, msg in self.messages(time.monotonic() + timeout):
            if msg.get("ready"):
                ready.add(r)
                if len(ready) == self.world:
                    return

    def stderr_tail(self, rank: int | None = None, n: int = 600) -> str:
        out = []
        for r, f in enumerate(self.errs):
            if rank is not None and r != rank:
                continue
            try:
                f.flush()
                f.seek(0)
                text = f.read().strip()
            except (OSError, ValueError):
                continue
            if text:
                out.append(f"rank {r}: ...{text[-n:]}")
        return " | ".join(out) or "no stderr"

    def stop(self, timeout: float = 15.0) -> None:
        """Ask to quit, then kill by pid whatever is still running."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.stdin.write(b'{"cmd": "quit"}\n')
                    p.stdin.flush()
                    p.stdin.close()
                except (BrokenPipeError, OSError, ValueError):
                    pass
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)  # the worker itself: nsenter execs it
                p.wait(timeout=5)
        for f in self.errs:
            f.close()
        if self.transport.startswith("xsk"):  # a killed rank leaves its host program attached
            for r in range(self.world):
                with contextlib.suppress(Exception):
                    net.xdp_detach("eth0", netns=self.tb.ns(r))


def kernel_counters(tb: Testbed) -> dict:
    """Drops nobody injected: veth/device drops (both ends), TBF drops, UDP receive-buffer
    overflows, and TCP retransmitted segments, summed over the testbed's namespaces."""
    c = dict.fromkeys(("dev_drops", "qdisc_drops", "udp_rcvbuf_errors", "tcp_retrans"), 0)
    for ns in [tb.switch_ns] + [tb.ns(r) for r in range(tb.n)]:
        with net.in_netns(ns):  # /proc/thread-self/net follows this thread's netns
            dev = Path("/proc/thread-self/net/dev").read_text().splitlines()[2:]
            snmp = Path("/proc/thread-self/net/snmp").read_text().splitlines()
        for line in dev:
            f = line.split(":", 1)[1].split()
            c["dev_drops"] += int(f[3]) + int(f[11])
        for names, vals in zip(snmp[::2], snmp[1::2]):
            row = dict(zip(names.split()[1:], vals.split()[1:]))
            if names.startswith("Udp:"):
                c["udp_rcvbuf_errors"] += int(row.get("RcvbufErrors", 0))
            elif names.startswith("Tcp:"):
                c["tcp_retrans"] += int(row.get("RetransSegs", 0))
        with net.ipr(ns) as ip:
            for q in ip.get_qdiscs():
                st = q.get_attr("TCA_STATS")
                if st:
                    c["qdisc_drops"] += int(st.get("drop", 0))
    return c


def clear(tb: Testbed, buffer: int, mark: int = 0) -> None:
    """Clear the fabric's faults; with ``buffer`` bytes, give every switch port a drop-tail queue
    at the link rate holding that much (``--switch-buffer``), CE-marking past ``mark`` bytes."""
    tb.clear()
    if buffer:
        tb.queue(tb.rate_bps, buffer=buffer, thresholds=(0,) * NPRIO, mark=mark or None)


def run_block(ws: WorkerSet, tb: Testbed, cmd: dict, cond: str, loss: float, timeout: float,
              buffer: int = 0, mark: int = 0) -> list[dict]:
    clear(tb, buffer, mark)
    if cond == "loss":
        tb.loss(loss)
    tb.stats(reset=True)
    try:
        ws.send(cmd)
        out: dict[int, dict] = {}
        cleared = False
        for r, msg in ws.messages(time.monotonic() + timeout):
            if msg.get("drained") and not cleared:
                clear(tb, buffer, mark)  # every rank has finished the measured rounds
                cleared = True
            elif "block" in msg:
                out[r] = msg["block"]
                if len(out) == ws.world:
                    return [out[r] for r in range(ws.world)]
    finally:
        tb.clear()
    raise AssertionError("unreachable")


def summarize(ranks: list[dict], size: int) -> dict:
    world = len(ranks)
    t0 = np.array([r["t0"] for r in ranks])   # [rank, round]
    t1 = np.array([r["t1"] for r in ranks])
    start, end = t0.max(0), t1.max(0)
    lat = end - start
    windows = [w for r in ranks for w in r["windows"]]
    hit, touched = set(), set()
    for ws, we in windows:
        ov = np.minimum(end, we) - np.maximum(start, ws)
        if (ov > 0).any():
            touched |= set(np.flatnonzero(ov > 0).tolist())
            hit.add(int(np.argmax(ov)))
    own = np.array([np.median(r1 - r0) for r0, r1 in zip(t0, t1)])
    s = {"rounds": len(lat), "p50": float(np.percentile(lat, 50)), "p99": float(np.percentile(lat, 99)),
         "mean": float(lat.mean()), "min": float(lat.min()), "max": float(lat.max()),
         "latency": lat.tolist(), "rank_p50": own.tolist(),
         "gbps": float(np.median(2 * (world - 1) / world * size * 8 / lat / 1e9)),
         "cpu": float(np.mean([r["cpu"] for r in ranks])), "cpu_sys": float(np.mean([r["cpu_sys"] for r in ranks])),
         "exact": min(r["exact"] for r in ranks), "stale": max(r["stale"] for r in ranks),
         "stale_max_age": max(r["stale_max_age"] for r in ranks),
         "windows": windows, "burst_rounds": sorted(hit), "touched_rounds": sorted(touched)}
    if hit:
        s["burst_med"] = float(np.median(lat[sorted(hit)]))
        s["touched_med"] = float(np.median(lat[sorted(touched)]))
        rest = [i for i in range(len(lat)) if i not in touched]
        s["other_p50"] = float(np.median(lat[rest])) if rest else None
    recs = [rec for r in ranks for rec in r["recs"] if rec]
    if recs:
        s["retx"] = sum(rec["retx"] for rec in recs) / len(lat)
        s["probes"] = sum(rec["probes"] for rec in recs) / len(lat)
        s["nacks"] = sum(rec.get("nacks", 0) for rec in recs) / len(lat)
        s["min_delivered"] = min(rec["min_delivered"] for rec in recs)
        s["below_bound"] = sum(bool(rec["below"]) for rec in recs)
        s["tx_bytes_per_rank_round"] = float(np.mean([rec["tx_bytes"] for rec in recs]))
        s["counters"] = [r["counters"] for r in ranks]  # per rank, at the block's end
    return s


def median_of(values: list):
    """The median of the values that are not None (None: none are)."""
    vals = [v for v in values if v is not None]
    return float(np.median(vals)) if vals else None


def repeat_ratios(run: dict, tr: str, key: str, cond: str) -> tuple:
    """(p50 / Gloo's, p99 / Gloo's, Gloo's burst med / this one's, p50 / the floor's) of one block
    against the peers of the same repeat (None where either is missing)."""
    s = run.get(tr, {}).get(key, {}).get(cond) or {}
    g = run.get("gloo", {}).get(key, {}).get(cond) or {}
    f = run.get("floor", {}).get(key, {}).get(cond) or {}
    if "p50" not in s:
        return None, None, None, None
    return (s["p50"] / g["p50"] if tr != "gloo" and "p50" in g else None,
            s["p99"] / g["p99"] if tr != "gloo" and "p99" in g else None,
            g["burst_med"] / s["burst_med"] if tr != "gloo" and "burst_med" in g and "burst_med" in s else None,
            s["p50"] / f["p50"] if tr != "floor" and "p50" in f else None)


def link_share(world: int, mode: str = "tar", broadcast: bool = False) -> float:
    """Tensors the busiest rank must send through its link in an allreduce round: ``2 (W-1)/W``
    (any allreduce that spreads the work evenly: Gloo's ring, transpose allreduce); with a broadcast
    all-gather ``(W-1)/W + 1/W``; a parameter server ``W-1`` (its all-gather), broadcast 1."""
    if mode == "ps":
        return 1.0 if broadcast else float(world - 1)
    return (world - 1) / world + (1 if broadcast else world - 1) / world


def burst_round_least(mib: float, world: int, tol: float, ratio: float, burst_s: float, rate_bps: int,
                      share: float | None = None) -> float:
    """The shortest a burst round can be, in seconds, for any transport on these links.

    Each rank must put at least ``(1 - tol)`` of its share of the allreduce's data
    (``share`` tensors, default ``link_share(world)``: ``2 (W-1)/W``) through its NIC's rate
    limit; while a burst of ``ratio`` loss lasts only ``1 - ratio`` of what crosses the link
    arrives.  The burst starts with the round: a round of T >= ``burst_s`` then delivers at
    most ``rate x (T - ratio x burst_s)`` (headers and control packets left out: a lower bound)."""
    share = link_share(world) if share is None else share
    data = (1 - tol) * share * mib * MiB * 8 / rate_bps  # seconds of link
    if ratio < 1 and data / (1 - ratio) < burst_s:
        return data / (1 - ratio)  # done before the burst ends
    return data + min(ratio, 1.0) * burst_s


def burst_ceiling(run: dict, tr: str, key: str, world: int, tol: float, ratio: float, rate_bps: int,
                  mode: str = "tar"):
    """Gloo's burst median over the shortest burst round any transport can have (the burst ``tr``
    got; with ``tr``'s share of the data: see ``link_share``): the highest 'Gloo / x' burst ratio
    reachable in this repeat (None: not measured)."""
    s = run.get(tr, {}).get(key, {}).get("burst") or {}
    g = run.get("gloo", {}).get(key, {}).get("burst") or {}
    if not s.get("burst_len") or "burst_med" not in g or not rate_bps:  # (no rate limit: no bound)
        return None
    share = link_share(world, mode, tr in BROADCAST)
    return g["burst_med"] / burst_round_least(float(key), world, tol, ratio, s["burst_len"], rate_bps, share)


def combine(runs: list[dict], transports: list[str]) -> dict:
    """Per block, the median over repeats of each figure (the worst of 'exact'); a block that failed
    in every repeat keeps its first error."""
    out: dict = {t: {} for t in transports}
    for tr in transports:
        for key in {k for run in runs for k in run.get(tr, {})}:
            out[tr][key] = {}
            for cond in {c for run in runs for c in run[tr].get(key, {})}:
                ok = [run[tr][key][cond] for run in runs if "p50" in run[tr].get(key, {}).get(cond, {})]
                if not ok:
                    out[tr][key][cond] = next(run[tr][key][cond] for run in runs if cond in run[tr].get(key, {}))
                    continue
                m = {k: median_of([s.get(k) for s in ok])
                     for k in ("p50", "p99", "burst_med", "gbps", "cpu", "cpu_sys", "retx", "burst_len")}
                m = {k: v for k, v in m.items() if v is not None}
                m["exact"] = min(s["exact"] for s in ok)
                m["repeats"] = len(ok)
                out[tr][key][cond] = m
    return out


def fmt_ms(v) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def main(argv=None) -> int:
    ap = Parser(description=__doc__.split("\n\n")[0])  # (a mistake: one line, exit status 2)
    ap.add_argument("--workers", type=int, default=4,
                    help="testbed workers, one rank each (default 4, as issue 6 states its targets; 2..8)")
    ap.add_argument("--sizes", default="1,8,32", help="tensor sizes, MiB of float32 (default 1,8,32)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="measured rounds per block (default 60 up to 1 MiB, 12 up to 8 MiB, 6 above)")
    ap.add_argument("--transports", default=",".join(TRANSPORTS),
                    help=f"comma-separated, of {', '.join(TRANSPORTS + BROADCAST + KEYED)} "
                         f"(default: {','.join(TRANSPORTS)})")
    ap.add_argument("--conditions", default=",".join(CONDITIONS))
    ap.add_argument("--tol", type=float, default=0.05, help="pydblp static tolerance (default 0.05)")
    ap.add_argument("--mode", default="tar", choices=("tar", "ps"), help="pydblp Config.mode (default tar)")
    ap.add_argument("--loss", type=float, default=0.01, help="random loss of the loss condition")
    ap.add_argument("--burst-ratio", type=float, default=0.8)
    ap.add_argument("--burst-len", default="gloo",
                    help="burst duration: 'gloo' (Gloo's clean p50 at that size, for every transport; default), "
                         "'own' (each transport's own clean p50) or milliseconds")
    ap.add_argument("--burst-every", type=int, default=None,
                    help="a burst every k measured rounds from round 1 (default 3; 2 for blocks under 9 rounds)")
    ap.add_argument("--peer-timeout", type=float, default=30.0)
    ap.add_argument("--mtu", type=int, default=1500, help="MTU of every testbed link (default 1500)")
    ap.add_argument("--rate", type=float, default=1000.0, metavar="MBIT",
                    help="each worker link's rate in Mbit/s (default 1000, the testbed's); 0: no limit, where "
                         "the transports' own cost decides")
    ap.add_argument("--spin", type=float, default=0.0,
                    help="pydblp transports' busy-poll seconds (default 0: 4 ranks share the CPUs, "
                         "as pydblp.torch assumes)")
    ap.add_argument("--no-pace", action="store_true",
                    help="AF_XDP transmit unpaced (it bypasses the worker NIC's TBF; default: paced at its rate)")
    ap.add_argument("--chunk-bytes", type=int, default=None,
                    help="pydblp payload per packet (default: Config's 1408; at most "
                         "pydblp.collective.link_chunk_bytes(MTU): 8000 at MTU 9000)")
    ap.add_argument("--send-burst", type=int, default=None,
                    help="pydblp Config.burst: data packets sent per loop turn (default: Config's)")
    ap.add_argument("--block-timeout", type=float, default=None, help="seconds per block (default: by size)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run every transport's blocks this many times, interleaved (gloo, udp, ..., gloo, udp, "
                         "...); ratios are taken within each repeat, then their median (default 1)")
    ap.add_argument("--spread", type=int, default=0, metavar="PACKETS",
                    help="pydblp Config.spread: where the link is the bottleneck, send batches take turns over "
                         "their destinations PACKETS at a time (default 0: off)")
    ap.add_argument("--switch-buffer", type=float, default=0.0, metavar="KIB",
                    help="give every switch port a drop-tail queue at the link rate holding KIB KiB, as a "
                         "switch's port buffer: what overflows it is dropped (the fabric's virtual queue; frames "
                         "do not wait in it). Default 0: none, the links' TBFs are at the senders only and a "
                         "port takes any number of senders at once")
    ap.add_argument("--switch-mark", type=float, default=0.0, metavar="KIB",
                    help="with --switch-buffer: the ports CE-mark ECN-capable frames past KIB KiB of backlog "
                         "(default 0: no marking)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    if not (args.rate == 0 or 1 <= args.rate <= 34000):
        ap.error(f"--rate {args.rate:g}: use 0 (no limit) or 1..34000 Mbit/s")
    try:
        sizes = [float(s) for s in args.sizes.split(",") if s]
    except ValueError:
        sizes = []
    transports = [t for t in args.transports.split(",") if t]
    conds = [c for c in args.conditions.split(",") if c]
    if not 2 <= args.workers <= 8:
        ap.error(f"--workers {args.workers}: use 2..8")
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: use 1 or more")
    if not sizes or not all(math.isfinite(s) and int(s * MiB) >= 4 for s in sizes):
        ap.error(f"--sizes {args.sizes}: use sizes in MiB above 0, comma-separated, e.g. --sizes 1,8")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if args.workers * 3 * max(sizes) * MiB > ram:  # (each rank's input, expected mean and result at least)
        ap.error(f"--sizes {args.sizes}: {args.workers} ranks of {max(sizes):g} MiB tensors outgrow this machine's "
                 f"{ram / 2**30:.0f} GiB of memory; use smaller sizes, e.g. --sizes 1,8,32")
    if not transports or not set(transports) <= set(TRANSPORTS + BROADCAST + KEYED):
        ap.error(f"--transports {args.transports!r}: use some of {','.join(TRANSPORTS + BROADCAST + KEYED)}")
    if not conds or not set(conds) <= set(CONDITIONS):
        ap.error(f"--conditions {args.conditions!r}: use some of {','.join(CONDITIONS)}")
    chunk = 1408 if args.chunk_bytes is None else args.chunk_bytes  # (Config's default)
    link = link_chunk_bytes(args.mtu) if 144 <= args.mtu <= 65535 else None
    pydblp_too = any(t != "gloo" for t in transports)
    for bad, what in (
            (args.rounds is not None and args.rounds < 1, f"--rounds {args.rounds}: use 1 or more"),
            (args.rounds == 1 and "burst" in conds,
             "--rounds 1: a burst block needs 2 or more (bursts start at measured round 1), or leave burst out "
             "of --conditions"),
            (not 0 <= args.tol < 1, f"--tol {args.tol}: use a tolerance in [0, 1), e.g. --tol 0.05"),
            (not 0 <= args.loss <= 1, f"--loss {args.loss}: use a probability in [0, 1], e.g. --loss 0.01"),
            (not 0 < args.burst_ratio <= 1, f"--burst-ratio {args.burst_ratio}: use a loss ratio in (0, 1], e.g. 0.8"),
            (args.burst_every is not None and args.burst_every < 1, f"--burst-every {args.burst_every}: use 1 or more"),
            (not 0 < args.peer_timeout <= TIMEOUT_MAX,
             f"--peer-timeout {args.peer_timeout}: use seconds in (0, {TIMEOUT_MAX:g}], e.g. 30"),
            (not 68 <= args.mtu <= 65535, f"--mtu {args.mtu}: use 68..65535 (the testbed's), e.g. --mtu 1500"),
            (pydblp_too and link is None, f"--mtu {args.mtu}: pydblp's least chunk (64 bytes) needs an MTU of 144 or "
                                          f"more, e.g. --mtu 1500"),
            (not 0 <= args.spin < math.inf, f"--spin {args.spin}: use busy-poll seconds >= 0, e.g. 200e-6"),
            (args.chunk_bytes is not None and (chunk % 4 or not 64 <= chunk <= (link or 8000)),
             f"--chunk-bytes {args.chunk_bytes}: use a multiple of 4 in 64..{link or 8000} (what MTU {args.mtu} "
             f"carries), e.g. --chunk-bytes {min(1408, link or 8000)}"),
            (pydblp_too and link is not None and chunk > link,  # (Config's default chunks)
             f"--mtu {args.mtu}: {chunk}-byte chunks need MTU {chunk + wire.DATAGRAM_OVERHEAD} or more: give "
             f"--chunk-bytes {link} too"),
            (args.send_burst is not None and args.send_burst < 1, f"--send-burst {args.send_burst}: use 1 or more packets"),
            (args.spread < 0, f"--spread {args.spread}: use 0 (off) or a number of packets, e.g. 32"),
            (not 0 <= args.switch_buffer < math.inf or (args.switch_buffer and args.rate == 0),
             f"--switch-buffer {args.switch_buffer:g}: use KiB >= 0 with a link rate (--rate above 0), e.g. 128"),
            (not 0 <= args.switch_mark <= args.switch_buffer or (args.switch_mark and not args.switch_buffer),
             f"--switch-mark {args.switch_mark:g}: use KiB up to --switch-buffer's (and give that), e.g. 32"),
            (args.block_timeout is not None and not 0 < args.block_timeout < math.inf,
             f"--block-timeout {args.block_timeout}: use seconds above 0, e.g. 120")):
        if bad:
            ap.error(what)
    if "burst" in conds and "clean" not in conds:
        conds.insert(0, "clean")  # the burst duration is the clean p50
    conds = [c for c in CONDITIONS if c in conds]
    if args.burst_len not in ("gloo", "own"):
        try:
            burst_ms = float(args.burst_len)
        except ValueError:
            ap.error(f"--burst-len {args.burst_len!r}: use gloo, own or milliseconds")
        if not 0 < burst_ms < math.inf:
            ap.error(f"--burst-len {args.burst_len}: use milliseconds above 0, e.g. --burst-len 20")
    if args.burst_len == "gloo" and "burst" in conds:
        if "gloo" in transports:
            transports = ["gloo"] + [t for t in transports if t != "gloo"]  # its clean p50 sizes every burst
        else:
            print("bench/allreduce.py: no gloo in --transports; bursts last each transport's own clean p50",
                  file=sys.stderr)
            args.burst_len = "own"
    if os.geteuid() != 0:
        print("bench/allreduce.py needs root (namespaces, XDP, AF_XDP)", file=sys.stderr)
        return 2

    buffer, mark = int(args.switch_buffer * 1024), int(args.switch_mark * 1024)

    def rounds_for(mib):
        # >= ~1 s of rounds a block: the p50 and the burst median then span more than one of the
        # machine's slow spells (20 rounds of 1 MiB last 0.3 s)
        return args.rounds or (60 if mib <= 1 else 12 if mib <= 8 else 6)

    def timeout_for(mib):
        return args.block_timeout or 30.0 + (rounds_for(mib) + 3) * 3.0 * max(1.0, mib / 8)

    t_begin = time.monotonic()
    failures: list[str] = []
    seq = 0
    tmp = Path(tempfile.mkdtemp(prefix="dblp-allreduce-"))
    print(f"bench/allreduce.py: {args.workers} workers, sizes {sizes} MiB, conditions {conds}, "
          f"pydblp tol {args.tol}, {os.cpu_count()} CPUs (workers not pinned)"
          + (f", {args.repeats} repeats interleaved" if args.repeats > 1 else "") + f", {PYTHON}", flush=True)

    def one_repeat(tb, rep: int) -> dict:
        """Every transport's blocks once (Gloo first: its clean p50 sizes this repeat's bursts;
        the others in the given order in even repeats, reversed in odd ones: drift over a repeat
        favours none of them)."""
        nonlocal seq
        res: dict = {t: {} for t in transports}
        tag = f"[{rep + 1}/{args.repeats}] " if args.repeats > 1 else ""
        first = [t for t in transports if t == "gloo" and args.burst_len == "gloo"]
        rest = [t for t in transports if t not in first]
        for tr in first + (rest if rep % 2 == 0 else rest[::-1]):
            gen = 0
            ws = None
            try:
                for mib in sizes:
                    size = int(mib * MiB) // 4 * 4
                    key = f"{mib:g}"
                    res[tr][key] = {}
                    for cond in conds:
                        if tr == "floor" and cond != "clean":
                            continue  # the floor repairs no loss
                        if ws is None:
                            gen += 1
                            ws = WorkerSet(tb, tr, args, tmp, f"{rep}.{gen}")
                            try:
                                ws.wait_ready(120)
                            except WorkerFailure:
                                ws.stop(5)
                                ws = None
                                raise
                        seq += 1
                        cmd = {"cmd": "block", "seq": seq, "size": size, "rounds": rounds_for(mib), "warmup": 1,
                               "burst": None}
                        if cond == "burst":
                            if args.burst_len in ("gloo", "own"):
                                ref = "gloo" if args.burst_len == "gloo" else tr
                                clean = res.get(ref, {}).get(key, {}).get("clean")
                                if not clean or "p50" not in clean:
                                    res[tr][key][cond] = {"error": f"no {ref} clean p50 to size the burst"}
                                    continue
                                duration = clean["p50"]
                            else:
                                duration = float(args.burst_len) / 1e3
                            every = args.burst_every or (3 if rounds_for(mib) >= 9 else 2)
                            cmd["burst"] = {"ratio": args.burst_ratio, "duration": duration,
                                            "rounds": list(range(1, rounds_for(mib), every))}
                        t = time.monotonic()
                        k0 = kernel_counters(tb)
                        try:
                            ranks = run_block(ws, tb, cmd, cond, args.loss, timeout_for(mib), buffer, mark)
                            dropped = tb.fabric.dropped(causes=("tail",)) if buffer else None
                        except WorkerFailure as e:
                            msg = f"{tag}{tr} {key} MiB {cond}: {e}"
                            print(f"  FAILED {msg}", flush=True)
                            failures.append(msg)
                            res[tr][key][cond] = {"error": str(e)}
                            ws.stop(5)
                            ws = None
                            continue
                        s = summarize(ranks, size)
                        s["wall"] = time.monotonic() - t
                        k1 = kernel_counters(tb)
                        s["kernel"] = {k: k1[k] - k0[k] for k in k0}
                        s["switch_drops"] = dropped
                        res[tr][key][cond] = s
                        s["burst_len"] = cmd["burst"]["duration"] if cond == "burst" else None
                        extra = (f" burst med {fmt_ms(s.get('burst_med'))} ms over rounds {s['burst_rounds']} "
                                 f"(bursts of {fmt_ms(s['burst_len'])} ms)" if cond == "burst" else "")
                        pyd = (f" retx/round {s['retx']:.0f}, min delivered {s['min_delivered']:.3f}"
                               if "retx" in s else "")
                        print(f"  {tag}{tr:<4} {key:>3} MiB {cond:<5}: p50 {fmt_ms(s['p50'])} ms, "
                              f"p99 {fmt_ms(s['p99'])} ms{extra}{pyd}, CPU/rank/round {fmt_ms(s['cpu'])} ms (sys {fmt_ms(s['cpu_sys'])}), exact {s['exact']:.3f}, stale {s['stale']:.3f} "
                              f"(max age {s['stale_max_age']}), "
                              f"uninjected drops {s['kernel']}"
                              + (f", switch tail drops {dropped}" if buffer else "") + f" ({s['wall']:.1f} s)", flush=True)
            except WorkerFailure as e:
                failures.append(f"{tag}{tr}: {e}")
                print(f"  FAILED {tag}{tr}: {e}", flush=True)
            finally:
                if ws is not None:
                    ws.stop()
        return res

    runs: list[dict] = []
    try:
        with Testbed(workers=args.workers, name=f"ar{os.getpid() % 100000}", mtu=args.mtu,
                     rate=f"{args.rate:g}mbit") as tb:
            rate_bps = tb.rate_bps
            for rep in range(args.repeats):
                runs.append(one_repeat(tb, rep))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    res = runs[0] if len(runs) == 1 else combine(runs, transports)

    # ---- table -------------------------------------------------------------
    print(f"\nround latency, ms (last rank in -> last rank out); {args.workers} workers, "
          + (f"{rate_bps / 1e9:g} Gbit/s TBF per NIC; " if rate_bps else "no rate limit; ")
          + f"loss {args.loss:.0%}; bursts {args.burst_ratio:.0%} lasting "
          + {"gloo": "Gloo's clean p50 (the same for every transport)",
             "own": "each transport's own clean p50"}.get(args.burst_len, f"{args.burst_len} ms"))
    hdr = (f"{'transport':<9} {'MiB':>4} {'cond':<6} {'p50':>8} {'p99':>8} {'burst med':>9} "
           f"{'p50/gloo':>8} {'p99/gloo':>8} {'burst gloo/x':>12} {'Gb/s':>5} {'retx/rd':>7} {'exact':>6}")
    print(hdr)
    print("-" * len(hdr))
    ratios: dict = {}
    for key in [f"{m:g}" for m in sizes]:
        for cond in conds:
            g = res.get("gloo", {}).get(key, {}).get(cond, {})
            for tr in transports:
                s = res[tr].get(key, {}).get(cond)
                if s is None:
                    continue
                if "error" in s:
                    print(f"{tr:<9} {key:>4} {cond:<6} FAILED: {s['error'][:80]}")
                    continue
                rr = [repeat_ratios(run, tr, key, cond) for run in runs]  # each within its own repeat
                r50, r99, rb, rf = (median_of([x[k] for x in rr]) for k in range(4))
                if tr not in ("gloo", "floor"):
                    ratios[f"{tr}/{key}/{cond}"] = {"p50_vs_gloo": r50, "p99_vs_gloo": r99,
                                                    "burst_gloo_over_pydblp": rb, "p50_vs_floor": rf}
                    if cond == "burst":
                        ratios[f"{tr}/{key}/{cond}"]["burst_ceiling"] = median_of(
                            [burst_ceiling(run, tr, key, args.workers, args.tol, args.burst_ratio, rate_bps,
                                           args.mode)
                             for run in runs])
                    if len(runs) > 1:
                        ratios[f"{tr}/{key}/{cond}"]["per_repeat"] = [
                            dict(zip(("p50_vs_gloo", "p99_vs_gloo", "burst_gloo_over_pydblp", "p50_vs_floor"), x))
                            for x in rr]
                c50 = "-" if r50 is None else f"{r50:.2f}"
                c99 = "-" if r99 is None else f"{r99:.2f}"
                cb = "-" if rb is None else f"{rb:.2f}x"
                cr = "-" if "retx" not in s else f"{s['retx']:.0f}"
                print(f"{tr:<9} {key:>4} {cond:<6} {fmt_ms(s['p50']):>8} {fmt_ms(s['p99']):>8} "
                      f"{fmt_ms(s.get('burst_med')):>9} {c50:>8} {c99:>8} {cb:>12} {s['gbps']:5.2f} "
                      f"{cr:>7} {s['exact']:6.3f}")
        print()

    targets = {}
    for tr in [t for t in transports if t not in ("gloo", "floor")]:
        for key in [f"{m:g}" for m in sizes]:
            for cond, field, name, ok in (("clean", "p50_vs_gloo", "clean p50 <= 1.5x gloo", lambda v: v <= 1.5),
                                          ("burst", "burst_gloo_over_pydblp", "burst rounds >= 6x better than gloo",
                                           lambda v: v >= 6.0)):
                r = ratios.get(f"{tr}/{key}/{cond}", {})
                if r.get(field) is not None:
                    each = [x[field] for x in r.get("per_repeat", []) if x[field] is not None]
                    failed = len(r.get("per_repeat", [])) - len(each)  # (a failed block has no ratio)
                    targets[f"{tr} {key} MiB {name}"] = (r[field], ok(r[field]), each, sum(map(ok, each)),
                                                         r.get("burst_ceiling") if cond == "burst" else None, failed)
    if targets:
        print("targets (issue 6" + ("" if args.repeats == 1 else f"; the median of {args.repeats} repeats' ratios, "
                                    "each within its repeat, min-max and how many met")
              + ("" if args.workers == 4 else f"; stated for 4 workers, this run has {args.workers}") + "):")
        for k, (v, ok, each, n_ok, ceil, failed) in targets.items():
            spread = f"  ({min(each):.2f}-{max(each):.2f}, met in {n_ok} of {len(each)})" if len(each) > 1 else ""
            spread += f"; {failed} repeat(s) FAILED, left out of the median" if failed else ""
            reach = "" if ceil is None else f"; any transport: <= {ceil:.2f}"
            print(f"  {k:<48} {v:6.2f}  {'met' if ok else 'MISSED'}{spread}{reach}")
        if any(t[4] is not None for t in targets.values()):
            print(f"  ('any transport': Gloo's burst median over the shortest burst round these links allow: "
                  f"{1 - args.tol:.0%} of a rank's data through its {rate_bps / 1e9:g} Gbit/s limit, with "
                  f"{args.burst_ratio:.0%} of what crosses it lost while the burst lasts; a rank's data: "
                  f"2 (W-1)/W of the tensor, or what a broadcast all-gather or --mode ps leaves on the busiest link)")
    floor = {key: res.get("floor", {}).get(key, {}).get("clean", {}) for key in [f"{m:g}" for m in sizes]}
    if any("p50" in f for f in floor.values()):
        print("floor (plain UDP sockets: pydblp's chunks and schedule, GSO/GRO, no loss handling), clean p50:")
        for key, f in floor.items():
            if "p50" not in f:
                continue
            g = res.get("gloo", {}).get(key, {}).get("clean", {})  # (medians over repeats)
            over = ", ".join(f"{tr} {ratios[f'{tr}/{key}/clean']['p50_vs_floor']:.2f}x" for tr in transports
                             if (ratios.get(f"{tr}/{key}/clean") or {}).get("p50_vs_floor"))
            print(f"  {key:>4} MiB: floor {fmt_ms(f['p50'])} ms"
                  + (f" = {f['p50'] / g['p50']:.2f}x gloo" if "p50" in g else "")
                  + (f"; pydblp / floor: {over}" if over else ""))
    print("p50/p99 over the measured rounds of each block; 'burst med': median over the rounds each burst "
          "overlapped most; 'burst gloo/x': Gloo's burst med / this transport's; Gb/s: a rank's "
          "allreduce data (2 (W-1)/W x tensor: (W-1)/W out, as much back) per round time; 'exact': share of the last "
          "(tail) round's result equal to the exact mean")
    wall = time.monotonic() - t_begin
    print(f"total {wall:.0f} s" + (f"; {len(failures)} failure(s)" if failures else ""))
    if args.json:
        out = {"world": args.workers, "sizes_mib": sizes, "conditions": conds, "transports": transports,
               "options": vars(args), "ncpu": os.cpu_count(), "kernel": os.uname().release, "python": PYTHON,
               "results": res, "ratios": ratios,
               "targets": {k: {"value": v, "met": ok, "per_repeat": each, **({"ceiling": c} if c else {})}
                           for k, (v, ok, each, _, c, _failed) in targets.items()},
               **({"runs": runs} if len(runs) > 1 else {}),
               "failures": failures, "wall_s": wall}
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    with stop_unwinds():  # (Ctrl-C and SIGTERM unwind; a second one cannot cut the clean-up short)
        sys.exit(main())
