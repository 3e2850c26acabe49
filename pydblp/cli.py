"""The ``dblp`` command: one subcommand per capability.

Each subcommand has a ``_add_<name>`` function that builds its parser and
points ``func`` at a ``_cmd_<name>`` handler.  Errors the user can fix are
raised as :class:`UsageError` (or the library's own error types) and printed
as one line, exit code 2; no tracebacks for user mistakes.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import struct
import sys

from pydblp.cliutil import Parser, UsageError, formatter, stop_unwinds

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
  dblp job add eth0 --job 7 --world 2 --rank 1 --peer 0=198.18.0.1,02:00:00:00:00:01
  dblp stats eth0 1 10                    ten one-second samples
  dblp unload --all                       remove every pydblp attachment and pin
"""


JOB_EPILOG = """\
examples:
  dblp job add eth0 --job 7 --world 4 --rank 1                 admit job 7's packets for rank 1 of 4
  dblp job add eth0 --job 7 --world 4 --rank 1 --transport udp to the kernel stack, not AF_XDP
  dblp job add eth0 --job 7 --world 2 --rank 1 --peer 0=198.18.0.1,02:00:00:00:00:01
                                                               rank 0 only from that address and MAC
  dblp job list eth0                                           the admitted jobs
  dblp job peers eth0 --netns w1                               the address bindings
  dblp job del eth0 --job 7
"""

CONFIG_EPILOG = """\
examples:
  dblp config eth0 --pressure 800                 shed priorities whose level is <= 800 now
  dblp config eth0 --shed-at 0,900,800,700,600,500,400,300   the default levels (priority 0 never)
  dblp config eth0 --rate-pps 500000              raise pressure above 500k packets/s (0: off)
"""

