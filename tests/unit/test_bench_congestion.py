"""bench/congestion.py's incast verdict: pairs of runs, ratios of means with intervals."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("congestion_bench",
                                               Path(__file__).resolve().parents[2] / "bench" / "congestion.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _runs(times, drops):
    return [{"total_s": t, "drops_per_round": d} for t, d in zip(times, drops)]


def test_one_pair_is_judged_on_its_ratios_alone():
    v = bench.incast_verdict({"off": _runs([10.0], [5000]), "ecn": _runs([10.0], [100])}, 30)
    assert v["pairs"] == 1 and v["time"]["ratio"] == pytest.approx(1.0) and v["time"]["lo"] is None
    assert v["drops_down"] == pytest.approx(50) and v["met"]


def test_with_pairs_the_whole_interval_must_hold():
    # ecn a little faster on the mean, but one pair slower: the interval reaches past 1.0
    v = bench.incast_verdict({"off": _runs([10.0, 10.0, 10.0], [5000] * 3),
                              "ecn": _runs([9.0, 11.5, 9.0], [100, 120, 90])}, 30)
    assert v["time"]["ratio"] < 1.0 < v["time"]["hi"] and not v["met"]
    assert "MISSED" in v["says"] and "over 3 pair(s)" in v["says"]
    v = bench.incast_verdict({"off": _runs([10.0, 10.2, 9.9], [5000] * 3),
                              "ecn": _runs([9.5, 9.6, 9.4], [100, 120, 90])}, 30)
    assert v["time"]["hi"] < 1.0 and v["met"]


def test_failed_runs_and_no_drops_under_ecn():
    v = bench.incast_verdict({"off": [{"error": "x"}, *_runs([10.0], [400])],
                              "ecn": [*_runs([9.0], [0]), *_runs([9.0], [0])]}, 30)
    assert v["pairs"] == 1 and v["drops_down"] == float("inf") and "none with ecn" in v["says"]
    assert bench.incast_verdict({"off": [{"error": "x"}], "ecn": _runs([9.0], [0])}, 30) is None
