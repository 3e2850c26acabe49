"""The ``dblp`` command: one subcommand per capability.

Each subcommand has a ``_add_<name>`` function that builds its parser and
points ``func`` at a ``_cmd_<name>`` handler.  Errors the user can fix are
raised as :class:`UsageError` (or the library's own error types) and printed
as one line, exit code 2; no tracebacks for user mistakes.
"""

from __future__ import annotations

import argparse
import signal
import sys

from pydblp.cliutil import UsageError, formatter

EPILOG = """\
examples:
  dblp experiment                         the main job: Gloo vs static vs DBLP under bursts
  dblp load eth0                          attach the host XDP program (native mode)
  dblp status                             where pydblp is loaded, jobs, counters
  dblp stats eth0 1 5                     per-verdict rates, five one-second samples
  dblp dump -r trace.pcap                 decode DBLP packets in a capture
  dblp dump -i eth0 --netns w0 -c 10      ten live packets from a namespace
"""


# ---- subcommands -----------------------------------------------------------
# (each _add_* registers one subcommand)

# ---- host program: load, unload, status, stats, job, config -----------------

HOST_EPILOG = """\
examples:
  dblp load eth0                          native XDP on eth0, DBLP on UDP 47800
  dblp load veth0 --netns w0 --mode skb   generic mode inside namespace w0
  dblp job add eth0 --job 7 --world 4 --rank 1
  dblp stats eth0 1 10                    ten one-second samples
  dblp unload --all                       remove every pydblp attachment and pin
"""


def _iface_args(p, required: bool = True):
    p.add_argument("ifname", metavar="IFNAME", nargs=None if required else "?", help="interface")
    p.add_argument("--netns", metavar="NS", help="network namespace of the interface")


def _add_load(sub):
    p = sub.add_parser("load", help="attach the host XDP program to an interface",
                       formatter_class=formatter, epilog=HOST_EPILOG,
                       description="Compile and attach bpf/dblp_host.bpf.c; pin its maps under "
                                   "/sys/fs/bpf/dblp so `job`, `stats` and `unload` find them.")
    _iface_args(p)
    p.add_argument("--mode", choices=["native", "skb"], default="native", help="XDP mode (default native)")
    p.add_argument("--port", type=int, default=47800, help="UDP destination port of DBLP traffic")
    p.add_argument("--force", action="store_true", help="replace an XDP program pydblp did not attach")
    p.set_defaults(func=_cmd_load)


def _cmd_load(args) -> int:
    from pydblp import host

    p = host.HostProgram(args.ifname, netns=args.netns, mode=args.mode, port=args.port,
                         force=args.force, pin=True, keep=True)
    where = f" (netns {args.netns})" if args.netns else ""
    print(f"loaded {host.PROG_NAME} on {args.ifname}{where}: {p.mode.value} mode, "
          f"prog id {p.prog_id}, port {args.port}, pins {p.pins}")
    p.close()
    return 0


def _add_unload(sub):
    p = sub.add_parser("unload", help="detach the host program and remove its pins",
                       formatter_class=formatter, epilog=HOST_EPILOG)
    _iface_args(p, required=False)
    p.add_argument("--all", action="store_true", help="every pydblp attachment, in every namespace")
    p.set_defaults(func=_cmd_unload)


def _cmd_unload(args) -> int:
    from pydblp import host

    if args.all == bool(args.ifname):
        raise UsageError("give an interface or --all (not both)")
    targets = ([(e["ifname"], e["netns"]) for e in host.loaded()] if args.all
               else [(args.ifname, args.netns)])
    for ifname, ns in targets:
        where = f" (netns {ns})" if ns else ""
        if host.unload(ifname, ns):
            print(f"unloaded {ifname}{where}")
        elif not args.all:
            raise UsageError(f"pydblp is not loaded on {ifname}{where}")
    return 0


def _add_status(sub):
    p = sub.add_parser("status", help="table of pydblp attachments, jobs and counters",
                       formatter_class=formatter, epilog=HOST_EPILOG)
    p.set_defaults(func=_cmd_status)