STATUS_EPILOG = """\
examples:
  dblp status                                     every pydblp attachment, its jobs and counters
  sudo watch -n1 dblp status                      the same, every second
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

    host.check_config(port=args.port)
    if os.geteuid() != 0:  # (bcc would print a page of map errors first)
        raise UsageError("loading an XDP program needs root (CAP_BPF and CAP_NET_ADMIN): run it with sudo")
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
    from pydblp.net import NetError

    if args.all == bool(args.ifname):
        raise UsageError("give an interface or --all (not both)")
    if args.all and args.netns:
        raise UsageError("--all covers every namespace: leave out --netns, or give the interface")
    targets = ([(e["ifname"], e["netns"]) for e in host.loaded()] if args.all
               else [(args.ifname, args.netns)])
    for ifname, ns in targets:
        where = f" (netns {ns})" if ns else ""
        try:
            done = host.unload(ifname, ns)
        except host.HostError:
            raise
        except NetError as e:  # a running process's program (a BPF link): --all leaves it to its owner
            if not args.all:
                raise
            print(f"kept {ifname}{where}: {e}", file=sys.stderr)
            continue
        if done:
            print(f"unloaded {ifname}{where}")
        elif not args.all:
            raise UsageError(f"pydblp is not loaded on {ifname}{where}")
    return 0


def _add_status(sub):
    p = sub.add_parser("status", help="table of pydblp attachments, jobs and counters",
                       formatter_class=formatter, epilog=STATUS_EPILOG)
    p.set_defaults(func=_cmd_status)


def _cmd_status(args) -> int:
    from pydblp import host

    rows = []
    for e in host.loaded():
        jobs, c = "-", None
        # pinned (`dblp load`), or read through the program (a data plane's own, unpinned)
        maps = host.open_pinned(e["ifname"], e["netns"]) if e["pinned"] else \
            host.open_attached(e["prog_id"], e["ifname"], e["netns"]) if e["prog_id"] else None
        if maps is not None:
            with maps as m:
                jobs = ",".join(f"{j}:{v['rank']}/{v['world_size']}{'u' if v['transport'] == 'udp' else ''}"
                                for j, v in sorted(m.jobs().items())) or "-"
                c = m.counters()
        mode = e["mode"].value if e["mode"] else "stale-pins"
        rows.append([e["netns"] or "-", e["ifname"], mode, str(e["prog_id"] or "-"), jobs,
                     *([str(c["pass"] + c["dblp_pass"]), str(c["redirect"]), str(sum(c["drop"].values())),
                        str(sum(c["shed"])), str(c["nosock"])] if c else ["-"] * 5)])
    head = ["NETNS", "IFACE", "MODE", "PROG", "JOBS(job:rank/world)", "PASS", "REDIRECT", "DROP", "SHED", "NOSOCK"]
    _table(head, rows)
    if not rows:
        print("(pydblp is not loaded anywhere)")
    _xsk_sockets()
    return 0


def _xsk_sockets() -> None:
    """The second table of ``dblp status``: every open data plane's AF_XDP sockets, one row per
    queue (what each process published, counters at most a second old)."""
    from pydblp.transport.xsk_queues import published

    rows = [[r["netns"] or "-", r["ifname"], str(q["queue"]), str(r["pid"]), str(r["port"]), q["mode"],
             str(q["busy_poll"] or "-"), str(q["rx_packets"]), str(q["tx_packets"]), str(q["rx_dropped"]),
             str(q["rx_ring_full"]), str(q["rx_fill_ring_empty_descs"])]
            for r in published() for q in r["queues"]]
    if rows:
        print()
        _table(["NETNS", "IFACE", "QUEUE", "PID", "PORT", "XSK", "BUSYPOLL", "RX", "TX", "RX_DROP", "RING_FULL",
                "FILL_EMPTY"], rows)


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
    if not (math.isfinite(args.interval) and args.interval > 0):
        raise UsageError(f"interval {args.interval:g}: give a positive number of seconds, e.g. 1")
    if args.count is not None and args.count <= 0:
        raise UsageError(f"count {args.count}: give a positive number of samples, or none to go on until Ctrl-C")
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
                       formatter_class=formatter, epilog=JOB_EPILOG)
    jsub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    a = jsub.add_parser("add", help="admit a job (others are dropped as 'job')", formatter_class=formatter,
                        epilog=JOB_EPILOG)
    _iface_args(a)
    a.add_argument("--job", type=int, required=True, help="job id (non-zero)")
    a.add_argument("--world", type=int, required=True, help="world size")
    a.add_argument("--rank", type=int, required=True, help="this host's rank")
    a.add_argument("--transport", choices=["xsk", "udp"], default="xsk",
                   help="xsk: redirect to AF_XDP (default); udp: pass to the kernel stack")
    a.add_argument("--peer", action="append", default=[], metavar="RANK=IP[,MAC]",
                   help="bind RANK's packets to source IP (and MAC): others claiming RANK are dropped "
                        "as spoof_ip/spoof_mac (repeatable; IP may be '-' to bind the MAC alone)")
    d = jsub.add_parser("del", help="remove a job", formatter_class=formatter, epilog=JOB_EPILOG)
    _iface_args(d)
    d.add_argument("--job", type=int, required=True)
    ls = jsub.add_parser("list", help="list jobs", formatter_class=formatter, epilog=JOB_EPILOG)
    _iface_args(ls)
    pe = jsub.add_parser("peers", help="list the ranks' source address bindings (anti-spoofing)",
                         formatter_class=formatter, epilog=JOB_EPILOG)
    _iface_args(pe)
    p.set_defaults(func=_cmd_job)


def _mbit(text: str) -> float:
    """``--rate``: Mbit/s as a bare number, or a rate with its unit (``10gbit``)."""
    from pydblp import units

    try:
        return float(text)
    except ValueError:
        pass
    try:
        return units.rate(text) / 1e6
    except ValueError as e:
        raise UsageError(f"--rate {text}: {e}") from None


def _peer_arg(text: str) -> tuple[int, str | None, str | None]:
    """``RANK=IP[,MAC]`` (IP '-': none) -> (rank, ip, mac); UsageError in one line."""
    rank, eq, addrs = text.partition("=")
    ip, _, mac = addrs.partition(",")
    if not eq or not rank.strip().isdigit() or not ip.strip():
        raise UsageError(f"--peer {text!r}: use RANK=IP[,MAC], e.g. --peer 0=198.18.0.1,02:00:00:00:00:01")
    ip = None if ip.strip() == "-" else ip.strip()
    return int(rank), ip, mac.strip() or None


def _cmd_job(args) -> int:
    from pydblp import host

    binds = []
    if args.action == "add":  # (every value checked before the interface is looked up)
        host.check_job(args.job, args.world, args.rank)
        binds = [_peer_arg(x) for x in args.peer]
        for rank, _, _ in binds:
            if rank >= args.world:
                raise UsageError(f"--peer rank {rank}: use 0..{args.world - 1} (--world {args.world})")
    elif args.action == "del":
        host.check_job(args.job, 1, 0)
    with host.open_pinned(args.ifname, args.netns) as m:
        if args.action == "add":
            m.set_job(args.job, args.world, args.rank, args.transport, binds)  # (all or nothing)
        elif args.action == "peers":
            _table(["JOB", "RANK", "IP", "MAC"],
                   [[j, r, v["ip"] or "-", v["mac"] or "-"] for (j, r), v in sorted(m.peers().items())])
        elif args.action == "del":
            if not m.unregister_job(args.job):
                raise UsageError(f"job {args.job} is not registered on {args.ifname}")
        else:
            _table(["JOB", "WORLD", "RANK", "TRANSPORT"],
                   [[j, v["world_size"], v["rank"], v["transport"]] for j, v in sorted(m.jobs().items())])
    return 0


def _add_config(sub):
    p = sub.add_parser("config", help="set pressure, rate estimate or shed levels of a loaded interface",
                       formatter_class=formatter, epilog=CONFIG_EPILOG)
    _iface_args(p)
    p.add_argument("--pressure", type=int, help="pressure level 0..1000 (normally written by the receiver)")
    p.add_argument("--rate-pps", type=int, help="raise pressure from the arrival rate above this (0: off)")
    p.add_argument("--shed-at", help="8 comma-separated levels: shed prio p at pressure >= level (0 never)")
    p.set_defaults(func=_cmd_config)


def _cmd_config(args) -> int:
    from pydblp import host

    shed_at = None
    example = "e.g. --shed-at 0,900,800,700,600,500,400,300"
    if args.shed_at is not None:
        try:
            shed_at = tuple(int(x) for x in args.shed_at.split(","))
        except ValueError:
            raise UsageError(f"--shed-at {args.shed_at!r}: give 8 comma-separated levels, {example}") from None
    try:
        host.check_config(rate_pps=args.rate_pps, shed_at=shed_at)
    except host.HostError as e:  # (the library's argument names, as this command's options)
        raise UsageError(str(e).replace("rate_pps", "--rate-pps").replace("shed_at", "--shed-at")) from None
    if args.pressure is not None and not 0 <= args.pressure <= host.PRESSURE_MAX:  # (the library clamps a
        raise UsageError(f"--pressure {args.pressure}: give a level in 0..{host.PRESSURE_MAX}")  # receiver's)
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
  dblp dump -r trace.pcap --key-file job.key   check every packet's tag
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
    p.add_argument("--key-file", metavar="FILE",
                   help="the job key: mark each packet's tag valid (with its run epoch), INVALID or untagged")
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
    if args.timeout is not None and not args.timeout > 0:
        raise UsageError(f"--timeout {args.timeout:g}: give a positive number of seconds")
    if args.count < 0:
        raise UsageError("-c COUNT must be >= 0")
    ports = set(args.port or [wire.DEFAULT_PORT])
    try:
        for port in ports:
            inspect.bind_port(port)
    except ValueError as e:
        raise UsageError(str(e)) from None
    expr = " ".join(args.expression) or None
    key = None
    if args.key_file:
        from pydblp.jobkey import KeyLoadError, load_key

        try:
            key = load_key(args.key_file)
        except KeyLoadError as e:
            raise UsageError(str(e)) from None
    show = inspect.describe if args.verbose else inspect.summary
    out = _PcapOut(args.write, args.read) if args.write else None

    def emit(pkt) -> None:
        print(show(pkt, ports, key), flush=True)
        if out is not None:
            out.write(pkt)

    kept = False
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
        kept = True
    except inspect.CaptureError as e:
        raise UsageError(str(e)) from None
    except BrokenPipeError:  # `dblp dump ... | head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        kept = True
    except KeyboardInterrupt:  # Ctrl-C ends a live capture: what it wrote is kept, as tcpdump's
        kept = True
        raise
    finally:
        if out is not None:
            out.close(keep=kept)
    return 0


class _PcapOut:
    """``dump -w FILE``: packets go to a file beside ``FILE``, which replaces it only when the
    dump ends well (a bad input or a failed capture leaves an existing ``FILE`` as it was)."""

    def __init__(self, path: str, read: str | None):
        if read and os.path.exists(path) and os.path.exists(read) and os.path.samefile(read, path):
            raise UsageError(f"-w {path} is the file -r reads: write to another file")
        self.path, self.part = path, f"{path}.part"
        self.writer = None
        try:
            open(self.part, "wb").close()  # (can it be written at all: say so before reading anything)
        except OSError as e:
            raise UsageError(f"cannot write {path}: {e.strerror or e}") from None

    def write(self, pkt) -> None:
        from scapy.utils import PcapWriter

        if self.writer is None:
            self.writer = PcapWriter(self.part, sync=True)
        self.writer.write(pkt)

    def close(self, keep: bool) -> None:
        if self.writer is not None:
            self.writer.close()
        elif keep:  # no packet: an empty capture (the pcap header alone: Ethernet, snaplen 65535)
            with open(self.part, "wb") as f:
                f.write(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 1))
        if keep:
            os.replace(self.part, self.path)
        else:
            os.unlink(self.part)



# ---- experiment: the main job ----------------------------------------------------

EXPERIMENT_EPILOG = """\
examples:
  dblp experiment                                 the demo: 4 workers, 1.1M-parameter MLP, 10 % loss, bursts
  dblp experiment --scenario paper --seeds 3      longer, more bursts, sharded optimizer, 3 seeds (~20 minutes)
  dblp experiment --scenario paper --consistency allgather --g-over step   the same, identical replicas
  dblp experiment --algo fsdp --scenario paper --consistency allgather   FSDP2 over a 'dblp' process group
  dblp experiment --scenario paper --model lm --seeds 3   the same for a 1.16M-parameter language model
  dblp experiment --scenario paper --relax none,ef,rotate,both --static-relax none   relaxed rounds, the ablation
  dblp experiment --scenario paper --relax none,ef,rotate,both --static-relax none --gloo-from old/report.json
                                                  the same, Gloo's runs taken from an earlier run of these seeds
  dblp experiment --model text --steps 200        char transformer on stdlib sources
  dblp experiment --bursts 0 --loss 0.1           10 % random loss, no bursts
  dblp experiment --loss 0 --burst-ms 60 --burst-port all   whole-round bursts only (tolerance cannot act)
  dblp experiment --rate 200 --consistency broadcast:10
  dblp experiment --arms gloo,dblp --net udp --out /tmp/exp
  dblp experiment --mode ps --allgather broadcast DBLP's setup: a parameter server, its result broadcast
  dblp experiment --scenario incast --seeds 3     finite switch buffer: priority shedding vs drop-tail
  dblp experiment --scenario incast --priority magnitude,layer,none   the priority rules, each both ways
  dblp experiment --arms dblp --starve 1:0.3   rank 1 gets 30 % of a core: its host program sheds
