#!/usr/bin/env python3
"""Transport benchmark: AF_XDP vs UDP receive and transmit between two namespaces.

One run, one veth pair (``va`` in namespace A, ``vb`` in B, MTU 1500, native
XDP), 1400-byte payloads.  A sender process in A, pinned to one CPU, offers
as much as it can with the AF_XDP transport; the receiver in B, pinned to
the other CPU, is one of:

  (a) ``xdp_drop``  an XDP program that counts and drops: what the sender offers
  (b) ``xsk_rx``    the host program + :class:`XskTransport` receiving into numpy
  (c) ``udp_rx``    the host program passing a 'udp' job + :class:`UdpTransport`

  (b') ``xsk_rx_qN`` (``--queues``, e.g. 1,2,4: each N > 1) the host program + :class:`XskQueues`,
                one AF_XDP socket on each of N receive queues, offered by N senders, one AF_XDP
                socket each on transmit queue 0..N-1 (a veth delivers on the receive queue of
                the sender's transmit queue): what every queue of a multi-queue NIC costs

and transmit rate for the two transports into an XDP_DROP receiver:

  ``xsk_tx`` / ``udp_tx``  packets per second the sender pushes out

NAPI placement (``--napi``): by default the receiving veth's NAPI runs in a
kthread pinned to the receiver's CPU (``threaded``), so the receive side's
kernel work (XDP, the AF_XDP copy, the UDP stack) lands on the receiver's
CPU, as a NIC's interrupt work does on the receiving host, and the sender's
CPU only transmits: every configuration is offered the same load.  The
kthread runs SCHED_FIFO (``--napi-prio fifo``, the default): like a NIC's
softirq it preempts the receiving application rather than sharing the CPU
with it by fairness (``--napi-prio other``).  With
``--napi inline`` (veth's own default) that work runs in the sender's
softirq on the sender's CPU instead, so a costlier receive path lowers the
offered rate of its own run.  The table prints each run's offered rate and
the share delivered next to the received rate.  Receivers sleep in poll(2)
under threaded NAPI (``--spin 0``: a spinning receiver would take the CPU
its NAPI thread needs) and spin 200 us, the transports' default, inline.

The configurations are interleaved within each repeat (a, b, c, tx...) so
background load hits them alike; the figures are medians over repeats and
the ratios b/a, b/c and xsk_tx/udp_tx are taken between medians of the
same run (see bench/README.md).  Needs root.  Bounded: about
``repeats * 5 * (duration + 0.5)`` seconds plus ~5 s of compiling.

    .venv/bin/python bench/transport.py [--duration 1.5] [--repeats 5] [--queues 1,2,4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from pydblp import bpf, net, wire  # noqa: E402
from pydblp.cliutil import stop_unwinds  # noqa: E402
from pydblp.transport import Batch  # noqa: E402
from pydblp.transport.udp import UdpTransport  # noqa: E402
from pydblp.transport.xsk import XskTransport  # noqa: E402
from pydblp.transport.xsk_queues import XskQueues  # noqa: E402

A4, B4 = "198.18.9.1", "198.18.9.2"
MACS = ("02:00:5e:13:00:01", "02:00:5e:13:00:02")
JOB_X, JOB_U = 21, 22
DROP_PROG = r"""
BPF_PERCPU_ARRAY(cnt, u64, 2);
int xdp_count_drop(struct xdp_md *ctx) {
    int k0 = 0, k1 = 1;
    u64 *p = cnt.lookup(&k0), *b = cnt.lookup(&k1);
    if (p) *p += 1;
    if (b) *b += ctx->data_end - ctx->data;
    return XDP_DROP;
}
"""


VA, VB = "va", "vb"  # setup() makes them unique (the NAPI thread is found by name)


def setup(tag: str, queues: int = 1):
    global VA, VB
    VA, VB = f"dbta{tag}", f"dbtb{tag}"
    a, b = f"dblpbench{tag}a", f"dblpbench{tag}b"
    for ns in (a, b):
        net.netns_del(ns)
        net.netns_add(ns)
    q = {"num_tx_queues": queues, "num_rx_queues": queues}
    with net.ipr(a) as ip:
        ip.link("add", ifname=VA, kind="veth", **q, peer={"ifname": VB, "net_ns_fd": b, **q})
    for ns, dev, i, addr, peer in ((a, VA, 0, A4, B4), (b, VB, 1, B4, A4)):
        with net.ipr(ns) as ip:
            idx = ip.link_lookup(ifname=dev)[0]
            ip.link("set", index=idx, address=MACS[i], mtu=1500)
            ip.addr("add", index=idx, address=addr, prefixlen=24)
            ip.link("set", index=idx, state="up")
            ip.neigh("add", dst=peer, lladdr=MACS[1 - i], ifindex=idx, state=0x80)
    return a, b


def batch(n: int, payload: int, job: int, peer: int) -> Batch:
    h = wire.empty_batch(n)
    h["kind"], h["job"], h["src"], h["dst"] = wire.Kind.DATA, job, 0, 1
    h["nchunks"] = 1 << 20
    h["chunk"] = np.arange(n)
    pay = np.random.default_rng(0).integers(0, 256, (n, payload), dtype=np.uint8)
    return Batch.fill(h, pay, None, peer)


def sender(kind: str, ns: str, job: int, duration: float, payload: int, nbatch: int, cpu: int, go_r: int, res_w: int,
           queue: int = 0):
    """Child process: send as fast as possible for ``duration``; report (sent, elapsed)."""
    code = 1
    try:
        os.sched_setaffinity(0, {cpu})
        if kind == "xsk":
            t = XskTransport(VA, netns=ns, queue=queue, rx_frames=64, tx_frames=4096)
        else:
            t = UdpTransport(VA, netns=ns, port=0)
        with t:
            b = batch(nbatch, payload, job, t.add_peer(B4))
            os.read(go_r, 1)
            sent = 0
            t0 = time.perf_counter()
            end = t0 + duration
            while time.perf_counter() < end:
                sent += t.send(b, timeout=0.05)
            el = time.perf_counter() - t0
            if kind == "xsk":
                t.flush(0.5)
            os.write(res_w, struct.pack("=Qd", sent, el))
        code = 0
    except BaseException as e:  # never return into the parent's code
        os.write(2, f"sender: {e!r}\n".encode())
    finally:
        os._exit(code)


def run_one(kind_tx, ns_a, job, args, recv_fn, senders: int = 1):
    """Fork ``senders`` senders (on transmit queues 0..senders-1), run ``recv_fn(done)`` while they
    send; return (sent, elapsed, received): their sum, the longest, what the receiver took."""
    go_r, go_w = os.pipe()
    res_r, res_w = os.pipe()
    pids = []
    for q in range(senders):
        pid = os.fork()
        if pid == 0:
            sender(kind_tx, ns_a, job, args.duration, args.payload, args.batch, args.cpus[0], go_r, res_w, q)
        pids.append(pid)
    os.close(go_r)
    os.close(res_w)
    time.sleep(0.1 * senders)  # let the children open their sockets
    os.write(go_w, b"g" * senders)
    done = {"res": []}

    def finished() -> bool:
        while len(done["res"]) < senders and select.select([res_r], [], [], 0)[0]:
            data = os.read(res_r, 16)  # (a 16-byte write to a pipe is atomic)
            done["res"].append(struct.unpack("=Qd", data) if len(data) == 16 else (0, args.duration))
            if len(data) != 16:
                break
        return len(done["res"]) == senders

    statuses = []
    try:
        received = recv_fn(finished)
        deadline = time.monotonic() + args.duration + 5
        while not finished() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        for pid in pids:
            statuses.append(os.waitpid(pid, 0)[1])
        os.close(go_w)
        os.close(res_r)
    if len(done["res"]) < senders or any(os.waitstatus_to_exitcode(st) != 0 for st in statuses):
        raise RuntimeError(f"sender ({kind_tx}) failed")
    return sum(r[0] for r in done["res"]), max(r[1] for r in done["res"]), received


def drain_loop(t, into, finished):
    got = 0
    idle_since = None
    while True:
        n = len(t.recv(into, timeout=0.02))
        got += n
        if finished():
            if n:
                idle_since = None
            elif idle_since is None:
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since > 0.05:
                return got


def threaded_napi(ns: str, ifname: str, cpu: int, fifo: bool = True) -> list[int]:
    """Run the receiving veth's NAPI in a kthread pinned to the receiver's CPU.

    On veth the receive side's kernel work (XDP, the AF_XDP copy, the UDP
    stack) otherwise runs in the *sender's* softirq, on the sender's CPU;
    threaded NAPI on the receiver's CPU makes the pair behave like two hosts.
    ``fifo``: the kthread runs SCHED_FIFO (priority 1), so, like a NIC's
    softirq, it preempts the receiving application instead of sharing the CPU
    with it by CFS's fairness (which wakes the application for every few
    packets and cuts the NAPI thread's batches short).
    """
    import subprocess

    subprocess.run(["ip", "netns", "exec", ns, "sh", "-c", f"echo 1 > /sys/class/net/{ifname}/threaded"], check=True)
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                comm = Path(f"/proc/{d}/comm").read_text().strip()
            except OSError:
                continue
            if comm.startswith(f"napi/{ifname}-"):
                os.sched_setaffinity(int(d), {cpu})
                if fifo:
                    os.sched_setscheduler(int(d), os.SCHED_FIFO, os.sched_param(1))
                pids.append(int(d))
    return pids


def counter(drop_map) -> int:
    return sum(struct.unpack("=Q", v)[0] for v in drop_map.lookup(struct.pack("=I", 0)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=1.5, help="seconds each sender runs (default 1.5)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--payload", type=int, default=1400)
    ap.add_argument("--batch", type=int, default=1024, help="packets per send/recv call")
    ap.add_argument("--cpus", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1],
                    help="sender CPU,receiver CPU (default 0,1)")
    ap.add_argument("--napi", choices=("inline", "threaded"), default="threaded",
                    help="receiver veth NAPI: a kthread pinned to the receiver CPU (default: receive work on the "
                         "receiver's CPU, as on a NIC) or inline in the sender's softirq (veth's default: the "
                         "receive side's kernel work is charged to the sender's CPU)")
    ap.add_argument("--napi-prio", choices=("fifo", "other"), default="fifo",
                    help="threaded NAPI kthread's scheduling: SCHED_FIFO 1, preempting the receiver as a NIC's "
                         "softirq does (default), or SCHED_OTHER, sharing the CPU with it fairly")
    ap.add_argument("--spin", type=float, default=None,
                    help="receivers' busy-poll seconds before sleeping in poll(2) (default: 0 with threaded NAPI, "
                         "which needs the receiver CPU; 200e-6, the transports' own, inline)")
    ap.add_argument("--queues", default="1,2,4",
                    help="receive queue counts for xsk_rx (default 1,2,4; 1: the single-queue XskTransport)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    try:
        queues = sorted({int(q) for q in args.queues.split(",")})
    except ValueError:
        queues = []
    if not queues or queues[0] < 1 or queues[-1] > 16:
        ap.error(f"--queues {args.queues!r}: counts 1..16, comma-separated, e.g. 1,2,4")
    ncpu = os.cpu_count() or 1
    for bad, what in ((not args.duration > 0, f"--duration {args.duration:g}: give seconds > 0"),
                      (args.repeats < 1, f"--repeats {args.repeats}: give 1 or more"),
                      (not 1 <= args.payload <= 3000, f"--payload {args.payload}: give 1..3000 bytes"),
                      (args.batch < 1, f"--batch {args.batch}: give 1 or more"),
                      (len(args.cpus) != 2 or len(set(args.cpus)) != 2 or not all(0 <= c < ncpu for c in args.cpus),
                       f"--cpus {','.join(map(str, args.cpus))}: two different CPUs in 0..{ncpu - 1}, e.g. 0,1"),
                      (args.spin is not None and args.spin < 0, f"--spin {args.spin}: give seconds >= 0")):
        if bad:
            ap.error(what)
    spin = args.spin if args.spin is not None else (0.0 if args.napi == "threaded" else 200e-6)
    if os.geteuid() != 0:
        print("bench/transport.py needs root (namespaces, XDP, AF_XDP)", file=sys.stderr)
        return 2
    from bcc import BPF

    from pydblp.host import HostProgram

    ns_a, ns_b = setup(str(os.getpid() % 100000), queues[-1])
    host = drop = None
    many = [q for q in queues if q > 1]
    results: dict[str, list] = {k: [] for k in ("xdp_drop", "xsk_rx", *(f"xsk_rx_q{q}" for q in many),
                                                "udp_rx", "xsk_tx", "udp_tx")}
    try:
        drop = BPF(text=DROP_PROG)
        drop_fd = drop.load_func("xdp_count_drop", BPF.XDP).fd
        drop_map = bpf.Map(drop["cnt"].map_fd, owned=False)
        # kept (netlink, not a BPF link): the runs below swap XDP programs on VB by netlink, which a
        # link refuses; deleting the namespaces at the end takes the attachment with them
        host = HostProgram(VB, netns=ns_b, mode="native", keep=True)
        host.register_job(JOB_X, 2, 1, "xsk")
        host.register_job(JOB_U, 2, 1, "udp")
        os.sched_setaffinity(0, {args.cpus[1]})
        if args.napi == "threaded":
            net.xdp_attach(VB, drop_fd, net.Mode.NATIVE, ns_b)  # veth has NAPI once XDP is on
            if not threaded_napi(ns_b, VB, args.cpus[1], fifo=args.napi_prio == "fifo"):
                print(f"bench/transport.py: no NAPI thread appeared for {VB} (threaded NAPI unsupported?); "
                      "rerun with --napi inline", file=sys.stderr)
                return 2
        into = Batch.empty(args.batch * 4, args.payload)
        dblp_bytes = args.payload + wire.HEADER_LEN

        for rep in range(args.repeats):
            # (a) XDP_DROP: what the sender offers
            net.xdp_attach(VB, drop_fd, net.Mode.NATIVE, ns_b)
            c0 = counter(drop_map)
            sent, el, _ = run_one("xsk", ns_a, JOB_X, args, lambda fin: None)
            time.sleep(0.05)
            results["xdp_drop"].append((counter(drop_map) - c0, sent, el))
            # (b) AF_XDP receive into numpy
            net.xdp_attach(VB, host.prog_fd, net.Mode.NATIVE, ns_b)
            with XskTransport(VB, netns=ns_b, host=host, spin=spin) as t:
                sent, el, got = run_one("xsk", ns_a, JOB_X, args, lambda fin: drain_loop(t, into, fin))
                results["xsk_rx"].append((got, sent, el))
            # (b') every one of q receive queues, q senders
            for q in many:
                with XskQueues(VB, netns=ns_b, queues=list(range(q)), host=host, spin=spin) as t:
                    sent, el, got = run_one("xsk", ns_a, JOB_X, args, lambda fin: drain_loop(t, into, fin), q)
                    results[f"xsk_rx_q{q}"].append((got, sent, el))
            # (c) UDP transport (host program passes the 'udp' job up)
            with UdpTransport(VB, netns=ns_b, spin=spin) as t:
                sent, el, got = run_one("xsk", ns_a, JOB_U, args, lambda fin: drain_loop(t, into, fin))
                results["udp_rx"].append((got, sent, el))
            # transmit: each transport into an XDP_DROP receiver
            net.xdp_attach(VB, drop_fd, net.Mode.NATIVE, ns_b)
            for kind in ("xsk", "udp"):
                c0 = counter(drop_map)
                sent, el, _ = run_one(kind, ns_a, JOB_X, args, lambda fin: None)
                time.sleep(0.05)
                results[f"{kind}_tx"].append((counter(drop_map) - c0, sent, el))
            print(f"repeat {rep + 1}/{args.repeats}: " + ", ".join(
                f"{k} {v[-1][0] / v[-1][2] / 1e6:.3f}" for k, v in results.items()) + " Mpps", flush=True)
    finally:  # (each step whatever the one before did: the namespaces always go)
        for step in (host.close if host is not None else None, drop.cleanup if drop is not None else None,
                     lambda: net.netns_del(ns_a), lambda: net.netns_del(ns_b)):
            try:
                if step is not None:
                    step()
            except Exception as e:
                print(f"bench/transport.py: cleaning up: {e}", file=sys.stderr)

    def med(key, what):
        rows = results[key]
        vals = [(got if what == "rx" else sent) / el for got, sent, el in rows]
        return statistics.median(vals), min(vals), max(vals)

    out = {"napi": args.napi, "napi_prio": args.napi_prio, "spin_s": spin, "payload": args.payload, "duration_s": args.duration, "repeats": args.repeats, "batch": args.batch,
           "cpus": args.cpus, "ncpu": os.cpu_count(), "kernel": os.uname().release, "figures": {}}
    napi = f"{args.napi} ({args.napi_prio})" if args.napi == "threaded" else args.napi
    print(f"\n{args.payload}-byte payloads, {args.duration:.1f} s x {args.repeats} repeats, NAPI {napi}, "
          f"receiver spin {spin * 1e6:.0f} us, "
          f"sender CPU {args.cpus[0]}, receiver CPU {args.cpus[1]}; medians (min-max):")
    print(f"{'config':<10} {'Mpps':>8} {'Gbit/s':>8}  {'range Mpps':>15}  {'delivered':>9}  {'offered Mpps':>12}")
    for key in results:
        m, lo, hi = med(key, "rx" if key != "udp_tx" and key != "xsk_tx" else "tx")
        offered = statistics.median([s / el for _, s, el in results[key]])
        deliv = statistics.median([g / s if s else 0 for g, s, _ in results[key]])
        out["figures"][key] = {"mpps": m / 1e6, "min": lo / 1e6, "max": hi / 1e6,
                               "gbps": m * dblp_bytes * 8 / 1e9, "offered_mpps": offered / 1e6,
                               "delivered": deliv, "runs": results[key]}
        print(f"{key:<10} {m / 1e6:8.3f} {m * dblp_bytes * 8 / 1e9:8.2f}  {lo / 1e6:6.3f}-{hi / 1e6:<8.3f}"
              f"  {deliv:9.3f}  {offered / 1e6:12.3f}")
    f = out["figures"]
    ratios = {"xsk_rx/xdp_drop (b/a)": f["xsk_rx"]["mpps"] / f["xdp_drop"]["mpps"],
              "xsk_rx/udp_rx (b/c)": f["xsk_rx"]["mpps"] / f["udp_rx"]["mpps"],
              "xsk_tx/udp_tx": f["xsk_tx"]["mpps"] / f["udp_tx"]["mpps"]}
    for q in many:
        ratios[f"xsk_rx_q{q}/xsk_rx"] = f[f"xsk_rx_q{q}"]["mpps"] / f["xsk_rx"]["mpps"]
    out["ratios"] = ratios
    out["queues"] = queues
    print("\nratios (medians of this run):")
    for k, v in ratios.items():
        print(f"  {k:<24} {v:.2f}")
    print("Gbit/s counts DBLP bytes (32-byte header + payload); tx rows: packets the sender pushed per second,"
          " 'delivered' = share the XDP_DROP receiver counted.")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    with stop_unwinds():  # (Ctrl-C and SIGTERM unwind; a second one cannot cut the clean-up short)
        sys.exit(main())
