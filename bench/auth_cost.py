#!/usr/bin/env python3
"""What a job key costs: per-packet tag and verify, and CPU per rank and round of an allreduce.

Both MAC paths of :mod:`pydblp.mac` are measured: ``c`` (the batched C
BLAKE2b, what a transport uses where a C compiler is) and ``hashlib`` (the
fallback without one).

Part 1, per packet (no socket): ``AuthTransport``'s own work on a batch of
``--batch`` packets of ``--chunk`` payload bytes, on each path: tagging
(``send`` with the inner transport's send replaced by a no-op: payload copy,
trailers, MACs) and verifying (the receive path on a batch of tagged packets:
checks, MACs, untagging); and the MACs alone over the same bytes (one
``Macs`` call per batch, each path), beside per-packet hashlib loops of
HMAC-SHA256 (OpenSSL; SHA-NI where the CPU has it) and an unkeyed SHA-1
pass.  Medians over ``--repeats``.

Part 2, per round: ``--world`` ranks as threads of this process, each a
``Collective`` (``tar``, ``static:0``) over ``UdpTransport`` on 127.0.0.1,
``--mib`` MiB float32 allreduces.  Three sets of ranks, keyless, keyed on the
C path and keyed on the hashlib path (``authenticate``), run blocks of
``--rounds`` rounds in turn (A, B, C, A, B, C, ... ``--repeats`` each, after one
warm-up block each), so all see the same machine; with ``--floor`` a fourth
set, keyed with a MAC that costs nothing (``nomac``: all-zero MACs), shows what
the wrapper costs beside the hashing.  CPU per rank and round: the rank threads' CPU time
(``time.thread_time``: user + system of the thread) over the block, divided
by ranks and rounds, and the whole process's (``time.process_time``: the
idle responders too); wall: the block's duration over its rounds.  Figures
are medians over blocks; the headline is keyed / keyless of each, per path.  Results
are checked against the exact mean (an inexact one is an error, exit 1).

No root; about ``3 * (repeats + 1) * rounds * round time`` (8 MiB, 4 ranks on
2 shared vCPUs: ~0.5 s a round, ~1.5 min with the defaults).  Exit 2 when the
C path is unavailable (the reason is logged)::

    .venv/bin/python bench/auth_cost.py [--mib 8] [--world 4] [--rounds 5] [--repeats 3]
                                        [--batch 2048] [--chunk 1408] [--floor] [--json out.json]
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pydblp import mac, wire  # noqa: E402
from pydblp.cliutil import Parser  # noqa: E402
from pydblp.collective import Collective, Config  # noqa: E402
from pydblp.collective.config import CHUNK_MAX  # noqa: E402
from pydblp.transport.auth import authenticate  # noqa: E402
from pydblp.transport.base import Batch  # noqa: E402
from pydblp.transport.udp import UdpTransport  # noqa: E402

KEY = bytes(range(32))
EPOCH = 0x0BADCAFE
PATHS = ("c", "hashlib")  # pydblp.mac's; "nomac" (--floor) is the bench's own


class NoMacs:
    """A MAC that costs nothing (all zero, so every tag verifies): the keyed path's floor."""

    def __call__(self, headers, payload, body, rows=None):
        return np.zeros((len(headers) if rows is None else len(rows), wire.MAC_LEN), np.uint8)


