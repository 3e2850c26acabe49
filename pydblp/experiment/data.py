"""Data that ships with installed packages: no downloads.

* ``digits``: scikit-learn's 8x8 handwritten digits (1,797 images, 10 classes).
* ``text``: characters of this Python's own standard-library sources.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import torch

from pydblp._extras import require

TEXT_MODULES = ("argparse.py", "dataclasses.py", "enum.py", "functools.py", "inspect.py", "pathlib.py",
                "subprocess.py", "textwrap.py", "typing.py", "shutil.py")


def digits(seed: int = 0, test_fraction: float = 0.2):
    """(x_train, y_train, x_test, y_test): float32 images (N, 1, 8, 8) scaled to [0, 1], int64 labels."""
    require("the digits data set (dblp experiment --model digits)", "sklearn")
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.from_numpy((d.images / 16.0).astype(np.float32)).unsqueeze(1)
    y = torch.from_numpy(d.target.astype(np.int64))
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(x) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return x[train], y[train], x[test], y[test]


def text(max_chars: int = 400_000, test_fraction: float = 0.1):
    """(train ids, test ids, vocabulary size): bytes of stdlib sources mapped to printable ASCII ids."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks = []
    for name in TEXT_MODULES:
        p = root / name
        if p.exists():
            chunks.append(p.read_bytes())
    if not chunks:
        raise FileNotFoundError(f"no standard-library sources under {root}")
    raw = np.frombuffer(b"\n".join(chunks)[:max_chars], np.uint8)
    ids = np.clip(raw.astype(np.int64) - 31, 0, 96)  # '\n' and control -> 0, ' '..'~' -> 1..95
    ids[raw == 10] = 96
    n_test = int(len(ids) * test_fraction)
    t = torch.from_numpy(ids)
    return t[:-n_test], t[-n_test:], 97


def shard(n: int, rank: int, world: int, seed: int) -> torch.Tensor:
    """This rank's indices of a seeded permutation of range(n)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return perm[rank::world]
