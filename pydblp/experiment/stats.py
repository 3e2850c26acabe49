"""The experiment's measurements of quality over time: a smoothed held-out loss curve, the time it
first reaches a target (interpolated between evaluations), and bootstrap intervals of ratios
over seeds.

Why: a threshold on accuracy over a few hundred held-out samples moves in steps of a third of
a point, and an evaluation every 20 steps is ~2.5 s of a ~20 s time to target; the time a run
"reaches" a target was then the first evaluation past it, and per-seed ratios spread from
0.35x to 1.36x.  The held-out cross-entropy is smooth, a centred mean over ``SMOOTH``
evaluations takes out most of the rest of its noise, and the crossing is interpolated
linearly between the two evaluations around it.
"""

from __future__ import annotations

import numpy as np

SMOOTH = 3  # evaluations in the centred moving mean (at the ends, what there is)
CURVE_AT = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8)  # the curve ratio's targets: Gloo's loss at these fractions of its steps


def smooth(values, width: int = SMOOTH) -> np.ndarray:
    """Centred moving mean over ``width`` (odd) points; the ends average the points they have."""
    v = np.asarray(values, float)
    h = width // 2
    return np.array([v[max(0, i - h): i + h + 1].mean() for i in range(len(v))])


def value_at(xs, values, x: float) -> float | None:
    """``values`` (over increasing ``xs``) at ``x``, linearly interpolated; None outside."""
    xs, v = np.asarray(xs, float), np.asarray(values, float)
    if not len(xs) or x < xs[0] or x > xs[-1]:
        return None
    return float(np.interp(x, xs, v))


def first_crossing(ts, values, target: float, lower: bool = True) -> float | None:
    """When ``values`` (over increasing times ``ts``) first reach ``target`` (at or below it when
    ``lower``, else at or above), interpolated linearly between the evaluations around it;
    None if they never do."""
    ts, v = np.asarray(ts, float), np.asarray(values, float)
    hit = v <= target if lower else v >= target
    if not hit.any():
        return None
    i = int(np.argmax(hit))
    if i == 0:
        return float(ts[0])
    t0, t1, v0, v1 = ts[i - 1], ts[i], v[i - 1], v[i]
    return float(t0 + (t1 - t0) * (v0 - target) / (v0 - v1)) if v0 != v1 else float(t1)


def curve_ratio(ts_a, loss_a, end_a: float, ts_b, loss_b, end_b: float, targets) -> tuple[float, int] | None:
    """How many times longer run a takes than run b to reach the same held-out loss, over a
    range of ``targets``: the geometric mean over them of ``t_a / t_b``, each time the curve's
    :func:`first_crossing`.  A run that never reaches a target counts its last evaluation's time
    (``end_a``/``end_b``: a lower bound, against it).  One target on a flat stretch of a curve
    is decided by its noise; a range reads the horizontal distance between two curves.

    Returns (ratio, targets one of the two never reached); None without a target."""
    logs, missed = [], 0
    for y in targets:
        if y is None:
            continue
        a = first_crossing(ts_a, loss_a, y)
        b = first_crossing(ts_b, loss_b, y)
        missed += (a is None) + (b is None)
        a, b = end_a if a is None else a, end_b if b is None else b
        if a > 0 and b > 0:
            logs.append(np.log(a / b))
    return (float(np.exp(np.mean(logs))), missed) if logs else None


def bootstrap_geomean(ratios, level: float = 0.90, reps: int = 10_000, seed: int = 0) -> dict | None:
    """The geometric mean of per-seed ratios with its ``level`` percentile-bootstrap interval
    (seeds resampled with replacement, seeded): ``{"ratio", "lo", "hi", "n", "per_seed"}``."""
    r = np.array([x for x in ratios if x is not None and x > 0], float)
    if not len(r):
        return None
    out = {"ratio": float(np.exp(np.log(r).mean())), "n": len(r), "per_seed": [float(x) for x in r]}
    if len(r) < 2:
        out["lo"] = out["hi"] = None
        return out
    rng = np.random.default_rng(seed)
    m = np.exp(np.log(r)[rng.integers(0, len(r), (reps, len(r)))].mean(axis=1))
    tail = (1 - level) / 2 * 100
    out["lo"], out["hi"] = (float(x) for x in np.percentile(m, [tail, 100 - tail]))
    return out


def bootstrap_ratio(num, den, level: float = 0.90, reps: int = 10_000, seed: int = 0) -> dict | None:
    """The ratio of means ``mean(num) / mean(den)`` over paired per-seed values, with its
    ``level`` percentile-bootstrap interval (seeds resampled with replacement, seeded).

    Returns ``{"ratio", "lo", "hi", "n", "per_seed"}``; None without a pair of values."""
    pairs = [(a, b) for a, b in zip(num, den) if a is not None and b is not None and b > 0]
    if not pairs:
        return None
    a, b = np.array(pairs, float).T
    out = {"ratio": float(a.mean() / b.mean()), "n": len(a), "per_seed": [float(x) for x in a / b]}
    if len(a) < 2:
        out["lo"] = out["hi"] = None
        return out
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(a), (reps, len(a)))
    r = a[idx].mean(axis=1) / b[idx].mean(axis=1)
    tail = (1 - level) / 2 * 100
    out["lo"], out["hi"] = (float(x) for x in np.percentile(r, [tail, 100 - tail]))
    return out
