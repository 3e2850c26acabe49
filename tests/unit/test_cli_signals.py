"""How a signal stops a command (``cliutil.stop_unwinds``, around ``dblp`` and the bench
scripts): the first Ctrl-C or SIGTERM unwinds, later ones are ignored until the clean-up is
done, a signal ignored at start stays ignored, and the handlers found are back afterwards.  Each
case runs in a child Python that signals itself, so the test runner's own handlers never change
(the end-to-end case, a testbed's ``down`` under repeated Ctrl-C, is in tests/linux/test_testbed.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

UNWIND = r"""
import os, signal, sys
from pydblp.cliutil import stop_unwinds
sig = getattr(signal, sys.argv[1])
before = signal.getsignal(sig)
try:
    with stop_unwinds():
        try:
            os.kill(os.getpid(), sig)
            print("not stopped")
        finally:
            os.kill(os.getpid(), signal.SIGINT)   # later ones, during the clean-up: ignored
            os.kill(os.getpid(), signal.SIGTERM)
            print("cleaned up", flush=True)
except KeyboardInterrupt:
    print("KeyboardInterrupt")
except SystemExit as e:
    print("exit", e.code)
print("restored", signal.getsignal(sig) is before)
"""


@pytest.mark.parametrize("sig,ends", [("SIGINT", "KeyboardInterrupt"), ("SIGTERM", "exit 143")])
def test_the_first_stop_unwinds_and_later_ones_wait_for_the_clean_up(sig, ends):
    p = subprocess.run([sys.executable, "-c", UNWIND, sig], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split("\n")[:3] == ["cleaned up", ends, "restored True"], p.stdout


IGNORED = r"""
import os, signal
from pydblp.cliutil import stop_unwinds
signal.signal(signal.SIGINT, signal.SIG_IGN)   # as a shell starts a background job
with stop_unwinds():
    os.kill(os.getpid(), signal.SIGINT)
    print("went on", flush=True)
print("still ignored", signal.getsignal(signal.SIGINT) is signal.SIG_IGN)
"""


def test_a_signal_ignored_at_start_stays_ignored():
    p = subprocess.run([sys.executable, "-c", IGNORED], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["went", "on", "still", "ignored", "True"], p.stdout


def test_dblp_exits_130_on_ctrl_c_with_its_handlers_back(monkeypatch):
    """``dblp`` in-process: a KeyboardInterrupt out of the command is exit status 130, and the
    handlers of SIGINT and SIGTERM are the ones it found."""
    from pydblp import cli

    before = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)]

    def stopped(args):
        assert signal.getsignal(signal.SIGINT) is not before[0]  # (its own, while it runs)
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_cmd_status", stopped)
    assert cli.main(["status"]) == 130
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)] == before
