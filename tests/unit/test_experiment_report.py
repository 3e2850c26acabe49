"""The experiment report's plots from a small synthetic report (no testbed needed)."""

from __future__ import annotations

import numpy as np
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
    (["--p-low", "1", "--arms", "static"], "--p-low 1"), (["--target", "-1"], "--target -1"),
    (["--arms", "gloo,tcp"], "--arms"),
    # the regime's knobs
    (["--rate", "0.5"], "--rate 0.5"), (["--rate", "20000"], "--rate 20000"), (["--rate", "-1"], "--rate -1"),
    # FSDP2 and the backend
    (["--algo", "fsdp", "--consistency", "sharded"], "--algo fsdp shards the model itself"),
    (["--via", "backend", "--algo", "fsdp"], "--via backend"),
    (["--via", "backend", "--consistency", "broadcast:10"], "--via backend"),
    (["--burst-ratio", "0.9,0.6"], "--burst-ratio 0.9,0.6"), (["--burst-ratio", "1.2,1.5"], "--burst-ratio"),
    (["--burst-ratio", "0.8"], "--burst-ratio 0.8"), (["--burst-port", "4"], "--burst-port 4"),
    (["--burst-port", "one"], "--burst-port one"), (["--burst-port", "-1"], "--burst-port -1"),
    (["--scenario", "paper", "--workers", "1"], "--workers 1"),
    (["--scenario", "paper", "--workers", "2", "--burst-port", "2"], "--burst-port 2"),
    (["--loss-model", "ge", "--loss", "0.85"], "--loss 0.85"), (["--ge-len", "0.5"], "--ge-len 0.5"),
    (["--ge-bad", "0"], "--ge-bad 0"), (["--ge-bad", "1.5"], "--ge-bad 1.5"),
    (["--k", "-0.1"], "--k -0.1"), (["--k", "0.99"], "--k 0.99"), (["--freq", "0"], "--freq 0"),
    (["--eta", "0"], "--eta 0"), (["--seeds", "0"], "--seeds 0"), (["--warm-up", "-1"], "--warm-up -1"),
    (["--consistency", "allgathr"], "--consistency allgathr"),
    (["--consistency", "broadcast:0"], "--consistency broadcast:0"),
    (["--consistency", "broadcast"], "--consistency broadcast"),
    (["--consistency", "sharded:all"], "--consistency sharded:all"),
    # priority and congestion
    (["--priority", "size"], "--priority size"), (["--priority", ""], "--priority"),
    (["--drop-policy", "tail"], "--drop-policy needs a queue"),
    (["--scenario", "incast", "--drop-policy", "red"], "--drop-policy red"),
    (["--queue", "0"], "--queue 0"), (["--queue", "1000", "--queue-kb", "1"], "--queue-kb 1"),
    (["--queue-kb", "64"], "--queue-kb needs a queue"), (["--queue-port", "0"], "--queue-port needs a queue"),
    (["--scenario", "incast", "--queue-port", "4"], "--queue-port 4"),
    (["--cc", "dctcp"], "--cc dctcp"), (["--mark-kb", "32"], "--mark-kb needs a queue"),
    (["--scenario", "incast", "--mark-kb", "200"], "--mark-kb 200"),
    (["--scenario", "incast", "--mark-kb", "0"], "--mark-kb 0"),
    (["--starve", "4"], "--starve 4"), (["--starve", "1:0"], "--starve 1:0"), (["--starve", "x"], "--starve x"),
    # Gloo's runs from an earlier report
    (["--gloo-from", "/nonexistent/report.json"], "--gloo-from /nonexistent/report.json: not a dblp experiment"),
    (["--gloo-from", "/nonexistent/report.json", "--arms", "gloo,dblp"], "--gloo-from /nonexistent/report.json: "
                                                                          "Gloo's runs come from the report")])
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


