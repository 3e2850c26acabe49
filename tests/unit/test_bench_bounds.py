"""bench/allreduce.py's bound on burst rounds: the least any transport can take on rate-limited links."""

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("allreduce_bench",
                                               Path(__file__).resolve().parents[2] / "bench" / "allreduce.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

GBIT = 10**9
LINK_1MIB_4W = 1.5 * 2**20 * 8 / GBIT  # a rank's 2 (W-1)/W x 1 MiB through 1 Gbit/s, seconds


def _run() -> dict:
    """One repeat's 8 MiB burst blocks, as allreduce.py records them (seconds)."""
    return {"gloo": {"8": {"burst": {"burst_med": 0.330, "burst_len": 0.111}}},
            "udp": {"8": {"burst": {"burst_med": 0.250, "burst_len": 0.111}}}}


def test_without_a_burst_it_is_the_link_time_of_the_data():
    assert bench.burst_round_least(1, 4, 0.0, 0.8, 0.0, GBIT) == pytest.approx(LINK_1MIB_4W)
    assert bench.burst_round_least(1, 4, 0.05, 0.8, 0.0, GBIT) == pytest.approx(0.95 * LINK_1MIB_4W)
    assert bench.burst_round_least(8, 2, 0.0, 0.8, 0.0, GBIT) == pytest.approx(8 * 2**20 * 8 / GBIT)


def test_a_burst_inside_the_round_costs_its_lost_share():
    b = 0.014
    assert bench.burst_round_least(1, 4, 0.0, 0.8, b, GBIT) == pytest.approx(LINK_1MIB_4W + 0.8 * b)
    assert bench.burst_round_least(1, 4, 0.0, 1.0, b, GBIT) == pytest.approx(LINK_1MIB_4W + b)


def test_a_burst_longer_than_the_round_leaves_the_lossy_rate():
    assert bench.burst_round_least(1, 4, 0.0, 0.8, 1.0, GBIT) == pytest.approx(LINK_1MIB_4W / 0.2)


def test_the_two_cases_meet_and_the_bound_grows_with_the_burst():
    edge = LINK_1MIB_4W / 0.2  # the burst that ends as the round does
    below = bench.burst_round_least(1, 4, 0.0, 0.8, edge * 0.999, GBIT)
    above = bench.burst_round_least(1, 4, 0.0, 0.8, edge * 1.001, GBIT)
    assert below == pytest.approx(above, rel=1e-3)
    seq = [bench.burst_round_least(1, 4, 0.0, 0.8, b / 1000, GBIT) for b in range(0, 200, 5)]
    assert seq == sorted(seq)


def test_ceiling_is_gloos_burst_median_over_the_bound():
    run = _run()
    least = bench.burst_round_least(8, 4, 0.05, 0.8, 0.111, GBIT)
    assert bench.burst_ceiling(run, "udp", "8", 4, 0.05, 0.8, GBIT) == pytest.approx(0.330 / least)
    assert bench.burst_ceiling(run, "udp", "1", 4, 0.05, 0.8, GBIT) is None  # no such block
    del run["gloo"]
    assert bench.burst_ceiling(run, "udp", "8", 4, 0.05, 0.8, GBIT) is None


def test_no_rate_limit_no_ceiling():
    run = _run()
    assert bench.burst_ceiling(run, "udp", "8", 4, 0.05, 0.8, 0) is None


def test_a_broadcast_allgather_or_a_server_moves_the_bound_with_the_busiest_link():
    """What the busiest rank sends, in tensors: 2 (W-1)/W for an even allreduce; a broadcast
    all-gather 1; a parameter server W-1, or 1 when it broadcasts.  The bound scales with it."""
    assert bench.link_share(4) == pytest.approx(1.5)
    assert bench.link_share(4, broadcast=True) == pytest.approx(1.0)
    assert bench.link_share(4, "ps") == 3 and bench.link_share(4, "ps", True) == 1
    assert bench.burst_round_least(1, 4, 0.0, 0.8, 0.0, GBIT, share=1.0) == pytest.approx(LINK_1MIB_4W / 1.5)
    run = _run()
    run["udp-bc"] = run["udp"]
    even = bench.burst_ceiling(run, "udp", "8", 4, 0.0, 0.8, GBIT)
    bc = bench.burst_ceiling(run, "udp-bc", "8", 4, 0.0, 0.8, GBIT)
    assert bc > even  # less data through the link: a shorter least burst round
    assert bench.burst_ceiling(run, "udp", "8", 4, 0.0, 0.8, GBIT, mode="ps") < even
