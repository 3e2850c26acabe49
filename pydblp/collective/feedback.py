"""Error feedback's memory (``Config.error_feedback``): what a rank's reduce-scatter
contributions lost, to be sent again in the tensor's next round.

Per tensor a dense ``(T, C)`` array in the tensor's row order, zero but for the rows the last
round's estimates left out, and the list of those rows.  A round adds the listed rows to its
input and the next renewal zeroes them again, so the work a round spends on feedback follows
what the round before left out (a tenth to a third of the rows under the paper scenario's loss),
not the tensor's size.  A round that reads its input where it lies (``Protocol._in_place``)
sends the listed rows from a patched copy and every other row in place.
"""

from __future__ import annotations

import numpy as np

from pydblp.collective.rounds import rows_of

_NONE = np.empty(0, np.intp)


class Residuals:
    """Per tensor id, the rows of this rank's contributions its last round's estimates left out."""

    def __init__(self) -> None:
        self._e: dict[int, np.ndarray] = {}     # tensor id -> (T, C) float32, zero off ``_rows``
        self._rows: dict[int, np.ndarray] = {}  # tensor id -> its rows with a residual (tensor order)

    def rows(self, tensor: int, shape: tuple) -> np.ndarray:
        """The tensor's rows with a residual (tensor order); none where the kept shape is not
        ``shape`` (a new bucket layout starts clean)."""
        e = self._e.get(tensor)
        return self._rows[tensor] if e is not None and e.shape == shape else _NONE

    def sent(self, tensor: int, flat: np.ndarray, shape: tuple, rows: np.ndarray,
             into: np.ndarray | None = None) -> np.ndarray:
        """What a round read in place from ``flat`` (``shape``: its (T, C) rows) sends at the
        tensor's ``rows``: the input plus the residual held there, in ``into`` when given (else a
        new array)."""
        v = rows_of(flat, rows, shape[1], into=into)
        if len(self.rows(tensor, shape)):
            v += self._e[tensor][rows]
        return v

    def add_into(self, tensor: int, x: np.ndarray, perm: np.ndarray | None) -> None:
        """Add the residual to ``x``, a round's input in its row order (``perm[i]``: the tensor row
        at round row ``i``; None: the tensor's order)."""
        rows = self.rows(tensor, x.shape)
        if len(rows):
            x[rows if perm is None else inverse(perm)[rows]] += self._e[tensor][rows]

    def renew(self, tensor: int, shape: tuple, rows: np.ndarray, vals: np.ndarray) -> None:
        """The round just ended left out ``vals`` at the tensor's ``rows`` (distinct): they replace
        what was held.  ``vals`` must not be a view of the residual itself."""
        e = self._e.get(tensor)
        if e is None or e.shape != shape:
            e = self._e[tensor] = np.zeros(shape, np.float32)
        else:
            e[self._rows[tensor]] = 0
        e[rows] = vals
        self._rows[tensor] = np.asarray(rows, np.intp)

    def state_dict(self) -> dict[int, np.ndarray]:
        """Each tensor's residual, dense (copies)."""
        return {t: e.copy() for t, e in self._e.items()}

    def load_state_dict(self, state: dict) -> None:
        """Take ``state`` (:meth:`state_dict`'s shape) instead of what is held."""
        self._e = {int(t): np.array(a, np.float32) for t, a in state.items()}
        self._rows = {t: np.flatnonzero(e.reshape(len(e), -1).any(axis=1)) for t, e in self._e.items()}


def inverse(perm: np.ndarray) -> np.ndarray:
    """The inverse of permutation ``perm``: ``inverse(perm)[perm[i]] == i``."""
    inv = np.empty(len(perm), np.intp)
    inv[perm] = np.arange(len(perm))
    return inv
