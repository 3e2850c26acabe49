"""``dblp testbed ...`` and ``dblp fault ...`` (registered from pydblp/cli.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from pydblp import units
from pydblp.cliutil import UsageError, formatter, unit_rate

TESTBED_EPILOG = """\
examples:
  dblp testbed up --name tb1 --workers 4          switch + w0..w3, 1 Gbit/s NICs, fabric loaded
  dblp testbed up --name big --workers 8 --rate none --mtu 3000
  dblp testbed status                              every testbed, its ports and faults
  dblp testbed exec w1 -- iperf3 -s                run a command inside worker w1
  dblp testbed exec --name tb1 w0 -- ip addr       (--name needed when several are up)
  dblp testbed down --name tb1                     remove namespaces, links, XDP, pins
  dblp testbed down --all                          also cleans up after a killed creator

Workers have 198.18.0.(K+1)/15 on eth0 (w0 = 198.18.0.1); no route out.
"""

FAULT_EPILOG = """\
examples:
  dblp fault loss 0.01                              1 % random loss on every port
  dblp fault loss 0.05 --port w0 --testbed tb1      frames delivered to w0 only
  dblp fault ge --p 0.01 --r 0.25                   Gilbert-Elliott, mean burst 4 packets
  dblp fault burst --ratio 0.8 --duration 50ms      one 50 ms burst of 80 % loss, now
  dblp fault burst --ratio 0.9 --duration 100ms --in 2s --every 1s --count 5
  dblp fault queue --rate 1gbit --buffer 256k       virtual egress queue, priority early drop
  dblp fault queue --rate 100mbit --mark 32k        ECN too: CE-mark ECT frames past 32 KiB
  dblp fault queue --rate 1gbit --mark 32k --delay --port w0
                                                    a real buffer: frames wait, as at a switch
  dblp fault queue --rate 1gbit --mark 32k --mark-drop --delay --port w0
                                                    an AQM: past 32k ECT is marked, Not-ECT dropped
  dblp fault clear                                  remove every fault
  dblp fault stats                                  per port and cause: packets dropped/passed

