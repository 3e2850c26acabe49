#!/usr/bin/env python3
"""A/B of two checkouts of pydblp: ``bench/allreduce.py`` from each, alternating, paired.

A change to the collective or a transport moves a 1 MiB round by a few per
cent, and the machine drifts by more than that over minutes, so one run of
each says nothing.  This runs each checkout's own ``bench/allreduce.py``
(it imports the pydblp beside it) ``--pairs`` times in ABBA order (A B, B A,
A B, ...: neither side always runs first, after the other's teardown), with
the same arguments, and prints per block the figures of every pair, the mean
of each side, the mean paired difference with its standard error, and in how
many pairs B was lower.  Lower is better for every figure shown (p50, burst
median, CPU per rank and round).

    .venv/bin/python bench/ab.py A_DIR B_DIR [--pairs 8] [--json out.json] -- ALLREDUCE_ARGS...

e.g. ``bench/ab.py /tmp/base . --pairs 10 -- --sizes 1 --conditions clean
--transports udp --rounds 80`` (~12 s a run).  A_DIR and B_DIR are
checkouts (or copies of ``pydblp/``, ``bench/`` and ``bpf/``); both run on
this interpreter.  Bounded by the runs it makes: ``2 x pairs`` runs of
``allreduce.py``, each within its own bounds.  Needs root, as
``allreduce.py`` does.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

FIGURES = (("p50", "p50"), ("burst_med", "burst med"), ("cpu", "CPU/rank/round"))


def run(checkout: Path, args: list[str], out: Path) -> dict:
    """One run of the checkout's allreduce.py; its JSON results (``{}`` if it wrote none)."""
    script = checkout / "bench" / "allreduce.py"
    p = subprocess.run([sys.executable, str(script), *args, "--json", str(out)], cwd=checkout,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode not in (0, 1) or not out.exists():  # 1: a block failed; the rest still counts
        tail = "\n".join(p.stdout.strip().splitlines()[-5:])
        raise SystemExit(f"bench/ab.py: {script} exited with status {p.returncode}:\n{tail}")
    return json.loads(out.read_text())["results"]


def label(k: tuple) -> str:
    tr, key, cond, f = k
    return f"{tr} {key} MiB {cond} {dict(FIGURES)[f]}"


def figures(results: dict) -> dict:
    """(transport, MiB, condition, figure) -> value, for every block that has it."""
    out = {}
    for tr, sizes in results.items():
        for key, conds in sizes.items():
            for cond, s in conds.items():
                for f, _ in FIGURES:
                    if isinstance(s.get(f), (int, float)):
                        out[(tr, key, cond, f)] = float(s[f])
    return out


def main() -> int:
    argv = sys.argv[1:]
    rest = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="examples:\n  bench/ab.py /tmp/base . -- --sizes 1 --conditions clean "
                                        "--transports udp --rounds 80\n  bench/ab.py /tmp/base . --pairs 6 -- "
                                        "--sizes 1 --conditions burst --burst-len 14 --transports udp,xsk-ktx")
    ap.add_argument("a", type=Path, help="checkout A (the baseline)")
    ap.add_argument("b", type=Path, help="checkout B")
    ap.add_argument("--pairs", type=int, default=8, help="A/B pairs, ABBA order (default 8)")
    ap.add_argument("--json", help="write every pair's figures and the summary here")
    a = ap.parse_args(argv)
    for d in (a.a, a.b):
        if not (d / "bench" / "allreduce.py").is_file() or not (d / "pydblp").is_dir():
            ap.error(f"{d}: not a pydblp checkout (no bench/allreduce.py and pydblp/ there)")
    if a.pairs < 1:
        ap.error(f"--pairs {a.pairs}: use 1 or more")
    if "--json" in rest or "--repeats" in rest:
        ap.error("give --json to bench/ab.py itself; --repeats has no place here (the pairs are the repeats)")
    if os.geteuid() != 0:
        print("bench/ab.py needs root (bench/allreduce.py does)", file=sys.stderr)
        return 2
    sides = {"A": a.a.resolve(), "B": a.b.resolve()}
    pairs: list[dict] = []
    print(f"bench/ab.py: A {sides['A']}, B {sides['B']}, {a.pairs} pairs in ABBA order; "
          f"allreduce.py {' '.join(rest)}", flush=True)
    with tempfile.TemporaryDirectory(prefix="dblp-ab-") as tmp:
        for i in range(a.pairs):
            pair = {}
            for side in ("AB" if i % 2 == 0 else "BA"):
                pair[side] = figures(run(sides[side], rest, Path(tmp) / f"{i}{side}.json"))
            pairs.append(pair)
            shown = sorted(set(pair["A"]) & set(pair["B"]))
            print(f"  pair {i + 1} (A / B): " + "; ".join(f"{label(k)} {pair['A'][k] * 1e3:.1f} / "
                                                         f"{pair['B'][k] * 1e3:.1f}" for k in shown), flush=True)
    keys = sorted(set.intersection(*(set(p["A"]) & set(p["B"]) for p in pairs)))
    summary = {}
    print(f"\n{'block, figure (ms)':<42} {'A mean':>8} {'B mean':>8} {'B - A':>8} {'+-se':>6} {'B lower':>8}")
    for k in keys:
        av = [p["A"][k] for p in pairs]
        bv = [p["B"][k] for p in pairs]
        d = [y - x for x, y in zip(av, bv)]
        se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("nan")
        lower = sum(y < x for x, y in zip(av, bv))
        summary["/".join(k)] = {"a": av, "b": bv, "mean_diff": statistics.mean(d), "se": se, "b_lower": lower}
        print(f"{label(k):<42} {statistics.mean(av) * 1e3:>8.2f} "
              f"{statistics.mean(bv) * 1e3:>8.2f} {statistics.mean(d) * 1e3:>+8.2f} {se * 1e3:>6.2f} "
              f"{lower:>4} of {len(d)}")
    print("B - A below zero: B lower (faster, cheaper).  A difference within ~2 standard errors is the "
          "machine's, not the change's.")
    if a.json:
        Path(a.json).write_text(json.dumps({"a": str(sides["A"]), "b": str(sides["B"]), "args": rest,
                                            "pairs": [{s: {"/".join(k): v for k, v in p[s].items()} for s in p}
                                                      for p in pairs], "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
