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

__all__ = ["ShardedSGD", "ShardedAdam"]


class _Sharded:
    """The common part: flat views of the module's parameters and gradients, one round a step."""

    TENSOR = 0xFFFD  # tensor id of the step's round (DDP buckets use small ids)

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
        self.C = state.collective.C
        n = sum(p.numel() for p in self.params)
        self._rows = -(-n // self.C)
        self.steps = 0

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def _buffer(self) -> np.ndarray:
        """A zeroed (rows, C) float32 buffer for per-element optimizer state (only the owned rows
        are ever used)."""
        return np.zeros((self._rows, self.C), np.float32)

    @torch.no_grad()
    def step(self) -> None:
        """Run the step's round and write the new parameters into the module.  A parameter
        without a gradient counts as zero gradient.  Blocks for the round; raises
        :class:`~pydblp.collective.CollectiveError` as the collective does (the state is then
        unusable)."""
        grad = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
                          for p in self.params]).numpy()
        flat = torch.cat([p.detach().reshape(-1).float() for p in self.params]).numpy()
        self.steps += 1
        out = self.state.submit(lambda col: col.sharded_update(grad, flat, self._update, self.TENSOR)).wait()
        off = 0
        for p in self.params:
            k = p.numel()
            p.copy_(torch.from_numpy(np.ascontiguousarray(out[off: off + k])).view_as(p).to(p.dtype))
            off += k

    def _update(self, rows: np.ndarray, mean: np.ndarray, values: np.ndarray) -> np.ndarray:
        """The owner's new values of its chunk ``rows`` from their mean gradient and current values
        (:meth:`~pydblp.collective.Collective.sharded_update`'s ``update``)."""
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
        self._b = self._buffer()

    def _update(self, rows, g, p):
        if self.momentum:
            g = self._b[rows] = np.float32(self.momentum) * self._b[rows] + g
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

    def __init__(self, state, module: torch.nn.Module, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8):
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"betas {betas!r}: give two values in [0, 1)")
        if not eps > 0:
            raise ValueError(f"eps {eps!r}: give a value > 0")
        super().__init__(state, module, lr)
        self.betas, self.eps = (float(betas[0]), float(betas[1])), float(eps)
        self._m, self._v = self._buffer(), self._buffer()

    def _update(self, rows, g, p):
        b1, b2 = self.betas
        m = self._m[rows] = b1 * self._m[rows] + (1 - b1) * g
        v = self._v[rows] = b2 * self._v[rows] + (1 - b2) * g * g
        t = self.steps
        step = self.lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + self.eps)
        return (p - step).astype(np.float32)