def _best(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def keyed(inner, key: bytes | None, path: str):
    """``authenticate(inner, key, EPOCH)`` computing its MACs on ``path`` (``c``, ``hashlib``, ``nomac``)."""
    t = authenticate(inner, key, EPOCH)
    if key is not None:
        t._macs = NoMacs() if path == "nomac" else mac.Macs(key, EPOCH, native=path == "c")
    return t


def per_packet(n: int, chunk: int, repeats: int) -> dict:
    """Microseconds per packet: the wrapper's tag and verify paths and the MACs alone, per MAC
    path, and bare per-packet hashes."""
    rng = np.random.default_rng(0)
    h = wire.empty_batch(n)
    h["kind"], h["job"], h["nchunks"], h["chunk"] = wire.Kind.DATA, 1, n, np.arange(n)
    plain = Batch.fill(h, rng.integers(0, 256, (n, chunk), dtype=np.uint8))
    out = {}
    for path in PATHS:
        t = keyed(UdpTransport(port=0), KEY, path)
        tagged = {}

        def keep(b, timeout=1.0):  # the inner send: keep the tagged batch (its rows are reused
            tagged["b"] = b         # by the next send, which tags the same packets), send nothing
            return b.n

        t.inner.send = keep
        out[f"tag_us_{path}"] = _best(lambda: t.send(plain), repeats) / n * 1e6
        got, into = tagged["b"], Batch.empty(n, chunk)
        out[f"verify_us_{path}"] = _best(lambda: t._deliver(got, into, False), repeats) / n * 1e6
        assert into.n == n and t.stats()["auth_bad_tag"] == 0
        t.close()
        m, lens = mac.Macs(KEY, EPOCH, native=path == "c"), plain.lengths[:n].astype(np.int64)
        out[f"mac_us_{path}"] = _best(lambda: m(plain.headers, plain.payload, lens), repeats) / n * 1e6
    rows = [memoryview(r) for r in np.ascontiguousarray(rng.integers(0, 256, (n, chunk + 32), dtype=np.uint8))]

    def each(base):
        def go():
            cp = base.copy
            for r in rows:
                m = cp()
                m.update(r)
                m.digest()
        return go

    out["hmac_sha256_us"] = _best(each(hmac.new(KEY, digestmod="sha256")), repeats) / n * 1e6
    out["sha1_us"] = _best(each(hashlib.sha1()), repeats) / n * 1e6
    return out


class Ranks:
    def __init__(self, world: int, path: str | None):
        self.ts = [keyed(UdpTransport(port=0), None if path is None else KEY, path) for _ in range(world)]
        peers = [("127.0.0.1", t.port) for t in self.ts]
        self.cols = [Collective(t, r, world, peers, Config(peer_timeout=60)) for r, t in enumerate(self.ts)]

    def block(self, xs: list, rounds: int) -> tuple[float, float, float, bool]:
        """``rounds`` allreduces: (rank threads' CPU s, process CPU s, wall s, every result exact)."""
        cpu = [0.0] * len(self.cols)
        exact = np.mean(np.float64(xs), axis=0)
        ok = [True] * len(self.cols)

        def go(r):
            t0 = time.thread_time()
            for _ in range(rounds):
                y = self.cols[r].allreduce(xs[r])
            cpu[r] = time.thread_time() - t0
            ok[r] = bool(np.allclose(y, exact, atol=1e-5))

        th = [threading.Thread(target=go, args=(r,)) for r in range(len(self.cols))]
        p0, w0 = time.process_time(), time.perf_counter()
        for x in th:
            x.start()
        for x in th:
            x.join()
        return sum(cpu), time.process_time() - p0, time.perf_counter() - w0, all(ok)

    def close(self):
        for c in self.cols:
            c.close()


def per_round(mib: float, world: int, rounds: int, repeats: int, paths=PATHS) -> dict:
    n = int(mib * 2**20) // 4
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    sets = {"keyless": Ranks(world, None)} | {f"keyed_{p}": Ranks(world, p) for p in paths}
    res = {k: {"thread_cpu_ms": [], "process_cpu_ms": [], "wall_ms": []} for k in sets}
    exact = True
    try:
        for name, rk in sets.items():
            rk.block(xs, 1)  # warm-up
        for _ in range(repeats):
            for name, rk in sets.items():
                cpu, pcpu, wall, ok = rk.block(xs, rounds)
                exact &= ok
                res[name]["thread_cpu_ms"].append(cpu / world / rounds * 1e3)
                res[name]["process_cpu_ms"].append(pcpu / world / rounds * 1e3)
                res[name]["wall_ms"].append(wall / rounds * 1e3)
        auth = {p: sets[f"keyed_{p}"].ts[0].stats() for p in paths}
    finally:
        for rk in sets.values():
            rk.close()
    out = {k: {m: statistics.median(v) for m, v in d.items()} | {"blocks": d} for k, d in res.items()}
    for p in paths:
        out[f"ratio_{p}"] = {m: out[f"keyed_{p}"][m] / out["keyless"][m]
                             for m in ("thread_cpu_ms", "process_cpu_ms", "wall_ms")}
        out[f"rank0_auth_{p}"] = {k: v for k, v in auth[p].items() if k.startswith("auth_")}
    out["exact"] = exact
    return out


def main(argv=None) -> int:
    ap = Parser(description=__doc__.split("\n\n")[0])  # (a mistake: one line, exit status 2)
    ap.add_argument("--mib", type=float, default=8)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=1408)
    ap.add_argument("--floor", action="store_true",
                    help="also keyed ranks whose MAC costs nothing: what the wrapper costs without hashing")
    ap.add_argument("--json", help="write the figures here too")
    a = ap.parse_args(argv)
    for bad, what in ((not (math.isfinite(a.mib) and int(a.mib * 2**20) // 4 >= 1),
                       f"--mib {a.mib:g}: use MiB above 0 (a float32 at least), e.g. --mib 8"),
                      (a.world < 2, f"--world {a.world}: use 2 or more ranks"),
                      (a.rounds < 1, f"--rounds {a.rounds}: use 1 or more"),
                      (a.repeats < 1, f"--repeats {a.repeats}: use 1 or more"),
                      (a.batch < 1, f"--batch {a.batch}: use 1 or more packets"),
                      (not 1 <= a.chunk <= CHUNK_MAX, f"--chunk {a.chunk}: use payload bytes in 1..{CHUNK_MAX} "
                                                      f"(pydblp's largest chunk), e.g. --chunk 1408")):
        if bad:
            ap.error(what)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if not mac.native_available():
        return 2
    pp = per_packet(a.batch, a.chunk, 2 * a.repeats + 1)
    print(f"per packet ({a.chunk}-byte payloads, batches of {a.batch}), us:")
    for p in PATHS:
        print(f"  {p:>7}: tag {pp[f'tag_us_{p}']:.2f}, verify {pp[f'verify_us_{p}']:.2f}, "
              f"MACs alone {pp[f'mac_us_{p}']:.2f}")
    print(f"  per-packet hashlib loops: HMAC-SHA256 {pp['hmac_sha256_us']:.2f}, SHA-1 {pp['sha1_us']:.2f}",
          flush=True)
    paths = (*PATHS, "nomac") if a.floor else PATHS
    pr = per_round(a.mib, a.world, a.rounds, a.repeats, paths)
    for k in ("keyless", *(f"keyed_{p}" for p in paths)):
        d = pr[k]
        print(f"{a.mib:g} MiB x {a.world} ranks, {k:>13}: CPU per rank and round {d['thread_cpu_ms']:.1f} ms "
              f"(process {d['process_cpu_ms']:.1f} ms), round {d['wall_ms']:.1f} ms")
    for p in paths:
        r = pr[f"ratio_{p}"]
        print(f"keyed ({p}) / keyless: CPU {r['thread_cpu_ms']:.3f} (process {r['process_cpu_ms']:.3f}), "
              f"round {r['wall_ms']:.3f}")
    print(f"results exact: {pr['exact']}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "per_packet": pp, "per_round": pr}, indent=1))
    return 0 if pr["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