def test_experiment_tol_bound_follows_the_arms(capsys, monkeypatch):
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
        assert cli.main(["experiment", "--p-low", "0.7", "--arms", "gloo,static"]) == 2
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
        cli.main(["experiment", "--consistency", "sharded:whole"])
        cli.main(["experiment", "--rate", "0", "--algo", "fsdp", "--consistency", "none"])
        cli.main(["experiment", "--via", "backend", "--stagger", "off", "--warm-up", "0"])
    finally:
        signal.signal(signal.SIGTERM, old)
    paper, base = runner.SCENARIOS["paper"], runner.Options()
    assert (seen[0].steps, seen[0].bursts) == (paper["steps"], paper["bursts"]) != (base.steps, base.bursts)
    assert seen[0].burst_ports == base.burst_ports == (1,) and seen[0].rate_mbit is None
    assert (seen[1].burst_ports, seen[1].loss, seen[1].rate_mbit) == ("all", 0.02, 200.0)
    assert seen[1].burst_ratio == (0.7, 0.8) and seen[1].consistency == "broadcast:5"
    assert seen[1].steps == paper["steps"]
    assert (seen[0].consistency, seen[0].g_over) == ("sharded", "window") != (base.consistency, base.g_over)
    assert seen[2].consistency == "sharded:whole"
    assert (seen[3].rate_mbit, seen[3].algo, seen[3].consistency) == (0.0, "fsdp", "none")  # 0: no link limit
    assert (seen[4].via, seen[4].algo, base.via, base.algo) == ("backend", "ddp", "hook", "ddp")
    assert (seen[4].stagger, seen[0].stagger, base.stagger) == ("off", "on", "on")
    assert (seen[4].warm_up, seen[0].warm_up, base.warm_up) == (0, 2, 2)


def test_ge_params_give_the_asked_mean_loss_and_run_length():
    from pydblp.experiment import runner

    for loss, length, bad in ((0.05, 8, 0.8), (0.1, 20, 1.0), (0.3, 2, 0.5)):
        p, r = runner.ge_params(loss, length, bad)
        assert 1 / r == pytest.approx(length) and p * bad / (p + r) == pytest.approx(loss)


def _summary(arm, wall, ttt, div, relaxed=0.6):
    return {"arm": arm, "wall_s": wall, "time_to_target_s": ttt, "final_metric": 0.9, "metric": "accuracy",
            "retransmit_bytes": 2816, "divergence_max": div, "phase_identical": True,
            "delivered_by_phase": {"critical": 0.99, "relaxed": relaxed},
            "rounds_by_phase": {"critical": 10, "relaxed": 20},
            "bound_by_phase": {"critical": 0.016, "relaxed": 1 - relaxed - 0.01}}


def test_aggregate_and_table_show_mean_and_spread_over_seeds():
    from pydblp.experiment import runner

    per_seed = [{"static": _summary("static", 10.0, 8.0, 0.0), "dblp": _summary("dblp", 8.0, 6.0, 1e-3)},
                {"static": _summary("static", 12.0, None, 0.0), "dblp": _summary("dblp", 6.0, 4.0, 3e-3, 0.8)}]
    mean, spread = runner.aggregate(per_seed)
    assert mean["dblp"]["wall_s"] == 7.0 and spread["dblp"]["wall_s"] == 1.0
    assert mean["static"]["time_to_target_s"] == 8.0 and mean["static"]["time_to_target_s_n"] == 1
    assert mean["dblp"]["divergence_max"] == pytest.approx(2e-3) and mean["dblp"]["phase_identical"] is True
    rep = {"summary": mean, "spread": spread, "target": [0.9, 0.92],
           "speedup": {"dblp_vs_static": {"wall_s": 1.5}}}
    text = report.table(rep)
    assert "7.0 +-1.0" in text and "0.91 (mean of 2)" in text and "speedup dblp vs static: wall 1.50x" in text
    # static reached the target in one seed of two: its cell is that seed's, and says so
    row = next(ln for ln in text.splitlines() if ln.startswith("time to held-out loss"))
    assert "8.0 (1 of 2)" in row and "5.0 +-1.0" in row and "(2 of 2)" not in row
    assert "phase decisions identical on every rank" in text
    # by phase: means over the seeds, each with the phase's mean bound
    assert "relaxed 0.7000 (20 rounds, bound 29.0 %)" in text and "critical 0.9900 (10 rounds, bound 1.6 %)" in text


def _options(monkeypatch, *argv):
    """What ``dblp experiment ARGV`` would run (the runner stands in, records, stops)."""
    import signal

    from pydblp import cli
    from pydblp.experiment import runner

    seen = []
    monkeypatch.setattr(runner, "run", lambda opt: (seen.append(opt), (_ for _ in ()).throw(RuntimeError("x"))))
    old = signal.getsignal(signal.SIGTERM)
    try:
        cli.main(["experiment", *argv])
    finally:
        signal.signal(signal.SIGTERM, old)
    return seen[0]