(docs/experiment.md describes every option and what the table measures)
"""


def _pair(text: str):
    """'LO,HI' -> (LO, HI) floats, or None when it is not two numbers."""
    try:
        lo, hi = (float(x) for x in text.split(","))
    except ValueError:
        return None
    return lo, hi


def _g(x) -> str:
    return "-" if x is None else format(x, "g")


def _ports(text: str, workers: int, option: str = "--burst-port"):
    """'all' -> 'all'; '1' or 'w0,w2' -> (1,) / (0, 2) (a worker as w1 or 1, as everywhere);
    raises UsageError for anything else."""
    if text == "all":
        return "all"
    try:
        ports = tuple(sorted({int(x.strip().removeprefix("w")) for x in text.split(",")}))
    except ValueError:
        ports = ()
    if not ports or not all(0 <= p < workers for p in ports):
        raise UsageError(f"{option} {text}: use all, or workers w0..w{workers - 1} (or 0..{workers - 1}) "
                         f"separated by commas")
    return ports


def _choices(text: str, option: str, allowed: tuple) -> tuple:
    """'a,b' -> ('a', 'b') when every name is allowed (in the order given, once each); else UsageError."""
    names = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    if not names or any(n not in allowed for n in names):
        raise UsageError(f"{option} {text}: use one or more of {', '.join(allowed)}, separated by commas")
    return names


def _starve(text: str, workers: int) -> tuple[int, float]:
    """'RANK' or 'RANK:SHARE' -> (rank, share of one core; default 0.3)."""
    rank, _, share = text.partition(":")
    try:
        r, sh = int(rank), float(share) if share else 0.3
    except ValueError:
        r, sh = -1, 0.0
    if not (0 <= r < workers and 0 < sh <= 1):
        raise UsageError(f"--starve {text}: use RANK[:SHARE], a rank 0..{workers - 1} and a share of one core "
                         "in (0, 1], e.g. 1:0.3")
    return r, sh


def _add_experiment(sub):
    p = sub.add_parser("experiment", help="the main job: Gloo vs static vs DBLP under microbursts",
                       formatter_class=formatter, epilog=EXPERIMENT_EPILOG,
                       description="Bring up a testbed, train the same model with the same seed over Gloo, "
                                   "static bounded loss (MLT-style) and DBLP phase-aware bounded loss under "
                                   "seeded microbursts and background loss; print a comparison table (mean and "
                                   "spread over --seeds); write report.json and PNG plots. Options left out "
                                   "come from --scenario.")
    p.add_argument("--scenario", choices=["demo", "paper", "incast"], default="demo",
                   help="preset for every option not given (default demo; paper: DBLP's regime and "
                        "architecture, a sharded optimizer whose all-gather carries parameters; incast: "
                        "a parameter server behind a finite switch buffer, priority shedding vs drop-tail)")
    p.add_argument("--workers", type=int)
    p.add_argument("--model", choices=["mlp", "digits", "text", "lm"],
                   help="mlp (default: digits, 1.1M parameters), digits (CNN, 30k), text (transformer, 100k) or "
                        "lm (the transformer widened to 1.16M: a language model, judged by perplexity)")
    p.add_argument("--steps", type=int)
    p.add_argument("--seeds", type=int, help="run N seeds (--seed, --seed+1, ...): mean and spread (default 1)")
    p.add_argument("--arms",
                   help="comma-separated subset of gloo,static,dblp (default all three, incast: gloo,dblp); the "
                        "first seed runs them in this order, the next in reverse, and so on")
    p.add_argument("--net", choices=["xsk", "xsk-ktx", "udp"],
                   help="pydblp data plane (default AF_XDP; xsk-ktx: AF_XDP receive, kernel transmit)")
    p.add_argument("--rate", metavar="MBIT",
                   help="each worker link's rate in Mbit/s, or with a unit, e.g. 10gbit (default 1000; "
                        "0: no limit)")
    p.add_argument("--bursts", type=int, help="microbursts over the run (0: none; demo 15, paper 30)")
    p.add_argument("--burst-ratio", metavar="LO,HI", help="a burst drops a ratio uniform in [LO, HI] (0.6,0.9)")
    p.add_argument("--burst-ms", type=float, help="burst length in ms (default 8: part of a round)")
    p.add_argument("--burst-port", metavar="PORTS",
                   help="workers whose incoming link a burst hits: all, or e.g. 1,3 (default 1)")
    p.add_argument("--loss-model", choices=["random", "ge"], help="background loss: random or Gilbert-Elliott")
    p.add_argument("--loss", type=float, help="background loss: mean drop rate on every port (default 0.1)")
    p.add_argument("--ge-len", type=float, metavar="PACKETS", help="ge: mean bad-state run (default 10 packets)")
    p.add_argument("--ge-bad", type=float, metavar="RATIO", help="ge: drop ratio in the bad state (default 0.8)")
    p.add_argument("--p-low", type=float, help="static tolerance, DBLP's P_low (default 0.016)")
    p.add_argument("--k", type=float, help="DBLP's P_high - P_low (default 0.40)")
    p.add_argument("--high", choices=["fixed", "loss"],
                   help="DBLP's relaxed bound: p-low + k (fixed, the paper's; default) or p-low plus the loss "
                        "the network makes, measured from STOPs' echoes, at most k (loss)")
    p.add_argument("--freq", type=int, help="DBLP measures the gradient norm every FREQ steps (default 10)")
    p.add_argument("--eta", type=float, help="DBLP: critical while |dG|/G >= ETA (default 0.5)")
    p.add_argument("--g-over", choices=["step", "window"],
                   help="DBLP's G: the norm of the measured step's averaged gradient (step, the paper's rule; "
                        "default) or of its mean over the FREQ steps since the last measurement (window; "
                        "the paper scenario's)")
    p.add_argument("--estimator", choices=["unbiased", "zero"])
    p.add_argument("--order", choices=["shuffle", "rows"],
                   help="pydblp runs: the chunks' order in a message: shuffle (default: a permutation per round, so "
                        "a bound's cut and a burst hit other rows each round) or rows (the tensor's order)")
    p.add_argument("--stagger", choices=["on", "off"],
                   help="pydblp runs: each sender starts its messages at its own chunk (on, default: a cut that "
                        "stops every sender at once leaves out other rows of each) or at chunk 0 (off)")
    p.add_argument("--spread", type=int, metavar="PACKETS",
                   help="pydblp runs: where the link is the bottleneck, send batches take turns over their "
                        "destinations PACKETS at a time (Config.spread; default 0: off), for shallow switch "
                        "buffers (--queue with --drop-policy tail)")
    p.add_argument("--warm-up", type=int, metavar="ROUNDS",
                   help="pydblp runs over the hook or a sharded optimizer: exact rounds of zeros of the model's size "
                        "before the first step, as DDP's broadcast of the parameters warms Gloo's sockets "
                        "(default 2; 0: none)")
    p.add_argument("--consistency", help="replica consistency: allgather (default, paper: sharded; identical results "
                                         "on every rank), "
                                         "allgather:bound (the same, the all-gather stops at the round's bound; "
                                         "the rest is filled from the last result), allgather:carry (the same; "
                                         "the rest is applied a round later), "
                                         "sharded (a sharded optimizer: owners step their shard, the all-gather "
                                         "carries parameters and tolerates loss; a row not delivered keeps its "
                                         "value), sharded:whole (the same, the all-gather repaired whole), "
                                         "none (the all-gather tolerates loss; replicas drift) or broadcast:N "
                                         "(none, plus a parameter broadcast every N steps)")
    p.add_argument("--mode", choices=["tar", "ps"],
                   help="pydblp's collective: transpose allreduce (default) or a parameter server (rank 0)")
    p.add_argument("--allgather", choices=["unicast", "broadcast"],
                   help="pydblp's all-gather: a copy per rank (default) or one to the testbed's broadcast address")
    p.add_argument("--priority", metavar="RULES",
                   help="pydblp chunk priority, one run each: magnitude (default), layer, none; e.g. magnitude,layer")
    p.add_argument("--queue", type=float, metavar="MBIT",
                   help="a finite switch buffer draining at MBIT Mbit/s on --queue-port (incast: 2000)")
    p.add_argument("--queue-kb", type=float, metavar="KB", help="its buffer in KiB (default 128)")
    p.add_argument("--mark-kb", type=float, metavar="KB",
                   help="its ECN threshold in KiB: ECN-capable frames admitted past it are marked CE (default: none)")
    p.add_argument("--cc", metavar="MODES",
                   help="pydblp congestion control, one run each: ecn (default: back off on CE marks) and/or off")
    p.add_argument("--plan", metavar="MODES",
                   help="dblp's plans, one run each: auto (default: send what the bound needs where the link is the "
                        "bottleneck), on and/or off (every chunk), e.g. auto,off")
    p.add_argument("--queue-port", metavar="PORTS",
                   help="workers whose incoming link has the queue: all, or e.g. 0 (default: 0 with --mode ps, else all)")
    p.add_argument("--drop-policy", metavar="POLICIES",
                   help="the queue's drops, one pydblp run each: priority (early drop of low priority within each "
                        "message's budget, default) and/or tail (drop-tail), e.g. priority,tail")
    p.add_argument("--starve", metavar="RANK[:SHARE]",
                   help="cap that rank's CPU at SHARE of one core (default 0.3): a receiver that cannot keep up")
    p.add_argument("--target", type=float,
                   help="held-out loss (nats) to reach (default: Gloo's smoothed held-out loss at 80 %% of its "
                        "steps)")
    p.add_argument("--gloo-from", metavar="REPORT",
                   help="take each seed's Gloo run (figures, target, burst length) from an earlier report.json of "
                        "the same scenario and seeds instead of running it again (the paper scenario's slowest "
                        "arm); the options that shape Gloo's run must match; --arms then leaves gloo out")
    p.add_argument("--relax", metavar="WAYS",
                   help="pydblp's relaxed rounds, one run each: none (default), ef (error feedback: what a round "
                        "leaves out is sent again), rotate (random rotation: a lost chunk becomes noise), both; "
                        "e.g. none,ef,rotate,both (the ablation)")
    p.add_argument("--static-relax", metavar="WAYS",
                   help="the static arm's relaxed rounds, one run each (default: --relax's); each DBLP arm is "
                        "compared with its static twin where that ran, else with static's first")
    p.add_argument("--seed", type=int)
    p.add_argument("--key-file", metavar="FILE",
                   help="job key for the pydblp runs: every packet tagged and verified (docs/authentication.md)")
    p.add_argument("--out", default="dblp-experiment", help="output directory (default ./dblp-experiment)")
    p.set_defaults(func=_cmd_experiment)
    _diloco_options(p)


def _experiment_options(args):
    """The runner's Options from the arguments; UsageError (one line) for the first bad one."""
    from pydblp.experiment import runner

    base = runner.options(args.scenario)
    arms = base.arms if args.gloo_from is None else tuple(m for m in base.arms if m != "gloo")
    if args.arms is not None:
        arms = tuple(m for m in args.arms.split(",") if m)
        bad = [m for m in arms if m not in runner.ARMS]
        if bad or not arms:
            raise UsageError(f"--arms takes gloo, static, dblp (got {args.arms!r})")
    v = {k: getattr(args, k) for k in ("workers", "model", "steps", "seeds", "net", "bursts", "burst_ms", "loss",
                                       "loss_model", "ge_len", "ge_bad", "p_low", "k", "high", "freq", "eta", "g_over",
                                       "estimator", "order", "stagger", "consistency", "mode", "allgather", "target", "seed",
                                       "warm_up", "spread")}
    eff = {k: (x if x is not None else getattr(base, k)) for k, x in v.items()}  # what will run
    ratio = _pair(args.burst_ratio) if args.burst_ratio is not None else base.burst_ratio
    k_top = 1 - eff["p_low"]
    checks = ((2 <= eff["workers"] <= 250, f"--workers {eff['workers']}: use 2..250"),
              (eff["steps"] >= 10, f"--steps {eff['steps']}: use 10 or more"),
              (1 <= eff["seeds"] <= 100, f"--seeds {eff['seeds']}: use 1..100"),
              (args.rate is None or args.rate == 0 or 1 <= args.rate <= 10000,
               f"--rate {_g(args.rate)}: use 0 (no limit) or 1..10000 Mbit/s"),
              (0 <= eff["loss"] < 1, f"--loss {eff['loss']:g}: use a probability in [0, 1)"),
              (eff["bursts"] >= 0, f"--bursts {eff['bursts']}: use 0 (none) or more"),
              (ratio is not None and 0 <= ratio[0] <= ratio[1] <= 1,
               f"--burst-ratio {args.burst_ratio}: use LO,HI with 0 <= LO <= HI <= 1, e.g. 0.6,0.9"),
              (eff["burst_ms"] is None or eff["burst_ms"] > 0, f"--burst-ms {_g(eff['burst_ms'])}: use a positive length"),
              (eff["ge_len"] >= 1, f"--ge-len {eff['ge_len']:g}: use a mean bad run of 1 packet or more"),
              (0 < eff["ge_bad"] <= 1, f"--ge-bad {eff['ge_bad']:g}: use a drop ratio in (0, 1]"),
              (eff["loss_model"] != "ge" or eff["loss"] < eff["ge_bad"],
               f"--loss {eff['loss']:g}: a Gilbert-Elliott mean loss must be below --ge-bad {eff['ge_bad']:g}"),
              (0 <= eff["p_low"] < 1, f"--p-low {eff['p_low']:g}: use [0, 1)"),
              (eff["k"] >= 0 and (args.k is None or "dblp" not in arms or eff["k"] < k_top),
               f"--k {eff['k']:g}: use [0, {k_top:g}) (P_high = p-low + k stays below 1)"),
              ("dblp" not in arms or eff["p_low"] + eff["k"] < 1,
               f"--p-low {eff['p_low']:g}: use [0, {1 - eff['k']:g}) (DBLP's P_high = p-low + k "
               f"({eff['k']:g}) must stay below 1)"),
              (eff["freq"] >= 1, f"--freq {eff['freq']}: use 1 or more steps"),
              (eff["warm_up"] >= 0, f"--warm-up {eff['warm_up']}: use 0 (none) or more rounds"),
              (eff["spread"] >= 0, f"--spread {eff['spread']}: use 0 (off) or a number of packets, e.g. 32"),
              (eff["eta"] > 0, f"--eta {eff['eta']:g}: use a positive threshold, e.g. 0.5"),
              (eff["target"] is None or eff["target"] > 0, f"--target {_g(eff['target'])}: use a positive number"))
    for ok, what in checks:
        if not ok:
            raise UsageError(what)
    from pydblp.experiment.worker import CONSISTENCY_USE, consistency

    try:
        knobs = consistency(eff["consistency"])[0]
    except ValueError:
        raise UsageError(f"--consistency {eff['consistency']}: use {CONSISTENCY_USE}") from None
    from pydblp.collective import Config, Dblp

    try:  # (the pair the collective's Config refuses)
        Config(phase=Dblp(high=eff["high"]), **knobs).check()
    except ValueError as e:
        raise UsageError(f"--high {eff['high']} with --consistency {eff['consistency']}: {e}") from None
    ports = _ports(args.burst_port, eff["workers"]) if args.burst_port is not None else base.burst_ports
    if ports != "all" and any(p >= eff["workers"] for p in ports):
        raise UsageError(f"--burst-port: the {args.scenario} scenario bursts port(s) {ports}, beyond "
                         f"--workers {eff['workers']}; give --burst-port")
    prio = _choices(args.priority, "--priority", runner.PRIORITIES) if args.priority is not None else None
    policy = (_choices(args.drop_policy, "--drop-policy", runner.DROP_POLICIES) if args.drop_policy is not None
              else None)
    queue = args.queue if args.queue is not None else base.queue_mbit
    queue_kb = args.queue_kb if args.queue_kb is not None else base.queue_kb
    cc = _choices(args.cc, "--cc", runner.CCS) if args.cc is not None else None
    plan = _choices(args.plan, "--plan", runner.PLANS) if args.plan is not None else None
    relax = _choices(args.relax, "--relax", runner.RELAX) if args.relax is not None else None
    static_relax = (_choices(args.static_relax, "--static-relax", runner.RELAX) if args.static_relax is not None
                    else None)
    mark_kb = args.mark_kb if args.mark_kb is not None else base.mark_kb
    if mark_kb is not None and not 0 < mark_kb <= queue_kb:
        raise UsageError(f"--mark-kb {mark_kb:g}: use a threshold within the queue's buffer, 0 < KB <= {queue_kb:g}")
    if queue is not None and not 1 <= queue <= 100000:
        raise UsageError(f"--queue {queue:g}: use a drain rate of 1..100000 Mbit/s")
    if not 1.5 <= queue_kb <= 4 * 1024 * 1024:
        raise UsageError(f"--queue-kb {queue_kb:g}: use 1.5 (one frame) .. 4194304 KiB")
    if queue is None and (args.queue_kb is not None or args.queue_port is not None or args.mark_kb is not None
                          or (policy is not None and policy != ("priority",))):
        what = "--queue-kb" if args.queue_kb is not None else "--queue-port" if args.queue_port is not None \
            else "--mark-kb" if args.mark_kb is not None else "--drop-policy"
        raise UsageError(f"{what} needs a queue: add --queue MBIT (e.g. --queue 1000) or use --scenario incast")
    qports = _ports(args.queue_port, eff["workers"], "--queue-port") if args.queue_port is not None else None
    starve = _starve(args.starve, eff["workers"]) if args.starve is not None else None
    if args.via == "backend" and (args.algo != "ddp" or eff["consistency"] not in ("allgather", "none")):
        raise UsageError("--via backend: DDP over a 'dblp' group takes --algo ddp and --consistency allgather or none")
    if args.algo == "fsdp" and eff["consistency"] not in ("allgather", "none"):
        raise UsageError(f"--algo fsdp shards the model itself: --consistency {eff['consistency']} does not apply "
                         f"(add --consistency allgather)")
    return runner.options(args.scenario, arms=arms, rate_mbit=args.rate, burst_ratio=ratio, algo=args.algo, via=args.via,
                          burst_ports=ports, out_dir=args.out, priority=prio, drop_policy=policy, cc=cc, relax=relax,
                          static_relax=static_relax, plan=plan, gloo_from=args.gloo_from,
                          queue_mbit=queue, queue_kb=queue_kb, mark_kb=mark_kb, queue_ports=qports, starve=starve, **v)


