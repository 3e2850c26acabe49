"""The simulator itself: its network model, its scheduler, and that a seed fixes a run.

The protocol's behaviour on it is tested in test_sim_protocol.py; its agreement with the
testbed in tests/linux/test_sim_agreement.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from pydblp.collective import CollectiveError, Config
from pydblp.sim import Link, Network, Sim, SimError
from pydblp.sim.network import FRAME_OVERHEAD, Queue

SCENARIO = """
import dataclasses, hashlib, json, sys
import numpy as np
from pydblp.collective import Config
from pydblp.sim import Link, Sim
sim = Sim(4, Config(job=9, phase="static:0.05"), link=Link("1gbit"), seed=int(sys.argv[1]))
sim.network.loss(0.1)
sim.network.ge(0.01, 0.3)
sim.network.burst(start=0.002, duration=0.001, every=0.02)
xs = [np.random.default_rng(r).standard_normal(50_000).astype(np.float32) for r in range(4)]
def program(node):
    ys = []
    for i in range(4):
        ys.append(node.collective.allreduce(xs[node.rank], tensor=1))
        node.compute(0.001)
    return ys
nodes = sim.run(program)
recs = [[dataclasses.asdict(r) for r in n.records] for n in nodes]
out = json.dumps({"records": recs, "drops": sim.network.drops, "now": sim.now}, sort_keys=True)
ys = b"".join(y.tobytes() for n in nodes for y in n.result)
print(hashlib.sha256(out.encode()).hexdigest(), hashlib.sha256(ys).hexdigest(), len(out))
"""


def _scenario(seed: int, hashseed: str) -> str:
    env = dict(os.environ, PYTHONHASHSEED=hashseed)
    return subprocess.run([sys.executable, "-c", SCENARIO, str(seed)], env=env, capture_output=True, text=True,
                          check=True, timeout=120).stdout


def test_a_seed_gives_byte_identical_round_records_in_two_processes():
    """Records (latencies included), drops and results, serialised, hash alike across processes
    with different hash seeds; another seed gives another run."""
    a, b = _scenario(5, "1"), _scenario(5, "2")
    assert a == b and a.strip()
    assert _scenario(6, "1").split()[0] != a.split()[0]


def send(net, src, now, sizes, dsts, ect=False):
    """``Network.send``, then every hop admitted at its port at once (one sender: the order they
    reach the switch): ``(taken, [(packet, rank, arrival time, CE)], retry)``."""
    taken, hops, retry = net.send(src, now, sizes, dsts)
    out = []
    for i, d, t in hops:
        passed = net.admit(d, t, int(sizes[i]), ect)
        if passed is not None:
            out.append((i, d, *passed))
    return taken, out, retry


def test_a_message_takes_its_bytes_at_the_link_rate_plus_two_hops():
    net = Network(2, Link("1gbit", latency=10e-6))
    sizes = np.full(100, 1000)
    taken, arrivals, retry = send(net, 0, 0.0, sizes, np.ones(100, np.int64))
    assert taken == 100 and retry == np.inf
    last = arrivals[-1][2]
    # serialised on the uplink (100 x 8 us), then the last one again on the port, plus 2 hops
    assert last == pytest.approx(100 * 8e-6 + 8e-6 + 2 * 10e-6)
    times = [t for _, _, t, _ in arrivals]
    assert times == sorted(times)


def test_a_port_admits_packets_in_the_order_they_reach_the_switch():
    """A rank fills its uplink at once (compute costs nothing here): its packets reach the switch
    over the next milliseconds.  A port that counted them in its backlog when they were handed
    in dropped and marked packets of other ranks that reached it first (142 false tail drops in
    this clean 4-rank allreduce).  Admitted as they reach the switch, a clean round drops none."""
    sim = Sim(4, Config(job=1, phase="static:0"), link=Link("1gbit", latency=20e-6), seed=1)
    x = np.ones(300_000, np.float32)
    nodes = sim.run(lambda n: [n.collective.allreduce(x) for _ in range(2)])
    assert all(np.array_equal(n.result[-1], x) for n in nodes)
    assert sim.network.drops["tail"] == 0


def test_a_receiver_is_woken_when_its_packets_arrive():
    """Admitting a run of packets at the ports must not move the clock past the earliest of
    them: a receiver waiting for packets that arrive at t wakes at t, not at the time a later
    packet of the same run reached the switch (then it took packets late, up to a hop)."""
    sim = Sim(4, Config(job=1, phase="static:0"), link=Link("1gbit", latency=20e-6), seed=1)
    late, calls = [], [0]
    arrive = sim.arrive

    def watch(rank, a):
        calls[0] += 1
        if len(a.times) and sim.now > a.times[0]:
            late.append((rank, sim.now - float(a.times[0])))
        arrive(rank, a)

    sim.arrive = watch
    x = np.ones(300_000, np.float32)
    nodes = sim.run(lambda n: [n.collective.allreduce(x) for _ in range(2)])
    assert all(np.array_equal(n.result[-1], x) for n in nodes)
    assert calls[0] > 10 and not late, late[:5]


def test_a_full_send_queue_takes_a_prefix_and_says_when_the_next_fits():
    net = Network(2, Link("1gbit", queue=10_000))
    taken, _, retry = net.send(0, 0.0, np.full(20, 1000), np.ones(20, np.int64))
    assert taken == 10
    assert 0 < retry <= 10 * 8e-6
    assert net.send(0, retry, np.full(1, 1000), np.ones(1, np.int64))[0] == 1


def test_incast_overflows_the_receivers_port_drop_tail():
    """Three senders at line rate into one port: it takes one link's worth, drops the rest."""
    net = Network(4, [Link("1gbit", queue=64 << 10)] + [Link("1gbit", queue=1 << 20)] * 3)
    hops = []
    for src in (1, 2, 3):
        taken, h, _ = net.send(src, 0.0, np.full(200, 1500), np.zeros(200, np.int64))
        assert taken == 200
        hops += h
    for _, d, t in sorted(hops, key=lambda x: x[2]):  # (at the port in the order they reach it)
        net.admit(d, t, 1500)
    assert net.drops["tail"] > 0
    assert net.delivered + net.drops["tail"] == 600
    q = Queue(1e9, 3000)
    assert q.put(0.0, 1500) is not None and q.put(0.0, 1500) is not None and q.put(0.0, 1500) is None