def test_incast_scenario_runs_each_pydblp_rule_with_both_queue_policies(monkeypatch):
    from pydblp.experiment import runner

    opt = _options(monkeypatch, "--scenario", "incast", "--priority", "magnitude,layer")
    assert opt.mode == "ps" and opt.loss == 0 and opt.bursts == 0 and opt.queue_mbit
    assert runner.queue_ports(opt) == (0,)  # the parameter server's port: where the traffic converges
    names = [a.name for a in runner.arms(opt)]
    assert names == ["gloo", "dblp/magnitude/priority", "dblp/magnitude/tail", "dblp/layer/priority",
                     "dblp/layer/tail"]
    assert {(a.priority, a.drop_policy) for a in runner.arms(opt)[1:]} == {
        (p, d) for p in ("magnitude", "layer") for d in ("priority", "tail")}
    # one rule, one policy: the run keeps the arm's own name (the demo's table is unchanged)
    demo = _options(monkeypatch)
    assert [a.name for a in runner.arms(demo)] == ["gloo", "static", "dblp"] and demo.queue_mbit is None
    given = _options(monkeypatch, "--queue", "500", "--queue-port", "1,2", "--starve", "2", "--arms", "dblp")
    assert (given.queue_mbit, given.queue_ports, given.starve) == (500.0, (1, 2), (2, 0.3))


def test_cc_modes_are_one_run_each_and_the_queue_marks_where_asked(monkeypatch):
    from pydblp.experiment import runner

    opt = _options(monkeypatch, "--scenario", "incast", "--drop-policy", "tail", "--cc", "off,ecn", "--mark-kb", "32")
    assert [(a.name, a.cc) for a in runner.arms(opt)] == [
        ("gloo", "ecn"), ("dblp/cc-off", "off"), ("dblp/cc-ecn", "ecn")]
    assert opt.mark_kb == 32.0

    class Tb:
        def queue(self, rate, **kw):
            self.kw = kw

    tb = Tb()
    runner.set_queue(tb, opt, runner.arms(opt)[1])
    assert tb.kw["mark"] == 32 * 1024 and tb.kw["port"] == [0]
    assert [a.name for a in runner.arms(_options(monkeypatch))] == ["gloo", "static", "dblp"]  # one mode: no suffix


def test_shed_thresholds_rank_priorities_high_in_the_buffer():
    from pydblp.experiment import runner

    t = runner.shed_thresholds(128 * 1024)
    assert t[0] == 0 and list(t[1:]) == sorted(t[1:], reverse=True)  # prio 7 sheds first, prio 0 never
    assert t[7] > 128 * 1024 // 2 and t[1] < 128 * 1024


def test_policy_ratios_and_drop_rows_in_the_table():
    from pydblp.experiment import runner

    run = runner.Run("dblp/magnitude/priority", fabric={"tail": 5, "bound": 2, "early3": 4, "early7": 10},
                     host=[{"shed": [0, 1, 0, 0, 0, 0, 0, 6]}, None, {"shed": [0] * 7 + [3]}])
    drops = runner.drop_summary(run)
    assert drops["queue_tail_drops"] == 5 and drops["queue_early_drops"] == 14
    assert drops["queue_early_by_prio"] == [0, 0, 0, 4, 0, 0, 0, 10] and drops["queue_bound_refusals"] == 2
    assert drops["host_shed"] == 10 and drops["host_shed_by_prio"] == [0, 1, 0, 0, 0, 0, 0, 9]
    assert drops["host_shed_by_rank"] == [7, None, 3]
    assert runner.drop_summary(runner.Run("gloo"))["queue_tail_drops"] is None
    pri = {**_summary("dblp/magnitude/priority", 8.0, 4.0, 0.0), **drops, "delivered": 0.90}
    tail = {**_summary("dblp/magnitude/tail", 10.0, 6.0, 0.0), "final_metric": 0.85, "delivered": 0.92,
            "queue_tail_drops": 30, "queue_early_drops": 0}
    ratios = report.policy_ratios({"dblp/magnitude/priority": pri, "dblp/magnitude/tail": tail})
    r = ratios["dblp/magnitude/priority_vs_tail"]
    assert r["time_to_target_s"] == 1.5 and r["wall_s"] == 1.25
    assert r["final_gain"] == pytest.approx(0.05) and r["delivered_gain"] == pytest.approx(-0.02)
    per_seed = [{"dblp/magnitude/priority": pri, "dblp/magnitude/tail": tail}] * 2
    mean, spread = runner.aggregate(per_seed)
    assert mean["dblp/magnitude/priority"]["queue_early_by_prio"] == [0, 0, 0, 4, 0, 0, 0, 10]
    text = report.table({"summary": mean, "spread": spread, "target": 0.9, "speedup": ratios})
    assert "queue tail drops (packets)" in text and "host-program sheds (packets)" in text
    assert "dblp/magnitude/priority: queue early drops by priority 0..7: 0 0 0 4 0 0 0 10" in text
    assert "dblp/magnitude/priority vs drop-tail: time_to_target 1.50x" in text
    # no queue, no host program: the drop rows are left out
    plain = report.table({"summary": {"gloo": _summary("gloo", 5.0, 4.0, 0.0)}, "speedup": {}})
    assert "queue tail drops" not in plain and "host-program sheds" not in plain


