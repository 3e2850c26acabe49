"""The experiment report's plots from a small synthetic report (no testbed needed)."""

from __future__ import annotations

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
