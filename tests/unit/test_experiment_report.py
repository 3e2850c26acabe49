"""The experiment report's plots from a small synthetic report (no testbed needed)."""

from __future__ import annotations

import pytest

from pydblp.experiment import report


def run(scale):
    steps = [{"t": 0.1 * i, "loss": 1.0 / (i + 1), "sync": scale * (0.01 + 0.001 * i)} for i in range(20)]
    return {"steps": steps, "evals": [{"t": 1.0, "eval": 0.9, "metric": "accuracy"}],
            "divs": [{"step": 9, "div": 1e-4 * scale}, {"step": 19, "div": 2e-4 * scale}],
            "final": {"rounds": [{"tol": 0.01 * (i % 3)} for i in range(20)],
                      "phase": {"history": [[0, 3.0, True], [10, 1.0, True], [20, 0.9, False]]}}}


def test_plots_writes_four_pngs(tmp_path):
    rep = {"runs": {"gloo": run(2.0), "dblp": run(1.0)}}
    made = report.plots(rep, tmp_path)
    assert [p.name for p in made] == ["loss_accuracy.png", "latency_cdf.png", "tolerance.png",
                                      "divergence_phase.png"]
    for p in made:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


@pytest.mark.parametrize("argv,flag", [
    (["--workers", "1"], "--workers 1"), (["--workers", "300"], "--workers 300"),
    (["--steps", "5"], "--steps 5"), (["--loss", "1.5"], "--loss 1.5"), (["--bursts", "-3"], "--bursts -3"),
    (["--burst-ms", "0"], "--burst-ms 0"), (["--p-low", "0.7"], "--p-low 0.7"),
    (["--p-low", "1", "--transports", "static"], "--p-low 1"), (["--target", "-1"], "--target -1"),
    (["--transports", "gloo,tcp"], "--transports"),
    # the regime's knobs
    (["--rate", "0"], "--rate 0"), (["--rate", "20000"], "--rate 20000"),
    (["--burst-ratio", "0.9,0.6"], "--burst-ratio 0.9,0.6"), (["--burst-ratio", "1.2,1.5"], "--burst-ratio"),
    (["--burst-ratio", "0.8"], "--burst-ratio 0.8"), (["--burst-port", "4"], "--burst-port 4"),
    (["--burst-port", "one"], "--burst-port one"), (["--burst-port", "-1"], "--burst-port -1"),
    (["--scenario", "paper", "--workers", "1"], "--workers 1"),
    (["--scenario", "paper", "--workers", "2", "--burst-port", "2"], "--burst-port 2"),
    (["--loss-model", "ge", "--loss", "0.85"], "--loss 0.85"), (["--ge-len", "0.5"], "--ge-len 0.5"),
    (["--ge-bad", "0"], "--ge-bad 0"), (["--ge-bad", "1.5"], "--ge-bad 1.5"),
    (["--k", "-0.1"], "--k -0.1"), (["--k", "0.99"], "--k 0.99"), (["--freq", "0"], "--freq 0"),
    (["--eta", "0"], "--eta 0"), (["--seeds", "0"], "--seeds 0"),
    (["--consistency", "allgathr"], "--consistency allgathr"),
    (["--consistency", "broadcast:0"], "--consistency broadcast:0"),
    (["--consistency", "broadcast"], "--consistency broadcast")])
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
        assert cli.main(["experiment", "--p-low", "0.7", "--transports", "gloo,static"]) == 2
    finally:
        signal.signal(signal.SIGTERM, old)
    assert [o.p_low for o in seen] == [0.7] and "stopped by the test" in capsys.readouterr().err


def test_experiment_scenario_presets_yield_to_given_options(monkeypatch):
    """--scenario paper fills what is not given; what is given wins, 'all' ports included."""
    import signal

    from pydblp import cli
    from pydblp.experiment import runner

    seen = []
    monkeypatch.setattr(runner, "run", lambda opt: (seen.append(opt), (_ for _ in ()).throw(RuntimeError("x"))))
    old = signal.getsignal(signal.SIGTERM)
    try:
        cli.main(["experiment", "--scenario", "paper"])
        cli.main(["experiment", "--scenario", "paper", "--burst-port", "all", "--loss", "0.02", "--rate", "200",
                  "--burst-ratio", "0.7,0.8", "--consistency", "broadcast:5"])
    finally:
        signal.signal(signal.SIGTERM, old)
    paper, base = runner.SCENARIOS["paper"], runner.Options()
    assert (seen[0].steps, seen[0].bursts) == (paper["steps"], paper["bursts"]) != (base.steps, base.bursts)
    assert seen[0].burst_ports == base.burst_ports == (1,) and seen[0].rate_mbit is None
    assert (seen[1].burst_ports, seen[1].loss, seen[1].rate_mbit) == ("all", 0.02, 200.0)
    assert seen[1].burst_ratio == (0.7, 0.8) and seen[1].consistency == "broadcast:5"
    assert seen[1].steps == paper["steps"]


def test_ge_params_give_the_asked_mean_loss_and_run_length():
    from pydblp.experiment import runner

    for loss, length, bad in ((0.05, 8, 0.8), (0.1, 20, 1.0), (0.3, 2, 0.5)):
        p, r = runner.ge_params(loss, length, bad)
        assert 1 / r == pytest.approx(length) and p * bad / (p + r) == pytest.approx(loss)


def _summary(tr, wall, ttt, div):
    return {"transport": tr, "wall_s": wall, "time_to_target_s": ttt, "final_metric": 0.9, "metric": "accuracy",
            "retransmit_bytes": 2816, "divergence_max": div, "phase_identical": True,
            "delivered_by_phase": {"critical": 0.99}, "rounds_by_phase": {"critical": 10}}


def test_aggregate_and_table_show_mean_and_spread_over_seeds():
    from pydblp.experiment import runner

    per_seed = [{"static": _summary("static", 10.0, 8.0, 0.0), "dblp": _summary("dblp", 8.0, 6.0, 1e-3)},
                {"static": _summary("static", 12.0, None, 0.0), "dblp": _summary("dblp", 6.0, 4.0, 3e-3)}]
    mean, spread = runner.aggregate(per_seed)
    assert mean["dblp"]["wall_s"] == 7.0 and spread["dblp"]["wall_s"] == 1.0
    assert mean["static"]["time_to_target_s"] == 8.0 and mean["static"]["time_to_target_s_n"] == 1
    assert mean["dblp"]["divergence_max"] == pytest.approx(2e-3) and mean["dblp"]["phase_identical"] is True
    rep = {"summary": mean, "spread": spread, "target": [0.9, 0.92],
           "speedup": {"dblp_vs_static": {"wall_s": 1.5}}}
    text = report.table(rep)
    assert "7.0 +-1.0" in text and "0.91 (mean of 2)" in text and "speedup dblp vs static: wall 1.50x" in text
    assert "phase decisions identical on every rank" in text
