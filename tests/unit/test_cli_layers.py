"""The CLI modules form no import cycle: the testbed subcommands do not need the entry point."""

from __future__ import annotations

import subprocess
import sys


def test_testbed_cli_imports_without_the_top_level_cli():
    code = ("import sys, argparse, pydblp.testbed.cli as t\n"
            "p = argparse.ArgumentParser(); sub = p.add_subparsers()\n"
            "t.add_testbed(sub); t.add_fault(sub)\n"
            "assert 'pydblp.cli' not in sys.modules, 'pydblp.testbed.cli imported pydblp.cli'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_usage_error_of_the_testbed_module_is_one_line(capsys):
    from pydblp import cli

    assert cli.main(["testbed", "exec", "w0"]) == 2
    err = capsys.readouterr().err
    assert err == "dblp testbed: no command: dblp testbed exec w0 -- CMD [ARGS...]\n"
