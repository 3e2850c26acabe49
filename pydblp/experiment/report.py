"""The experiment's comparison table, speedups and PNG plots."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def speedups(summary: dict) -> dict:
    """Ratios of dblp over gloo and over static: wall time, burst-round latency, p99."""
    out = {}
    d = summary.get("dblp")
    if not d:
        return out
    for base in ("gloo", "static"):
        b = summary.get(base)
        if not b:
            continue
        r = {}
        for key in ("wall_s", "burst_round_ms", "round_p99_ms", "time_to_target_s"):
            if b.get(key) and d.get(key):
                r[key] = b[key] / d[key]
        out[f"dblp_vs_{base}"] = r
    return out


def table(rep: dict) -> str:
    rows = [("", *rep["summary"].keys())]

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    s = rep["summary"]
    metric = next((v["metric"] for v in s.values() if v["metric"]), "metric")
    lines = [
        ("wall time (s)", "wall_s", ".1f"),
        (f"time to {metric} {rep['target']} (s)", "time_to_target_s", ".1f"),
        (f"final {metric}", "final_metric", ".4f"),
        ("round p50 (ms)", "round_p50_ms", ".1f"),
        ("round p99 (ms)", "round_p99_ms", ".1f"),
        ("round max (ms)", "round_max_ms", ".1f"),
        ("burst rounds", "burst_rounds", "d"),
        ("burst-round latency (ms)", "burst_round_ms", ".1f"),
        ("delivered fraction", "delivered", ".4f"),
        ("pydblp retransmits", "retransmits", "d"),
        ("TCP retransmits (rank 0)", "tcp_retransmits", "d"),
    ]
    for label, key, spec in lines:
        rows.append((label, *(fmt(v.get(key), spec) for v in s.values())))
    w0 = max(len(r[0]) for r in rows)
    ws = [max(len(r[i]) for r in rows) for i in range(1, len(rows[0]))]
    text = ["  ".join([r[0].ljust(w0)] + [c.rjust(w) for c, w in zip(r[1:], ws)]) for r in rows]
    for name, r in rep["speedup"].items():
        parts = ", ".join(f"{k.replace('_ms', '').replace('_s', '')} {v:.2f}x" for k, v in r.items())
        text.append(f"speedup {name.replace('_', ' ')}: {parts}")
    return "\n".join(text)


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plots(rep: dict, out: Path) -> list[Path]:
    from pydblp._extras import require

    require("the experiment's plots", "matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = rep["runs"]
    made = []
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for tr, r in runs.items():
        a1.plot([s["t"] for s in r["steps"]], [s["loss"] for s in r["steps"]], label=tr, lw=0.8)
        if r["evals"]:
            a2.plot([e["t"] for e in r["evals"]], [e["eval"] for e in r["evals"]], marker="o", ms=3, label=tr)
            a2.set_ylabel(r["evals"][0]["metric"])
    a1.set_xlabel("time (s)"), a1.set_ylabel("training loss"), a1.legend()
    a2.set_xlabel("time (s)"), a2.legend()
    made.append(_save(plt, fig, out / "loss_accuracy.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for tr, r in runs.items():
        x = np.sort([s["sync"] * 1e3 for s in r["steps"]])
        ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=tr)
    ax.set_xscale("log"), ax.set_xlabel("round latency (ms, backward + sync)"), ax.set_ylabel("CDF")
    ax.legend(), ax.grid(alpha=0.3)
    made.append(_save(plt, fig, out / "latency_cdf.png"))

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for tr, r in runs.items():
        rounds = r["final"].get("rounds")
        if rounds:
            ax.plot([x["tol"] * 100 for x in rounds], label=tr, lw=0.8)
    ax.set_xlabel("collective round"), ax.set_ylabel("tolerance (%)"), ax.legend()
    made.append(_save(plt, fig, out / "tolerance.png"))
    return made
