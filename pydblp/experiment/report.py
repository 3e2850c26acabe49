"""The experiment's comparison table, speedups and PNG plots."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _dblp_pairs(names) -> list[tuple[str, str]]:
    """(a DBLP arm, its static arm) pairs: ``dblp/ef`` with ``static/ef`` where that ran, else
    with the first static arm."""
    names = list(names)
    statics = [n for n in names if n == "static" or n.startswith("static/")]
    out = []
    for name in names:
        if name == "dblp" or name.startswith("dblp/"):
            twin = "static" + name[len("dblp"):]
            base = twin if twin in names else statics[0] if statics else None
            if base:
                out.append((name, base))
    return out


def _off_pairs(names, knob: str = "cc") -> list[tuple[str, str]]:
    """(a run with ``knob`` on, the same run with it off) where both ran (``--cc off,ecn``,
    ``--plan auto,off``): ``dblp/cc-ecn`` with ``dblp/cc-off``, ``dblp/magnitude/tail/cc-ecn``
    with ``dblp/magnitude/tail/cc-off``, ``dblp/plan-auto`` with ``dblp/plan-off``."""
    names = list(names)
    out = []
    for name in names:
        head, sep, rest = name.partition(f"/{knob}-")
        mode, slash, tail = rest.partition("/")
        if sep and mode != "off" and f"{head}/{knob}-off{slash}{tail}" in names:
            out.append((name, f"{head}/{knob}-off{slash}{tail}"))
    return out


def _pairs(names, static_too: bool = False) -> list[tuple[str, str]]:
    """Each DBLP arm with its static arm (:func:`_dblp_pairs`) and with Gloo's where that ran;
    ``static_too``: each static arm with Gloo's too."""
    names = list(names)
    dblp = _dblp_pairs(names)
    if "gloo" not in names:
        return dblp
    statics = [n for n in names if n == "static" or n.startswith("static/")] if static_too else []
    return dblp + [(n, "gloo") for n, _ in dblp] + [(n, "gloo") for n in statics]


SPEEDUP_KEYS = ("burst_round_ms", "round_p99_ms")  # (time to target and wall: the ratio lines, with intervals)


def speedups(summary: dict) -> dict:
    """Each DBLP arm's burst-round latency and round p99 against gloo's and static's
    (:func:`_pairs`), as ``base / arm`` (above 1: the arm's rounds are shorter).  ``summary``
    holds one seed's values, or the means over seeds: over seeds the speedup is the ratio of
    the means, as the ratio lines' (:func:`ratios`)."""
    out = {}
    for name, static in _pairs(summary):
        d, b = summary[name], summary[static]
        out[f"{name}_vs_{static}"] = {key: b[key] / d[key] for key in SPEEDUP_KEYS if b.get(key) and d.get(key)}
    return out


