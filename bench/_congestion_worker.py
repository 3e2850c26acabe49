#!/usr/bin/env python3
"""The processes of ``bench/congestion.py``; each runs inside a testbed worker namespace.

Not meant to be run by hand.  Three kinds (the first argument):

``rank``
    One pydblp rank (``Collective`` over ``--transport``, ``Config(cc=--cc)``).  Over
    stdin/stdout, one JSON object a line (pipes, not the network: the fabric's queue never
    touches them)::

        parent -> rank   {"cmd": "phase", "start": T0, "until": T1 | null, "rounds": R | null}
                         {"cmd": "quit"}
        rank -> parent   {"ready": true, "pid": PID, "ect": bool}
                         {"phase": {...}}       the phase's per-round records and counters
                         {"error": "..."}       then exit 1

    A phase waits until CLOCK_MONOTONIC ``T0`` (the same clock in every namespace), then runs
    back-to-back allreduces of ``--size`` bytes: ``R`` of them, or, with ``until``, until a
    round's result says some rank saw its clock pass ``T1``.  That vote rides in the tensor:
    element 0 is 1.0 on a rank past ``T1``, else 0.0, and every rank stops after the round
    whose mean has it above 0 (``Config.consistent``: every rank holds the same result, so all
    stop after the same round).  Per round: start and end times, the round record's bytes,
    the transport's cumulative ``rx_bytes``, the CE marks received so far and the rate control's
    per-destination rates (``Protocol.cc.state()``).

``tcp-sink``
    Listens on ``--addr:--port``, prints ``{"ready": true}``, takes one connection and counts
    the bytes it reads in bins of ``--bin`` s from ``--start``, until ``--until`` (+ 2 s grace
    or EOF); prints ``{"sink": {...}}``.

``tcp-source``
    Connects to ``--dst:--port`` (congestion control ``--cc``) just before ``--start``, then ``sendall``s 64 KiB buffers
    until ``--until``; prints ``{"source": {...}}`` with the socket's TCP_INFO at the end
    (RTT, retransmissions, whether ECN was negotiated) and its congestion control.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import struct
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

CHUNK = 64 << 10  # bytes a tcp-source sendall hands the socket
TCPI_OPT_ECN = 8


def emit(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def sleep_until(t: float) -> None:
    while True:
        left = t - time.monotonic()
        if left <= 0:
            return
        time.sleep(min(left, 0.5))


# ---- pydblp rank ---------------------------------------------------------------

def rank_args(argv):
    p = argparse.ArgumentParser(prog="_congestion_worker.py rank")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--transport", required=True, choices=["xsk", "xsk-ktx", "udp"])
    p.add_argument("--peers", required=True, help="JSON list of [addr, port, mac] per rank")
    p.add_argument("--iface", default="eth0")
    p.add_argument("--job", type=int, required=True)
    p.add_argument("--mode", default="tar", choices=["tar", "ps"])
    p.add_argument("--cc", default="ecn")
    p.add_argument("--cc-knobs", default="", help="more Config cc_* knobs: 'cc_gain=0.5,cc_increase=20e6'")
    p.add_argument("--tol", type=float, default=0.05)
    p.add_argument("--size", type=int, required=True, help="bytes of float32 per allreduce")
    p.add_argument("--rate", type=float, default=0.0, help="bits/s xsk paces its transmit at (0: unpaced)")
    p.add_argument("--peer-timeout", type=float, default=30.0)
    return p.parse_args(argv)


class Rank:
    def __init__(self, a):
        from pydblp.collective import Collective, Config
        from pydblp.dataplane import open_dataplane

        self.a = a
        peers = [tuple(p) for p in json.loads(a.peers)]
        self.dp = open_dataplane(a.transport, a.iface, port=peers[a.rank][1], job=a.job, rank=a.rank,
                                 world=a.world, rate=a.rate)
        cfg = Config(job=a.job, mode=a.mode, estimator="unbiased", phase=f"static:{a.tol}",
                     peer_timeout=a.peer_timeout, cc=a.cc)
        for kv in filter(None, a.cc_knobs.split(",")):
            k, v = kv.split("=", 1)
            if not k.startswith("cc_") or not hasattr(cfg, k):
                raise ValueError(f"--cc-knobs: {k!r} is not a Config cc_* knob")
            setattr(cfg, k, float(v))
        try:
            self.col = Collective(self.dp.transport, a.rank, a.world, peers, cfg)
        except BaseException:
            self.dp.close()
            raise
        n = max(1, a.size // 4)
        self.x = np.random.default_rng(a.rank).standard_normal(n).astype(np.float32)
        self.out = np.empty_like(self.x)

    @property
    def cc(self):
        return self.col.protocol.cc

    def phase(self, cmd: dict) -> dict:
        col, t = self.col, self.col.t
        rounds, until = cmd.get("rounds"), cmd.get("until")
        sleep_until(cmd["start"])
        recs = []
        counters0 = dict(col.counters)
        cc0 = None if self.cc is None else self.cc.state()
        c0 = os.times()
        i = 0
        while True:
            self.x[0] = 1.0 if until is not None and time.monotonic() >= until else 0.0
            t0 = time.monotonic()
            col.allreduce(self.x, out=self.out)
            t1 = time.monotonic()
            r = col.records[-1]
            cc = self.cc
            recs.append({"t0": t0, "t1": t1, "rx": r.bytes_received, "tx": r.bytes_sent,
                         "rx_cum": t.stats().get("rx_bytes", 0), "ce_cum": col.counters["ce_received"],
                         "retx": r.retransmits, "min_delivered": r.min_delivered, "below": r.below_bound,
                         "rate": None if cc is None else [round(v) for v in cc.rate.tolist()]})
            i += 1
            if rounds is not None and i >= rounds:
                break
            if until is not None and self.out[0] > 0:
                break
        c1 = os.times()
        cc = self.cc
        return {"recs": recs, "counters0": counters0, "counters": dict(col.counters), "cc0": cc0,
                "cc": None if cc is None else cc.state(),
                "transport": {k: v for k, v in t.stats().items() if isinstance(v, (int, float))},
                "cpu": c1.user + c1.system - c0.user - c0.system}

    def close(self) -> None:
        try:
            self.col.close()
        finally:
            self.dp.close()


def rank_main(argv) -> int:
    a = rank_args(argv)
    import torch  # noqa: F401  (as bench/_allreduce_worker.py: one thread; torch is not otherwise used)

    torch.set_num_threads(1)
    impl = None
    try:
        impl = Rank(a)
        emit({"ready": True, "pid": os.getpid(), "ect": bool(getattr(impl.dp.transport, "ect", False))})
        for line in sys.stdin:
            cmd = json.loads(line)
            if cmd["cmd"] == "quit":
                break
            emit({"phase": impl.phase(cmd)})
        return 0
    except BaseException as e:
        emit({"error": f"job {a.job} rank {a.rank}: {type(e).__name__}: {e}"})
        traceback.print_exc()
        return 1
    finally:
        if impl is not None:
            try:
                impl.close()
            except Exception:
                traceback.print_exc()


# ---- TCP ----------------------------------------------------------------------

def tcp_args(argv, prog):
    p = argparse.ArgumentParser(prog=f"_congestion_worker.py {prog}")
    p.add_argument("--addr", help="tcp-sink: address to listen on")
    p.add_argument("--dst", help="tcp-source: the sink's address")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--start", type=float, required=True, help="CLOCK_MONOTONIC of the flow's start")
    p.add_argument("--until", type=float, required=True, help="CLOCK_MONOTONIC of its end")
    p.add_argument("--bin", type=float, default=0.1, help="tcp-sink: seconds a byte-count bin spans")
    p.add_argument("--cc", help="tcp-source: the socket's congestion control (TCP_CONGESTION; default the netns's)")
    return p.parse_args(argv)


def tcp_info(s: socket.socket) -> dict:
    raw = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    opts = raw[5]
    u = struct.unpack_from("=24I", raw, 8)  # rto .. total_retrans
    return {"ecn": bool(opts & TCPI_OPT_ECN), "rtt_us": u[15], "rttvar_us": u[16], "snd_cwnd": u[18],
            "total_retrans": u[23]}


def sink_main(argv) -> int:
    a = tcp_args(argv, "tcp-sink")
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((a.addr, a.port))
    ls.listen(1)
    emit({"ready": True, "pid": os.getpid()})
    ls.settimeout(max(5.0, a.until - time.monotonic() + 5))
    conn, _ = ls.accept()
    ls.close()
    nbins = int(np.ceil((a.until - a.start) / a.bin)) + 1
    bins = [0] * nbins
    before = total = 0
    buf = bytearray(1 << 20)
    end = a.until + 2.0
    conn.settimeout(0.5)
    while True:
        now = time.monotonic()
        if now > end:
            break
        try:
            n = conn.recv_into(buf)
        except socket.timeout:
            continue
        if not n:
            break
        now = time.monotonic()
        total += n
        k = int((now - a.start) // a.bin)
        if k < 0:
            before += n
        elif k < nbins:
            bins[k] += n
    conn.close()
    emit({"sink": {"bin": a.bin, "bins": bins, "before": before, "total": total}})
    return 0


def source_main(argv) -> int:
    a = tcp_args(argv, "tcp-source")
    sleep_until(a.start - 0.3)
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if a.cc:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, a.cc.encode())
    s.settimeout(5)
    s.connect((a.dst, a.port))
    cc = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0").decode()
    data = b"\0" * CHUNK
    sleep_until(a.start)
    sent = 0
    while time.monotonic() < a.until:
        s.sendall(data)
        sent += CHUNK
    info = tcp_info(s)
    s.close()
    emit({"source": {"sent": sent, "cc": cc, **info}})
    return 0


def main() -> int:
    kind, argv = (sys.argv[1], sys.argv[2:]) if len(sys.argv) > 1 else ("", [])
    if kind == "rank":
        return rank_main(argv)
    if kind == "tcp-sink":
        return sink_main(argv)
    if kind == "tcp-source":
        return source_main(argv)
    print("usage: _congestion_worker.py rank|tcp-sink|tcp-source ...", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
