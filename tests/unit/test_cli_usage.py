"""CLI mistakes: one line on stderr naming the option, its bad value and the fix, exit status 2,
before any interface, pin or testbed is looked up (the interface and testbed named here do not
exist: a check made after the lookup would answer "not loaded" or "no testbed" instead)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from pydblp import cli


@pytest.mark.parametrize("argv,says", [
    (["stats", "nosuch0", "nan", "1"], "interval nan: give a positive number of seconds"),
    (["stats", "nosuch0", "inf"], "interval inf: give a positive number of seconds"),
    (["stats", "nosuch0", "1", "0"], "count 0: give a positive number of samples"),
    (["stats", "nosuch0", "--bogus"], "unrecognized arguments: --bogus (see dblp stats --help)"),
    (["stats", "nosuch0", "--netns", "ns", "1", "2.5"], "count '2.5': give a whole number"),
    (["config", "nosuch0", "--pressure", "5000"], "--pressure 5000: give a level in 0..1000"),
    (["config", "nosuch0", "--shed-at", "5,900,800,700,600,500,400,300"], "priority 0's, which is never shed: give 0, got 5"),
    (["config", "nosuch0", "--shed-at", "0,9"], "--shed-at needs 8 levels in 0..1000"),
    (["config", "nosuch0", "--shed-at", "0,a"], "give 8 comma-separated levels"),
    (["config", "nosuch0", "--rate-pps", "-1"], "--rate-pps -1 out of range 0..4294967295"),
    (["job", "add", "nosuch0", "--job", "0", "--world", "4", "--rank", "1"], "job id 0 must be in 1..2^32-1"),
    (["job", "add", "nosuch0", "--job", "7", "--world", "0", "--rank", "0"], "world size 0 must be in 1..65535"),
    (["job", "add", "nosuch0", "--job", "7", "--world", "4", "--rank", "4"], "rank 4 must be in 0..3 (world size 4)"),
    (["job", "add", "nosuch0", "--job", "7", "--world", "4", "--rank", "1", "--peer", "x"], "use RANK=IP[,MAC]"),
    (["job", "add", "nosuch0", "--job", "7", "--world", "4", "--rank", "1", "--peer", "5=198.18.0.5"],
     "--peer rank 5: use 0..3"),
    (["load", "nosuch0", "--port", "70000"], "port 70000 out of range 1..65535"),
    (["unload", "--all", "--netns", "w0"], "--all covers every namespace"),
    (["dump", "-i", "lo", "--timeout", "-1"], "--timeout -1: give a positive number of seconds"),
    (["fault", "burst", "--ratio", "1.5"], "--ratio must be within [0, 1], got 1.5"),
    (["fault", "burst", "--duration", "5xs"], "bad duration '5xs'"),
    (["fault", "burst", "--count", "3"], "give its period too, e.g. --every 1s"),
    (["fault", "queue", "--rate", "fast"], "bad rate 'fast'"),
    (["fault"], "no action: dblp fault loss|ge|burst|queue|clear|stats"),
    (["testbed", "exec", "w0", "--name", "x", "--", "true"], "--name comes before the worker"),
    (["config", "nosuch0", "--rate-pps", "500"], "--rate-pps 500: the estimate counts packets per 1 ms"),
    (["config", "nosuch0", "--shed-at", "1,2,3"], "--shed-at needs 8 levels"),
    (["config", "nosuch0", "--netns", "dblp-no-such-ns", "--pressure", "5"],
     "network namespace 'dblp-no-such-ns' does not exist"),
    (["fault", "queue", "--rate", "1000"], "--rate 1000: give the unit, e.g. --rate 1000mbit"),
    (["testbed", "up", "--rate", "1000"], "--rate 1000: give the unit"),
    (["experiment", "--rate", "fast"], "bad rate 'fast'"),
    (["fault", "queue", "--rate", "1gbit", "--thresholds", "a"], "--thresholds 'a': 8 comma-separated"),
    (["fault", "loss", "1.5"], "P must be within [0, 1], got 1.5"),
    (["fault", "ge", "--p", "0.1", "--loss-bad", "3"], "--loss-bad must be within [0, 1], got 3.0"),
    (["experiment", "--algo", "diloco", "--key-file", "job.key"], "--key-file does not apply to --algo diloco"),
    (["experiment", "--algo", "diloco", "--arms", "gloo"], "--arms does not apply to --algo diloco"),
    (["experiment", "--outer-steps", "3"], "--outer-steps is an --algo diloco option"),
    (["experiment", "--algo", "fsdp", "--topology", "exp"], "--topology is an --algo diloco option"),
    (["experiment", "--algo", "diloco", "--burst-ms", "-5"], "--burst-ms -5: use 0 < MS < 3000"),
    (["experiment", "--high", "loss", "--consistency", "allgather:bound"], "gives each rank its own bound"),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_a_mistake_is_one_line_naming_the_fix(argv, says, capsys):
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith(f"dblp {argv[0]}: ") and says in lines[0], err


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="drops root with setpriv")
def test_a_user_without_root_is_told_to_use_sudo(tmp_path):
    """An unprivileged user's EACCES is one line saying what to do, not a bare errno."""
    tmp_path.chmod(0o700)  # (root's: the testbed's state directory below cannot be made)
    r = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups",
                        sys.executable, "-m", "pydblp.cli", "testbed", "up"],
                       capture_output=True, text=True, timeout=60, cwd="/",
                       env={**os.environ, "DBLP_TESTBED_DIR": str(tmp_path / "testbed")})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].endswith("run it with sudo"), r.stderr