def _cmd_status(args) -> int:
    from pydblp import host

    rows = []
    for e in host.loaded():
        jobs, c = "-", None
        if e["pinned"]:
            with host.open_pinned(e["ifname"], e["netns"]) as m:
                jobs = ",".join(f"{j}:{v['rank']}/{v['world_size']}{'u' if v['transport'] == 'udp' else ''}"
                                for j, v in sorted(m.jobs().items())) or "-"
                c = m.counters()
        mode = e["mode"].value if e["mode"] else "stale-pins"
        rows.append([e["netns"] or "-", e["ifname"], mode, str(e["prog_id"] or "-"), jobs,
                     *([str(c["pass"] + c["dblp_pass"]), str(c["redirect"]), str(sum(c["drop"].values())),
                        str(sum(c["shed"]))] if c else ["-"] * 4)])
    head = ["NETNS", "IFACE", "MODE", "PROG", "JOBS(job:rank/world)", "PASS", "REDIRECT", "DROP", "SHED"]
    _table(head, rows)
    if not rows:
        print("(pydblp is not loaded anywhere)")
    return 0


def _table(head: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    for row in [head, *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip())


def _add_stats(sub):
    p = sub.add_parser("stats", help="per-verdict and per-priority rates, bcc-tools style",
                       formatter_class=formatter, epilog=HOST_EPILOG,
                       description="Print packet rates per verdict every INTERVAL seconds, COUNT times "
                                   "(default: 1 s, until Ctrl-C).")
    _iface_args(p)
    p.add_argument("interval", nargs="?", type=float, default=None, help="seconds (default 1)")
    p.add_argument("count", nargs="?", type=int, default=None, help="samples (default: until Ctrl-C)")
    # argparse binds all positionals at the first one, so `stats IF --netns NS 1 5`
    # leaves "1 5" over: main() assigns them to these, in order.
    p.set_defaults(func=_cmd_stats, late_positionals=(("interval", float), ("count", int)))


def _flat_counters(c: dict) -> dict[str, int]:
    out = {k: c[k] for k in ("pass", "dblp_pass", "redirect", "nosock")}
    out.update({f"drop:{k}": v for k, v in c["drop"].items()})
    out.update({f"shed:p{i}": v for i, v in enumerate(c["shed"])})
    return out


def _cmd_stats(args) -> int:
    import time

    from pydblp import host

    if args.interval is None:
        args.interval = 1.0
    if args.interval <= 0 or (args.count is not None and args.count <= 0):
        raise UsageError("interval and count must be positive")
    with host.open_pinned(args.ifname, args.netns) as m:
        prev, t0 = _flat_counters(m.counters()), time.monotonic()
        print(f"{'TIME':8}  {'pass':>10} {'dblp_pass':>10} {'redirect':>10} {'nosock':>8} "
              f"{'drop':>8} {'shed':>8}   (packets/s; nonzero drop/shed causes follow)")
        n = 0
        while args.count is None or n < args.count:
            time.sleep(args.interval)
            cur, t1 = _flat_counters(m.counters()), time.monotonic()
            dt = t1 - t0
            rate = {k: (cur[k] - prev[k]) / dt for k in cur}
            drop = sum(v for k, v in rate.items() if k.startswith("drop:"))
            shed = sum(v for k, v in rate.items() if k.startswith("shed:"))
            causes = " ".join(f"{k}={v:.0f}" for k, v in rate.items() if ":" in k and v)
            print(f"{time.strftime('%H:%M:%S')}  {rate['pass']:10.0f} {rate['dblp_pass']:10.0f} "
                  f"{rate['redirect']:10.0f} {rate['nosock']:8.0f} {drop:8.0f} {shed:8.0f}   {causes}",
                  flush=True)
            prev, t0, n = cur, t1, n + 1
    return 0


def _add_job(sub):
    p = sub.add_parser("job", help="register, remove or list jobs on a loaded interface",
                       formatter_class=formatter, epilog=HOST_EPILOG)
    jsub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    a = jsub.add_parser("add", help="admit a job (others are dropped as 'job')")
    _iface_args(a)
    a.add_argument("--job", type=int, required=True, help="job id (non-zero)")
    a.add_argument("--world", type=int, required=True, help="world size")
    a.add_argument("--rank", type=int, required=True, help="this host's rank")
    a.add_argument("--transport", choices=["xsk", "udp"], default="xsk",
                   help="xsk: redirect to AF_XDP (default); udp: pass to the kernel stack")
    d = jsub.add_parser("del", help="remove a job")
    _iface_args(d)
    d.add_argument("--job", type=int, required=True)
    ls = jsub.add_parser("list", help="list jobs")
    _iface_args(ls)
    p.set_defaults(func=_cmd_job)


def _cmd_job(args) -> int:
    from pydblp import host

    with host.open_pinned(args.ifname, args.netns) as m:
        if args.action == "add":
            m.register_job(args.job, args.world, args.rank, args.transport)
        elif args.action == "del":
            if not m.unregister_job(args.job):
                raise UsageError(f"job {args.job} is not registered on {args.ifname}")
        else:
            _table(["JOB", "WORLD", "RANK", "TRANSPORT"],
                   [[j, v["world_size"], v["rank"], v["transport"]] for j, v in sorted(m.jobs().items())])
    return 0


def _add_config(sub):
    p = sub.add_parser("config", help="set pressure, rate estimate or shed levels of a loaded interface",
                       formatter_class=formatter, epilog=HOST_EPILOG)
    _iface_args(p)
    p.add_argument("--pressure", type=int, help="pressure level 0..1000 (normally written by the receiver)")
    p.add_argument("--rate-pps", type=int, help="raise pressure from the arrival rate above this (0: off)")
    p.add_argument("--shed-at", help="8 comma-separated levels: shed prio p at pressure >= level (0 never)")
    p.set_defaults(func=_cmd_config)


def _cmd_config(args) -> int:
    from pydblp import host

    shed_at = None
    if args.shed_at:
        try:
            shed_at = tuple(int(x) for x in args.shed_at.split(","))
        except ValueError:
            raise UsageError("--shed-at takes 8 integers, e.g. 0,900,800,700,600,500,400,300") from None
    with host.open_pinned(args.ifname, args.netns) as m:
        m.configure(rate_pps=args.rate_pps, shed_at=shed_at)
        if args.pressure is not None:
            m.set_pressure(args.pressure)
        print(f"{args.ifname}: pressure {m.pressure}, port {m.port}")
    return 0


# ---- dump --------------------------------------------------------------------

DUMP_EPILOG = """\
Without EXPRESSION only UDP to or from the DBLP port(s) is shown.  Each
packet is one line: time, src:port > dst:port, kind, job, round, tensor,
src->dst rank, chunk/nchunks, prio, payload len, flags; malformed DBLP
packets read `malformed (<reason>)`.

examples:
  dblp dump -r trace.pcap                      decode a capture
  dblp dump -r trace.pcap -v -c 5              first five packets, every field
  dblp dump -i veth0 --netns w0 -c 10          ten live packets inside netns w0
  dblp dump -i eth0 -w dblp.pcap               capture to a file (and print)
  dblp dump -r all.pcap 'udp dst port 47800 and host 198.18.0.2'
  dblp dump -i eth0 --port 47800 --port 47801  DBLP on two ports
"""


def _add_dump(sub):
    p = sub.add_parser("dump", help="decode DBLP packets from a pcap file or a live interface (tcpdump style)",
                       formatter_class=formatter, epilog=DUMP_EPILOG,
                       description="Decode DBLP packets from a pcap file or a live interface.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("-r", dest="read", metavar="FILE", help="read packets from a pcap/pcapng file")
    src.add_argument("-i", dest="iface", metavar="IFACE", help="capture live on IFACE (root)")
    p.add_argument("--netns", metavar="NAME", help="the network namespace of IFACE (with -i)")
    p.add_argument("-c", dest="count", type=int, default=0, metavar="COUNT", help="stop after COUNT packets")
    p.add_argument("-w", dest="write", metavar="OUT", help="also write the packets shown to pcap file OUT")
    p.add_argument("--port", type=int, action="append", metavar="PORT",
                   help="UDP port carrying DBLP (repeatable; default 47800)")
    p.add_argument("--timeout", type=float, metavar="SECONDS", help="stop a live capture after SECONDS")
    p.add_argument("-v", dest="verbose", action="store_true", help="print every header field")
    p.add_argument("expression", nargs="*", help="BPF filter expression, as for tcpdump")
    p.set_defaults(func=_cmd_dump)


def _cmd_dump(args) -> int:
    from pydblp import inspect, wire

    if not args.read and not args.iface:
        raise UsageError("give -r FILE or -i IFACE")
    if args.netns and not args.iface:
        raise UsageError("--netns needs -i IFACE")
    if args.timeout is not None and not args.iface:
        raise UsageError("--timeout applies to live capture (-i)")
    if args.count < 0:
        raise UsageError("-c COUNT must be >= 0")
    ports = set(args.port or [wire.DEFAULT_PORT])
    try:
        for port in ports:
            inspect.bind_port(port)
    except ValueError as e:
        raise UsageError(str(e)) from None
    expr = " ".join(args.expression) or None
    show = inspect.describe if args.verbose else inspect.summary
    writer = None
    if args.write:
        from scapy.utils import PcapWriter

        try:
            writer = PcapWriter(args.write, sync=True)
        except OSError as e:
            raise UsageError(f"cannot write {args.write}: {e.strerror or e}") from None

    def emit(pkt) -> None:
        print(show(pkt, ports), flush=True)
        if writer is not None:
            writer.write(pkt)

    try:
        if args.read:
            shown = 0
            for pkt in inspect.read_pcap(args.read, expr):
                if expr is None and inspect.dblp_payload(pkt, ports) is None:
                    continue
                emit(pkt)
                shown += 1
                if shown == args.count:
                    break
        else:
            inspect.sniff_live(args.iface, emit, expr or inspect.default_filter(ports),
                               count=args.count, timeout=args.timeout, netns=args.netns)
    except inspect.CaptureError as e:
        raise UsageError(str(e)) from None
    except BrokenPipeError:  # `dblp dump ... | head`: stop quietly
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    finally:
        if writer is not None:
            writer.close()
    return 0



# ---- experiment: the main job ----------------------------------------------------

EXPERIMENT_EPILOG = """\
examples:
  dblp experiment                                 defaults: 4 workers, digits CNN, 30 bursts
  dblp experiment --model text --steps 200        char transformer on stdlib sources
  dblp experiment --bursts 0 --loss 0.1           10 % random loss, no bursts
  dblp experiment --transports gloo,dblp --net udp --out /tmp/exp
  dblp experiment --mode ps --allgather broadcast DBLP's setup: a parameter server, its result broadcast
"""


def _add_experiment(sub):
    p = sub.add_parser("experiment", help="the main job: Gloo vs static vs DBLP under microbursts",
                       formatter_class=formatter, epilog=EXPERIMENT_EPILOG,
                       description="Bring up a testbed, train the same model with the same seed over Gloo, "
                                   "static bounded loss (MLT-style) and DBLP phase-aware bounded loss under "
                                   "seeded microbursts (60-90 % loss for about one round); print a comparison "
                                   "table; write report.json and PNG plots.")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--model", choices=["digits", "text"], default="digits")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--transports", default=",".join(("gloo", "static", "dblp")),
                   help="comma-separated subset of gloo,static,dblp (in this order of runs)")
    p.add_argument("--net", choices=["xsk", "xsk-ktx", "udp"], default="xsk",
                   help="pydblp data plane (default AF_XDP; xsk-ktx: AF_XDP receive, kernel transmit)")
    p.add_argument("--bursts", type=int, default=30, help="microbursts over the run (0: none)")
    p.add_argument("--burst-ms", type=float, help="burst length (default: one median Gloo round)")
    p.add_argument("--loss", type=float, default=0.0, help="background random loss on every port")
    p.add_argument("--tol", type=float, default=0.016, help="static tolerance, DBLP's P_low (default 0.016)")
    p.add_argument("--estimator", choices=["unbiased", "zero"], default="unbiased")
    p.add_argument("--mode", choices=["tar", "ps"], default="tar",
                   help="pydblp's collective: transpose allreduce (default) or a parameter server (rank 0)")
    p.add_argument("--allgather", choices=["unicast", "broadcast"], default="unicast",
                   help="pydblp's all-gather: a copy per rank (default) or one to the testbed's broadcast address")
    p.add_argument("--target", type=float, help="accuracy (digits, default 0.9) or perplexity (text, 8.0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="dblp-experiment", help="output directory (default ./dblp-experiment)")
    p.set_defaults(func=_cmd_experiment)


def _cmd_experiment(args) -> int:
    from pydblp.collective.phase import DBLP_K
    from pydblp.experiment import report, runner

    transports = tuple(t for t in args.transports.split(",") if t)
    bad = [t for t in transports if t not in runner.TRANSPORTS]
    if bad or not transports:
        raise UsageError(f"--transports takes gloo, static, dblp (got {args.transports!r})")
    tol_top, why = (1 - DBLP_K, f" (DBLP's P_high = tol + {DBLP_K:g} must stay below 1)") \
        if "dblp" in transports else (1.0, "")
    checks = ((2 <= args.workers <= 250, "--workers {workers}: use 2..250"),
              (args.steps >= 10, "--steps {steps}: use 10 or more"),
              (0 <= args.loss < 1, "--loss {loss:g}: use a probability in [0, 1)"),
              (args.bursts >= 0, "--bursts {bursts}: use 0 (none) or more"),
              (args.burst_ms is None or args.burst_ms > 0, "--burst-ms {burst_ms:g}: use a positive length"),
              (0 <= args.tol < tol_top, f"--tol {{tol:g}}: use [0, {tol_top:g}){why}"),
              (args.target is None or args.target > 0, "--target {target:g}: use a positive number"))
    for ok, what in checks:
        if not ok:
            raise UsageError(what.format(**vars(args)))
    opt = runner.Options(workers=args.workers, model=args.model, steps=args.steps, transports=transports,
                         net=args.net, seed=args.seed, bursts=args.bursts, burst_ms=args.burst_ms,
                         loss=args.loss, tol=args.tol, estimator=args.estimator, target=args.target,
                         out_dir=args.out, mode=args.mode, allgather=args.allgather)
    try:
        rep = runner.run(opt)
    except RuntimeError as e:
        raise UsageError(str(e)) from None
    print(report.table(rep))
    print(f"report: {args.out}/report.json; plots: {args.out}/loss_accuracy.png, latency_cdf.png, tolerance.png")
    return 0


# ---- testbed and fault (implemented in pydblp/testbed/cli.py) ----------------


def _add_testbed(sub):
    from pydblp.testbed.cli import add_testbed

    add_testbed(sub)


def _add_fault(sub):
    from pydblp.testbed.cli import add_fault

    add_fault(sub)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dblp", formatter_class=formatter, epilog=EPILOG,
        description="pydblp: loss-tolerant gradient transport (XDP + AF_XDP).")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, add in sorted(globals().items()):
        if name.startswith("_add_"):
            add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    for name, conv in getattr(args, "late_positionals", ()):
        if extra and getattr(args, name) is None:
            try:
                setattr(args, name, conv(extra.pop(0)))
            except ValueError:
                parser.error(f"{args.command}: {name} must be a number")
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from pydblp.bpf import BPFError
    from pydblp.net import NetError

    # SIGTERM unwinds like Ctrl-C, so owners (testbeds, XDP attachments) clean up
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        return args.func(args) or 0
    except (UsageError, NetError, BPFError, FileNotFoundError, PermissionError) as e:
        print(f"dblp {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
