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


class Parser(argparse.ArgumentParser):
    """Every ``dblp`` parser: a mistake is one line naming it and pointing at ``--help`` (argparse
    would print the whole usage block first); subcommand parsers are of this class too."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")
