"""The experiment's measurements of quality over time: a smoothed held-out loss curve, the time it
first reaches a target (interpolated between evaluations), and intervals of ratios over seeds.

Why: a threshold on accuracy over a few hundred held-out samples moves in steps of a third of
a point, and an evaluation every 20 steps is ~2.5 s of a ~20 s time to target; the time a run
"reaches" a target was then the first evaluation past it, and per-seed ratios spread from
0.35x to 1.36x.  The held-out cross-entropy is smooth, a centred mean over ``SMOOTH``
evaluations takes out most of the rest of its noise, and the crossing is interpolated
linearly between the two evaluations around it.

The intervals over seeds are Student-t intervals on the log of the ratio (the delta method for a
ratio of means; the log ratios' own spread for a geometric mean).  A percentile bootstrap over 4
to 6 seeds covers ~75-80 % where it says 90 %: resampling so few seeds underestimates their
spread.  In a simulation of per-seed times with a known ratio (lognormal noise, 2,000 trials)
these cover 88-90 % at a nominal 90 %, with 4 and with 6 seeds (tests/unit/test_experiment_report.py).
"""

from __future__ import annotations

import math

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


def curve_ratio(ts_a, loss_a, end_a: float, ts_b, loss_b, end_b: float, targets) -> tuple[float, int, int] | None:
    """How many times longer run a takes than run b to reach the same held-out loss, over a
    range of ``targets``: the geometric mean over them of ``t_a / t_b``, each time the curve's
    :func:`first_crossing`.  A run that never reaches a target counts its last evaluation's time
    (``end_a``/``end_b``): less than its time to it would be, so in its favour (a missed target
    of run a makes the ratio a lower bound, of run b an upper bound).  One target on a flat
    stretch of a curve is decided by its noise; a range reads the horizontal distance between
    two curves.

    Returns (ratio, targets run a never reached, targets run b never reached); None without a
    target."""
    logs, missed_a, missed_b = [], 0, 0
    for y in targets:
        if y is None:
            continue
        a = first_crossing(ts_a, loss_a, y)
        b = first_crossing(ts_b, loss_b, y)
        missed_a, missed_b = missed_a + (a is None), missed_b + (b is None)
        a, b = end_a if a is None else a, end_b if b is None else b
        if a > 0 and b > 0:
            logs.append(np.log(a / b))
    return (float(np.exp(np.mean(logs))), missed_a, missed_b) if logs else None


def t_quantile(p: float, df: int) -> float:
    """Student's t distribution's ``p`` quantile with ``df`` degrees of freedom (0 < p < 1):
    its CDF, through the regularized incomplete beta function, inverted by bisection."""
    if not 0 < p < 1 or df < 1:
        raise ValueError(f"t_quantile({p}, {df}): p in (0, 1) and df >= 1")
    if p < 0.5:
        return -t_quantile(1 - p, df)
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def _t_cdf(t: float, df: int) -> float:
    """P(T <= t) for t >= 0: 1 - I_x(df/2, 1/2) / 2 with x = df / (df + t^2)."""
    return 1 - 0.5 * _betainc(df / 2, 0.5, df / (df + t * t))


def _betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b): its continued fraction (modified
    Lentz), on the side of x where it converges fast."""
    if x <= 0:
        return 0.0
    if x >= 1:
        return 1.0
    if x > (a + 1) / (a + b + 2):
        return 1 - _betainc(b, a, 1 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny = 1e-300
    f, c, d = 1.0, 1.0, 0.0
    for i in range(400):
        m = i // 2
        if i == 0:
            num = 1.0
        elif i % 2 == 0:
            num = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        else:
            num = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        d = 1 + num * d
        d = 1 / (d if abs(d) > tiny else tiny)
        c = 1 + num / c
        c = c if abs(c) > tiny else tiny
        f *= c * d
        if abs(1 - c * d) < 1e-15:
            break
    return front * (f - 1)


def geomean_interval(ratios, level: float = 0.90) -> dict | None:
    """The geometric mean of per-seed ratios with its ``level`` Student-t interval (on the log
    ratios, n - 1 degrees of freedom): ``{"ratio", "lo", "hi", "n", "per_seed"}``; ``lo`` and
    ``hi`` None with one seed."""
    r = np.array([x for x in ratios if x is not None and x > 0], float)
    if not len(r):
        return None
    logs = np.log(r)
    out = {"ratio": float(np.exp(logs.mean())), "n": len(r), "per_seed": [float(x) for x in r]}
    if len(r) < 2:
        out["lo"] = out["hi"] = None
        return out
    half = t_quantile(0.5 + level / 2, len(r) - 1) * logs.std(ddof=1) / math.sqrt(len(r))
    out["lo"], out["hi"] = float(np.exp(logs.mean() - half)), float(np.exp(logs.mean() + half))
    return out


def ratio_interval(num, den, level: float = 0.90) -> dict | None:
    """The ratio of means ``R = mean(num) / mean(den)`` over paired per-seed values, with its
    ``level`` Student-t interval on log R (n - 1 degrees of freedom; the delta method's
    variance of log R, which keeps the seeds paired: ``var(a)/a^2 + var(b)/b^2 - 2 cov(a, b)/(a b)``
    over n, at the means).

    Returns ``{"ratio", "lo", "hi", "n", "per_seed"}``, ``lo`` and ``hi`` None with one pair;
    None without a pair of values."""
    pairs = [(a, b) for a, b in zip(num, den) if a is not None and b is not None and b > 0]
    if not pairs:
        return None
    a, b = np.array(pairs, float).T
    ma, mb = a.mean(), b.mean()
    out = {"ratio": float(ma / mb), "n": len(a), "per_seed": [float(x) for x in a / b]}
    if len(a) < 2 or ma <= 0:
        out["lo"] = out["hi"] = None
        return out
    var = a.var(ddof=1) / ma ** 2 + b.var(ddof=1) / mb ** 2 - 2 * np.cov(a, b)[0, 1] / (ma * mb)
    half = t_quantile(0.5 + level / 2, len(a) - 1) * math.sqrt(max(var, 0.0) / len(a))
    out["lo"], out["hi"] = float(ma / mb * math.exp(-half)), float(ma / mb * math.exp(half))
    return out