def test_summary_carries_the_gradient_error_mean():
    from pydblp.experiment import runner

    steps = [{"step": i, "sync": 0.01, "t0": float(i), "dt": 0.02, "opt": 0.001} for i in range(10)]
    run = runner.Run("dblp", steps=steps, evals=[{"eval": 0.9, "metric": "accuracy", "loss": 0.3, "t": 1.0, "step": 9}],
                     gerrs=[{"gerr": 0.1, "step": 0}, {"gerr": 0.3, "step": 5}], final={"wall": 1.0})
    run.final["rounds"] = [{"phase": "critical" if i < 10 else "relaxed", "delivered": 1.0, "retx": 0,
                            "below": 0, "tol": 0.0} for i in range(20)]  # two rounds a step
    s = runner.summarize(run, runner.Options(), target=0.35)
    assert s["grad_error"] == pytest.approx(0.2) and s["time_to_target_s"] == 1.0
    assert s["grad_error_by_phase"] == pytest.approx({"critical": 0.1, "relaxed": 0.3})
    assert runner.summarize(runner.Run("gloo", steps=steps), runner.Options(), None)["grad_error"] is None
    text = report.table({"summary": {"dblp": s}, "speedup": {}})
    assert "gradient error" in text and "dblp: gradient error by phase: critical 0.1000, relaxed 0.3000" in text


def test_the_ranks_cpu_is_summed_shown_and_paired(monkeypatch):
    from pydblp.experiment import runner

    monkeypatch.setattr(runner.os, "cpu_count", lambda: 2)
    steps = [{"step": i, "sync": 0.01, "t0": float(i), "dt": 0.02, "opt": 0.001} for i in range(10)]

    def summary(arm, cpu):
        return runner.summarize(runner.Run(arm, steps=steps, final={"wall": 4.0, "cpu": cpu}), runner.Options(), None)

    s = summary("dblp", [1.0, 2.0, 3.0, 0.5])
    assert s["cpu_s"] == pytest.approx(6.5) and s["cpu_busy"] == pytest.approx(6.5 / (4.0 * 2))
    assert summary("gloo", None)["cpu_s"] is None and summary("gloo", [1.0, None])["cpu_busy"] is None
    text = report.table({"summary": {"dblp": s}, "speedup": {}})
    assert "CPU, all ranks (s)" in text and "share of the machine's CPUs busy" in text
    assert "CPU, all ranks" not in report.table({"summary": {"gloo": summary("gloo", None)}, "speedup": {}})
    seeds = [{"summary": {"static": summary("static", [2.0] * 4), "dblp": summary("dblp", [1.0 + i] * 4)}}
             for i in range(3)]
    r = report.ratios(seeds)["dblp / static"]["cpu_s"]
    assert r["ratio"] == pytest.approx(1.0) and r["per_seed"] == pytest.approx([0.5, 1.0, 1.5])
    assert "CPU 1.00x (90 % CI" in "\n".join(report.ratio_lines({"ratios": report.ratios(seeds)}))


def test_consistency_specs_map_to_the_collective_s_knobs():
    from pydblp.experiment.worker import consistency

    assert consistency("allgather") == ({"consistent": True}, 0, False)
    assert consistency("sharded") == ({"consistent": False}, 0, True)
    assert consistency("sharded:whole") == ({"consistent": True}, 0, True)
    assert consistency("broadcast:7") == ({"consistent": False}, 7, False)
    with pytest.raises(ValueError, match="sharded"):
        consistency("sharded:2")


def test_time_to_target_is_the_smoothed_held_out_loss_crossing_interpolated():
    """The loss curve is smoothed over 3 evaluations and the crossing interpolated between the
    two evaluations around it; Gloo's target is its smoothed loss at 80 % of its steps."""
    from pydblp.experiment import runner, stats

    losses = [2.0, 1.6, 1.2, 1.0, 0.9, 0.85, 0.8, 0.82, 0.78, 0.8]
    evals = [{"eval": 0.5, "metric": "accuracy", "loss": v, "t": 2.0 * (i + 1), "step": 10 * (i + 1) - 1}
             for i, v in enumerate(losses)]
    sm = stats.smooth(losses)
    assert sm[0] == pytest.approx(1.8) and sm[1] == pytest.approx(1.6) and sm[-1] == pytest.approx(0.79)
    run = runner.Run("gloo", evals=evals)
    opt = runner.Options(steps=100)
    target = runner.gloo_target(run, opt)  # step 80: the 8th evaluation's smoothed loss
    assert target == pytest.approx(sm[7])
    # first smoothed value at or below 1.3: between t=4 (1.6) and t=6 (1.2667)
    t = stats.first_crossing([e["t"] for e in evals], sm, 1.3)
    assert 4.0 < t < 6.0 and t == pytest.approx(4.0 + 2.0 * (1.6 - 1.3) / (1.6 - sm[2]))
    assert stats.first_crossing([1, 2], [1.0, 0.9], 0.5) is None
    assert stats.first_crossing([1, 2], [0.4, 0.3], 0.5) == 1.0


