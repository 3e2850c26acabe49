"""Estimators for partial reductions, and priorities of chunks.

All functions are vectorised over chunks; a chunk is a row of ``C`` values.

Reduce (the shard owner, from ``W`` contributions ``buf[w]`` with arrival
mask ``mask[w]``):

* ``zero``: missing contributions count as zero, ``sum / W`` (DBLP, MLT).
* ``unbiased``: per chunk, the mean of the contributions that arrived stands for
  the missing ones (Weintraub et al.).  The owner's own contribution always
  "arrives", so it is counted once with its weight ``1/W`` and the others' mean
  stands for all ``W - 1`` of them: ``(own + (W - 1) * mean(arrived others)) / W``
  (``own`` alone when no other arrived).  If each other contribution arrives
  independently with the same probability, the expectation equals the true mean.
  ``sum / arrived`` over all ``W`` would weigh the owner's own by ``E[1/arrived]``
  instead: at 40 % loss among 4 ranks, 0.41 instead of 0.25, a pull towards each
  owner's own gradient.

Neighbour average (:func:`neighbour_mean`, a neighbour round): per chunk, the weighted
mean over this rank and the neighbours whose chunk arrived, the weights renormalised over
them: ``(w_self x + sum_j m_j w_j x_j) / (w_self + sum_j m_j w_j)``, the per-chunk
renormalisation ``unbiased`` makes for the mean.

All-gather misses (a chunk of the result that did not arrive):

* ``stale``: the previous round's value of that chunk (falls back to local
  in the first round).
* ``local``: this rank's own contribution.
* ``carry``: (only past a consistent all-gather's bound, ``Config.allgather_bound``) zero on
  every rank; the shard's owner adds the rows to its next round's estimate (error feedback).
"""

from __future__ import annotations

import numpy as np

ESTIMATORS = ("zero", "unbiased")
FILLS = ("stale", "local", "carry")
PRIORITIES = ("magnitude", "position", "layer", "none")


