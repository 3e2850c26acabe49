"""Sharded optimizers over pydblp: each rank steps the shard it owns, parameters are all-gathered.

The DDP hook (:func:`pydblp.torch.hook`) all-gathers the mean *gradient*, and every rank runs
the whole optimizer.  A sharded optimizer all-gathers *parameters* instead (ZeRO-1 style, and
DBLP's parameter server): in one round per step (:meth:`pydblp.collective.Collective.sharded_update`)
the ranks reduce-scatter their gradients, each shard's owner applies the optimizer to its shard
(its optimizer state lives only there) and sends the new values to everyone.  Without
``Config.consistent`` the all-gather tolerates loss within the round's bound, and a parameter
whose chunk does not arrive keeps this rank's value until a later round delivers it: replicas
lag their owners by the rows they missed, they do not drift apart.

Use it without DDP's gradient synchronisation (plain module, or under ``ddp.no_sync()``)::

    opt = pydblp.torch.ShardedSGD(state, model, lr=0.05, momentum=0.9)
    for batch in data:
        opt.zero_grad()
        loss(model, batch).backward()
        opt.step()

Every rank must start from the same parameters (the constructor broadcasts rank 0's over the
default process group).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from pydblp.collective.config import TENSOR_SHARDED
from pydblp.torch._flat import assign, flatten

__all__ = ["ShardedSGD", "ShardedAdam"]


class _Sharded:
    """The common part: flat views of the module's parameters and gradients, one round a step,
    and the owner's per-element optimizer state for its own rows only."""

    TENSOR = TENSOR_SHARDED  # (pydblp.collective.config.RESERVED_TENSORS)
    STATE = ()       # names of the per-element state buffers a subclass keeps

    def __init__(self, state, module: torch.nn.Module, lr: float):
        if not lr > 0:
            raise ValueError(f"lr {lr!r}: give a learning rate > 0")
        self.state, self.lr = state, float(lr)
        self.params = [p for p in module.parameters() if p.requires_grad]
        if not self.params:
            raise ValueError("the module has no trainable parameters")
        if dist.is_initialized():  # every rank starts from rank 0's values
            with torch.no_grad():
                for p in self.params:
                    dist.broadcast(p.data, 0)
        self.steps = 0
        self._first: int | None = None  # the first owned row (an owner gets the same rows every round)
        self._buffers: dict[str, np.ndarray] = {}

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        """Run the step's round and write the new parameters into the module.  A parameter
        without a gradient counts as zero gradient.  Blocks for the round; raises
        :class:`~pydblp.collective.CollectiveError` as the collective does (the state is then
        unusable)."""
        grad = flatten([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]).numpy()
        values = flatten(self.params).numpy()
        self.steps += 1
        out = self.state.submit(lambda col: col.sharded_update(grad, values, self._owned, self.TENSOR)).wait()
        assign(self.params, torch.from_numpy(out))

    def _owned(self, rows: np.ndarray, mean: np.ndarray, values: np.ndarray) -> np.ndarray:
        """``sharded_update``'s ``update``: this owner's state buffers, (rows of its shard, C)
        zeroed at its first round, indexed by ``rows`` relative to its first row."""
        if self._first is None:
            self._first = int(rows.min())
            self._buffers = {name: np.zeros((len(rows), mean.shape[1]), np.float32) for name in self.STATE}
        return self._update(rows - self._first, mean, values, **self._buffers)

    def _update(self, at: np.ndarray, g: np.ndarray, p: np.ndarray, **state: np.ndarray) -> np.ndarray:
        """The owner's new values of its rows (``at``: their rows in ``state``) from their mean
        gradient ``g`` and current values ``p``; updates ``state`` in place."""
        raise NotImplementedError


class ShardedSGD(_Sharded):
    """SGD with momentum (PyTorch's rule: ``b = momentum * b + g``, ``p -= lr * b``), sharded.

    Args:
        state: a :class:`pydblp.torch.State`.
        module: the model; its trainable parameters are stepped, in ``module.parameters()`` order.
        lr: the learning rate (> 0).
        momentum: in [0, 1).
    """

    def __init__(self, state, module: torch.nn.Module, lr: float, momentum: float = 0.0):
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum {momentum!r}: use a value in [0, 1)")
        super().__init__(state, module, lr)
        self.momentum = float(momentum)
        self.STATE = ("b",) if self.momentum else ()

    def _update(self, at, g, p, b=None):
        if b is not None:
            g = b[at] = np.float32(self.momentum) * b[at] + g
        return p - np.float32(self.lr) * g


class ShardedAdam(_Sharded):
    """Adam (PyTorch's rule, no weight decay), sharded.

    Args:
        state: a :class:`pydblp.torch.State`.
        module: the model; its trainable parameters are stepped, in ``module.parameters()`` order.
        lr: the learning rate (> 0).
        betas: (beta1, beta2), each in [0, 1).
        eps: added to the denominator (> 0).
    """

    STATE = ("m", "v")

    def __init__(self, state, module: torch.nn.Module, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8):
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"betas {betas!r}: give two values in [0, 1)")
        if not eps > 0:
            raise ValueError(f"eps {eps!r}: give a value > 0")
        super().__init__(state, module, lr)
        self.betas, self.eps = (float(betas[0]), float(betas[1])), float(eps)

    def _update(self, at, g, p, m, v):
        b1, b2 = self.betas
        m[at] = b1 * m[at] + (1 - b1) * g
        v[at] = b2 * v[at] + (1 - b2) * g * g
        t = self.steps
        step = self.lr * (m[at] / (1 - b1 ** t)) / (np.sqrt(v[at] / (1 - b2 ** t)) + self.eps)
        return (p - step).astype(np.float32)