def test_interval_of_a_ratio_over_seeds():
    from pydblp.experiment import stats

    b = stats.ratio_interval([8.0, 9.0, 7.0, 8.0], [10.0, 10.0, 10.0, 10.0])
    assert b["ratio"] == pytest.approx(0.8) and b["n"] == 4 and b["per_seed"] == pytest.approx([0.8, 0.9, 0.7, 0.8])
    # log R +- t(0.95, 3) * sd(a) / (mean(a) sqrt(4)): the base does not vary here
    half = 2.3533636 * np.std([8.0, 9.0, 7.0, 8.0], ddof=1) / 8.0 / 2
    assert (b["lo"], b["hi"]) == pytest.approx((0.8 * np.exp(-half), 0.8 * np.exp(half)), rel=1e-6)
    wide = stats.ratio_interval([4.0, 13.0, 6.0, 9.0], [10.0, 10.0, 10.0, 10.0])
    assert wide["hi"] - wide["lo"] > b["hi"] - b["lo"]
    # paired seeds: a base that moves with the arm narrows the interval
    paired = stats.ratio_interval([8.0, 9.0, 7.0, 8.0], [10.0, 11.25, 8.75, 10.0])
    assert paired["ratio"] == pytest.approx(0.8) and paired["hi"] - paired["lo"] < 1e-6
    one = stats.ratio_interval([8.0, None], [10.0, 10.0])
    assert one["n"] == 1 and one["lo"] is None
    assert stats.ratio_interval([None], [1.0]) is None


def test_student_t_quantiles():
    """Against the tables (two-sided 90 % and 95 % for a few degrees of freedom)."""
    from pydblp.experiment import stats

    table = {(0.95, 1): 6.313752, (0.95, 3): 2.353363, (0.95, 5): 2.015048, (0.975, 5): 2.570582,
             (0.95, 30): 1.697261, (0.975, 2): 4.302653}
    for (p, df), want in table.items():
        assert stats.t_quantile(p, df) == pytest.approx(want, rel=1e-6)
        assert stats.t_quantile(1 - p, df) == pytest.approx(-want, rel=1e-6)
    with pytest.raises(ValueError):
        stats.t_quantile(1.0, 3)


def test_the_90_percent_intervals_cover_90_percent_with_few_seeds():
    """Simulated per-seed times with a known ratio of means (seed-to-seed spread, lognormal
    noise; seeded): over 4 and over 6 seeds the intervals hold it 85-95 % of the time.  A
    percentile bootstrap of the same runs holds it ~75-80 %: it is the check that fails."""
    from pydblp.experiment import stats

    rng = np.random.default_rng(7)
    for n in (4, 6):
        hits = {"ratio": 0, "geomean": 0, "bootstrap": 0}
        trials = 600
        for _ in range(trials):
            base = 30 * np.exp(rng.normal(0, 0.15, n))
            b = base * np.exp(rng.normal(0, 0.1, n))
            a = 0.7 * base * np.exp(rng.normal(0, 0.2, n))
            true = 0.7 * np.exp(0.2 ** 2 / 2 - 0.1 ** 2 / 2)  # E[a] / E[b]
            r = stats.ratio_interval(a, b)
            hits["ratio"] += r["lo"] <= true <= r["hi"]
            g = stats.geomean_interval(a / b)
            hits["geomean"] += g["lo"] <= 0.7 <= g["hi"]
            idx = rng.integers(0, n, (2000, n))
            boot = np.percentile(a[idx].mean(axis=1) / b[idx].mean(axis=1), [5, 95])
            hits["bootstrap"] += boot[0] <= true <= boot[1]
        cover = {k: v / trials for k, v in hits.items()}
        assert 0.85 <= cover["ratio"] <= 0.95 and 0.85 <= cover["geomean"] <= 0.95, (n, cover)
        assert cover["bootstrap"] < 0.84, (n, cover)