def reduce_mean(buf: np.ndarray, mask: np.ndarray, estimator: str, scratch: bool = False,
                out: np.ndarray | None = None, own: int | None = None) -> np.ndarray:
    """Estimate the mean over W contributions: buf (W, n, C), mask (W, n) -> (n, C).

    Entries of ``buf`` where ``mask`` is False are ignored whatever they
    hold.  ``scratch=True`` lets this zero them in place instead of
    working on a copy.  ``out``: an (n, C) float32 array to write the
    estimate into (not overlapping ``buf``), else a new one.  ``own``: the
    index of the caller's own contribution, which is always there (its
    ``mask`` row must be all True, unchecked): ``unbiased`` then weighs it ``1/W`` (see above);
    None: every contribution alike (``sum / arrived``).
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}: {', '.join(ESTIMATORS)}")
    whole = bool(mask.all())
    if not whole:
        if not scratch:
            buf = buf.copy()
        buf[~mask] = 0
    total = buf.sum(axis=0, dtype=np.float32, out=out)
    W = buf.shape[0]
    if estimator == "zero" or whole:  # (every chunk arrived: unbiased divides by W too, the same bits)
        total /= np.float32(W)
    elif own is None:
        arrived = mask.sum(axis=0, dtype=np.float32)
        total /= np.maximum(arrived, 1, out=arrived)[:, None]
    else:  # (own's mask row is all True: the caller's own contribution)
        others = mask.sum(axis=0, dtype=np.float32) - 1  # per chunk, the others that arrived
        total -= buf[own]  # their sum
        # (own + (W - 1) / others * sum) / W where some arrived; own alone where none did
        scale = np.float32(W - 1) / np.maximum(others, 1)
        scale[others == 0] = 0
        total *= scale[:, None]
        total += buf[own]
        total /= np.where(others > 0, np.float32(W), np.float32(1))[:, None]
    return total


def neighbour_mean(x: np.ndarray, w_self: float, buf: np.ndarray, mask: np.ndarray, weights: np.ndarray,
                   out: np.ndarray) -> np.ndarray:
    """The weighted mean of this rank's rows and its neighbours', per chunk over what arrived.

    Args:
        x: (n, C) this rank's rows.
        w_self: this rank's weight (>= 0).
        buf: (K, n, C) the neighbours' rows; entries where ``mask`` is False are ignored
            (zeroed in place).
        mask: (K, n) which neighbour chunks count (arrived, from a neighbour taken in).
        weights: (K,) the neighbours' weights.
        out: (n, C) where the result goes (may not alias ``x``).

    A chunk with zero total weight (``w_self`` 0 and nothing arrived) keeps ``x``'s values.
    """
    w = mask * weights[:, None].astype(np.float32)           # (K, n)
    den = np.float32(w_self) + w.sum(axis=0, dtype=np.float32)  # (n,)
    np.multiply(x, np.float32(w_self), out=out)
    for k in range(len(buf)):
        if w[k].any():
            buf[k][~mask[k]] = 0
            out += buf[k] * w[k][:, None]
    zero = den <= 0
    if zero.any():
        out[zero] = x[zero]
        den[zero] = 1
    out /= den[:, None]
    return out


def _bands(frac: np.ndarray) -> np.ndarray:
    """Class 1..7 of positions ``frac`` in [0, 1): seven equal bands, the first most important."""
    return (1 + np.minimum((frac * 7).astype(np.int64), 6)).astype(np.uint8)


_CLASSES: dict[int, np.ndarray] = {}  # n -> the priority class of each rank 0..n-1


def _classes(n: int) -> np.ndarray:
    """The class of ranks 0..n-1 of a ranking (kept per n: message sizes repeat)."""
    c = _CLASSES.get(n)
    if c is None:
        c = _bands(np.arange(n) / n)
        if len(_CLASSES) < 256:  # message sizes repeat round after round; never an unbounded table
            _CLASSES[n] = c
    return c


def chunk_priority(rows: np.ndarray | None, how: str, first_row: int | np.ndarray = 0, total_rows: int | None = None,
                   layers: np.ndarray | None = None, sq: np.ndarray | None = None, n: int | None = None) -> np.ndarray:
    """Priority class 1 (most important) .. 7 per chunk; 0 is kept for control and pins.

    ``magnitude``: chunks ranked by L2 norm, largest first (MLT).
    ``position``: by position in the tensor, earliest first (DDP buckets
    list the last layers first, so early rows are the layers nearest the
    output).  ``layer``: ``layers[first_row + i]``, the whole tensor's class
    per chunk from the model's structure (:func:`layer_classes`); without
    ``layers`` (a tensor nobody described), as ``position``.  ``none``: all 1.
    Every class but ``layer``'s is relative to the message.  ``first_row`` may instead be an
    array: each row's number in the tensor (a message in shuffled order).  A caller that has
    the rows' squared norms gives them as ``sq`` (``magnitude``), their number as ``n``, and
    ``rows`` None.
    """
    n = len(rows) if rows is not None else n
    if n == 0 or how == "none":
        return np.ones(n, np.uint8)
    ids = first_row + np.arange(n) if np.isscalar(first_row) else first_row  # (layer, position only)
    if how == "layer":
        if layers is None:
            how = "position"
        else:
            return np.ascontiguousarray(layers[ids], np.uint8)
    if how == "magnitude":
        norms = np.einsum("ij,ij->i", rows, rows) if sq is None else sq  # squared: same order, no temporary
        out = np.empty(n, np.uint8)
        out[np.argsort(-norms, kind="stable")] = _classes(n)  # the chunk ranked r gets rank r's class
        return out
    if how == "position":
        return _bands(ids / (total_rows or n))
    raise ValueError(f"unknown priority {how!r}: {', '.join(PRIORITIES)}")


def layer_classes(sizes, depths, layers: int, chunk_values: int) -> np.ndarray:
    """The ``layer`` priority of each chunk of a flat tensor made of parameters.

    The rule: layer ``d`` of ``layers`` (0 the input's, ``layers - 1`` the
    output's: the model's order, not the bucket's) gets class
    ``1 + floor(7 * (layers - 1 - d) / layers)``: the layers nearest the
    output most important (their error reaches the loss undiluted, they are
    the fewest parameters of a typical network, and DDP all-reduces them
    first), the input's least.  A chunk spanning several parameters takes the
    most important class among them.  Classes depend only on the model's
    structure, so every rank computes the same ones, and they are absolute
    over the model (a bucket of early layers is all low priority), unlike
    ``magnitude`` and ``position``, which rank chunks within one message.

    Args:
        sizes: values of each parameter, in the flat tensor's order.
        depths: each parameter's layer, 0..layers-1.
        layers: the model's number of layers.
        chunk_values: values per chunk (``Config.chunk_bytes // 4``).

    Raises:
        ValueError: lengths that differ, a depth outside 0..layers-1 or a
            chunk size below 1.
    """
    sizes, depths = np.asarray(sizes, np.int64), np.asarray(depths, np.int64)
    if len(sizes) != len(depths) or chunk_values < 1 or layers < 1:
        raise ValueError("layer_classes: one depth per size, chunk_values >= 1, layers >= 1")
    if len(depths) and (depths.min() < 0 or depths.max() >= layers):
        raise ValueError(f"layer_classes: depths must be in 0..{layers - 1}")
    cls = (1 + (7 * (layers - 1 - depths)) // layers).astype(np.uint8)
    ends = np.cumsum(sizes)
    n = int(-(-int(ends[-1]) // chunk_values)) if len(ends) else 0
    out = np.full(n, 7, np.uint8)
    starts = ends - sizes
    for s, e, c in zip((starts // chunk_values).tolist(), ((ends - 1) // chunk_values).tolist(), cls.tolist()):
        if e >= s:
            np.minimum(out[s: e + 1], c, out=out[s: e + 1])
    return out
