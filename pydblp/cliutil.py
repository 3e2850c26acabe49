"""What every ``dblp`` subcommand module shares: the user-error type and the help layout.

:mod:`pydblp.cli` (the entry point) and :mod:`pydblp.testbed.cli` (the
``testbed`` and ``fault`` subcommands it registers) both import this module,
and neither imports the other's internals.
"""

from __future__ import annotations

import argparse


class UsageError(Exception):
    """A mistake in the command line or environment, shown as one line (exit status 2)."""


def formatter(prog: str) -> argparse.HelpFormatter:
    """The help formatter of every ``dblp`` parser: epilogs kept as written, options aligned."""
    return argparse.RawDescriptionHelpFormatter(prog, max_help_position=32)