def test_ratios_pair_each_dblp_arm_with_its_static_and_gloo():
    per = lambda arm, ttt, wall, q, metric="accuracy": {"arm": arm, "time_to_target_s": ttt, "wall_s": wall,
                                                      "final_metric": q, "metric": metric}
    seeds = [{"summary": {"gloo": per("gloo", 30.0, 100.0, 0.97), "static": per("static", 10.0, 50.0, 0.97),
                          "dblp": per("dblp", 8.0 + i, 38.0, 0.968), "dblp/ef": per("dblp/ef", 7.0, 37.0, 0.97)}}
             for i in range(3)]
    r = report.ratios(seeds)
    assert set(r) == {"dblp / static", "dblp/ef / static", "dblp / gloo", "dblp/ef / gloo", "static / gloo"}
    assert r["dblp / static"]["time_to_target_s"]["ratio"] == pytest.approx(0.9)
    assert r["dblp/ef / gloo"]["wall_s"]["ratio"] == pytest.approx(0.37)
    assert r["dblp / gloo"]["final_quality"]["mean"] == pytest.approx(-0.2)
    text = "\n".join(report.ratio_lines({"ratios": r}))
    assert "dblp / static: time to target 0.90x (90 % CI" in text and "3 seeds: 0.80 0.90 1.00)" in text
    assert "final quality -0.20 accuracy points" in text


def test_ratios_pair_a_run_with_congestion_control_with_the_same_run_without():
    """``--cc off,ecn`` (the incast): each ``cc-ecn`` arm against its ``cc-off`` twin, with the
    interval over seeds; arms without a twin get no pair."""
    from pydblp.experiment import runner

    opt = runner.options("incast", cc=("off", "ecn"), drop_policy=("priority", "tail"))
    names = [a.name for a in runner.arms(opt)]
    assert report._off_pairs(names) == [("dblp/magnitude/priority/cc-ecn", "dblp/magnitude/priority/cc-off"),
                                       ("dblp/magnitude/tail/cc-ecn", "dblp/magnitude/tail/cc-off")]
    assert report._off_pairs(["dblp/cc-ecn/none", "dblp/cc-off/none", "dblp/cc-ecn/ef"]) == \
        [("dblp/cc-ecn/none", "dblp/cc-off/none")]
    per = lambda arm, ttt, wall: {"arm": arm, "time_to_target_s": ttt, "wall_s": wall}
    seeds = [{"summary": {"gloo": per("gloo", 20.0, 25.0), "dblp/cc-off": per("dblp/cc-off", 70.0, 85.0),
                          "dblp/cc-ecn": per("dblp/cc-ecn", 70.0 + 7 * i, 89.25)}} for i in range(3)]
    r = report.ratios(seeds)["dblp/cc-ecn / dblp/cc-off"]
    assert r["time_to_target_s"]["ratio"] == pytest.approx(1.1) and r["wall_s"]["ratio"] == pytest.approx(1.05)
    text = "\n".join(report.ratio_lines({"ratios": report.ratios(seeds)}))
    assert "dblp/cc-ecn / dblp/cc-off: time to target 1.10x (90 % CI" in text


def test_the_static_arm_runs_its_own_relaxations_and_each_dblp_arm_finds_its_twin():
    from pydblp.experiment import runner

    opt = runner.Options(arms=("gloo", "static", "dblp"), relax=("none", "ef", "rotate"), static_relax=("none", "ef"))
    got = [(a.name, a.method, a.relax) for a in runner.arms(opt)]
    assert got == [("gloo", "gloo", "none"), ("static/none", "static", "none"), ("static/ef", "static", "ef"),
                   ("dblp/none", "dblp", "none"), ("dblp/ef", "dblp", "ef"), ("dblp/rotate", "dblp", "rotate")]
    assert report._dblp_pairs([n for n, _, _ in got]) == [("dblp/none", "static/none"), ("dblp/ef", "static/ef"),
                                                          ("dblp/rotate", "static/none")]
    plain = [a.name for a in runner.arms(runner.Options())]
    assert plain == ["gloo", "static", "dblp"]


def test_seeds_alternate_the_order_of_their_runs():
    """Even seeds run the arms as given, odd ones in reverse, so over an even number of seeds
    every arm holds each place equally often; while the bursts' length is still to be sized,
    the first run (which sizes it) stays first."""
    from pydblp.experiment import runner

    given = runner.arms(runner.Options(relax=("none", "ef")))
    names = [a.name for a in given]
    assert names == ["gloo", "static/none", "static/ef", "dblp/none", "dblp/ef"]
    order = [[a.name for a in runner.run_order(given, nth, sized=True)] for nth in range(4)]
    assert order[0] == order[2] == names and order[1] == order[3] == names[::-1]
    for arm in names:  # (each place equally often over two seeds)
        assert order[0].index(arm) + order[1].index(arm) == len(names) - 1
    assert [a.name for a in runner.run_order(given, 1, sized=False)] == ["gloo", *names[:0:-1]]
    assert runner.run_order(given[:1], 1, sized=True) == given[:1]