A fault on port wK acts on frames the switch delivers to worker K (all ports
when --port is omitted).  Times are CLOCK_MONOTONIC seconds (--at).
"""


# ---- dblp testbed ------------------------------------------------------------

def add_testbed(sub) -> None:
    p = sub.add_parser("testbed", help="emulated cluster: worker namespaces behind an XDP switch",
                       formatter_class=formatter, epilog=TESTBED_EPILOG,
                       description="Bring up, inspect and remove emulated clusters (network "
                                   "namespaces, a Linux bridge, the fabric XDP program).")
    ts = p.add_subparsers(dest="action", metavar="ACTION")
    p.set_defaults(func=_no_fault_action)

    up = ts.add_parser("up", help="create a testbed", formatter_class=formatter, epilog=TESTBED_EPILOG)
    up.add_argument("--name", help="testbed name (default: tb + random hex)")
    up.add_argument("--workers", type=int, default=4, help="worker namespaces (default 4)")
    up.add_argument("--mtu", type=int, default=1500, help="MTU of every link (default 1500)")
    up.add_argument("--rate", default=None, help="TBF limit per worker NIC, e.g. 10gbit; 'none' for "
                                                 "no limit (default 1gbit)")
    up.add_argument("--mode", choices=["auto", "native", "skb"], default="auto",
                    help="fabric XDP mode (auto: native; skb above mtu 3506 on kernels without multi-buffer XDP)")
    up.add_argument("--no-fabric", action="store_true", help="no XDP fabric (no faults)")
    up.add_argument("--json", action="store_true", help="print the state as JSON")
    up.set_defaults(func=cmd_up)

    down = ts.add_parser("down", help="remove a testbed", formatter_class=formatter, epilog=TESTBED_EPILOG)
    g = down.add_mutually_exclusive_group()
    g.add_argument("--name", "--testbed", dest="name", help="testbed to remove (default: the only one)")
    g.add_argument("--all", action="store_true", help="every testbed, also those of crashed runs")
    down.set_defaults(func=cmd_down)

    st = ts.add_parser("status", help="list testbeds", formatter_class=formatter, epilog=TESTBED_EPILOG)
    st.add_argument("--json", action="store_true", help="machine-readable")
    st.set_defaults(func=cmd_status)

    ex = ts.add_parser("exec", help="run a command inside a worker", formatter_class=formatter,
                       epilog=TESTBED_EPILOG, usage="dblp testbed exec [--name N] WORKER -- CMD...")
    ex.add_argument("--name", "--testbed", dest="name", help="testbed (default: the only one)")
    ex.add_argument("worker", help="w0, w1, ... (or an index)")
    ex.add_argument("cmd", nargs=argparse.REMAINDER, help="command and arguments, after --")
    ex.set_defaults(func=cmd_exec)


def cmd_up(args) -> int:
    from pydblp.testbed import Testbed

    tb = Testbed(workers=args.workers, name=args.name, mtu=args.mtu, rate=unit_rate(args.rate),
                 fabric=not args.no_fabric, mode=args.mode)
    tb.up()  # (rolls back on any exception: dblp's main turns Ctrl-C and SIGTERM into one)
    tb.detach()
    if args.json:
        print(json.dumps(tb.state, indent=1))
    else:
        rate = units.rate_text(tb.rate_bps) if tb.rate_bps else "no limit"
        print(f"testbed {tb.name}: {tb.n} workers, mtu {tb.mtu}, NIC rate {rate}, "
              f"fabric prog {tb.prog_id or '-'}")
        for w in tb.workers:
            print(f"  {w:4} netns {tb.ns(w):24} {tb.addr(w):15} {tb.mac(w)}")
        print(f"remove with: dblp testbed down --name {tb.name}")
    return 0


def cmd_down(args) -> int:
    from pydblp import testbed

    if args.all:
        done = testbed.teardown_all()
        print(f"removed {len(done)} testbed(s){': ' + ', '.join(done) if done else ''}")
        return 0
    name = testbed.resolve(args.name)
    r = testbed.teardown(name)
    extra = f", killed {len(r['killed'])} process(es) left inside" if r["killed"] else ""
    print(f"removed testbed {name} ({len(r['namespaces'])} namespaces{extra})")
    return 0


def cmd_status(args) -> int:
    from pydblp import testbed

    entries = testbed.status()
    for e in entries:
        if e.get("status") == "up" and e.get("present") and e.get("fabric"):
            try:
                with testbed.Fabric(e["pin_dir"], e["ports"]) as f:
                    e["faults"] = {p: f.config(i).describe() for p, i in e["ports"].items()}
            except testbed.FabricError:
                e["faults"] = None
    if args.json:
        print(json.dumps(entries, indent=1))
        return 0
    if not entries:
        print("(no testbed)")
        return 0
    for e in entries:
        health = e.get("status", "?")
        if not e.get("present"):
            health = f"broken (namespaces missing: `dblp testbed down --name {e['name']}`)"
        elif health == "creating" and not e.get("creator_alive"):
            health = f"stale (creator died while building: `dblp testbed down --name {e['name']}`)"
        elif e.get("fabric_detached"):
            health = (f"fabric detached from {', '.join(e['fabric_detached'])} (faults change nothing "
                      f"there: `dblp testbed down --name {e['name']}` and up again)")
        rate = units.rate_text(e.get("rate_bps") or 0)
        print(f"{e['name']}: {health}; {e['workers']} workers, mtu {e['mtu']}, rate {rate}, "
              f"fabric prog {e.get('prog_id') or '-'}")
        for w, a in e.get("addrs", {}).items():
            faults = (e.get("faults") or {}).get(w) or {}
            print(f"  {w:4} {e['name']}-{w:20} {a:15} {json.dumps(faults) if faults else ''}")
    return 0


def cmd_exec(args) -> int:
    from pydblp.testbed import Testbed

    if args.cmd[:1] in (["--name"], ["--testbed"]):  # (argparse takes what follows WORKER as the command)
        raise UsageError(f"{args.cmd[0]} comes before the worker: dblp testbed exec {args.cmd[0]} NAME "
                         f"{args.worker} -- CMD [ARGS...]")
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise UsageError("no command: dblp testbed exec w0 -- CMD [ARGS...]")
    tb = Testbed.open(args.name)
    argv = tb.argv(args.worker, cmd)
    sys.stdout.flush()
    try:
        os.execvp(argv[0], argv)
    except FileNotFoundError:
        raise UsageError(f"{argv[0]}: not found") from None


# ---- dblp fault ----------------------------------------------------------------

def _no_fault_action(args) -> int:
    raise UsageError("no action: dblp fault loss|ge|burst|queue|clear|stats ... (see dblp fault --help)")


def add_fault(sub) -> None:
    p = sub.add_parser("fault", help="set or clear testbed faults at run time, show counters",
                       formatter_class=formatter, epilog=FAULT_EPILOG,
                       description="Loss, Gilbert-Elliott loss, microbursts and a priority-aware "
                                   "virtual queue on the testbed switch (bpf/fabric.bpf.c).")
    fs = p.add_subparsers(dest="action", metavar="ACTION")
    p.set_defaults(func=_no_fault_action)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--testbed", "--name", dest="testbed", help="testbed (default: the only one)")
    common.add_argument("--port", action="append",
                        help="egress port wK (repeatable; default every port)")

    def add(name, help_):
        return fs.add_parser(name, help=help_, parents=[common], formatter_class=formatter, epilog=FAULT_EPILOG)

    a = add("loss", "Bernoulli loss")
    a.add_argument("p", type=float, help="drop probability, 0..1 (0 = off)")
    a = add("ge", "Gilbert-Elliott bursty loss")
    a.add_argument("--p", type=float, required=True, help="good -> bad per packet (0 = off)")
    a.add_argument("--r", type=float, default=0.5, help="bad -> good per packet; mean burst = 1/r")
    a.add_argument("--loss-bad", type=float, default=1.0, help="drop probability in bad (1-h)")
    a.add_argument("--loss-good", type=float, default=0.0, help="drop probability in good (1-k)")
    a = add("burst", "arm a microburst window")
    a.add_argument("--ratio", type=float, default=0.8, help="drop probability inside (default 0.8)")
    a.add_argument("--duration", default="50ms", help="window length (default 50ms; 0 disarms)")
    w = a.add_mutually_exclusive_group()
    w.add_argument("--in", dest="delay", default="0", help="start this long from now (default now)")
    w.add_argument("--at", type=float, help="start at this CLOCK_MONOTONIC time, seconds")
    a.add_argument("--every", help="repeat with this period")
    a.add_argument("--count", type=int, help="number of windows with --every (default forever)")
    a = add("queue", "virtual egress queue with priority-aware early drop")
    a.add_argument("--rate", required=True, help="line rate, e.g. 1gbit (0 removes the queue)")
    a.add_argument("--buffer", default="256k", help="buffer bytes: tail drop beyond (default 256k)")
    a.add_argument("--thresholds", help="8 comma-separated early-drop backlogs in bytes, prio 0..7")
    a.add_argument("--mark", metavar="SIZE",
                   help="ECN: set CE on ECN-capable frames admitted past this backlog, e.g. 32k "
                        "(at most --buffer; default 0: no marking)")
    a.add_argument("--mark-drop", action="store_true",
                   help="with --mark: past it, drop the IP frames that cannot be marked (Not-ECT), as an "
                        "ECN AQM does (default: they meet only the tail drop at --buffer)")
    a.add_argument("--delay", action="store_true",
                   help="the queue also holds frames: a TBF at --rate with room for --buffer on the port, "
                        "as a switch's buffer (default: drops and marks only, no frame waits)")
    add("clear", "remove faults (and reset queue and Gilbert-Elliott state)")
    a = add("stats", "counters per port and cause")
    a.add_argument("--json", action="store_true", help="machine-readable")
    a.add_argument("--reset", action="store_true", help="zero the counters after reading")
    for name in ("loss", "ge", "burst", "queue", "clear", "stats"):
        fs.choices[name].set_defaults(func=cmd_fault)


def _port(args):
    if not args.port:
        return None
    return args.port[0] if len(args.port) == 1 else args.port


def cmd_fault(args) -> int:
    from pydblp.testbed import Testbed
    from pydblp.testbed.fabric import parse_duration, parse_mark, parse_rate, parse_size, prob

    # every value is checked before the testbed is looked up: one line for the first bad one
    mark = thr = qrate = None
    if args.action == "queue":
        qrate = parse_rate(unit_rate(args.rate))
        if args.mark is not None:
            mark = parse_mark(args.mark, parse_size(args.buffer))
        if args.mark_drop and not mark:
            raise UsageError("--mark-drop drops what cannot be marked past the mark: give --mark too, e.g. --mark 32k")
        if args.thresholds:
            try:
                thr = [int(x) for x in args.thresholds.split(",")]
            except ValueError:
                raise UsageError(f"--thresholds {args.thresholds!r}: 8 comma-separated integers (bytes)") from None
    if args.action == "burst":
        prob(args.ratio, "--ratio")
        for opt in ("duration", "delay", "every"):
            if getattr(args, opt):
                parse_duration(getattr(args, opt))
        if args.count is not None and not args.every:
            raise UsageError(f"--count {args.count} repeats a burst: give its period too, e.g. --every 1s")
    if args.action in ("loss", "ge"):
        for opt in ("p", "r", "loss_bad", "loss_good"):
            if getattr(args, opt, None) is not None:
                prob(getattr(args, opt), "P" if args.action == "loss" else "--" + opt.replace("_", "-"))
    tb = Testbed.open(args.testbed)
    try:
        port = _port(args)
        where = f"port {', '.join(args.port)}" if args.port else "every port"
        if args.action == "loss":
            tb.loss(args.p, port=port)
            print(f"{tb.name}: loss {args.p:g} on {where}")
        elif args.action == "ge":
            tb.ge(args.p, args.r, loss_bad=args.loss_bad, loss_good=args.loss_good, port=port)
            mean = f", mean burst {1 / args.r:g} packets" if args.p and args.r else ""
            print(f"{tb.name}: Gilbert-Elliott p={args.p:g} r={args.r:g}{mean} on {where}")
        elif args.action == "burst":
            every = parse_duration(args.every) if args.every else None
            start = tb.burst(ratio=args.ratio, duration=parse_duration(args.duration), at=args.at,
                             delay=parse_duration(args.delay), every=every, count=args.count, port=port)
            print(f"{tb.name}: burst ratio {args.ratio:g} for {args.duration} at monotonic "
                  f"{start:.6f}{f' every {args.every}' if every else ''} on {where}")
        elif args.action == "queue":
            tb.queue(args.rate, buffer=args.buffer, thresholds=thr, port=port, mark=mark, mark_drop=args.mark_drop,
                     delay=args.delay)
            ecn = f" ECN mark {args.mark}{' (Not-ECT dropped)' if args.mark_drop else ''}" if mark else ""
            kind = "delaying queue" if args.delay else "virtual queue"
            if qrate:
                print(f"{tb.name}: {kind} rate {args.rate} buffer {args.buffer}{ecn} on {where}")
            else:
                print(f"{tb.name}: virtual queue removed on {where}")
        elif args.action == "clear":
            tb.clear(port=port)
            print(f"{tb.name}: faults cleared on {where}")
        elif args.action == "stats":
            s = tb.stats(reset=args.reset)
            if port is not None:
                keep = set(args.port)
                missing = sorted(keep - set(s))
                if missing:
                    raise UsageError(f"--port {missing[0]}: {tb.name} has ports {', '.join(sorted(s))}")
                s = {k: v for k, v in s.items() if k in keep}
            if args.json:
                print(json.dumps(s, indent=1))
            else:
                _print_stats(s)
    finally:
        tb.close()
    return 0


def _print_stats(s: dict) -> None:
    from pydblp.testbed.fabric import CAUSES

    causes = [c for c in CAUSES.values() if any(c in v for v in s.values())]
    head = ["PORT", *[c.upper() for c in causes], "BACKLOG", "PEAK"]
    rows = []
    for port, v in s.items():
        rows.append([port, *[str(v.get(c, {}).get("packets", 0)) for c in causes],
                     str(v.get("backlog", "-")), str(v.get("peak", "-"))])
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    for r in [head, *rows]:
        print("  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip())
    for port, v in s.items():
        if v.get("config"):
            print(f"{port}: {json.dumps(v['config'])}")
