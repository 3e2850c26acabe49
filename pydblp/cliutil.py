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


def unit_rate(text: str | None, flag: str = "--rate") -> str | None:
    """``text`` unchanged if it names a rate with its unit (``1gbit``, ``100mbit``), ``0`` or
    ``none``; UsageError for a bare number, which tc would read as bytes/s and ``pydblp.units``
    as bits/s (neither what a user typing ``--rate 1000`` means)."""
    if text is None:
        return None
    t = str(text).strip()
    try:
        bare = float(t)
    except ValueError:
        return text
    if bare == 0:
        return text
    raise UsageError(f"{flag} {t}: give the unit, e.g. {flag} {t}mbit or {flag} 1gbit")