def test_faults_drop_at_their_rates_and_windows():
    net = Network(2, Link(0), seed=1)
    net.loss(0.2, port=1)
    send(net, 0, 0.0, np.full(20_000, 100), np.ones(20_000, np.int64))
    assert net.drops["loss"] / 20_000 == pytest.approx(0.2, abs=0.01)
    ge = Network(2, Link(0), seed=2)
    ge.ge(0.05, 0.25, port=1)  # long-run loss p / (p + r) = 1/6, in bursts of 1/r = 4
    send(ge, 0, 0.0, np.full(30_000, 100), np.ones(30_000, np.int64))
    assert ge.drops["ge"] / 30_000 == pytest.approx(1 / 6, abs=0.02)
    b = Network(2, Link(0))
    b.burst(start=1.0, duration=0.5, every=2.0, count=2, port=1)
    for t, lost in ((0.9, 0), (1.2, 1), (1.6, 1), (2.2, 1), (3.2, 2), (5.2, 2)):
        send(b, 0, t, np.full(1, 100), np.ones(1, np.int64))
        assert b.drops["burst"] == lost, t
    with pytest.raises(ValueError, match="r must be > 0"):
        net.ge(0.1, 0)
    with pytest.raises(ValueError, match="port 5"):
        net.loss(0.1, port=5)


def test_link_arguments_are_checked():
    with pytest.raises(ValueError, match="bad rate"):
        Link("fast")
    with pytest.raises(ValueError, match="latency"):
        Link(latency=-1)
    with pytest.raises(ValueError, match="queue"):
        Link(queue=10)


