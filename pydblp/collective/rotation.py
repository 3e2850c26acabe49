"""Random rotation of a reduce-scatter's rows (``Config.rotate``): a lost chunk becomes noise.

Without it a chunk lost within a round's bound takes ``C`` coordinates out of the owner's
estimate whole (the ``unbiased`` estimator averages those coordinates over fewer ranks, ``zero``
leaves a hole).  With it every rank sends, instead of its rows, a randomized Hadamard transform of
them in blocks of ``m`` rows (``y = H (s * x)``: ``s`` a random sign per row, ``H`` the orthonormal
``m x m`` Hadamard matrix applied along the rows, each column of values on its own), as OptiReduce
does with whole buckets; the owner estimates the mean of the rotated rows, as of any rows, and
rotates its estimate back.  A lost rotated row then costs each of the block's ``m`` rows ``1/m``
of its energy (``H``'s entries are ``+-1/sqrt(m)``): a small error spread over ``m * C``
coordinates, not a hole of ``C``.

Blocks lie within a shard (its owner rotates back its shard alone), over the round's row order
(a shuffled round's blocks are random sets of the tensor's rows each round); a shard's rows past
its last whole block go in blocks of the powers of two its remainder holds (13 rows: 8, 4, 1).
The signs come from the round and tensor numbers, as the shuffle does, so every rank draws the
same ones and nothing travels.  The transform is linear: the mean of rotated rows is the rotated
mean, and the ``unbiased`` estimator stays unbiased (what ``zero`` leaves out is spread, not
removed: error feedback sends it again).  Cost: ``m`` multiply-adds a value each way.
"""

from __future__ import annotations

import numpy as np

_H: dict[int, np.ndarray] = {}


def hadamard(m: int) -> np.ndarray:
    """The orthonormal Sylvester Hadamard matrix of order ``m`` (a power of two), float32; kept."""
    h = _H.get(m)
    if h is None:
        if m < 1 or m & (m - 1):
            raise ValueError(f"rotation block of {m} rows: use a power of two")
        h = np.ones((1, 1), np.float64)
        while len(h) < m:
            h = np.block([[h, h], [h, -h]])
        h = _H[m] = (h / np.sqrt(m)).astype(np.float32)
    return h


def blocks(n: int, m: int) -> list[tuple[int, int]]:
    """(first row, rows) of the blocks ``n`` rows are rotated in: whole blocks of ``m``, then the
    remainder's powers of two, largest first."""
    out = [(i, m) for i in range(0, n - n % m, m)]
    first, rest = n - n % m, n % m
    size = m
    while rest:
        size //= 2
        if rest >= size:
            out.append((first, size))
            first, rest = first + size, rest - size
    return out


def signs(rnd: int, tensor: int, T: int) -> np.ndarray:
    """The round's random sign per row (float32 +-1), the same on every rank."""
    rng = np.random.Generator(np.random.PCG64((rnd, tensor, 0x0D07)))
    return (rng.integers(0, 2, T, dtype=np.int8) * 2 - 1).astype(np.float32)


def rotate(x: np.ndarray, first: int, end: int, m: int, s: np.ndarray, inverse: bool = False) -> None:
    """Rotate rows ``first..end`` of ``x`` (T, C) in place, in blocks of ``m`` rows; ``s``: the
    round's :func:`signs` (T,).  ``inverse``: undo it (``H`` is its own inverse, then the signs)."""
    n = end - first
    full = n - n % m
    if full:
        v = x[first: first + full].reshape(full // m, m, -1)
        if not inverse:
            v *= s[first: first + full].reshape(full // m, m, 1)
        v[...] = np.matmul(hadamard(m), v)
        if inverse:
            v *= s[first: first + full].reshape(full // m, m, 1)
    for a, size in blocks(n, m)[full // m:]:
        a += first
        v = x[a: a + size]
        if not inverse:
            v *= s[a: a + size, None]
        if size > 1:
            v[...] = hadamard(size) @ v
        if inverse:
            v *= s[a: a + size, None]
