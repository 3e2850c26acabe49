#!/usr/bin/env python3
"""Software cost of an allreduce round: pydblp over UDP against Gloo, on one loopback.

``--world`` ranks (processes, default 4) in one private namespace talk over
its loopback (198.18.0.1/32 on ``lo``): no links, no TBF, no fabric XDP, no
loss.  What is left is each stack's own work per round, user and system
CPU, which on this machine kind (2 shared vCPUs for 4 ranks) is what bounds
`allreduce.py`'s small rounds.  pydblp: ``Collective`` (``tar``, ``unbiased``,
``static:0.05``) over ``UdpTransport("lo")`` (GSO and GRO: loopback keeps a
GSO message whole, so a receive takes it merged), the result written into the
input (``allreduce(x, out=x)``); Gloo: ``all_reduce`` in place, then divided by
the world size, as in `allreduce.py`.

Each repeat runs every size for both, the order alternating from repeat to
repeat (pydblp first in even repeats, Gloo first in odd ones), ``--rounds``
measured rounds after 10 warm-up ones.  CPU is each rank's process CPU
(``getrusage``: every thread) over the measured rounds, less the benchmark's
own copy of the input before each round (both stacks reduce in place; the
copy is timed with the thread's CPU clock), divided by the rounds and averaged
over ranks; wall is the slowest rank's mean ``allreduce`` call (each rank
times its calls; their sum over the rounds).  Figures are
medians over repeats (min-max), and the headline is pydblp's CPU per rank
and round over Gloo's.  Ranks are not pinned (4 on 2 CPUs: they share, as
in the testbed).  The last round's result is checked against the exact mean:
pydblp ends a round at its bound (95 % of each message), so a chunk still on its
way then (its sender preempted on the shared CPUs) or dropped by a receive buffer
may be missing from it, which the round's record shows (reported, not an error);
inexact with every chunk in is an error (exit status 1).  With ``--relax ef`` a round
also carries what earlier rounds left out, so only a block in which no rank fed anything
back is held to the exact mean.  Needs root (a
namespace).  Bounded: about ``repeats * rounds * (0.03 + gap + 0.017 * MiB)``
seconds per size plus ~10 s of start-up (~65 s with the defaults); a block
that takes more than ``60 + rounds * (0.05 + gap + 0.5 * MiB)`` seconds ends
the run with an error.

``--transport xsk`` or ``xsk-ktx`` (``--net testbed``, implied): the ranks run in the
workers of a testbed (``pydblp.testbed``: a namespace per worker, veths to a bridge, no
link limit, no fabric program, ``--queues`` receive queues per veth) and pydblp opens its
data plane there as a job does (``open_dataplane``: the host program, an AF_XDP socket per
queue); Gloo runs over the same veths.  ``--transport udp --net testbed`` measures the UDP
transport there too.  On a testbed each implementation's ranks run alone: pydblp's are
started for its blocks of a repeat and stopped before Gloo's start, since its host XDP
program on every veth would otherwise run on Gloo's packets too (and veth copies each frame
for an XDP program), charging Gloo pydblp's cost.  A veth costs the sender the receiver's softirq work (veth delivers
in the sender's context), so these figures are CPU per rank and round of the whole path.

``--gap MS``: each rank sleeps MS ms after each measured round, as a training
step's compute on a GPU leaves the CPU to the communication stack.  CPU per
round then includes what each stack spends while its caller is away (threads
that poll or spin), and wall is the mean duration of the ``allreduce`` calls
alone (with the gaps, rounds no longer run back to back: a round also waits
for whatever the stack does between rounds).

    .venv/bin/python bench/cpu.py [--sizes 1,8] [--rounds 100] [--repeats 3] [--world 4] [--gap 0]
                                  [--transport udp|xsk|xsk-ktx] [--net lo|testbed] [--queues 1]
                                  [--relax none|ef]
                                  [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pydblp import net  # noqa: E402
from pydblp.cliutil import Parser, hold_stops, stop_unwinds  # noqa: E402

ADDR = "198.18.0.1"
PORT0 = 47900  # rank r listens on PORT0 + r
WARMUP = 10


def rank_main(a) -> int:
    """One rank: read '<bytes> <rounds>' lines, answer each with one JSON line of figures."""
    import numpy as np

    if a.impl == "gloo":
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group("gloo", store=dist.FileStore(a.store, a.world), rank=a.rank,
                                world_size=a.world, timeout=datetime.timedelta(seconds=60))

        def round_(x):
            t = torch.from_numpy(x)
            dist.all_reduce(t)
            t.div_(a.world)
            return x

        def drops():
            return 0
    else:
        from pydblp.collective import Collective, Config
        from pydblp.transport.udp import UdpTransport

        relax = dict(estimator="zero", error_feedback=True) if a.relax == "ef" else {}
        cfg = Config(job=9, phase="static:0.05", peer_timeout=30.0, cc=a.cc, **relax)
        if a.net == "lo":
            t = UdpTransport("lo", port=PORT0 + a.rank, spin=0.0)
            peers = [(ADDR, PORT0 + r) for r in range(a.world)]
            dp = None
        else:
            from pydblp.dataplane import open_dataplane
            from pydblp.testbed import worker_addr

            dp = open_dataplane(a.transport, "eth0", port=PORT0, job=9, rank=a.rank, world=a.world)
            t = dp.transport
            peers = [(worker_addr(r), PORT0) for r in range(a.world)]
        col = Collective(t, a.rank, a.world, peers, cfg)

        def round_(x):  # in place, as Gloo's
            return col.allreduce(x, out=x)

        def drops():
            return t.stats().get("rx_dropped", 0)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        size, rounds, gap_us = (int(v) for v in line.split())
        base = np.random.default_rng(size).standard_normal(size // 4).astype(np.float32)
        x = base + np.float32(a.rank + 1)
        y = np.empty_like(x)
        for _ in range(WARMUP):
            np.copyto(y, x)
            round_(y)
        d0, c0, busy, copying = drops(), resource.getrusage(resource.RUSAGE_SELF), 0.0, 0.0
        fed0 = 0 if a.impl == "gloo" else col.protocol.counters["fed_back"]
        for _ in range(rounds):
            t0 = time.thread_time()
            np.copyto(y, x)  # both reduce in place: a fresh input, not counted as either stack's
            copying += time.thread_time() - t0
            t0 = time.monotonic()
            out = round_(y)
            busy += time.monotonic() - t0
            if gap_us:
                time.sleep(gap_us / 1e6)  # the caller away (computing on a GPU, say): the CPU is free
        c1 = resource.getrusage(resource.RUSAGE_SELF)
        want = base + np.float32((a.world + 1) / 2)
        # (pydblp at tol 0.05 ends a round at its bound, without chunks still on their way or dropped:
        # then inexact by design; the last round's record says whether every chunk was in.  With
        # --relax ef a round also carries what the one before left out: exact only where no rank
        # fed anything back over the block)
        full = a.impl == "gloo" or (col.records[-1].min_delivered == 1.0
                                    and col.protocol.counters["fed_back"] == fed0)
        print(json.dumps({"cpu": (c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime - copying) / rounds,
                          "sys": (c1.ru_stime - c0.ru_stime) / rounds, "wall": busy / rounds,
                          "copy": copying / rounds,
                          "exact": bool(np.allclose(out, want, rtol=1e-5, atol=1e-5)), "full": full,
                          "drops": drops() - d0}), flush=True)
    if a.impl == "gloo":
        dist.destroy_process_group()
    else:
        time.sleep(0.5)  # late probes of the last round get their answer
        col.close()
        if dp is not None:
            dp.close()
    return 0


class Ranks:
    """``world`` rank processes of one implementation inside the namespace."""

    def __init__(self, impl: str, where, world: int, store: Path, a):
        """``where(rank)``: the argv prefix that runs a rank in its namespace."""
        argv = [sys.executable, str(Path(__file__).resolve()), "--rank-of", impl, "--world", str(world),
                "--store", str(store), "--transport", a.transport, "--net", a.net, "--cc", a.cc,
                "--relax", a.relax]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo" if a.net == "lo" else "eth0", "OMP_NUM_THREADS": "1"}
        self.impl = impl
        self.procs = [subprocess.Popen([*where(r), *argv, "--rank", str(r)], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, text=True, env=env) for r in range(world)]
        try:
            self.replies(60)
        except BaseException:  # a rank that did not come up: end the others too
            self.stop()
            raise

    def replies(self, timeout: float) -> list[dict]:
        out = []
        deadline = time.monotonic() + timeout
        for r, p in enumerate(self.procs):
            if not select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise RuntimeError(f"{self.impl} rank {r}: no answer in {timeout:.0f} s")
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.impl} rank {r} exited with status {p.wait()}")
            out.append(json.loads(line))
        return out

    def block(self, size: int, rounds: int, gap: float) -> dict:
        for p in self.procs:
            p.stdin.write(f"{size} {rounds} {round(gap * 1e6)}\n")
            p.stdin.flush()
        got = self.replies(60 + rounds * (0.05 + gap + 0.5 * size / (1 << 20)))
        return {"cpu": statistics.mean(g["cpu"] for g in got), "sys": statistics.mean(g["sys"] for g in got),
                "copy": statistics.mean(g["copy"] for g in got),
                "wall": max(g["wall"] for g in got), "exact": all(g["exact"] for g in got),
                "full": all(g["full"] for g in got), "drops": sum(g["drops"] for g in got)}

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.stdin.close()
                except OSError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()  # the rank itself (nsenter execs it), by pid
                p.wait(timeout=5)


def main() -> int:
    ap = Parser(description=__doc__.split("\n\n")[0],  # (a mistake: one line, exit status 2)
                formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,8", help="tensor sizes in MiB, comma-separated (default 1,8)")
    ap.add_argument("--rounds", type=int, default=100, help="measured rounds per size and repeat (default 100)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--gap", type=float, default=0.0,
                    help="ms each rank sleeps between rounds (its caller computing elsewhere; default 0: "
                         "back to back); CPU then includes what each stack spends meanwhile")
    ap.add_argument("--cc", choices=["ecn", "off"], default="ecn",
                    help="pydblp's Config.cc (default ecn: ECN-capable packets, marks counted and echoed)")
    ap.add_argument("--relax", choices=["none", "ef"], default="none",
                    help="pydblp's relaxed rounds: none (default) or ef (Config.error_feedback, the 'zero' "
                         "estimator): what error feedback costs a round that loses nothing")
    ap.add_argument("--transport", choices=["udp", "xsk", "xsk-ktx"], default="udp",
                    help="pydblp's data plane (default udp; the AF_XDP kinds run on a testbed)")
    ap.add_argument("--net", choices=["lo", "testbed"],
                    help="lo: one namespace's loopback (default for udp); testbed: a worker namespace per rank, "
                         "veths, no link limit (default for xsk, xsk-ktx)")
    ap.add_argument("--queues", type=int, default=1, help="receive queues per testbed veth (default 1)")
    ap.add_argument("--json", help="write figures and every repeat here")
    ap.add_argument("--rank-of", choices=["pydblp", "gloo"], dest="impl", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--store", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.net is None:
        a.net = "lo" if a.transport == "udp" else "testbed"
    if a.impl:
        return rank_main(a)
    if a.transport != "udp" and a.net == "lo":
        ap.error(f"--transport {a.transport} needs an interface with XDP: use --net testbed")
    if not 1 <= a.queues <= 16 or (a.queues > 1 and a.net == "lo"):
        ap.error("--queues: 1..16, with --net testbed")
    try:
        sizes = [float(s) for s in a.sizes.split(",")]
    except ValueError:
        ap.error(f"--sizes {a.sizes!r}: use MiB, comma-separated, e.g. 1,8")
    if (not all(math.isfinite(s) and int(s * (1 << 20)) >= 4 for s in sizes) or a.rounds < 1 or a.repeats < 1
            or not 2 <= a.world <= 8 or not 0 <= a.gap < math.inf):
        ap.error("sizes and rounds must be positive, repeats >= 1, world 2..8, gap >= 0")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if a.world * 3 * max(sizes) * (1 << 20) > ram:  # (each rank's input, its copy and the expected mean)
        ap.error(f"--sizes {a.sizes}: {a.world} ranks of {max(sizes):g} MiB tensors outgrow this machine's "
                 f"{ram / 2**30:.0f} GiB of memory; use smaller sizes, e.g. --sizes 1,8")
    if os.geteuid() != 0:
        print("bench/cpu.py: needs root (a network namespace)", file=sys.stderr)
        return 2
    python = f"{sys.version.split()[0]} ({os.path.realpath(sys.executable)})"  # the ranks' interpreter too

    ns = f"dblpbench-cpu{os.getpid()}"
    tmp = Path(f"/tmp/{ns}")
    tmp.mkdir()
    tb = None
    sets = []
    runs: dict = {}
    try:
        if a.net == "lo":
            net.netns_add(ns)
            subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
            subprocess.run(["ip", "-n", ns, "addr", "add", f"{ADDR}/32", "dev", "lo"], check=True)

            def where(r):
                return ["nsenter", f"--net={net.NETNS_RUN_DIR}/{ns}", "--"]
            place = "one namespace's loopback, pydblp over udp"
        else:
            from pydblp.testbed import Testbed

            tb = Testbed(workers=a.world, name=f"cpu{os.getpid() % 100000}", rate=0, fabric=False,
                         queues=a.queues).up()

            def where(r):
                return tb.argv(tb.workers[r], [])
            place = f"testbed veths ({a.queues} queue{'s' if a.queues > 1 else ''}, no link limit), " \
                    f"pydblp over {a.transport}"
        from pydblp import native
        from pydblp.transport.udp import native_lib

        compiled = "on" if native_lib() is not None else f"off ({native.why('udp')})"
        impls = ("pydblp", "gloo")
        alone = a.net == "testbed"  # (there each implementation's ranks run without the other's)
        if not alone:
            sets.extend(Ranks(impl, where, a.world, tmp / f"store-{impl}", a) for impl in impls)
        print(f"bench/cpu.py: {a.world} ranks on {place}, {a.rounds} rounds x {a.repeats} "
              f"repeats" + (f", {a.gap:g} ms between rounds" if a.gap else ", back to back")
              + f", {os.cpu_count()} CPUs (ranks not pinned), Python {python}, compiled loops {compiled}",
              flush=True)
        def measure(s, rep, mib):
            r = s.block(int(mib * (1 << 20)) // 4 * 4, a.rounds, a.gap / 1e3)
            runs.setdefault(f"{s.impl}/{mib:g}", []).append(r)
            print(f"  repeat {rep + 1} {s.impl:<6} {mib:g} MiB: CPU/rank/round {r['cpu'] * 1e3:.2f} ms "
                  f"(sys {r['sys'] * 1e3:.2f}; input copy {r['copy'] * 1e3:.2f} not counted), wall/round "
                  f"{r['wall'] * 1e3:.2f} ms, exact {r['exact']}"
                  + ("" if r["full"] else f" (the last round ended at its bound before every chunk "
                                          f"was in; receive-buffer drops: {r['drops']})"),
                  flush=True)

        for rep in range(a.repeats):
            order = impls if rep % 2 == 0 else impls[::-1]  # (alternating: drift favours neither)
            if not alone:
                for mib in sizes:
                    for impl in order:
                        measure(next(s for s in sets if s.impl == impl), rep, mib)
                continue
            for impl in order:
                s = Ranks(impl, where, a.world, tmp / f"store-{impl}-{rep}", a)
                sets.append(s)
                try:
                    for mib in sizes:
                        measure(s, rep, mib)
                finally:
                    s.stop()
                    sets.remove(s)
    finally:
        hold_stops()  # (a run that ended by itself: no signal may cut this either)
        for s in sets:
            s.stop()
        if tb is not None:
            tb.down()
        elif net.netns_exists(ns):
            net.netns_del(ns)
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("cpu", "sys", "wall")} for k, v in runs.items()}
    print(f"\n{'MiB':>5} {'pydblp CPU':>10} {'(sys)':>6} {'gloo CPU':>8} {'(sys)':>6} {'CPU ratio':>9} "
          f"{'min-max':>11} {'wall ratio':>10}   (ms per rank and round, medians over {a.repeats})")
    ratios = {}
    for mib in sizes:
        p, g = med[f"pydblp/{mib:g}"], med[f"gloo/{mib:g}"]
        each = [rp["cpu"] / rg["cpu"] for rp, rg in zip(runs[f"pydblp/{mib:g}"], runs[f"gloo/{mib:g}"])]
        ratios[f"{mib:g}"] = {"cpu": p["cpu"] / g["cpu"], "wall": p["wall"] / g["wall"], "cpu_each": each}
        print(f"{mib:>5g} {p['cpu'] * 1e3:>10.2f} {p['sys'] * 1e3:>6.2f} {g['cpu'] * 1e3:>8.2f} {g['sys'] * 1e3:>6.2f} "
              f"{p['cpu'] / g['cpu']:>8.2f}x {min(each):>5.2f}-{max(each):<5.2f} {p['wall'] / g['wall']:>9.2f}x")
    # inexact though every chunk of the last round was in: wrong
    inexact = [k for k, v in runs.items() if not all(r["exact"] or not r["full"] for r in v)]
    if inexact:
        print(f"NOT EXACT: {', '.join(inexact)}")
    partial = [k for k, v in runs.items() if not all(r["full"] for r in v)]
    if partial:
        print(f"last round ended at its bound before every chunk was in (not an error): {', '.join(partial)}")
    if a.json:
        Path(a.json).write_text(json.dumps({"runs": runs, "medians": med, "ratios": ratios, "options": vars(a),
                                            "kernel": platform.release(), "cpus": os.cpu_count(),
                                            "python": python, "compiled": compiled}, indent=1))
    return 1 if inexact else 0


if __name__ == "__main__":
    with stop_unwinds():  # (a second Ctrl-C is ignored until the namespace, testbed and ranks are gone)
        sys.exit(main())
