"""Phase controllers: the loss tolerance of each round.

``Static`` is the MLT-style baseline (one fixed tolerance).  ``Dblp`` is
DBLP's phase-aware controller (Ma et al.): every ``freq`` rounds it compares
the L2 norm G of the averaged gradient with the previous measurement; the
regime is *critical* when ``|G_prev - G| / G_prev >= eta``.  Training starts
critical.  Critical rounds use ``p_low``; the others ``p_low + k``.
``Schedule`` takes any callable ``round index -> tolerance``.

Granularity: by default a controller observes every round (one allreduce per
training step).  A caller that runs several rounds per step (DDP's comm hook:
one round per gradient bucket) calls :meth:`PhaseController.count_steps` once
before the first round and :meth:`PhaseController.end_step` after each step's
last round; ``Dblp`` then measures G over the whole step's averaged gradient
(all its rounds' results) every ``freq`` steps, as the paper does, and changes
tolerance only between steps.

One phase for the job: every rank must decide on the same G.  With
consistent results (``Config.consistent``) each rank's result is the same
vector, so each measures the same G.  Without, ranks hold different all-gather
fills; the collective then hands the controller only the shard this rank owns
(its exact reduce-scatter estimate) and, at the end of a measured step, the
squared norms summed over ranks (:meth:`Collective.end_step`): G from data
every rank holds identically.
"""

from __future__ import annotations

import collections
import math
from typing import Callable

import numpy as np

DBLP_K = 0.40  # DBLP's P_high - P_low: 40 percentage points
HISTORY_MAX = 1024  # measurements Dblp.history keeps


class PhaseController:
    """Decides ``tol`` (a loss fraction in [0, 1)) before each round and learns after it."""

    name = "?"

    def tol(self, index: int) -> float:
        raise NotImplementedError

    def phase(self) -> str:
        return self.name

    def observe(self, index: int, result: np.ndarray) -> None:
        """Called with the averaged gradient after round ``index``."""

    def count_steps(self) -> None:
        """Observe by training step from now on: :meth:`end_step` closes each step."""

    def end_step(self, total: float | None = None) -> None:
        """A training step's rounds are all observed (after :meth:`count_steps`).  ``total``: the
        step's squared norm summed over every rank's partial observations (replaces this rank's own)."""

    def measuring(self) -> float | None:
        """The squared norm observed so far in a step that will be measured, else None."""
        return None


class Static(PhaseController):
    name = "static"

    def __init__(self, tol: float = 0.0):
        _check(tol)
        self._tol = tol

    def tol(self, index: int) -> float:
        return self._tol


class Dblp(PhaseController):
    """DBLP defaults: p_low 1.6 % (within their 0.8-2.4 % range), k 40 points, freq 10, eta 0.5."""

    name = "dblp"

    def __init__(self, p_low: float = 0.016, k: float = DBLP_K, freq: int = 10, eta: float = 0.5):
        _check(p_low)
        _check(p_low + k)
        if k < 0:
            raise ValueError(f"k {k} must be >= 0 (P_high = p_low + k)")
        if freq < 1 or eta <= 0:
            raise ValueError("freq must be >= 1 and eta > 0")
        self.p_low, self.k, self.freq, self.eta = p_low, k, freq, eta
        self.critical = True
        self.g_prev: float | None = None
        # the latest measurements, for inspection: (round or step index, G, critical); bounded, so
        # a long run's memory stays flat
        self.history: collections.deque[tuple[int, float, bool]] = collections.deque(maxlen=HISTORY_MAX)
        self.steps: int | None = None  # steps ended so far once count_steps() was called
        self._sq = 0.0                 # squared norm of the current step's results so far

    def tol(self, index: int) -> float:
        return self.p_low if self.critical else self.p_low + self.k

    def phase(self) -> str:
        return "critical" if self.critical else "relaxed"

    def observe(self, index: int, result: np.ndarray) -> None:
        if self.steps is not None:  # by step: add this round's share of the step's norm
            if self.steps % self.freq == 0:
                r = result.astype(np.float64, copy=False).reshape(-1)
                self._sq += float(np.dot(r, r))
            return
        if index % self.freq:
            return
        self._decide(index, float(np.linalg.norm(result.astype(np.float64, copy=False))))

    def count_steps(self) -> None:
        if self.steps is None:
            self.steps, self._sq = 0, 0.0

    def measuring(self) -> float | None:
        return self._sq if self.steps is not None and self.steps % self.freq == 0 else None

    def end_step(self, total: float | None = None) -> None:
        if self.steps is None:
            raise RuntimeError("end_step() before count_steps()")
        step, self.steps = self.steps, self.steps + 1
        if step % self.freq == 0:
            self._decide(step, math.sqrt(max(0.0, self._sq if total is None else total)))
        self._sq = 0.0

    def _decide(self, index: int, g: float) -> None:
        if self.g_prev is not None and self.g_prev > 0 and math.isfinite(g):
            self.critical = abs(self.g_prev - g) / self.g_prev >= self.eta
        self.g_prev = g
        self.history.append((index, g, self.critical))


class Schedule(PhaseController):
    name = "schedule"

    def __init__(self, fn: Callable[[int], float]):
        self.fn = fn

    def tol(self, index: int) -> float:
        t = float(self.fn(index))
        _check(t)
        return t


def _check(tol: float) -> None:
    if not 0.0 <= tol < 1.0:
        raise ValueError(f"tolerance {tol} must be in [0, 1)")


def make(spec: str | PhaseController) -> PhaseController:
    """``static:0.02``, ``dblp`` or ``dblp:0.016``, or a controller as is."""
    if isinstance(spec, PhaseController):
        return spec
    name, _, arg = spec.partition(":")
    if name == "static":
        return Static(float(arg or 0.0))
    if name == "dblp":
        return Dblp(float(arg)) if arg else Dblp()
    raise ValueError(f"unknown phase controller {spec!r}: use static:TOL or dblp[:P_LOW]")
