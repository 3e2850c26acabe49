"""How the experiment runner judges its ranks' exits (real subprocesses, no testbed): a rank that
crashes while closing, after the run's result came in, costs no figure; one that crashes before
fails the run with its log's tail."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from pydblp.experiment.runner import Arm, Options, run_arm

STEP = '{"step": 0, "t": 0.1, "t0": 0.0, "loss": 1.0, "sync": 0.01}'
FINAL = '{"final": true, "host": []}'


class Ranks:
    """Stands in for the testbed's ``popen``: rank r runs ``scripts[r]`` (Python) instead of a worker."""

    rate_bps = 10**9

    def __init__(self, scripts):
        self.scripts = scripts
        self.argv = {}  # rank -> the worker command line it would have run

    def addr(self, r):
        return "198.18.0.1"

    def group(self, port):
        return []

    def popen(self, r, argv, **kw):
        self.argv[r] = argv
        return subprocess.Popen([sys.executable, "-c", self.scripts[r], *argv[3:]], **kw)  # (its flags: sys.argv)


def run(tmp_path, scripts, ranks=None):
    opt = Options(workers=len(scripts), steps=1, out_dir=str(tmp_path), timeout=60)
    return run_arm(ranks or Ranks(scripts), opt, Arm("gloo", "gloo"), 0, [], [0.01])


def test_each_rank_is_told_its_arm(tmp_path):
    from pydblp.experiment import worker

    ranks = Ranks([f"print({STEP!r}); print({FINAL!r})"] * 2)
    got = run(tmp_path, ranks.scripts, ranks)
    assert got.arm == "gloo" and got.setup["method"] == "gloo"
    for r, argv in ranks.argv.items():
        assert argv[1:3] == ["-m", "pydblp.experiment.worker"]
        a = worker.parse(argv[3:])
        assert (a.arm, a.rank) == ("gloo", r)


def test_a_crash_while_closing_after_the_result_keeps_it(tmp_path, caplog):
    rank0 = f"import os, sys; print({STEP!r}); print({FINAL!r}); sys.stdout.flush(); os.abort()"
    with caplog.at_level(logging.WARNING, "pydblp.experiment.runner"):
        got = run(tmp_path, [rank0, "pass"])
    assert got.final == {"final": True} and len(got.steps) == 1
    assert "rank 0 exited with status -6 after the run's result came in" in caplog.text


def test_a_crash_before_the_result_fails_the_run_with_its_log(tmp_path):
    rank0 = f"import os, sys; print({STEP!r}); sys.stdout.flush(); sys.stderr.write('boom\\n'); os.abort()"
    with pytest.raises(RuntimeError, match=r"gloo: rank\(s\) \[0\] failed: boom"):
        run(tmp_path, [rank0, "import time; time.sleep(30)"])


def test_another_rank_failing_first_fails_the_run(tmp_path):
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] failed: bad input"):
        run(tmp_path, ["import time; time.sleep(30)", "import sys; sys.stderr.write(\"bad input\\n\"); sys.exit(3)"])


def test_the_ranks_share_an_alignment_directory_removed_after_the_run(tmp_path):
    # rank 1 leaves a file in the directory its --align names; rank 0 reports a step once it sees it
    where = "import os, sys, time; d = sys.argv[sys.argv.index('--align') + 1]\n"
    rank0 = where + f"while not os.listdir(d): time.sleep(0.01)\nprint({STEP!r}); print({FINAL!r})"
    rank1 = where + "open(os.path.join(d, '1'), 'x').close()"
    ranks = Ranks([rank0, rank1])
    got = run(tmp_path, ranks.scripts, ranks)
    assert got.final and len(got.steps) == 1
    dirs = {argv[argv.index("--align") + 1] for argv in ranks.argv.values()}
    assert len(dirs) == 1
    assert not os.path.exists(dirs.pop())


def test_a_rank_that_cannot_start_ends_the_ones_started_before_it(tmp_path):
    class Refuses(Ranks):
        def __init__(self, scripts):
            super().__init__(scripts)
            self.started = []

        def popen(self, r, argv, **kw):
            if r == 2:
                raise OSError(24, "Too many open files")
            p = super().popen(r, argv, **kw)
            self.started.append(p)
            return p

    ranks = Refuses(["import time; time.sleep(30)"] * 3)
    with pytest.raises(OSError, match="Too many open files"):
        run(tmp_path, ranks.scripts, ranks)
    assert len(ranks.started) == 2 and all(p.poll() is not None for p in ranks.started)
    align = ranks.argv[0][ranks.argv[0].index("--align") + 1]
    assert not os.path.exists(align)
