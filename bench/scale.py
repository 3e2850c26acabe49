#!/usr/bin/env python3
"""How the protocol scales with ranks, measured by simulation (pydblp.sim), 4 to 1,024 ranks.

Each configuration runs in a process of its own (so memory per rank is that process's growth
divided by the ranks): ``--rounds`` rounds of one kind of round on simulated 1 Gbit/s links
with ``--loss`` Bernoulli loss on every switch port, and reports per round:

- ``time`` (virtual ms, median over rounds of the slowest rank) and ``bound``: what the
  busiest link must carry in that round at the link rate (``time / bound`` is the headline);
- ``ctrl/rank`` and ``data/rank``: control (STOP, PROBE, BITMAP) and DATA packets each rank
  sends per round, and their ratio ``ctrl/data``;
- ``repaired``: the fraction of rank-rounds that resent a chunk or NACKed;
- ``MiB/rank``: resident memory per simulated rank; ``cpu s/round``: this machine's CPU
  time per simulated round (all ranks: the simulator runs them one at a time).

Kinds (tensor sizes chosen so 1,024 ranks fit in memory and minutes):

- ``allreduce``: transpose allreduce; each shard ``--chunks`` chunks (the tensor grows with
  the ranks, weak scaling: each message stays ``--chunks`` chunks);
- ``ps``: parameter server (rank 0 owns the tensor) of ``--ps-chunks`` chunks;
- ``gossip``: a neighbour round on the ``exp`` topology (log2 N peers) of ``--gossip-chunks``.

Running time on 2 vCPUs: ps and gossip about a minute a round at 1,024 ranks; allreduce a
minute a round at 256 and more than 49 minutes a round at 1,024 (give allreduce
``--ranks 4,16,64,256``); ``--ranks 4,16,64`` about a minute in all.  No root, no network.

Example::

    bench/scale.py                                         # 4, 16, 64 ranks: about a minute
    bench/scale.py --ranks 256,1024 --kinds ps,gossip      # about 5 minutes
    bench/scale.py --ranks 256 --kinds allreduce --json /tmp/scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time

import numpy as np

CHUNK = 512  # bytes per chunk: small, so that 1,024 ranks' buffers fit this machine


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one(kind: str, world: int, rounds: int, loss: float, chunks: int, seed: int, tick: float) -> dict:
    """Run one configuration in this process; its figures."""
    from pydblp.collective import Config
    from pydblp.sim import Link, Sim
    from pydblp.sim.network import FRAME_OVERHEAD
    from pydblp.torch.exchange import neighbours

    mode = "ps" if kind == "ps" else "tar"
    rss0 = _rss()
    cfg = Config(job=1, mode=mode, chunk_bytes=CHUNK, phase="static:0", peer_timeout=60.0, records_max=rounds)
    sim = Sim(world, cfg, link=Link("1gbit", latency=5e-6), seed=seed, limit=3600.0, tick=tick)
    sim.network.loss(loss)
    C = CHUNK // 4
    T = chunks * world if kind == "allreduce" else chunks
    x = np.ones(T * C, np.float32)
    frame = (CHUNK + FRAME_OVERHEAD) * 8 / 1e9  # s a data packet takes on a link

    if kind == "gossip":
        peers = [neighbours("exp", r, world, 0) for r in range(world)]
        bound = max(len(p) for p in peers) * T * frame
    elif kind == "ps":
        bound = (world - 1) * T * frame  # the server's link: every client's tensor in, its copy out
    else:
        bound = 2 * T * (world - 1) / world * frame

    def program(node):
        col = node.collective
        for i in range(rounds):
            if kind == "gossip":
                p = peers[node.rank]
                col.neighbours(x, p, [1.0 / (len(p) + 1)] * len(p), timeout=30.0)
            else:
                col.allreduce(x)
            if node.rank == 0:  # progress, on stderr: a 1,024-rank round can take many minutes
                print(f"  {kind} {world} ranks: rank 0 ended round {i + 1}/{rounds} at {node.now * 1e3:.2f} "
                      f"virtual ms, {time.process_time() - cpu0:.0f} s CPU", file=sys.stderr, flush=True)

    cpu0, wall0 = time.process_time(), time.perf_counter()  # (read by program's progress lines too)
    nodes = sim.run(program)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    errors = [repr(n.error) for n in nodes if n.error]
    if errors:
        raise SystemExit(f"{kind} at {world} ranks failed: {errors[:3]}")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    lat = np.array([[r.latency for r in n.records] for n in nodes])  # (ranks, rounds)
    st = [n.collective.t.stats() for n in nodes]
    ctrl = sum(s["tx_control"] for s in st)
    data = sum(s["tx_packets"] for s in st) - ctrl
    recs = [r for n in nodes for r in n.records]
    return {"kind": kind, "ranks": world, "rounds": rounds, "loss": loss, "chunks": T, "tick": tick,
            "time_ms": float(np.median(lat.max(axis=0)) * 1e3), "bound_ms": bound * 1e3,
            "ctrl_per_rank": ctrl / world / rounds, "data_per_rank": data / world / rounds,
            "ctrl_per_data": ctrl / max(data, 1),
            "repaired": float(np.mean([r.retransmits > 0 or r.nacks > 0 for r in recs])),
            "retransmits_per_round": sum(r.retransmits for r in recs) / rounds,
            "mib_per_rank": (peak - rss0) / world / 2**20,
            "cpu_s_per_round": cpu / rounds, "wall_s": wall, "drops": dict(sim.network.drops)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog="example: bench/scale.py --ranks 4,16,64 --kinds allreduce",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", default="4,16,64", help="rank counts, up to 4096 (default %(default)s: about a minute)")
    ap.add_argument("--kinds", default="allreduce,ps,gossip", help="allreduce, ps, gossip (default all)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per configuration (default %(default)s)")
    ap.add_argument("--loss", type=float, default=0.01, help="Bernoulli loss per port (default %(default)s)")
    ap.add_argument("--chunks", type=int, default=2, help="allreduce: chunks per shard (default %(default)s)")
    ap.add_argument("--ps-chunks", type=int, default=64, help="ps: chunks in the tensor (default %(default)s)")
    ap.add_argument("--gossip-chunks", type=int, default=64, help="gossip: chunks per message (default %(default)s)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tick", type=float, default=20e-6,
                    help="interrupt coalescing, s (Sim(tick=); default %(default)s)")
    ap.add_argument("--json", help="write every figure and the environment here")
    ap.add_argument("--one", nargs=2, metavar=("KIND", "RANKS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    sizes = {"allreduce": a.chunks, "ps": a.ps_chunks, "gossip": a.gossip_chunks}
    if a.one:
        kind, world = a.one[0], int(a.one[1])
        print(json.dumps(one(kind, world, a.rounds, a.loss, sizes[kind], a.seed, a.tick)))
        return 0
    try:
        ranks = [int(r) for r in a.ranks.split(",")]
    except ValueError:
        print(f"scale.py: --ranks {a.ranks!r}: give rank counts such as 4,16,64", file=sys.stderr)
        return 2
    kinds = a.kinds.split(",")
    bad = [k for k in kinds if k not in sizes]
    if bad or any(not 2 <= r <= 4096 for r in ranks):
        print(f"scale.py: use --kinds from {', '.join(sizes)} and --ranks in 2..4096", file=sys.stderr)
        return 2
    for wrong, what in ((a.rounds < 1, f"--rounds {a.rounds}: give 1 or more"),
                        (not 0 <= a.loss < 1, f"--loss {a.loss}: give a probability in [0, 1)"),
                        (min(a.chunks, a.ps_chunks, a.gossip_chunks) < 1, "--chunks, --ps-chunks and "
                         "--gossip-chunks: give 1 or more")):
        if wrong:
            print(f"scale.py: {what}", file=sys.stderr)
            return 2
    rows, failed = [], 0
    print(f"{'kind':9} {'ranks':>5} {'time ms':>9} {'bound ms':>9} {'ratio':>6} {'ctrl/rank':>9} "
          f"{'data/rank':>9} {'ctrl/data':>9} {'repaired':>8} {'MiB/rank':>8} {'cpu s/round':>11}", flush=True)
    for kind in kinds:
        for world in ranks:
            argv = [sys.executable, __file__, "--one", kind, str(world), "--rounds", str(a.rounds),
                    "--loss", str(a.loss), "--chunks", str(a.chunks), "--ps-chunks", str(a.ps_chunks),
                    "--gossip-chunks", str(a.gossip_chunks), "--seed", str(a.seed), "--tick", str(a.tick)]
            out = subprocess.run(argv, stdout=subprocess.PIPE, text=True)  # (its progress: on stderr)
            if out.returncode:
                print(f"{kind} {world}: failed (exit status {out.returncode}; its error is above)", flush=True)
                failed += 1
                continue
            r = json.loads(out.stdout)
            rows.append(r)
            print(f"{kind:9} {world:5d} {r['time_ms']:9.2f} {r['bound_ms']:9.2f} {r['time_ms'] / r['bound_ms']:6.2f} "
                  f"{r['ctrl_per_rank']:9.1f} {r['data_per_rank']:9.1f} {r['ctrl_per_data']:9.3f} "
                  f"{r['repaired']:8.2f} {r['mib_per_rank']:8.2f} {r['cpu_s_per_round']:11.2f}", flush=True)
    if a.json:
        env = {"python": platform.python_version(), "cpus": os.cpu_count(), "argv": sys.argv,
               "chunk_bytes": CHUNK, "link": "1gbit, 5 us per hop"}
        with open(a.json, "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