def test_curve_ratio_reads_the_horizontal_distance_between_two_curves():
    from pydblp.experiment import stats

    ts = [1.0, 2.0, 3.0, 4.0, 5.0]
    loss = [1.0, 0.8, 0.6, 0.4, 0.2]
    fast = [t * 0.5 for t in ts]  # the same curve in half the time
    assert stats.curve_ratio(fast, loss, fast[-1], ts, loss, ts[-1], [0.9, 0.7, 0.5, 0.3]) == \
        (pytest.approx(0.5), 0, 0)
    # a curve that stalls above the last target counts its end: less than its time would be
    r, missed_a, missed_b = stats.curve_ratio(ts, [1.0, 0.8, 0.6, 0.6, 0.6], 5.0, ts, loss, 5.0, [0.7, 0.3])
    assert (missed_a, missed_b) == (1, 0) and r == pytest.approx(np.sqrt(1.0 * 5.0 / 4.5))
    assert stats.curve_ratio(ts, loss, 5.0, ts, loss, 5.0, [None]) is None
    g = stats.geomean_interval([0.5, 2.0, 1.0])
    assert g["ratio"] == pytest.approx(1.0) and g["lo"] < 1.0 < g["hi"] and g["n"] == 3


def test_a_run_that_never_reaches_the_target_counts_its_end_and_is_said_so():
    per = lambda arm, ttt, end: {"arm": arm, "time_to_target_s": ttt, "wall_s": end + 1,
                                 "loss_curve": [[end / 2, end], [1.0, 0.5]]}
    seeds = [{"summary": {"static": per("static", 10.0, 20.0), "dblp": per("dblp", None, 16.0)}, "curve_targets": [0.6]},
             {"summary": {"static": per("static", 10.0, 20.0), "dblp": per("dblp", 8.0, 16.0)}, "curve_targets": [0.6]}]
    r = report.ratios(seeds)["dblp / static"]
    t = r["time_to_target_s"]
    assert t["per_seed"] == pytest.approx([1.6, 0.8]) and t["censored"] == [1, 0] and t["bound"] == "lower"
    line = "\n".join(report.ratio_lines({"ratios": {"dblp / static": r}}))
    # the arm's missed run counts less time than it would have taken: its ratio is at least this
    assert "time to target >=1.20x (" in line and "never reached: dblp 1 runs" in line and "a lower bound" in line
    flipped = report.ratios([{**s, "summary": {"static": s["summary"]["dblp"], "dblp": s["summary"]["static"]}}
                             for s in seeds])["dblp / static"]["time_to_target_s"]
    assert flipped["censored"] == [0, 1] and flipped["bound"] == "upper"
    assert r["curve"]["ratio"] == pytest.approx(0.8)  # (both curves cross 0.6 at 0.9 of their span)



def _earlier_report(path, opt, seeds=(900, 901)):
    """A report.json as an earlier run with Gloo writes it: its options, and per seed a Gloo summary
    whose loss curve falls from 1.0 to 0.2 over 10 s."""
    import json
    from dataclasses import asdict

    curve = [[2.0, 4.0, 6.0, 8.0, 10.0], [1.0, 0.8, 0.6, 0.4, 0.2]]
    gloo = lambda seed: {"arm": "gloo", "wall_s": 12.0 + seed % 10, "time_to_target_s": 7.0, "final_metric": 0.96,
                         "metric": "accuracy", "loss_curve": curve}
    rep = {"options": asdict(opt), "seeds": [{"seed": s, "target": 0.5, "curve_targets": [0.9, 0.7], "burst_ms": 8.0,
                                              "summary": {"gloo": gloo(s), "static": {"arm": "static"}}}
                                             for s in seeds]}
    path.write_text(json.dumps(rep))
    return path


