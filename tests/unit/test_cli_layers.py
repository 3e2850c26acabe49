"""The CLI modules: no import cycle (the testbed subcommands do not need the entry point), and
one parser class whose mistakes are one line."""

from __future__ import annotations

import subprocess
import sys

import pytest


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


def test_an_argparse_mistake_is_one_line_pointing_at_help(capsys):
    """A bad choice or type anywhere in ``dblp`` (argparse's own checks) is one line on stderr
    naming the option and the command's ``--help``, not the whole usage block."""
    from pydblp import cli

    for argv, says in ((["experiment", "--g-over", "x"], "dblp experiment: argument --g-over: invalid choice"),
                       (["testbed", "up", "--workers", "x"], "dblp testbed up: argument --workers"),
                       (["lod"], "dblp: argument COMMAND: invalid choice: 'lod'")):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and err.startswith(says) and "--help)" in err, err