def ratios(seeds: list[dict]) -> dict:
    """Per DBLP arm against static and Gloo, static against Gloo, and each run with congestion
    control or plans against the same run without (:func:`_off_pairs`; the same seeds): time to
    target, wall time and the ranks' CPU as ``arm / base`` (below 1: the arm is faster or
    cheaper), the ratio of the means over seeds with its 90 % interval
    (:func:`pydblp.experiment.stats.ratio_interval`); the curve ratio
    (:func:`~pydblp.experiment.stats.curve_ratio` over each seed's ``curve_targets``), its
    geometric mean over seeds with its interval; and the final quality against Gloo's:
    accuracy points (arm - gloo) or perplexity (arm / gloo - 1).

    A run that never reached the target counts its last evaluation's time, which is less than
    its time to target would have been: ``censored`` is ``[arm's, base's]`` count of such
    runs (targets, for the curve), and ``bound`` says what the ratio then is: ``"lower"`` (only
    the arm missed: the arm's true ratio is at least this), ``"upper"`` (only the base
    missed), ``"none"`` (both missed: neither)."""
    from pydblp.experiment import stats

    names = list(seeds[0]["summary"])
    pairs = _pairs(names, static_too=True) + _off_pairs(names, "cc") + _off_pairs(names, "plan")

    def ttt(summary: dict) -> tuple[float | None, bool]:
        """A run's time to target, or its last evaluation's time if it never got there (censored)."""
        t = summary.get("time_to_target_s")
        curve = summary.get("loss_curve") or [[]]
        if t is None and curve[0]:
            return curve[0][-1], True
        return t, False

    out = {}
    for arm, base in pairs:
        r = {}
        a = [ttt(s["summary"][arm]) for s in seeds]
        b = [ttt(s["summary"][base]) for s in seeds]
        got = stats.ratio_interval([x for x, _ in a], [x for x, _ in b])
        if got is not None:
            _censored(got, sum(c for _, c in a), sum(c for _, c in b))
            r["time_to_target_s"] = got
        for key in ("wall_s", "cpu_s"):
            got = stats.ratio_interval([s["summary"][arm].get(key) for s in seeds],
                                       [s["summary"][base].get(key) for s in seeds])
            if got is not None:
                r[key] = got
        per, missed_a, missed_b = [], 0, 0
        for s in seeds:
            ca, cb = s["summary"][arm].get("loss_curve"), s["summary"][base].get("loss_curve")
            if not (ca and cb and ca[0] and cb[0] and s.get("curve_targets")):
                continue
            c = stats.curve_ratio(ca[0], ca[1], ca[0][-1], cb[0], cb[1], cb[0][-1], s["curve_targets"])
            if c is not None:
                per.append(c[0])
                missed_a, missed_b = missed_a + c[1], missed_b + c[2]
        got = stats.geomean_interval(per)
        if got is not None:
            _censored(got, missed_a, missed_b)
            r["curve"] = got
        out[f"{arm} / {base}"] = r
    if "gloo" in names:
        for arm in names:
            if arm == "gloo":
                continue
            d = [(s["summary"][arm].get("final_metric"), s["summary"]["gloo"].get("final_metric"), s["summary"][arm].get("metric"))
                 for s in seeds]
            d = [x for x in d if x[0] is not None and x[1] is not None]
            if not d:
                continue
            ppl = d[0][2] == "perplexity"
            diff = [(a / b - 1) * 100 if ppl else (a - b) * 100 for a, b, _ in d]
            out.setdefault(f"{arm} / gloo", {})["final_quality"] = {
                "unit": "% perplexity" if ppl else "accuracy points", "mean": float(np.mean(diff)),
                "per_seed": [float(x) for x in diff]}
    return out


def _censored(got: dict, arm: int, base: int) -> None:
    """Note in ``got`` how many of the arm's and the base's runs (or targets) were never
    reached, and what that makes the ratio (see :func:`ratios`)."""
    got["censored"] = [arm, base]
    got["bound"] = "none" if arm and base else "lower" if arm else "upper" if base else None


def ratio_lines(rep: dict) -> list[str]:
    """The ratios' lines for the table: ``dblp / static: time to target 0.78x (90 % CI 0.70-0.86,
    6 seeds: 0.71 0.85 ...)``."""
    lines = []
    for pair, r in (rep.get("ratios") or {}).items():
        parts = []
        for key, what in (("time_to_target_s", "time to target"), ("curve", "curve"), ("wall_s", "wall"),
                          ("cpu_s", "CPU")):
            b = r.get(key)
            if not b:
                continue
            ci = f"90 % CI {b['lo']:.2f}-{b['hi']:.2f}, " if b.get("lo") is not None else ""
            late, sign = "", ""
            if b.get("bound"):
                arm, base = pair.split(" / ")
                unit = "targets" if key == "curve" else "runs"
                missed = " and ".join(f"{name} {k}" for name, k in zip((arm, base), b["censored"]) if k)
                late = (f"; never reached: {missed} {unit}, counted at their last evaluation: "
                        + {"lower": "a lower bound", "upper": "an upper bound", "none": "no bound"}[b["bound"]])
                sign = {"lower": ">=", "upper": "<="}.get(b["bound"], "~")
            parts.append(f"{what} {sign}{b['ratio']:.2f}x ({ci}{b['n']} seed{'s' if b['n'] > 1 else ''}: "
                         + " ".join(f"{x:.2f}" for x in b["per_seed"]) + late + ")")
        q = r.get("final_quality")
        if q:
            parts.append(f"final quality {q['mean']:+.2f} {q['unit']}")
        if parts:
            lines.append(f"{pair}: " + "; ".join(parts))
    return lines


