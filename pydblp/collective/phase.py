"""Phase controllers: the loss tolerance of each round.

``Static`` is the MLT-style baseline (one fixed tolerance).  ``Dblp`` is
DBLP's phase-aware controller (Ma et al.): every ``freq`` rounds it compares
the L2 norm G of the averaged gradient with the previous measurement; the
regime is *critical* when ``|G_prev - G| / G_prev >= eta``.  Training starts
critical.  Critical rounds use ``p_low``; the others ``p_low + k`` (``high="fixed"``, the
paper's), or ``p_low`` plus the loss the network makes, at most ``k`` (``high="loss"``).
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

Checkpoints: :meth:`PhaseController.state_dict` is what a controller has learned (``Dblp``: its
regime, the last G, the step counter and the partial sums of a step or window under way), as
numpy arrays, numbers and lists; :meth:`PhaseController.load_state_dict` puts it into a fresh
controller of the same kind, which then decides as the saved one would have.  The knobs
(``p_low``, ``freq``, ...) are the constructor's, not the state's.  ``Collective.state_dict``
includes its controller's.
"""

from __future__ import annotations

import collections
import math
from typing import Callable

import numpy as np

DBLP_K = 0.40  # DBLP's P_high - P_low: 40 percentage points
HISTORY_MAX = 1024  # measurements Dblp.history keeps
G_OVER = ("step", "window")  # what Dblp measures G on
HIGH = ("fixed", "loss")     # what Dblp's relaxed bound is over P_low: k, or the measured loss (at most k)
LOSS_GAIN = 1 / 64           # Dblp(high="loss"): the weight of one echo in the running loss


class PhaseController:
    """Decides ``tol`` (a loss fraction in [0, 1)) before each round and learns after it."""

    name = "?"

    def tol(self, index: int) -> float:
        raise NotImplementedError

    def phase(self) -> str:
        return self.name

    def observe(self, index: int, result: np.ndarray) -> None:
        """Called with the averaged gradient after round ``index``."""

    def observe_loss(self, sent: int, lost: int) -> None:
        """Called when a STOP's echo closes a span in which this rank sent ``sent`` DATA packets
        to its sender, ``lost`` of them lost (negative when packets in flight at the previous
        echo arrived since: ``sent`` may then be 0); only when :attr:`hears_loss`."""

    @property
    def hears_loss(self) -> bool:
        """Whether :meth:`observe_loss` is wanted (the protocol then counts what echoes say)."""
        return False

    @property
    def observes(self) -> bool:
        """Whether :meth:`observe` uses what it is shown (this base's ignores it, so a caller may
        skip making it: at 8 MiB a relaxed round's sample costs two fresh copies)."""
        return type(self).observe is not PhaseController.observe

    def count_steps(self) -> None:
        """Observe by training step from now on: :meth:`end_step` closes each step."""

    def end_step(self, total: float | None = None) -> None:
        """A training step's rounds are all observed (after :meth:`count_steps`).  ``total``: the
        step's squared norm summed over every rank's partial observations (replaces this rank's own)."""

    def measuring(self) -> float | None:
        """The squared norm observed so far in a step that will be measured, else None."""
        return None

    def state_dict(self) -> dict:
        """What this controller has learned, for :meth:`load_state_dict` (a new dict; arrays copied).
        A controller whose decisions depend only on its knobs and the round index (``Static``,
        ``Schedule``) has nothing to keep but its kind."""
        return {"name": self.name}

    def load_state_dict(self, state: dict) -> None:
        """Go on from ``state`` (:meth:`state_dict` of a controller of the same kind and knobs).

        Raises:
            ValueError: ``state`` is another kind's.
        """
        if state.get("name") != self.name:
            raise ValueError(f"a {state.get('name')!r} controller's state given to a {self.name!r} one")


class Static(PhaseController):
    name = "static"

    def __init__(self, tol: float = 0.0):
        _check(tol)
        self._tol = tol

    def tol(self, index: int) -> float:
        return self._tol


