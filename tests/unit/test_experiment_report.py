"""The experiment report's plots from a small synthetic report (no testbed needed)."""

from __future__ import annotations

import pytest

from pydblp.experiment import report


def run(scale):
    steps = [{"t": 0.1 * i, "loss": 1.0 / (i + 1), "sync": scale * (0.01 + 0.001 * i)} for i in range(20)]
    return {"steps": steps, "evals": [{"t": 1.0, "eval": 0.9, "metric": "accuracy"}],
            "final": {"rounds": [{"tol": 0.01 * (i % 3)} for i in range(20)]}}


def test_plots_writes_three_pngs(tmp_path):
    rep = {"runs": {"gloo": run(2.0), "dblp": run(1.0)}}
    made = report.plots(rep, tmp_path)
    assert [p.name for p in made] == ["loss_accuracy.png", "latency_cdf.png", "tolerance.png"]
    for p in made:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


@pytest.mark.parametrize("argv,flag", [
    (["--workers", "1"], "--workers 1"), (["--workers", "300"], "--workers 300"),
    (["--steps", "5"], "--steps 5"), (["--loss", "1.5"], "--loss 1.5"), (["--bursts", "-3"], "--bursts -3"),
    (["--burst-ms", "0"], "--burst-ms 0"), (["--tol", "0.7"], "--tol 0.7"),
    (["--tol", "1", "--transports", "static"], "--tol 1"), (["--target", "-1"], "--target -1"),
    (["--transports", "gloo,tcp"], "--transports")])
def test_experiment_arguments_refused_in_one_line_before_anything_runs(argv, flag, capsys, monkeypatch):
    """Each bad argument gets its own one-line error naming it (``--bursts -3`` used to start a
    300-step run); nothing is built or trained."""
    import signal

    from pydblp import cli
    from pydblp.experiment import runner

    monkeypatch.setattr(runner, "run", lambda opt: pytest.fail(f"ran with {opt}"))
    old = signal.getsignal(signal.SIGTERM)
    try:
        assert cli.main(["experiment", *argv]) == 2
    finally:
        signal.signal(signal.SIGTERM, old)
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"dblp experiment: {flag}") and "\n" not in err, err


def test_experiment_tol_bound_follows_the_transports(capsys, monkeypatch):
    """DBLP's P_high = tol + DBLP_K must stay below 1; without dblp any tol in [0, 1) is a static one."""
    import signal

    from pydblp import cli
    from pydblp.collective.phase import DBLP_K, Dblp
    from pydblp.experiment import runner

    def run(opt):  # stands in for the testbed run: record what it was asked, stop there
        seen.append(opt)
        raise RuntimeError("stopped by the test")

    seen = []
    monkeypatch.setattr(runner, "run", run)
    assert Dblp().k == DBLP_K
    old = signal.getsignal(signal.SIGTERM)
    try:
        assert cli.main(["experiment", "--tol", "0.7", "--transports", "gloo,static"]) == 2
    finally:
        signal.signal(signal.SIGTERM, old)
    assert [o.tol for o in seen] == [0.7] and "stopped by the test" in capsys.readouterr().err