def policy_ratios(summary: dict) -> dict:
    """Each pydblp run shedding by priority against the same run with a drop-tail queue
    (``dblp/magnitude/priority`` against ``dblp/magnitude/tail``): time to target and wall
    time as tail/priority (above 1: priority-aware shedding is faster), final metric and
    delivered fraction as priority minus tail."""
    out = {}
    for name, d in summary.items():
        if not name.endswith("/priority"):
            continue
        b = summary.get(name[: -len("priority")] + "tail")
        if not b:
            continue
        r = {}
        for key in ("time_to_target_s", "wall_s"):
            if b.get(key) and d.get(key):
                r[key] = b[key] / d[key]
        for key in ("final_metric", "delivered"):
            if b.get(key) is not None and d.get(key) is not None:
                r[key.replace("_metric", "") + "_gain"] = d[key] - b[key]
        out[f"{name}_vs_tail"] = r
    return out


def _target_text(rep: dict) -> str:
    t = rep.get("target")
    if isinstance(t, list):
        vals = [v for v in t if v is not None]
        return f"{np.mean(vals):.4g} (mean of {len(vals)})" if vals else "-"
    return "-" if t is None else f"{t:.4g}"


def table(rep: dict) -> str:
    """The comparison table: one column per arm; mean +- standard deviation over seeds (over
    the seeds that measured it: "(k of n)" when some did not, e.g. runs that never reached the
    target)."""
    s = {arm: dict(v) for arm, v in rep["summary"].items()}
    spread = {arm: dict(v) for arm, v in rep.get("spread", {}).items()}
    rows = [("", *s.keys())]

    def fmt(arm, key, spec):
        v = s[arm].get(key)
        if v is None:
            return "-"
        sd = spread.get(arm, {}).get(key)
        text = format(int(round(v)) if spec == "d" else v, spec)
        text += f" +-{format(sd, spec if spec != 'd' else '.0f')}" if sd is not None else ""
        n, of = s[arm].get(key + "_n"), s[arm].get("wall_s_n")
        return text + (f" ({n} of {of})" if n is not None and of is not None and n < of else "")  # (the seeds it had)

    metric = next((v["metric"] for v in s.values() if v.get("metric")), "metric")
    lines = [
        ("wall time (s)", "wall_s", ".1f"),
        ("CPU, all ranks (s)", "cpu_s", ".1f"),
        ("share of the machine's CPUs busy", "cpu_busy", ".2f"),
        (f"time to held-out loss {_target_text(rep)} (s)", "time_to_target_s", ".1f"),
        (f"final {metric}", "final_metric", ".4f"),
        ("final held-out loss", "final_loss", ".4f"),
        ("step p50 (ms)", "step_ms", ".1f"),
        ("communication share of a step", "comm_share", ".2f"),
        ("round p50 (ms)", "round_p50_ms", ".1f"),
        ("round p99 (ms)", "round_p99_ms", ".1f"),
        ("burst rounds", "burst_rounds", "d"),
        ("burst-round latency (ms)", "burst_round_ms", ".1f"),
        ("delivered fraction", "delivered", ".4f"),
        ("relaxed share of phase checks", "relaxed_share", ".2f"),
        ("pydblp retransmits (chunks)", "retransmits", "d"),
        ("pydblp retransmitted MB", "retransmit_mb", ".2f"),
        ("TCP retransmits (rank 0)", "tcp_retransmits", "d"),
        ("gradient error |g - exact| / |exact|, mean", "grad_error", ".4f"),
        ("replica divergence max |dp|", "divergence_max", ".2e"),
        ("replica divergence max rel", "divergence_rel_max", ".2e"),
        ("queue tail drops (packets)", "queue_tail_drops", "d"),
        ("queue early drops, by priority (packets)", "queue_early_drops", "d"),
        ("early drops refused: budget spent", "queue_bound_refusals", "d"),
        ("queue CE marks (packets)", "queue_marks", "d"),
        ("CE marks received (rank 0)", "ce_received", "d"),
        ("rounds rank 0 paced a destination", "paced_share", ".2f"),
        ("host-program sheds (packets)", "host_shed", "d"),
    ]
    optional = {"cpu_s", "cpu_busy", "queue_tail_drops", "queue_early_drops", "queue_bound_refusals", "queue_marks", "host_shed",
                "ce_received", "paced_share"}
    lines = [ln for ln in lines if ln[1] not in optional or any(v.get(ln[1]) is not None for v in s.values())]
    for arm in s:
        b = s[arm].get("retransmit_bytes")
        s[arm]["retransmit_mb"] = None if b is None else b / 1e6
        sd = spread.get(arm, {}).get("retransmit_bytes")
        spread.setdefault(arm, {})["retransmit_mb"] = None if sd is None else sd / 1e6
    for label, key, spec in lines:
        rows.append((label, *(fmt(arm, key, spec) for arm in s)))
    w0 = max(len(r[0]) for r in rows)
    ws = [max(len(r[i]) for r in rows) for i in range(1, len(rows[0]))]
    text = ["  ".join([r[0].ljust(w0)] + [c.rjust(w) for c, w in zip(r[1:], ws)]) for r in rows]
    for arm, v in s.items():
        by = v.get("delivered_by_phase") or {}
        if by and arm != "gloo":
            bound = v.get("bound_by_phase") or {}
            parts = ", ".join(f"{ph} {d:.4f} ({v['rounds_by_phase'][ph]:.0f} rounds"
                              + (f", bound {bound[ph] * 100:.1f} %)" if ph in bound else ")") for ph, d in by.items())
            same = {True: "identical on every rank", False: "DIFFER between ranks"}.get(v.get("phase_identical"), "")
            text.append(f"{arm}: delivered by phase: {parts}; phase decisions {same}".rstrip("; "))
        ge = v.get("grad_error_by_phase") or {}
        if ge:
            text.append(f"{arm}: gradient error by phase: " + ", ".join(f"{ph} {e:.4f}" for ph, e in ge.items()))
    for arm, v in s.items():
        if v.get("reused_from"):
            text.append(f"{arm}: from {v['reused_from']} (not run again; its time to target on its own clock)")
        for key, what in (("queue_early_by_prio", "queue early drops"), ("host_shed_by_prio", "host sheds")):
            by = v.get(key)
            if by and any(by):
                text.append(f"{arm}: {what} by priority 0..7: " + " ".join(f"{x:.0f}" for x in by))
    text.extend(ratio_lines(rep))
    for name, r in rep["speedup"].items():
        if name.endswith("_vs_tail"):
            parts = ", ".join(f"{k.replace('_s', '')} {v:.2f}x" if not k.endswith("_gain") else f"{k} {v:+.4f}"
                              for k, v in r.items())
            text.append(f"{name.replace('_vs_tail', '')} vs drop-tail: {parts}")
            continue
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
    for arm, r in runs.items():
        a1.plot([s["t"] for s in r["steps"]], [s["loss"] for s in r["steps"]], label=arm, lw=0.8)
        if r["evals"]:
            a2.plot([e["t"] for e in r["evals"]], [e["eval"] for e in r["evals"]], marker="o", ms=3, label=arm)
            a2.set_ylabel(r["evals"][0]["metric"])
    a1.set_xlabel("time (s)"), a1.set_ylabel("training loss"), a1.legend()
    a2.set_xlabel("time (s)"), a2.legend()
    made.append(_save(plt, fig, out / "loss_accuracy.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, r in runs.items():
        x = np.sort([s["sync"] * 1e3 for s in r["steps"]])
        ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=arm)
    ax.set_xscale("log"), ax.set_xlabel("round latency (ms, backward + sync)"), ax.set_ylabel("CDF")
    ax.legend(), ax.grid(alpha=0.3)
    made.append(_save(plt, fig, out / "latency_cdf.png"))

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for arm, r in runs.items():
        rounds = r["final"].get("rounds")
        if rounds:
            ax.plot([x["tol"] * 100 for x in rounds], label=arm, lw=0.8)
    ax.set_xlabel("collective round"), ax.set_ylabel("tolerance (%)"), ax.legend()
    made.append(_save(plt, fig, out / "tolerance.png"))

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for arm, r in runs.items():
        if r.get("divs"):
            a1.plot([d["step"] for d in r["divs"]], [max(d["div"], 1e-12) for d in r["divs"]], marker="o", ms=3,
                    label=arm)
        hist = (r["final"].get("phase") or {}).get("history") or []
        if hist:
            a2.plot([h[0] for h in hist], [h[1] for h in hist], label=f"{arm} G", lw=0.8)
            crit = [h for h in hist if h[2]]
            a2.scatter([h[0] for h in crit], [h[1] for h in crit], s=10, marker="x", label=f"{arm} critical")
    a1.set_yscale("log"), a1.set_xlabel("step"), a1.set_ylabel("max |parameter - rank 0's|")
    a2.set_xlabel("step"), a2.set_ylabel("gradient norm G (x: critical)")
    for a in (a1, a2):
        if a.get_legend_handles_labels()[0]:
            a.legend()
    made.append(_save(plt, fig, out / "divergence_phase.png"))
    return made