def test_a_clean_round_is_exact_and_takes_what_the_links_allow():
    """4 ranks, no loss: exact results; the round's virtual time is at least what each rank's
    link must carry (its reduce-scatter and all-gather bytes at 1 Gbit/s)."""
    sim = Sim(4, Config(job=4), link=Link("1gbit", latency=20e-6), seed=0)
    xs = [np.arange(100_000, dtype=np.float32) * (r + 1) for r in range(4)]
    nodes = sim.run(lambda node: node.collective.allreduce(xs[node.rank]))
    for n in nodes:
        np.testing.assert_allclose(n.result, np.mean(xs, axis=0))
    chunks = -(-100_000 * 4 // Config().chunk_bytes)
    wire_bytes = 2 * chunks * 3 / 4 * (Config().chunk_bytes + FRAME_OVERHEAD)
    bound = wire_bytes * 8 / 1e9
    latency = max(r.latency for n in nodes for r in n.records)
    assert bound <= latency < 1.5 * bound, (latency, bound)


def test_a_killed_rank_ends_and_its_peers_fail_naming_it():
    sim = Sim(3, Config(job=4, peer_timeout=0.5), seed=0)
    sim.kill(2, at=0.0)
    nodes = sim.run(lambda node: node.collective.allreduce(np.ones(1000, np.float32)))
    assert nodes[2].error == "killed"
    for n in nodes[:2]:
        assert isinstance(n.error, CollectiveError) and "rank 2" in str(n.error)
    assert sim.now == pytest.approx(0.5, abs=0.05)


def test_ranks_waiting_on_nothing_are_reported_not_hung():
    """A program that waits forever for a packet that never comes is a SimError naming it."""
    sim = Sim(2, seed=0)

    def program(node):
        if node.rank == 0:
            node.collective.t.recv(timeout=None)

    with pytest.raises(SimError, match=r"ranks \[0\] wait"):
        sim.run(program)


def test_a_run_past_its_limit_stops():
    sim = Sim(2, Config(job=4, peer_timeout=100.0), seed=0, limit=1.0)
    sim.kill(1, at=0.0)
    with pytest.raises(SimError, match="limit"):
        sim.run(lambda node: node.collective.allreduce(np.ones(10, np.float32)))


def test_sim_transport_counts_like_a_real_one():
    sim = Sim(2, Config(job=4), seed=0)
    nodes = sim.run(lambda node: node.collective.allreduce(np.ones(10_000, np.float32)))
    a, b = (n.collective.t.stats() for n in nodes)
    assert a["tx_packets"] == b["rx_packets"] and b["tx_packets"] == a["rx_packets"]
    assert a["tx_bytes"] == b["rx_bytes"] > 0
    assert nodes[0].collective.t.closed
    rec = nodes[0].records[0]
    # one round: all it sent; all it received but what came after it returned (a last STOP)
    assert rec.bytes_sent == a["tx_bytes"] and 0.9 * a["rx_bytes"] < rec.bytes_received <= a["rx_bytes"]
    assert a["tx_control"] > 0 and b["tx_control"] > 0  # STOPs, counted apart from data


def test_a_tick_coalesces_wake_ups_and_changes_no_result():
    """Sim(tick=): a rank waiting for packets wakes only at multiples of the tick; the result is
    the same, the round no shorter, the simulator's turns fewer."""
    xs = [np.arange(20_000, dtype=np.float32) * (r + 1) for r in range(4)]

    def once(tick):
        sim = Sim(4, Config(job=4), seed=0, tick=tick)
        turns = [0]
        turn = sim._turn

        def counted(node):
            turns[0] += 1
            turn(node)

        sim._turn = counted
        nodes = sim.run(lambda node: node.collective.allreduce(xs[node.rank]))
        return nodes, turns[0], max(r.latency for n in nodes for r in n.records)

    exact, turns0, lat0 = once(0.0)
    coarse, turns1, lat1 = once(200e-6)
    for a, b in zip(exact, coarse):
        np.testing.assert_array_equal(a.result, b.result)
    assert lat1 >= lat0 and turns1 < turns0
    with pytest.raises(ValueError, match="tick"):
        Sim(2, tick=-1)


def test_a_tick_never_wakes_a_rank_before_its_packets():
    """ceil(at / tick) * tick can land a float step below ``at`` (tick 20 us, at 1.84 ms plus a
    step): the rank woke before its packets, found none and waited again at the same instant,
    forever.  The wake-up is at or after the arrival."""
    sim = Sim(2, Config(job=1, phase="static:0"), link=Link(0, latency=20e-6), tick=20e-6, limit=1.0)
    assert sim._coalesce(0.0018400000000000003) >= 0.0018400000000000003
    turns = [0]
    turn = sim._turn

    def counted(node):
        turns[0] += 1
        assert turns[0] < 10_000, f"virtual time stuck at {sim.now!r}"
        turn(node)

    sim._turn = counted

    def program(node):
        node.compute(18 * 1e-4)
        return node.collective.allreduce(np.ones(1000, np.float32))

    nodes = sim.run(program)
    assert all(np.array_equal(n.result, np.ones(1000, np.float32)) for n in nodes)


def test_a_broadcast_allgather_reaches_every_rank_through_the_switch():
    sim = Sim(4, Config(job=4, mode="ps", allgather="broadcast"), seed=0)
    xs = [np.full(30_000, r + 1, np.float32) for r in range(4)]
    nodes = sim.run(lambda node: node.collective.allreduce(xs[node.rank]))
    for n in nodes:
        np.testing.assert_allclose(n.result, 2.5)
    # the server sent its all-gather once, not once per client
    sent = nodes[0].records[0].bytes_sent / (4 * 30_000)
    assert sent < 1.1, sent
