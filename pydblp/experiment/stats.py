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