def test_gloo_from_carries_each_seed_s_gloo_run_over_and_refuses_what_would_change_it(tmp_path):
    """An ablation need not run Gloo again: each seed's Gloo summary, target and curve targets come
    from the earlier report; its time to target is read off its curve for this run's target.  An
    option that shapes Gloo's training or network must match; a pydblp-only one may differ, and one
    the earlier report predates counts as its default."""
    import dataclasses
    import json

    from pydblp.experiment import runner

    earlier = runner.options("paper", seed=900, seeds=2)
    path = _earlier_report(tmp_path / "report.json", earlier)
    opt = runner.options("paper", seed=900, seeds=2, arms=("static", "dblp"), relax=("none", "ef"), k=0.2,
                         plan=("off",), gloo_from=str(path))
    got = runner.earlier_gloo(opt)
    assert sorted(got) == [900, 901]
    assert got[901]["target"] == 0.5 and got[901]["curve_targets"] == [0.9, 0.7] and got[901]["burst_ms"] == 8.0
    assert got[901]["summary"]["wall_s"] == 13.0 and got[901]["summary"]["reused_from"] == str(path)
    assert runner.reused_gloo(got[900], 0.5)["time_to_target_s"] == pytest.approx(7.0)  # (0.6 at 6 s, 0.4 at 8 s)
    assert runner.reused_gloo(got[900], 0.3)["time_to_target_s"] == pytest.approx(9.0)
    assert runner.reused_gloo(got[900], 0.1)["time_to_target_s"] is None
    # a report older than an option counts it at its default: pydblp's (plan, gloo_from) never
    # matter, Gloo's do (batch: the paper's is the default; eval_every: the paper's 10 is not 25)
    assert runner.PYDBLP_ONLY <= {f.name for f in dataclasses.fields(runner.Options)}
    rep = json.loads(path.read_text())
    del rep["options"]["gloo_from"], rep["options"]["plan"], rep["options"]["batch"]
    path.write_text(json.dumps(rep))
    assert sorted(runner.earlier_gloo(opt)) == [900, 901]
    del rep["options"]["eval_every"]
    path.write_text(json.dumps(rep))
    with pytest.raises(ValueError, match="its runs had --eval-every 25 and this one 10"):
        runner.earlier_gloo(opt)
    path = _earlier_report(tmp_path / "report.json", earlier)
    for change, flag in (({"model": "lm"}, "--model"), ({"loss": 0.05}, "--loss"), ({"steps": 200}, "--steps"),
                         ({"bursts": 0}, "--bursts"), ({"consistency": "allgather"}, "--consistency")):
        bad = runner.options("paper", seed=900, seeds=2, arms=("dblp",), gloo_from=str(path), **change)
        with pytest.raises(ValueError, match=f"its runs had {flag} "):
            runner.earlier_gloo(bad)
    with pytest.raises(ValueError, match="no Gloo run of seed 902 there"):
        runner.earlier_gloo(runner.options("paper", seed=901, seeds=2, arms=("dblp",), gloo_from=str(path)))
    with pytest.raises(ValueError, match="leave gloo out of --arms"):
        runner.earlier_gloo(runner.options("paper", seed=900, seeds=2, gloo_from=str(path)))
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(ValueError, match="not a dblp experiment report.json"):
        runner.earlier_gloo(runner.options("paper", seed=900, seeds=2, arms=("dblp",), gloo_from=str(tmp_path / "junk.json")))


def test_a_reused_gloo_run_gives_the_ratios_against_gloo_and_is_named_in_the_table(tmp_path):
    from pydblp.experiment import runner

    path = _earlier_report(tmp_path / "report.json", runner.options("paper", seed=900, seeds=2))
    was = runner.earlier_gloo(runner.options("paper", seed=900, seeds=2, arms=("dblp",), gloo_from=str(path)))
    dblp = {"arm": "dblp", "time_to_target_s": 3.5, "wall_s": 6.0, "final_metric": 0.965, "metric": "accuracy",
            "loss_curve": [[1.0, 2.0, 3.0, 4.0, 5.0], [1.0, 0.8, 0.6, 0.4, 0.2]]}
    static = {**dblp, "arm": "static", "time_to_target_s": 7.0}
    seeds = [{"seed": s, "summary": {"gloo": runner.reused_gloo(was[s], 0.5), "static": static, "dblp": dblp},
              "curve_targets": was[s]["curve_targets"]} for s in (900, 901)]
    r = report.ratios(seeds)
    assert r["dblp / gloo"]["time_to_target_s"]["ratio"] == pytest.approx(0.5)
    assert r["dblp / gloo"]["curve"]["ratio"] == pytest.approx(0.5)
    assert r["dblp / gloo"]["final_quality"]["mean"] == pytest.approx(0.5)
    rep = {"summary": seeds[0]["summary"], "spread": {}, "speedup": {}, "ratios": r, "target": 0.5}
    assert f"gloo: from {path} (not run again" in report.table(rep)


def test_the_cli_and_the_worker_offer_the_controller_s_choices():
    """`dblp experiment` names --high and --g-over without importing the collective (a fast
    CLI); its choices must stay the controller's, which the worker takes from it."""
    import argparse

    from pydblp import cli
    from pydblp.collective.phase import G_OVER, HIGH
    from pydblp.experiment import worker

    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    got = {a.dest: tuple(a.choices) for a in sub.choices["experiment"]._actions if a.dest in ("high", "g_over")}
    assert got == {"high": HIGH, "g_over": G_OVER}
    a = worker.parse(["--high", "loss", "--g-over", "window"])
    assert (a.high, a.g_over) == ("loss", "window")
    with pytest.raises(SystemExit):
        worker.parse(["--high", "auto"])
