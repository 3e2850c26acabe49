"""The AF_XDP queue set without root: what ``queues=`` means, the errors it raises, the UMEM split."""

from __future__ import annotations

import numpy as np
import pytest

from pydblp.testbed import Testbed
from pydblp.testbed.core import TestbedError
from pydblp.transport.xsk_queues import MIN_RX_FRAMES, check_queues, rx_frames_per_queue


@pytest.mark.parametrize("spec, count, want", [
    ("all", 4, (0, 1, 2, 3)),
    ("all", 1, (0,)),
    (2, 4, (2,)),
    ([3, 0], 4, (3, 0)),
    ((np.int64(1),), 2, (1,)),
])
def test_a_queue_set_is_what_it_says(spec, count, want):
    assert check_queues(spec, count, "eth0") == want


@pytest.mark.parametrize("spec, count, match", [
    ("some", 4, r"queues='some': 'all' or a list of queue indexes, e\.g\. queues=\[0, 2\]"),
    ([], 4, r"queues=\[\]: give at least one queue index, or queues='all'"),
    ([0, 0], 4, r"queues=\[0, 0\]: a queue appears twice; list each once"),
    ([0, -1], 4, r"-1 is not a queue index"),
    ([1.0], 4, r"1\.0 is not a queue index"),
    ([True], 4, r"True is not a queue index"),
    (None, 4, r"queues=None: 'all' or a list"),
    ([0, 4], 4, r"queue 4 does not exist on eth0: it has 4 receive queues \(0\.\.3\); choose among them "
                r"or queues='all'"),
    (99, 1, r"queue 99 does not exist on eth0: it has 1 receive queue \(0\.\.0\)"),
    ("all", 80, r"queues up to 63: the host program's socket map has 64 entries"),
])
def test_a_bad_queue_set_is_refused_in_one_line_with_the_fix(spec, count, match):
    with pytest.raises(ValueError, match=match) as e:
        check_queues(spec, count, "eth0")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("total, n, want", [
    (16384, 1, 16384), (16384, 2, 8192), (16384, 4, 4096), (16384, 8, 2048), (16384, 16, MIN_RX_FRAMES),
    (16384, 3, 4096),  # an even share rounded down to a power of two
    (1024, 4, 1024),   # never more than the whole budget
])
def test_the_receive_budget_is_split_across_queues(total, n, want):
    assert rx_frames_per_queue(total, n) == want


@pytest.mark.parametrize("queues", [0, 65, True, 2.0])
def test_a_testbed_refuses_a_bad_queue_count(queues):
    with pytest.raises(TestbedError, match="queues must be within 1..64"):
        Testbed(workers=2, queues=queues)