class Dblp(PhaseController):
    """DBLP defaults: p_low 1.6 % (within their 0.8-2.4 % range), k 40 points, freq 10, eta 0.5.

    ``g_over="window"`` (by step only): G is the norm of the *mean* averaged gradient over the
    steps since the last measurement (up to ``freq`` of them), not of the measured step's alone.
    One step's minibatch gradient is noisy once the signal is small (late in training its norm
    jumps by more than ``eta`` from one measurement to the next on this project's models, which
    reads as a critical regime); the window's mean keeps the signal and averages the noise down.
    Each round's vector must have the same shape at the same position in every step.  ``"step"``
    (default) is the paper's: the measured step's averaged gradient.

    ``high="loss"``: a relaxed round's bound is ``p_low`` plus the share of this rank's DATA
    packets the network lost lately, at most ``k``, instead of ``p_low + k``.  The share is
    measured from the echoes in STOPs (:class:`~pydblp.collective.cc.Ledger`): packets lost and
    packets sent, each a running sum weighted ``LOSS_GAIN`` per echo, over every destination.
    An echo counts packets still queued or in flight as lost and the next one as arrived, so the
    sums are long (1/64 an echo) and start from the first span taken as lossless: the measured
    share rises from 0 to the network's loss over about 1/LOSS_GAIN echoes (63 % of it after 64,
    86 % after 128; a 4-rank allreduce gives each rank about 6 an echo a round).
    Such a round ends as soon as what the network delivered is in, so it waits for no repair
    but cuts nothing the network did deliver: at a fixed ``k`` above the loss, relaxed rounds
    drop delivered data the model then lacks; below it, they repair.  Nothing else changes:
    the bound only sets when a message may stop, and the estimators stay unbiased at any bound.
    Each rank measures its own (its tolerance travels in its packets' headers).
    """

    name = "dblp"

    def __init__(self, p_low: float = 0.016, k: float = DBLP_K, freq: int = 10, eta: float = 0.5,
                 g_over: str = "step", high: str = "fixed"):
        _check(p_low)
        _check(p_low + k)
        if k < 0:
            raise ValueError(f"k {k} must be >= 0 (P_high = p_low + k)")
        if freq < 1 or eta <= 0:
            raise ValueError("freq must be >= 1 and eta > 0")
        if g_over not in G_OVER:
            raise ValueError(f"g_over {g_over!r}: use {' or '.join(G_OVER)}")
        if high not in HIGH:
            raise ValueError(f"high {high!r}: use {' or '.join(HIGH)}")
        self.p_low, self.k, self.freq, self.eta, self.g_over, self.high = p_low, k, freq, eta, g_over, high
        self._lost = self._sent = 0.0  # high="loss": running sums of packets lost and sent
        self._acc: list[np.ndarray] = []  # window: per round of a step, its vectors summed over the window
        self._k = 0                       # window: rounds observed in the current step
        self._n = 0                       # window: steps ended since the last measurement
        self.critical = True
        self.g_prev: float | None = None
        # the latest measurements, for inspection: (round or step index, G, critical); bounded, so
        # a long run's memory stays flat
        self.history: collections.deque[tuple[int, float, bool]] = collections.deque(maxlen=HISTORY_MAX)
        self.steps: int | None = None  # steps ended so far once count_steps() was called
        self._sq = 0.0                 # squared norm of the current step's results so far

    @property
    def window(self) -> bool:
        """G over the window (observed vectors are summed over steps)."""
        return self.g_over == "window"

    def tol(self, index: int) -> float:
        if self.critical:
            return self.p_low
        return self.p_low + (self.loss() if self.high == "loss" else self.k)

    def phase(self) -> str:
        return "critical" if self.critical else "relaxed"

    @property
    def hears_loss(self) -> bool:
        return self.high == "loss"

    def observe_loss(self, sent: int, lost: int) -> None:
        if not self._sent:  # the first span sets the scale, as if lossless: its own count is mostly
            self._sent = float(sent)  # packets still queued or in flight, not lost
            return
        self._sent += LOSS_GAIN * (sent - self._sent)
        self._lost += LOSS_GAIN * (lost - self._lost)

    def loss(self) -> float:
        """The share of this rank's DATA packets the network lost lately, within [0, k] (0 before
        any echo)."""
        return min(self.k, max(0.0, self._lost / self._sent)) if self._sent > 0 else 0.0

    def observe(self, index: int, result: np.ndarray) -> None:
        if self.window:
            if self.steps is None:
                raise RuntimeError("Dblp(g_over='window') measures by step: call count_steps() first")
            r = result.astype(np.float64, copy=False).reshape(-1)
            if self._k == len(self._acc):
                self._acc.append(r.copy())
            elif self._acc[self._k].shape != r.shape:
                raise ValueError(f"Dblp(g_over='window'): round {self._k} of a step gave {r.size} values, "
                                 f"earlier steps {self._acc[self._k].size}")
            else:
                self._acc[self._k] += r
            self._k += 1
            return
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
        if self.steps is None or self.steps % self.freq:
            return None
        if self.window:  # the squared norm of this rank's part of the window's mean
            return sum(float(np.dot(a, a)) for a in self._acc) / (self._n + 1) ** 2
        return self._sq

    def end_step(self, total: float | None = None) -> None:
        if self.steps is None:
            raise RuntimeError("end_step() before count_steps()")
        own = self.measuring()
        step, self.steps = self.steps, self.steps + 1
        self._n, self._k = self._n + 1, 0
        if step % self.freq == 0:
            self._decide(step, math.sqrt(max(0.0, own if total is None else total)))
            self._acc, self._n = [], 0
        self._sq = 0.0

    def state_dict(self) -> dict:
        """The regime, the last G and the measurements kept (``history``), the step counter,
        what a step or window under way has summed so far (a checkpoint may fall between a step's
        rounds: its rounds so far are counted once), and the running loss (``high="loss"``)."""
        return {"name": self.name, "critical": self.critical, "g_prev": self.g_prev,
                "history": [list(h) for h in self.history], "steps": self.steps, "sq": self._sq,
                "acc": [a.copy() for a in self._acc], "k": self._k, "n": self._n,
                "lost": self._lost, "sent": self._sent}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.critical, self.g_prev = bool(state["critical"]), state["g_prev"]
        self.history.clear()
        self.history.extend((int(i), float(g), bool(c)) for i, g, c in state["history"])
        self.steps, self._sq = state["steps"], float(state["sq"])
        self._acc = [np.array(a, np.float64) for a in state["acc"]]
        self._k, self._n = int(state["k"]), int(state["n"])
        self._lost, self._sent = float(state.get("lost", 0.0)), float(state.get("sent", 0.0))

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
