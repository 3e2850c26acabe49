#!/usr/bin/env python3
"""One rank of ``bench/allreduce.py``; runs inside a testbed worker namespace.

Not meant to be run by hand.  Protocol over stdin/stdout, one JSON object a
line (pipes, not the network: faults on the fabric never touch them):

    parent -> worker   {"cmd": "block", "size": BYTES, "rounds": R, "warmup": W,
                        "burst": null | {"ratio": .8, "duration": S, "rounds": [i, ...]}}
                       {"cmd": "quit"}
    worker -> parent   {"ready": true}
                       {"drained": true}       all measured rounds of the block are done
                                               everywhere (see below); the parent clears the fault
                       {"block": {...}}        per-round timestamps and records
                       {"error": "..."}        then exit 1

A block is W warm-up rounds, R measured rounds and one *tail* round, all
under the parent's fault.  A rank that completes the tail round knows that
every rank has finished the measured rounds (its tail result needs every
rank's tail contribution), so on the first ``drained`` the parent clears the
fault.  pydblp ranks then run one small *flush* round on the clean fabric,
so each block ends with an exchange no fault touched (the collective's idle
responder also answers late PROBEs between rounds, so a STOP lost in the
tail round cannot strand a peer either way).

Bursts start when a listed round starts: before entering a round listed in
``burst.rounds`` each rank leaves a marker under ``--sync`` (a directory on
the shared filesystem, under an flock); the rank that completes the set,
i.e. the last one to enter the round, arms the burst on the fabric
(``Fabric.burst(at=now)``, the maps pinned by the testbed) and reports the
window (CLOCK_MONOTONIC, the clock of bpf_ktime_get_ns and the same in
every namespace).  Rounds run back to back, so arming at the first rank's
entry would hit the previous round's tail on the slower ranks.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402


def emit(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--transport", required=True, help="-bc: pydblp with a broadcast all-gather to --group",
                   choices=["xsk", "xsk-ktx", "udp", "xsk-bc", "xsk-ktx-bc", "udp-bc", "xsk-key", "xsk-ktx-key",
                            "udp-key", "gloo", "floor"])
    p.add_argument("--peers", required=True, help="JSON list of [addr, port, mac] per rank")
    p.add_argument("--group", help="JSON [addr, port, mac] reaching every rank (the -bc transports)")
    p.add_argument("--key-file", help="the job key of the -key transports (every packet tagged and verified)")
    p.add_argument("--epoch", type=int, default=0, help="the run epoch of the -key transports")
    p.add_argument("--iface", default="eth0")
    p.add_argument("--job", type=int, default=31)
    p.add_argument("--tol", type=float, default=0.05)
    p.add_argument("--mode", default="tar")
    p.add_argument("--estimator", default="unbiased")
    p.add_argument("--peer-timeout", type=float, default=30.0)
    p.add_argument("--send-burst", type=int, default=None, help="Config.burst")
    p.add_argument("--spread", type=int, default=0, help="Config.spread")
    p.add_argument("--chunk-bytes", type=int, default=None, help="Config.chunk_bytes")
    p.add_argument("--spin", type=float, default=0.0, help="transport busy-poll seconds")
    p.add_argument("--rate", type=float, default=0.0, help="the link's bits/s xsk paces at (0: unpaced)")
    p.add_argument("--store", help="FileStore path (gloo rendezvous)")
    p.add_argument("--fabric", help="JSON {pin_dir, ports}: the fabric bursts are armed on")
    p.add_argument("--sync", help="directory for the burst-arming markers")
    return p.parse_args(argv)


class Pydblp:
    def __init__(self, a):
        from pydblp.collective import Collective, Config
        from pydblp.dataplane import open_dataplane

        peers = [tuple(p) for p in json.loads(a.peers)]
        from pydblp.jobkey import load_key

        keyed = a.transport.endswith("-key")
        kind = a.transport.removesuffix("-key").removesuffix("-bc")
        key = load_key(a.key_file) if keyed else None
        self.dp = open_dataplane(kind, a.iface, port=peers[a.rank][1], job=a.job, rank=a.rank, world=a.world,
                                 rate=a.rate, spin=a.spin, max_payload=a.chunk_bytes, key=key,
                                 epoch=a.epoch if keyed else None)
        cfg = Config(job=a.job, mode=a.mode, estimator=a.estimator, phase=f"static:{a.tol}",
                     peer_timeout=a.peer_timeout, spread=a.spread)
        if a.send_burst:
            cfg.burst = a.send_burst
        if a.chunk_bytes:
            cfg.chunk_bytes = a.chunk_bytes
        group = None
        if a.transport.endswith("-bc"):
            cfg.allgather, group = "broadcast", tuple(json.loads(a.group))
        try:
            self.col = Collective(self.dp.transport, a.rank, a.world, peers, cfg, group=group)
        except BaseException:
            self.dp.close()
            raise

    def prepare(self, x: np.ndarray):
        return x

    def round(self, buf) -> np.ndarray:
        return self.col.allreduce(buf, out=buf)  # in place, as Gloo's all_reduce (and the DDP hook's round)

    def record(self) -> dict:
        r = self.col.records[-1]
        return {"retx": r.retransmits, "probes": r.probes, "nacks": r.nacks, "min_delivered": r.min_delivered,
                "below": r.below_bound, "tx_bytes": r.bytes_sent}

    def flush(self) -> None:
        self.col.allreduce(np.zeros(1, np.float32), tensor=1)

    def counters(self) -> dict:
        ts = self.col.t.stats()
        return {**self.col.counters, "probe_timeout_ms": self.col.probe_timeout * 1e3,
                **{f"transport_{k}": ts.get(k, 0) for k in ("tx_kicks", "rx_polls", "tx_held", "rx_packets")}}

    def close(self) -> None:
        self.col.close()
        self.dp.close()


class _Peer:
    """A comparator: its rounds keep no records, flush nothing and count nothing."""

    def record(self) -> dict:
        return {}

    def flush(self) -> None:
        pass

    def counters(self) -> dict:
        return {}


class Gloo(_Peer):
    def __init__(self, a):
        import torch
        import torch.distributed as dist

        self.torch, self.dist, self.world = torch, dist, a.world
        store = dist.FileStore(a.store, a.world)
        dist.init_process_group("gloo", store=store, rank=a.rank, world_size=a.world,
                                timeout=datetime.timedelta(seconds=max(60.0, a.peer_timeout)))

    def prepare(self, x: np.ndarray):
        return self.torch.from_numpy(x)  # all_reduce works in place on this fresh array

    def round(self, buf) -> np.ndarray:
        self.dist.all_reduce(buf)
        buf.div_(self.world)
        return buf.numpy()

    def close(self) -> None:
        self.dist.destroy_process_group()


class Floor(_Peer):
    """The least a Python transpose allreduce over UDP sockets does on this testbed.

    The same chunks (``--chunk-bytes``, default pydblp's 1408 bytes of float32), shards and
    schedule as pydblp's ``tar`` mode: every rank sends shard k straight to rank k (one GSO
    message per ~45 datagrams), owner k takes the mean and sends it to every rank; receives take
    GRO-merged runs.  Nothing else: an 8-byte header (round, chunk, source, phase), no loss
    handling (a lost datagram, which a clean fabric still shows now and then at 32 MiB, fails
    the round after ``STALL`` s without a datagram, or ``--peer-timeout`` if shorter: it would
    never complete; run it on a clean fabric only), no validation, priorities or records.  A
    peer for pydblp, not a transport: what pydblp's protocol costs above it, and what Python
    and this testbed's kernel path cost against Gloo, show separately.
    """

    GRO_MAX = 65536  # bytes of one merged receive
    STALL = 5.0  # s without a datagram after which a round is given up (a lost one is never resent)

    def __init__(self, a):
        import select
        import socket

        peers = json.loads(a.peers)
        self.rank, self.world, self.timeout = a.rank, a.world, min(a.peer_timeout, self.STALL)
        self.C = (a.chunk_bytes or 1408) // 4
        self.dt = np.dtype([("round", "<u4"), ("chunk", "<u2"), ("src", "u1"), ("ag", "u1"),
                            ("pay", "<f4", (self.C,))])
        self.seg = self.dt.itemsize
        self.per = min(64, (self.GRO_MAX - 1024) // self.seg)  # datagrams per GSO message
        self.addrs = [(p[0], p[1]) for p in peers]
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        from pydblp.transport.udp import SO_RCVBUFFORCE, SO_SNDBUFFORCE

        s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)
        s.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, 2 << 20)  # as pydblp's UDP transport
        s.setsockopt(socket.SOL_UDP, 104, 1)  # UDP_GRO
        s.bind(self.addrs[a.rank])
        s.setblocking(False)
        self.sock = s
        self.poll = select.poll()
        self.POLLIN, self.POLLOUT = select.POLLIN, select.POLLOUT
        self.gso = [(socket.SOL_UDP, 103, self.seg.to_bytes(2, sys.byteorder))]  # UDP_SEGMENT
        self.anc = socket.CMSG_SPACE(4)
        self.rx = bytearray(self.GRO_MAX)
        self.r = 0
        self.early: list[np.ndarray] = []  # records of the next round, from a faster peer

    def prepare(self, x: np.ndarray):
        return x

    def _frames(self, rows: np.ndarray, ag: int) -> np.ndarray:
        rec = np.empty(len(rows), self.dt)
        rec["round"], rec["chunk"], rec["src"], rec["ag"] = self.r, np.arange(len(rows)), self.rank, ag
        rec["pay"] = rows
        return rec

    def round(self, x: np.ndarray) -> np.ndarray:
        W, C, me = self.world, self.C, self.rank
        self.r += 1
        T = -(-x.size // C)
        xs = np.zeros((T, C), np.float32)
        xs.reshape(-1)[: x.size] = x
        bounds = [(k * T // W, (k + 1) * T // W) for k in range(W)]
        a, b = bounds[me]
        self.y = np.empty((T, C), np.float32)
        self.rbuf = np.empty((W, b - a, C), np.float32)
        self.rbuf[me] = xs[a:b]
        self.first = np.array([lo for lo, _ in bounds])
        self.left_rs, self.left_ag = (W - 1) * (b - a), T - (b - a)
        self.out = [(self._frames(xs[lo:hi], 0), dst) for dst, (lo, hi) in enumerate(bounds) if dst != me and hi > lo]
        early, self.early = self.early, []
        for rec in early:
            self._take(rec)
        reduced, t_heard = False, time.monotonic()
        while True:
            if not reduced and self.left_rs == 0:
                self.y[a:b] = self.rbuf.sum(axis=0) / np.float32(W)
                self.out += [(self._frames(self.y[a:b], 1), dst) for dst in range(W) if dst != me and b > a]
                reduced = True
            self._send()
            if reduced and self.left_ag == 0 and not self.out:
                return self.y.reshape(-1)[: x.size]
            self.poll.register(self.sock, self.POLLIN | (self.POLLOUT if self.out else 0))
            if self.poll.poll(1000) and self._recv():
                t_heard = time.monotonic()
            elif time.monotonic() - t_heard > self.timeout:
                raise RuntimeError(f"round {self.r}: nothing for {self.timeout:.0f} s (the floor repairs no loss)")

    def _send(self) -> None:
        while self.out:
            rec, dst = self.out[0]
            k = min(len(rec), self.per)
            try:
                self.sock.sendmsg([rec[:k].view(np.uint8)], self.gso if k > 1 else [], 0, self.addrs[dst])
            except BlockingIOError:
                return
            if k == len(rec):
                self.out.pop(0)
            else:
                self.out[0] = (rec[k:], dst)

    def _recv(self) -> int:
        got = 0
        while True:
            try:
                n, anc, _, _ = self.sock.recvmsg_into([self.rx], self.anc)
            except BlockingIOError:
                return got
            got += n
            rec = np.frombuffer(self.rx, self.dt, count=n // self.seg)
            cur = rec["round"] == self.r
            if not cur.all():
                self.early.append(rec[rec["round"] == self.r + 1].copy())
                rec = rec[cur]
            self._take(rec)

    def _take(self, rec: np.ndarray) -> None:
        ag = rec["ag"] != 0
        if not ag.all():
            rs = rec[~ag]
            self.rbuf[rs["src"], rs["chunk"]] = rs["pay"]
            self.left_rs -= len(rs)
            rec = rec[ag]
        if len(rec):
            self.y[self.first[rec["src"]] + rec["chunk"]] = rec["pay"]
            self.left_ag -= len(rec)

    def close(self) -> None:
        self.sock.close()


_inputs: dict[int, tuple] = {}


def inputs(n: int, rank: int, world: int) -> tuple[np.ndarray, np.ndarray]:
    """Every rank holds base + (rank + 1): the exact mean is base + (world + 1) / 2."""
    if n not in _inputs:
        _inputs.clear()
        base = np.random.default_rng(n).standard_normal(n).astype(np.float32)
        _inputs[n] = (base + np.float32(rank + 1), base + np.float32((world + 1) / 2))
    return _inputs[n]


def last_to_enter(a, tag: str) -> bool:
    """Leave this rank's marker for ``tag``; True for the rank that completes the set."""
    import fcntl

    with open(os.path.join(a.sync, ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        Path(a.sync, f"{tag}.{a.rank}").touch()
        return all(Path(a.sync, f"{tag}.{r}").exists() for r in range(a.world))


def block(a, impl, fab, cmd: dict) -> dict:
    x, want = inputs(int(cmd["size"]) // 4, a.rank, a.world)
    burst = cmd.get("burst") or {}
    burst_at = set(burst.get("rounds", ()))
    warm, rounds = int(cmd["warmup"]), int(cmd["rounds"])
    t0s, t1s, recs, windows = [], [], [], []
    out = None
    for j, i in enumerate(range(-warm, rounds + 1)):  # warm-up (i < 0), measured, tail (i == rounds)
        # round j's inputs are x + j, so a result chunk left over from round j - k is off by k
        buf = impl.prepare(x + np.float32(j))
        if fab is not None and i in burst_at and last_to_enter(a, f"{cmd['seq']}-{i}"):
            start = fab.burst(ratio=burst["ratio"], duration=burst["duration"], at=time.monotonic())
            windows.append([start, start + burst["duration"]])
        if i == 0:
            c0 = os.times()
        t0 = time.monotonic()
        out = impl.round(buf)
        t1 = time.monotonic()
        if 0 <= i < rounds:
            t0s.append(t0)
            t1s.append(t1)
            recs.append(impl.record())
        if i == rounds - 1:
            c1 = os.times()
    emit({"drained": True})
    impl.flush()
    # the tail round's result: exact, stale (an earlier round's exact value), or estimated
    d = (want + np.float32(j)) - out
    k = np.rint(d)
    close = np.abs(d - k) <= 1e-4 * (1 + np.abs(want))
    exact = close & (k == 0)
    stale = close & (k >= 1)
    return {"t0": t0s, "t1": t1s, "recs": recs, "windows": windows,
            "exact": float(exact.mean()), "stale": float(stale.mean()),
            "stale_max_age": int(k[stale].max()) if stale.any() else 0,
            "cpu": (c1.user + c1.system - c0.user - c0.system) / max(rounds, 1), "cpu_sys": (c1.system - c0.system) / max(rounds, 1),
            "counters": impl.counters()}


def main(argv=None) -> int:
    a = parse(argv)
    import torch

    torch.set_num_threads(1)
    impl = fab = None
    try:
        impl = Gloo(a) if a.transport == "gloo" else Floor(a) if a.transport == "floor" else Pydblp(a)
        if a.fabric and a.sync:
            from pydblp.testbed.fabric import Fabric

            f = json.loads(a.fabric)
            fab = Fabric(Path(f["pin_dir"]), f["ports"])
        emit({"ready": True, "pid": os.getpid()})
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "quit":
                break
            emit({"block": block(a, impl, fab, cmd)})
        return 0
    except BaseException as e:  # reported to the parent, which gives up on this transport
        emit({"error": f"rank {a.rank} ({a.transport}): {type(e).__name__}: {e}"})
        traceback.print_exc()
        return 1
    finally:
        if fab is not None:
            fab.close()
        if impl is not None:
            try:
                impl.close()
            except Exception:
                traceback.print_exc()


if __name__ == "__main__":
    if os.environ.get("DBLP_BENCH_PROFILE"):  # a directory: each rank dumps cProfile stats there
        import cProfile

        prof = cProfile.Profile(time.process_time)  # CPU time: ranks share cores
        rc = prof.runcall(main)
        rank = sys.argv[sys.argv.index("--rank") + 1]
        prof.dump_stats(os.path.join(os.environ["DBLP_BENCH_PROFILE"], f"rank{rank}.prof"))
        sys.exit(rc)
    sys.exit(main())
