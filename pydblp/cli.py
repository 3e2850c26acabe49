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
