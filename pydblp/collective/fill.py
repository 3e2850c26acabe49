"""What a result row that did not arrive becomes, for every kind of round: one place.

A round's kind names where its missing rows come from (``missing``, a class attribute of the
:mod:`~pydblp.collective.rounds` types):

* ``"policy"`` (an allreduce): ``Config.fill``.  ``stale``: the row of the tensor id's previous
  result (``local`` while there is none of its shape); ``local``: this rank's own input;
  ``carry``: zero (only rows past a consistent all-gather's bound, ``Config.allgather_bound``;
  the shard's owner adds them to its next round's estimate, :meth:`Fill.carry`).
* ``"base"`` (a sharded update): this rank's current value (the parameter server's semantics).
* ``"local"`` (a shard broadcast): this rank's own value.
* ``"zero"`` (an all-gather of pieces): zero; this rank has no value of its own for the row.

Kinds whose result is never missing a row (a reduce-scatter: the owner's own estimate; a
neighbour round: a mean over what arrived) have none.  :class:`Fill` also decides how many rows
of a shard an all-gather carries (:meth:`Fill.sent_rows`): the rest are filled alike on every
rank.
"""

from __future__ import annotations

import numpy as np

from pydblp.collective.config import Config


class Fill:
    """Fills the missing rows of one rank's rounds and keeps what the fills read across rounds.

    Args:
        config: the collective's knobs (``fill``, ``consistent``, ``allgather_bound``).
        chunk: values per row (``C``).
    """

    def __init__(self, config: Config, chunk: int):
        self.cfg, self.C = config, chunk
        self.stale: dict[int, np.ndarray] = {}    # tensor id -> its last allreduce result (fill "stale" only)
        self.carried: dict[int, np.ndarray] = {}  # tensor id -> the rows of my shard cut from its all-gather and
                                                  # not yet sent (fill "carry"; tensor order, from the shard's start)

    def state_dict(self) -> dict:
        """What the fills read across rounds (copies): per tensor id, the last result (fill
        "stale") and the rows carried to the next round (fill "carry")."""
        return {"stale": {t: a.copy() for t, a in self.stale.items()},
                "carried": {t: a.copy() for t, a in self.carried.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Go on from ``state`` (:meth:`state_dict`'s).  An array whose shape does not fit its
        tensor id's next round is not used: the fills check shapes, as they do between rounds."""
        self.stale = {int(t): np.array(a, np.float32) for t, a in state["stale"].items()}
        self.carried = {int(t): np.array(a, np.float32) for t, a in state["carried"].items()}

    def rule(self, st) -> str | None:
        """What ``st``'s missing rows become now: "stale", "local", "carry", "base", "zero" or None
        (a kind that never misses one)."""
        rule = st.missing
        if rule != "policy":
            return rule
        rule = self.cfg.fill
        if rule == "stale":
            last = self.stale.get(st.tensor)
            return "stale" if last is not None and last.shape == st.y.shape else "local"
        return rule

    def sent_rows(self, st, n: int) -> int:
        """How many of a shard's ``n`` rows its all-gather carries (``Config.allgather_bound``): the
        round's ``need`` when replicas are consistent, the round has a bound, its rows are shuffled
        and the rest can be filled alike on every rank (fill "carry"; or "stale" once every rank
        holds the tensor's previous result): all ranks decide alike (same config, agreed bound, same
        round history); else all ``n``."""
        cfg = self.cfg
        if not (cfg.consistent and cfg.allgather_bound and st.tol8) or self.rule(st) not in ("carry", "stale"):
            return n
        return n - n * st.tol8 // 255 if st.perm is not None else n

    def carry(self, st, a: int, b: int, need: int) -> None:
        """Fill "carry" (error feedback), owner of rows ``a..b``: add what earlier rounds cut from
        this shard's all-gather to its estimate, keep the rows past ``need`` (cut now) for the next
        round, and zero them in this rank's result as every other rank's fill does.  A shard's
        rows are the same tensor rows every round (the shuffle stays within shards), so nothing
        cut is lost: it is applied one or more rounds late.  Nothing to do under another fill or
        in the tensor's own order (one-row tensors are never cut)."""
        if self.rule(st) != "carry" or st.perm is None:
            return
        rows = st.perm[a:b] - a  # the shard's rows in the tensor's order, relative to a
        acc = self.carried.get(st.tensor)
        if acc is None or acc.shape != (b - a, self.C):
            acc = self.carried[st.tensor] = np.zeros((b - a, self.C), np.float32)
        y = st.y[a:b]
        st.own = y.copy()
        y += acc[rows]
        acc[rows[:need]] = 0
        acc[rows[need:]] = y[need:]
        y[need:] = 0

    def missing_rows(self, st) -> None:
        """Fill the result rows of ``st`` that did not arrive (``st.have``, in the round's row order;
        written where ``st.put`` keeps them)."""
        missing = ~st.have
        if not missing.any():
            return
        rule = self.rule(st)
        if rule == "base":
            st.put(missing, st.base[missing])
        elif rule in ("carry", "zero"):
            st.put(missing, 0)  # (carry: the owners carry what they cut to the next round)
        elif rule == "stale":
            last = self.stale[st.tensor]  # (in the tensor's own order)
            st.put(missing, last[missing] if st.perm is None else last[st.perm[missing]])
        else:
            st.put(missing, st.input_rows(missing))

    def forget(self, tensor: int) -> None:
        """Drop what the fills keep for ``tensor`` (a tensor id no round will use again)."""
        self.stale.pop(tensor, None)
        self.carried.pop(tensor, None)

    def may_miss(self) -> bool:
        """Whether an allreduce's result may lack rows that then need a fill: its all-gather
        tolerates loss (``consistent`` False), is cut (``allgather_bound``) or may end at a
        ``deadline``.  Otherwise every row arrives or the round fails, and nothing is kept for
        the stale fill (a snapshot would cost a pass over the result every round)."""
        cfg = self.cfg
        return not cfg.consistent or cfg.allgather_bound or cfg.deadline is not None

    def keep(self, st, flat: np.ndarray | None = None, give: bool = False) -> np.ndarray | None:
        """Keep ``st``'s result (in the tensor's order) for the next round's stale fill, under fill
        "stale" where a round may miss rows (:meth:`may_miss`) only: a snapshot, the caller owns
        ``st.y`` and may change it.  ``flat``: the result is there instead (the caller's array,
        the tensor's values; its last row may be partial).  ``give``: ``st.y`` is the protocol's
        own buffer, kept as it is (no copy); returns the buffer it replaces (None: none, or
        nothing kept), for the protocol to reuse."""
        if st.missing != "policy" or self.cfg.fill != "stale":
            return None
        if not self.may_miss():
            self.stale.pop(st.tensor, None)  # (a snapshot from before the config changed)
            return None
        last = self.stale.get(st.tensor)
        if give:
            self.stale[st.tensor] = st.y
            return last
        shape = (len(st.have), self.C)
        if last is None or last.shape != shape:
            last = self.stale[st.tensor] = np.empty(shape, np.float32)
        if flat is None:
            np.copyto(last, st.y)
        else:
            v = last.reshape(-1)
            v[: flat.size] = flat
            v[flat.size:] = 0
        return None
