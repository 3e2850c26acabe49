"""DiLoCo and Factored Gossip DiLoCo, shaped like torchft's ``DiLoCo``.

Each worker takes ``sync_every`` (H) steps of its inner optimizer without
communicating, then forms the pseudo-gradient ``anchor - local`` (``anchor``:
the parameters at the start of the phase) and takes one step of its outer
optimizer (typically Nesterov SGD, lr 0.7, momentum 0.9) on it, from the
anchor.  What differs is how the pseudo-gradients are synchronised::

    with DiLoCo(exchange, model, inner, outer, sync_every=20, mode="gossip"):
        for x, y in data:
            inner.zero_grad(); loss(model(x), y).backward(); inner.step()

``mode="exact"``: DiLoCo.  The pseudo-gradient is averaged over all workers
(``Exchange.allreduce_mean``), blocking; every worker applies the same
outer step, so all hold the same model after it.

``mode="gossip"``: Factored Gossip DiLoCo.  Exact averaging is replaced by
mixing with neighbours (``topology``), factored in two:

* ``overlap_rounds`` non-blocking mixing rounds on the anchors, started in a
  background thread right after an outer step and overlapping the next inner
  phase.  Their result ``m`` (the mixed anchor) is applied at the next
  boundary as a shift ``m - anchor`` of both the anchor and the local
  parameters: the pseudo-gradient ``anchor - local`` is unchanged, so the
  mixing adds no staleness to it; the workers' starting points just move
  towards each other.
* ``blocking_rounds`` mixing rounds on the pseudo-gradient, before the outer
  step (the worker waits for them): they tighten agreement at the price of
  blocking time.

The balance between the two is the knob: ``blocking_rounds=0`` never blocks
on the network (highest compute utilisation); more blocking rounds, or the
``exp`` topology, bring the workers closer to exact DiLoCo.

Mixing weights: uniform over self and the neighbours (``1 / (1 + degree)``
each, which is the Metropolis-Hastings weight on the regular graphs used
here, so the mixing matrix is doubly stochastic and preserves the average),
renormalised over the neighbours whose tensors arrived.  ``random`` pairs
the ranks with a seeded random matching each round (weights 1/2, 1/2).

Failure semantics: exact mode raises whatever the exchange raises when a
rank is gone (the round cannot be exact); gossip mode leaves a neighbour
silent past the exchange's timeout out of that round, re-admits it when its
tensors arrive again, and records it (:attr:`DiLoCo.records`: per outer step,
which ranks were missing from which rounds).  An error in a background
mixing round is raised at the next boundary.

Checkpoints: :meth:`DiLoCo.state_dict` holds what the outer loop carries
(the anchor, the step and mixing-round counters, a mixing result not applied
yet, the outer optimizer's state and the exchange's suspects); the model's
parameters and the inner optimizer's state are the caller's to save with it,
and over :class:`~pydblp.torch.PydblpExchange` the collective's
(:meth:`pydblp.torch.State.state_dict`)::

    torch.save({"model": model.state_dict(), "inner": inner.state_dict(),
                "diloco": diloco.state_dict(), "pydblp": state.state_dict()}, f"ckpt-{rank}.pt")

A fresh ``DiLoCo`` over a fresh exchange, its model, inner optimizer (and
collective) loaded from it, then takes the steps the saved one would have.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from pydblp.torch._flat import assign, flat_dtype, flatten
from pydblp.torch.exchange import Exchange, neighbours

log = logging.getLogger(__name__)

MODES = ("exact", "gossip")

__all__ = ["DiLoCo", "OuterRecord", "MODES"]


@dataclass
class OuterRecord:
    """One outer step as this worker saw it."""

    step: int                 # outer step index (0-based)
    blocking_s: float         # seconds the caller waited: blocking mixing/allreduce + the overlap's tail
    overlap_wait_s: float     # of which: waiting for the non-blocking rounds to finish
    overlap_s: float = 0.0    # seconds the non-blocking rounds took (in the background)
    missing: dict = field(default_factory=dict)   # mixing round -> neighbours left out of it
    bytes_sent: int = 0       # exchange payload bytes: this step's blocking rounds, and the
                              # background rounds it applied (those that ran since the last one)


class DiLoCo:
    """A context manager that makes ``inner_optimizer.step()`` DiLoCo's inner loop.

    Args:
        exchange: an :class:`~pydblp.torch.Exchange` (``GlooExchange`` or ``PydblpExchange``).
        model: the module whose parameters are trained.
        inner_optimizer: the local optimizer (e.g. AdamW) over ``model``'s parameters.
        outer_optimizer: the outer optimizer over the same parameters (e.g.
            ``SGD(lr=0.7, momentum=0.9, nesterov=True)``).
        sync_every: H, inner steps per outer step.
        mode: ``exact`` or ``gossip``.
        topology: gossip neighbours: ``ring``, ``exp`` or ``random`` (see :func:`~pydblp.torch.exchange.neighbours`).
        overlap_rounds: gossip mixing rounds on the anchor that overlap the next inner phase.
        blocking_rounds: gossip mixing rounds on the pseudo-gradient before the outer step.
        seed: the ``random`` topology's seed (the same on every rank).

    Every worker must start from the same parameters (e.g. the same seed).
    """

    def __init__(self, exchange: Exchange, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
                 outer_optimizer: torch.optim.Optimizer, sync_every: int, mode: str = "exact",
                 topology: str = "ring", overlap_rounds: int = 1, blocking_rounds: int = 1, seed: int = 0):
        if sync_every < 1:
            raise ValueError(f"sync_every {sync_every}: use 1 or more inner steps")
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: use {', '.join(MODES)}")
        if overlap_rounds < 0 or blocking_rounds < 0:
            raise ValueError("overlap_rounds and blocking_rounds: use 0 or more")
        if mode == "gossip":
            if not exchange.supports_neighbours:
                raise ValueError(f"{type(exchange).__name__} has no neighbour average: use mode 'exact' "
                                 "or GlooExchange")
            neighbours(topology, 0, 2, 0)  # a bad topology, now
        self.exchange, self.model = exchange, model
        self.inner, self.outer = inner_optimizer, outer_optimizer
        self.sync_every, self.mode, self.topology = sync_every, mode, topology
        self.overlap_rounds, self.blocking_rounds, self.seed = overlap_rounds, blocking_rounds, seed
        self.params = [p for p in model.parameters() if p.requires_grad]
        self._dtype = flat_dtype(self.params)  # the anchor's: float64 models keep their precision
        self.local_step = 0
        self.outer_steps = 0
        self.records: list[OuterRecord] = []
        self._round = 0                      # mixing rounds so far (names them; the same on every rank)
        self._anchor = self._flat()
        self._mix: threading.Thread | None = None   # the background mixing rounds, while they run
        self._mix_out: dict | None = None             # their result (or error), until the next boundary applies it
        self._hook = None

    # ---- context manager ------------------------------------------------
    def __enter__(self) -> "DiLoCo":
        self._hook = self.inner.register_step_post_hook(lambda *_: self._after_inner_step())
        return self

    def __exit__(self, *exc) -> None:
        """Remove the hook; apply a mixing still running in the background (waiting for it)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._mix_out is not None and exc[0] is None:
            self._apply_overlap()
        elif self._mix_out is not None:
            self._wait_overlap()
            if "error" in self._mix_out:  # (the caller's exception goes on; this one is only logged)
                log.error("rank %d: background mixing rounds failed too: %s", self.exchange.rank,
                          self._mix_out["error"])
            self._mix_out = None

    def _after_inner_step(self) -> None:
        self.local_step += 1
        if self.local_step % self.sync_every == 0:
            self.sync()

    # ---- the outer step -----------------------------------------------------
    @torch.no_grad()
    def sync(self) -> OuterRecord:
        """The outer step (called by the hook every ``sync_every`` inner steps)."""
        t0 = time.monotonic()
        self._check_params()
        rec = OuterRecord(self.outer_steps, 0.0, 0.0)
        if self._mix_out is not None:
            w0 = time.monotonic()
            rec.overlap_s, missing, rec.bytes_sent = self._apply_overlap()
            rec.overlap_wait_s = time.monotonic() - w0
            rec.missing.update(missing)
        sent0 = self.exchange.bytes_sent  # (the background rounds are done: none of theirs after this)
        delta = self._anchor - self._flat()
        if self.mode == "exact":
            delta = self.exchange.allreduce_mean(delta)
        else:
            for _ in range(self.blocking_rounds):
                delta, left_out = self._mix_once(delta)
                rec.missing.update(left_out)
        assign(self.params, self._anchor)
        for p, g in zip(self.params, self._split(delta)):
            p.grad = g.view_as(p).to(p.device, p.dtype, copy=True)
        self.outer.step()
        self.outer.zero_grad(set_to_none=True)
        self._anchor = self._flat()
        rec.bytes_sent += self.exchange.bytes_sent - sent0
        if self.mode == "gossip" and self.overlap_rounds:
            self._start_overlap()
        rec.blocking_s = time.monotonic() - t0
        self.records.append(rec)
        self.outer_steps += 1
        return rec

    def _mix_once(self, x: torch.Tensor) -> tuple[torch.Tensor, dict]:
        r = self._round
        self._round += 1
        peers = neighbours(self.topology, self.exchange.rank, self.exchange.world, r, self.seed)
        # (called with no peers too: pydblp's collective numbers every round, on every rank)
        w = 1.0 / (1 + len(peers))
        out, arrived = self.exchange.neighbours_average(x, peers, [w] * len(peers), r)
        left = [p for p in peers if p not in arrived]
        return out, ({r: left} if left else {})

    def _start_overlap(self) -> None:
        snapshot = self._anchor.clone()
        out = self._mix_out = {}

        def run():
            t, sent0 = time.monotonic(), self.exchange.bytes_sent
            try:
                x, missing = snapshot, {}
                for _ in range(self.overlap_rounds):
                    x, left = self._mix_once(x)
                    missing.update(left)
                out.update(result=x, missing=missing)
            except BaseException as e:  # raised at the next boundary
                out["error"] = e
            out["seconds"] = time.monotonic() - t
            out["bytes"] = self.exchange.bytes_sent - sent0

        self._mix = threading.Thread(target=run, name="diloco-overlap", daemon=True)
        self._mix.start()

    def _wait_overlap(self) -> None:
        """Wait for the background rounds, if they run (their result stays in ``_mix_out``)."""
        if self._mix is not None:
            self._mix.join()
            self._mix = None

    def _apply_overlap(self) -> tuple[float, dict, int]:
        """Wait for the background rounds; shift anchor and parameters by (mixed - anchor).
        Their (seconds, missing neighbours, bytes sent)."""
        self._wait_overlap()
        out, self._mix_out = self._mix_out, None
        if "error" in out:
            raise out["error"]
        shift = out["result"] - self._anchor
        self._anchor += shift
        with torch.no_grad():
            assign(self.params, self._flat() + shift)
        return out["seconds"], out["missing"], out.get("bytes", 0)

    def _flat(self) -> torch.Tensor:
        return flatten(self.params, self._dtype)

    def _check_params(self) -> None:
        """Raise ValueError when the model's trainable parameters are no longer the ones this
        DiLoCo synchronises (one frozen or unfrozen since): they would drift apart unseen."""
        now = [p for p in self.model.parameters() if p.requires_grad]
        if len(now) != len(self.params) or any(a is not b for a, b in zip(now, self.params)):
            raise ValueError(f"the model's trainable parameters changed since DiLoCo was built ({len(self.params)} "
                             f"then, {len(now)} now): build DiLoCo after freezing or unfreezing parameters")

    # ---- checkpoints ------------------------------------------------------
    def state_dict(self) -> dict:
        """What the outer loop carries, for :meth:`load_state_dict`: the inner-step, outer-step
        and mixing-round counters, the anchor, the background mixing's result not applied yet
        (``overlap``: None, or its mixed anchor, its missing neighbours and seconds), the outer
        optimizer's state and the exchange's (its suspects: :meth:`Exchange.state_dict`).
        Tensors are copies; ``torch.load(weights_only=True)`` reads it.  Not kept:
        :attr:`records` (the resumed run's go on from ``outer_steps``).

        Call it between inner steps (each rank at the same step: the overlap's rounds are the
        same on every rank); it waits for the mixing rounds running in the background.

        Raises:
            What those rounds raised (as the next outer step would).
        """
        self._wait_overlap()
        out = self._mix_out
        if out is not None and "error" in out:
            raise out["error"]
        overlap = None if out is None else {"result": out["result"].clone(), "seconds": out["seconds"],
                                            "bytes": out["bytes"],
                                            "missing": {r: list(ps) for r, ps in out["missing"].items()}}
        return {"local_step": self.local_step, "outer_steps": self.outer_steps, "round": self._round,
                "anchor": self._anchor.clone(), "overlap": overlap,
                "outer": copy.deepcopy(self.outer.state_dict()), "exchange": self.exchange.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Go on from ``state`` (:meth:`state_dict` of this rank's DiLoCo, built alike over the
        same number of ranks, in an earlier run): with the model and inner optimizer loaded too,
        the next inner steps and outer steps are the saved one's next.  Load it before this
        DiLoCo's first outer step (inside its context or before it).

        Raises:
            RuntimeError: background mixing rounds are pending.
            ValueError: an anchor of another size (another model).
        """
        if self._mix_out is not None:
            raise RuntimeError("load_state_dict with mixing rounds pending: load before the first outer step")
        anchor = state["anchor"].detach().to("cpu", self._dtype)
        if anchor.numel() != self._anchor.numel():
            raise ValueError(f"an anchor of {anchor.numel()} values given to a model of {self._anchor.numel()}")
        self.outer.load_state_dict(state["outer"])
        self.exchange.load_state_dict(state["exchange"])
        self.local_step, self.outer_steps, self._round = (int(state[k]) for k in ("local_step", "outer_steps", "round"))
        self._anchor = anchor.clone()
        ov = state["overlap"]
        self._mix_out = None if ov is None else {
            "result": ov["result"].detach().to("cpu", self._dtype).clone(), "seconds": float(ov["seconds"]),
            "bytes": int(ov.get("bytes", 0)),
            "missing": {int(r): [int(p) for p in ps] for r, ps in ov["missing"].items()}}

    def _split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return list(torch.split(flat, [p.numel() for p in self.params]))
