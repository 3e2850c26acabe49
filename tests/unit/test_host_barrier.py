"""The experiment's HostBarrier (ranks of one host line up through files, not the network;
threads stand in for the rank processes, the barrier only sees files) and the TrainingClock
whose pauses end with it."""

from __future__ import annotations

import os
import random
import threading
import time

import pytest

from pydblp.experiment.worker import HostBarrier, TrainingClock

WORLD = 4


def run_ranks(path, barriers, delay):
    """WORLD ranks pass ``barriers`` barriers, rank r sleeping ``delay(r, k)`` before barrier k;
    returns {(rank, k): (arrived, left)} on the monotonic clock."""
    times, errors = {}, []

    def rank(r):
        b = HostBarrier(str(path), r, WORLD)
        try:
            for k in range(barriers):
                time.sleep(delay(r, k))
                t_in = time.monotonic()
                b.wait(timeout=30)
                times[(r, k)] = (t_in, time.monotonic())
        except BaseException as e:  # (reported by the test, not lost in the thread)
            errors.append(e)

    # daemon: a rank stuck in a broken barrier fails the test below, not the interpreter's exit
    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a rank hung in the barrier"
    assert not errors, errors
    return times


def test_no_rank_leaves_before_the_last_arrives(tmp_path):
    # rank 2 comes 0.2 s late: everyone leaves after it arrived
    times = run_ranks(tmp_path, 1, lambda r, k: 0.2 if r == 2 else 0.0)
    late = times[(2, 0)][0]
    assert all(left >= late for _, left in times.values())


def test_repeated_barriers_hold_each_time_and_keep_the_directory_small(tmp_path):
    rng = random.Random(7)
    delays = {(r, k): rng.uniform(0, 0.02) for r in range(WORLD) for k in range(12)}
    times = run_ranks(tmp_path, 12, lambda r, k: delays[(r, k)])
    for k in range(12):
        last_in = max(times[(r, k)][0] for r in range(WORLD))
        assert all(times[(r, k)][1] >= last_in for r in range(WORLD))
    # only the last two barriers' files stay: a run's pauses do not pile files up
    assert sorted(os.listdir(tmp_path)) == sorted(f"{k}.{r}" for k in (11, 12) for r in range(WORLD))


def test_a_rank_that_never_comes_is_a_timeout_naming_the_barrier(tmp_path):
    b = HostBarrier(str(tmp_path), 0, 2)
    with pytest.raises(TimeoutError, match=r"rank 0: 1 of 2 ranks did not reach barrier 1 in .* within 0 s"):
        b.wait(timeout=0.05)


def test_a_pause_and_its_lining_up_are_left_out_of_the_training_time():
    lined_up = []
    clock = TrainingClock(lambda: (lined_up.append(time.monotonic()), time.sleep(0.05)))
    t0 = time.monotonic()  # (before start: the clock's own zero is no earlier)
    clock.start()
    with clock.pause():
        time.sleep(0.1)  # an evaluation
    assert len(lined_up) == 2  # at the start and at the pause's end
    # the pause took at least 0.15 s (its work and the barrier's): none of it is training
    assert clock.elapsed() <= time.monotonic() - t0 - 0.15
    assert clock.paused >= 0.15
    with pytest.raises(RuntimeError):  # a failing check propagates; nothing is lined up after it
        with clock.pause():
            raise RuntimeError("divergence check failed")
    assert len(lined_up) == 2
