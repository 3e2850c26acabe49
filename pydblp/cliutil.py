"""What every ``dblp`` subcommand module shares: the user-error type, the help layout, and how a
signal stops a command (the bench scripts share the last two).

:mod:`pydblp.cli` (the entry point) and :mod:`pydblp.testbed.cli` (the
``testbed`` and ``fault`` subcommands it registers) both import this module,
and neither imports the other's internals.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading


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


STOPS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def stop_unwinds():
    """Within it, Ctrl-C (SIGINT) raises KeyboardInterrupt and SIGTERM (timeout(1), a job
    scheduler) exits with status 143, both unwinding through the owners' ``finally`` and ``with``
    blocks (testbeds, namespaces, XDP attachments, rank processes); every later SIGINT or SIGTERM
    is ignored until it ends, so a second Ctrl-C cannot cut that clean-up short and leave them
    behind.  The handlers it found are back on exit.  A signal ignored when it begins (a job
    started in the background, or under nohup) stays ignored.  Outside the main thread (where no
    handler can be set) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # (None: a handler set from C, which Python cannot put back; such a signal is left alone)
    old = {s: h for s in STOPS if (h := signal.getsignal(s)) not in (signal.SIG_IGN, None)}

    def stopping(signum, frame):
        hold_stops()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        sys.exit(128 + signum)

    for s in old:
        signal.signal(s, stopping)
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def hold_stops() -> None:
    """Ignore SIGINT and SIGTERM from now on (within :func:`stop_unwinds`: until it ends): called
    where a clean-up begins that no signal may cut, a run that ended by itself included."""
    if threading.current_thread() is threading.main_thread():
        for s in STOPS:
            if signal.getsignal(s) is not None:  # (a handler set from C: left alone, as stop_unwinds does)
                signal.signal(s, signal.SIG_IGN)