# the options --algo diloco takes besides its own group's, and that group's (which the other
# algorithms do not take)
DILOCO_SHARED = ("workers", "model", "rate", "loss", "bursts", "burst_ms", "seed", "out")
DILOCO_OWN = ("runs", "outer_steps", "sync_every", "topology", "overlap_rounds", "blocking_rounds", "peer_timeout")


def _given(args) -> list[str]:
    """The experiment options given on the command line (those whose value is not the default)."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    exp = sub.choices["experiment"]
    return [a.dest for a in exp._actions
            if a.dest not in ("help", "command", "func", "algo") and getattr(args, a.dest, None) != a.default]


def _option(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _cmd_experiment(args) -> int:
    given = _given(args)
    if args.rate is not None:
        args.rate = _mbit(args.rate)
    if args.algo == "diloco":
        other = [d for d in given if d not in DILOCO_SHARED + DILOCO_OWN]
        if other:
            raise UsageError(f"{_option(other[0])} does not apply to --algo diloco (it takes "
                             f"{', '.join(map(_option, DILOCO_SHARED))} and its own group's options)")
        return _cmd_experiment_diloco(args)
    own = [d for d in given if d in DILOCO_OWN]
    if own:
        raise UsageError(f"{_option(own[0])} is an --algo diloco option: add --algo diloco, or leave it out")
    from pydblp._extras import require
    from pydblp.experiment import report, runner

    opt = _experiment_options(args)
    if opt.gloo_from is not None:
        try:
            runner.earlier_gloo(opt)
        except ValueError as e:
            raise UsageError(str(e)) from None
    if args.key_file is not None:  # the workers read it themselves (never through the store)
        import os

        from pydblp.jobkey import KeyLoadError, load_key

        try:
            load_key(args.key_file)
        except KeyLoadError as e:
            raise UsageError(f"--key-file: {e}") from None
        os.environ["DBLP_KEY_FILE"] = os.path.abspath(args.key_file)
    # before a testbed comes up: the plots need matplotlib, the digits data set scikit-learn
    require("the main job", "matplotlib", *(("sklearn",) if opt.model in ("mlp", "digits") else ()))
    try:
        rep = runner.run(opt)
    except RuntimeError as e:
        raise UsageError(str(e)) from None
    print(report.table(rep))
    print(f"report: {args.out}/report.json; plots: {args.out}/loss_accuracy.png, latency_cdf.png, tolerance.png, "
          "divergence_phase.png")
    return 0


def _diloco_options(p):
    """``dblp experiment --algo diloco`` (pydblp/experiment/diloco.py): its options, in a group of their own."""
    from pydblp.experiment import diloco

    g = p.add_argument_group("DiLoCo (--algo diloco: DDP vs exact vs gossip DiLoCo over Gloo or pydblp, a worker "
                             "killed)",
                             "--workers, --model, --rate (default 20 here), --loss, --bursts, --burst-ms, --seed and "
                             "--out apply too (--bursts: one every 3 s from the start of each run); any other "
                             "option is refused.")
    g.add_argument("--algo", choices=["ddp", "fsdp", "diloco"], default="ddp",
                   help="ddp: the arms' comparison above (default); fsdp: the same with FSDP2 (fully_shard) over "
                        "a 'dblp' process group; diloco: this group's")
    g.add_argument("--via", choices=["hook", "backend"], default="hook",
                   help="--algo ddp's pydblp runs: DDP's comm hook (default) or DDP over a 'dblp' process group "
                        "(the torch.distributed backend, no hook)")
    d = diloco.Options()
    g.add_argument("--runs", default=",".join(d.runs), help=f"comma-separated subset of {','.join(diloco.RUNS)}")
    g.add_argument("--outer-steps", type=int, default=d.outer_steps, help=f"outer steps (default {d.outer_steps})")
    g.add_argument("--sync-every", type=int, default=d.sync_every, help=f"H, inner steps per outer step "
                                                                          f"(default {d.sync_every})")
    g.add_argument("--topology", choices=["ring", "exp", "random"], default=d.topology, help="gossip neighbours")
    g.add_argument("--overlap-rounds", type=int, default=d.overlap_rounds, help="non-blocking mixing rounds")
    g.add_argument("--blocking-rounds", type=int, default=d.blocking_rounds, help="blocking mixing rounds")
    g.add_argument("--peer-timeout", type=float, default=d.timeout,
                   help=f"seconds a gossip neighbour has per round (default {d.timeout:g})")


def _cmd_experiment_diloco(args) -> int:
    from pydblp.experiment import diloco

    d = diloco.Options()
    given = {k: getattr(args, k) for k in ("workers", "model", "loss", "bursts", "burst_ms", "seed")}
    a = {k: (v if v is not None else getattr(d, k)) for k, v in given.items()}
    if a["model"] == "mlp":
        a["model"] = "digits"  # DiLoCo's default: the digits CNN
    rate = d.rate if args.rate is None else f"{args.rate:g}mbit"
    runs = tuple(r for r in args.runs.split(",") if r)
    bad = [r for r in runs if r not in diloco.RUNS]
    checks = ((not bad and runs, f"--runs takes {', '.join(diloco.RUNS)} (got {args.runs!r})"),
              (2 <= a["workers"] <= 250, f"--workers {a['workers']}: use 2..250"),
              (args.rate is None or 1 <= args.rate <= 10000, f"--rate {_g(args.rate)}: use 1..10000 Mbit/s"),
              (args.outer_steps >= 2, f"--outer-steps {args.outer_steps}: use 2 or more"),
              (args.sync_every >= 1, f"--sync-every {args.sync_every}: use 1 or more"),
              (min(args.overlap_rounds, args.blocking_rounds) >= 0, "--overlap-rounds/--blocking-rounds: use 0+"),
              (args.peer_timeout > 0, f"--peer-timeout {args.peer_timeout:g}: use a positive number of seconds"),
              (0 <= a["loss"] < 1, f"--loss {a['loss']:g}: use a probability in [0, 1)"),
              (a["bursts"] >= 0, f"--bursts {a['bursts']}: use 0 (none) or more"),
              (0 < a["burst_ms"] < 3000, f"--burst-ms {_g(a['burst_ms'])}: use 0 < MS < 3000 (a burst every 3 s)"),
              (not any(r.startswith("gossip-kill") for r in runs) or a["workers"] >= 3,
               "gossip-kill needs --workers 3 or more"))
    for ok, what in checks:
        if not ok:
            raise UsageError(what)
    out = args.out if args.out != "dblp-experiment" else "dblp-experiment-diloco"
    opt = diloco.Options(workers=a["workers"], model=a["model"], outer_steps=args.outer_steps,
                         sync_every=args.sync_every, runs=runs, topology=args.topology,
                         overlap_rounds=args.overlap_rounds, blocking_rounds=args.blocking_rounds, rate=rate,
                         loss=a["loss"], bursts=a["bursts"], burst_ms=a["burst_ms"], timeout=args.peer_timeout,
                         seed=a["seed"], out_dir=out)
    try:
        rep = diloco.run(opt)
    except RuntimeError as e:
        raise UsageError(str(e)) from None
    print(diloco.table(rep))
    print(f"report: {out}/report.json")
    return 0


# ---- testbed and fault (implemented in pydblp/testbed/cli.py) ----------------


def _add_testbed(sub):
    from pydblp.testbed.cli import add_testbed

    add_testbed(sub)


def _add_fault(sub):
    from pydblp.testbed.cli import add_fault

    add_fault(sub)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
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
    where = f"dblp {args.command}" if getattr(args, "command", None) else "dblp"
    for name, conv in getattr(args, "late_positionals", ()):
        if extra and getattr(args, name) is None:
            try:
                setattr(args, name, conv(extra[0]))
            except ValueError:
                if extra[0].startswith("-"):
                    break  # an option this command does not have: said below
                what = "a whole number" if conv is int else "a number"
                sys.stderr.write(f"{where}: {name} {extra[0]!r}: give {what} (see {where} --help)\n")
                return 2
            extra.pop(0)
    if extra:
        sys.stderr.write(f"{where}: unrecognized arguments: {' '.join(extra)} (see {where} --help)\n")
        return 2
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from pydblp._extras import MissingExtra
    from pydblp.bpf import BPFError
    from pydblp.net import NetError

    # Ctrl-C and SIGTERM unwind, so owners (testbeds, XDP attachments) clean up; a second one is
    # ignored until they have
    with stop_unwinds():
        try:
            return args.func(args) or 0
        except (UsageError, NetError, BPFError, FileNotFoundError, PermissionError, MissingExtra) as e:
            denied = isinstance(e, OSError) and e.errno in (errno.EPERM, errno.EACCES) and os.geteuid() != 0
            print(f"dblp {args.command}: {e}" + (": needs root (BPF maps, namespaces, /run/dblp): run it with sudo"
                                                 if denied else ""), file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130


if __name__ == "__main__":
    sys.exit(main())
