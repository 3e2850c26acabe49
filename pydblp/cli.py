"""The ``dblp`` command: one subcommand per capability.

Each subcommand has a ``_add_<name>`` function that builds its parser and
points ``func`` at a ``_cmd_<name>`` handler.  Errors the user can fix are
raised as :class:`UsageError` (or the library's own error types) and printed
as one line, exit code 2; no tracebacks for user mistakes.
"""

from __future__ import annotations

import argparse
import sys

EPILOG = """\
examples:
  dblp dump -r trace.pcap                 decode DBLP packets in a capture
  dblp dump -i eth0 --netns w0 -c 10      ten live packets from a namespace
"""


class UsageError(Exception):
    """A mistake in the command line or environment, shown as one line."""


def _formatter(prog):
    return argparse.RawDescriptionHelpFormatter(prog, max_help_position=32)


# ---- subcommands -----------------------------------------------------------
# (each _add_* registers one subcommand)

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
                       formatter_class=_formatter, epilog=DUMP_EPILOG,
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



def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dblp", formatter_class=_formatter, epilog=EPILOG,
        description="pydblp: loss-tolerant gradient transport (XDP + AF_XDP).")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, add in sorted(globals().items()):
        if name.startswith("_add_"):
            add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from pydblp.net import NetError

    try:
        return args.func(args) or 0
    except (UsageError, NetError, FileNotFoundError, PermissionError) as e:
        print(f"dblp {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
