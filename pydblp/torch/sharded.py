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

Both subclass ``torch.optim.Optimizer``, with one parameter group (the module's trainable
parameters): an LR scheduler (``torch.optim.lr_scheduler``) sets ``param_groups[0]["lr"]``
(``OneCycleLR`` also ``momentum`` or ``betas``), and each step reads the group's values.  Each
owner applies its own rank's values to its shard: every rank must set the same ones (step its
scheduler alike).

Checkpoints: an owner's optimizer state is its shard's, so each rank saves its own (with the
collective's round counter and controller: :meth:`pydblp.torch.State.state_dict`) and loads it
into an optimizer built the same way, in a job of the same world, chunk size and model::

    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                "pydblp": state.state_dict()}, f"ckpt-{rank}.pt")

    # to resume: build state, model, opt and sched as before, then
    ckpt = torch.load(f"ckpt-{rank}.pt", weights_only=True)
    state.load_state_dict(ckpt["pydblp"])   # before the first round, every rank; then dist.barrier()
    model.load_state_dict(ckpt["model"])    # after the optimizer's constructor, which broadcasts rank 0's
    opt.load_state_dict(ckpt["opt"])
    sched.load_state_dict(ckpt["sched"])

When the rounds are exact (no loss, or tolerance 0: loss repaired) the resumed run's parameters
are then the uninterrupted run's, bit for bit (``tests/unit/test_checkpoint.py``); under
tolerated loss they differ as two uninterrupted runs do (what arrives in time decides).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from pydblp.collective.config import TENSOR_SHARDED
from pydblp.torch._flat import assign, flatten

__all__ = ["ShardedSGD", "ShardedAdam"]


class _Sharded(torch.optim.Optimizer):
    """The common part: one parameter group stepped as one flat vector, one round a step, and the
    owner's per-element optimizer state for its own rows only (torch.optim's per-parameter
    ``state`` stays empty)."""

    TENSOR = TENSOR_SHARDED  # (pydblp.collective.config.RESERVED_TENSORS)
    STATE = ()       # names of the per-element state buffers a subclass may keep

    def __init__(self, state, module: torch.nn.Module, defaults: dict):
        """``defaults``: the hyperparameters (``lr`` among them): the rule's keyword arguments each step."""
        if not defaults["lr"] > 0:
            raise ValueError(f"lr {defaults['lr']!r}: give a learning rate > 0")
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the module has no trainable parameters")
        wide = sorted({str(p.dtype) for p in params if p.dtype == torch.float64 or p.is_complex()})
        if wide:  # (the round steps float32 values: each step would round them)
            raise ValueError(f"{', '.join(wide)} parameters: a sharded optimizer steps float32 values; "
                             "use float32 (or lower-precision) parameters, or torch.optim over the DDP hook")
        super().__init__(params, defaults)
        self.dblp_state = state  # the pydblp State (``state`` is torch.optim's)
        if dist.is_initialized():  # every rank starts from rank 0's values
            with torch.no_grad():
                for p in params:
                    dist.broadcast(p.data, 0)
        self.steps = 0
        # the owner's shard, (first row, rows, values a row), at its first round: an owner gets
        # the same rows every round
        self._shard: tuple[int, int, int] | None = None
        self._buffers: dict[str, np.ndarray] = {}

    def add_param_group(self, param_group: dict) -> None:
        """One group only (the constructor's): the round steps one flat vector, with one set of
        hyperparameters.  Raises ValueError for a second."""
        if self.param_groups:
            raise ValueError("a sharded optimizer has one parameter group: the module's trainable parameters")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        """Run the step's round and write the new parameters into the module, with the
        hyperparameters ``param_groups[0]`` holds now.  A parameter without a gradient counts as
        zero gradient.  ``closure`` (torch.optim's): re-evaluates the model and returns the loss,
        called first; returned.  Blocks for the round; raises
        :class:`~pydblp.collective.CollectiveError` as the collective does (the state is then
        unusable)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        group = self.param_groups[0]
        params = group["params"]
        hyper = {k: group[k] for k in self.defaults}  # (read here: the owner's thread applies them)
        grad = flatten([p.grad if p.grad is not None else torch.zeros_like(p) for p in params]).numpy()
        values = flatten(params).numpy()
        self.steps += 1

        def update(rows, mean, now):
            return self._owned(rows, mean, now, hyper)

        out = self.dblp_state.submit(lambda col: col.sharded_update(grad, values, update, self.TENSOR)).wait()
        assign(params, torch.from_numpy(out))
        return loss

    def _owned(self, rows: np.ndarray, mean: np.ndarray, values: np.ndarray, hyper: dict) -> np.ndarray:
        """``sharded_update``'s ``update``: the new values of this owner's rows, ``rows`` relative
        to its first row indexing its state buffers."""
        shard = (int(rows.min()), len(rows), mean.shape[1])
        if self._shard is None:
            self._shard = shard
        elif shard != self._shard:  # (a loaded state of another chunk size, mode or model)
            raise ValueError(f"this owner's shard is rows {shard[0]}.. ({shard[1]} x {shard[2]}), its "
                             f"optimizer state's {self._shard[0]}.. ({self._shard[1]} x {self._shard[2]})")
        return self._update(rows - shard[0], mean, values, **hyper)

    def _buffer(self, name: str) -> np.ndarray:
        """The owner's per-element state ``name`` (rows of its shard, values a row), zero at first use."""
        buf = self._buffers.get(name)
        if buf is None:
            buf = self._buffers[name] = np.zeros(self._shard[1:], np.float32)
        return buf

    def _update(self, at: np.ndarray, g: np.ndarray, p: np.ndarray, **hyper) -> np.ndarray:
        """The owner's new values of its rows (``at``: their rows in its buffers) from their mean
        gradient ``g``, current values ``p`` and the step's hyperparameters; updates the buffers
        (:meth:`_buffer`) in place."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """This rank's optimizer state, with torch.optim's two keys: ``state`` (the rank and world it
        belongs to, the step count, the owner's shard as (first row, rows, values a row), None
        before its first round or on a rank that owns none, and its buffers, CPU float32 tensors
        of that shape, copies) and ``param_groups`` (the hyperparameters, a scheduler's
        ``initial_lr`` included; ``params`` as indices).  Numbers, tuples and tensors:
        ``torch.load(weights_only=True)`` reads it.  Call it between steps."""
        col = self.dblp_state.collective
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        group["params"] = list(range(len(self.param_groups[0]["params"])))
        return {"state": {"rank": col.rank, "world": col.world, "steps": self.steps, "shard": self._shard,
                          "buffers": {n: torch.from_numpy(b.copy()) for n, b in self._buffers.items()}},
                "param_groups": [group]}

    def load_state_dict(self, state_dict: dict) -> None:
        """Go on from ``state_dict`` (:meth:`state_dict` of this rank's optimizer, built alike, in
        an earlier run): the step count, the shard's buffers (copied) and the hyperparameters.
        Load it between steps, and the model's parameters and the collective's state with it.

        Raises:
            ValueError: another rank's or world's state, another number of parameters, or
                buffers that do not fit.  A state saved with another chunk size, ``Config.mode``
                or model size fails the first step instead (a ValueError from its round: the
                state is then unusable).
        """
        st, groups = state_dict["state"], state_dict["param_groups"]
        col = self.dblp_state.collective
        if (st["rank"], st["world"]) != (col.rank, col.world):
            raise ValueError(f"the state of rank {st['rank']} of {st['world']} given to rank {col.rank} of "
                             f"{col.world}: each rank loads its own")
        group = self.param_groups[0]
        if len(groups) != 1 or len(groups[0]["params"]) != len(group["params"]):
            raise ValueError(f"a state of {[len(g['params']) for g in groups]} parameters per group given to one "
                             f"group of {len(group['params'])}")
        shard = None if st["shard"] is None else tuple(int(v) for v in st["shard"])
        bad = [n for n, b in st["buffers"].items()
               if n not in self.STATE or shard is None or tuple(b.shape) != shard[1:]]
        if bad:
            raise ValueError(f"state buffers {bad} do not fit: this optimizer keeps {list(self.STATE)}, of its "
                             f"shard's shape, {None if shard is None else shard[1:]}")
        group.update((k, v) for k, v in groups[0].items() if k != "params")
        self.steps, self._shard = int(st["steps"]), shard
        self._buffers = {n: np.array(b.detach().cpu().numpy(), np.float32) for n, b in st["buffers"].items()}


class ShardedSGD(_Sharded):
    """SGD with momentum (PyTorch's rule: ``b = momentum * b + g``, ``p -= lr * b``), sharded.

    Args:
        state: a :class:`pydblp.torch.State`.
        module: the model; its trainable parameters are stepped, in ``module.parameters()`` order.
        lr: the learning rate (> 0); ``param_groups[0]["lr"]`` from then on.
        momentum: in [0, 1); ``param_groups[0]["momentum"]``.  The owner keeps a momentum buffer
            ``b`` for its rows from the first step with momentum.
    """

    STATE = ("b",)

    def __init__(self, state, module: torch.nn.Module, lr: float, momentum: float = 0.0):
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum {momentum!r}: use a value in [0, 1)")
        super().__init__(state, module, dict(lr=lr, momentum=float(momentum)))

    def _update(self, at, g, p, lr, momentum):
        if momentum:
            b = self._buffer("b")
            g = b[at] = np.float32(momentum) * b[at] + g
        return p - np.float32(lr) * g


class ShardedAdam(_Sharded):
    """Adam (PyTorch's rule, no weight decay), sharded.

    Args:
        state: a :class:`pydblp.torch.State`.
        module: the model; its trainable parameters are stepped, in ``module.parameters()`` order.
        lr: the learning rate (> 0); ``param_groups[0]["lr"]`` from then on.
        betas: (beta1, beta2), each in [0, 1); ``param_groups[0]["betas"]``.
        eps: added to the denominator (> 0); ``param_groups[0]["eps"]``.

    The owner keeps the moments ``m`` and ``v`` for its rows; the bias correction counts every
    step (:attr:`steps`).
    """

    STATE = ("m", "v")

    def __init__(self, state, module: torch.nn.Module, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8):
        if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"betas {betas!r}: give two values in [0, 1)")
        if not eps > 0:
            raise ValueError(f"eps {eps!r}: give a value > 0")
        super().__init__(state, module, dict(lr=lr, betas=(float(betas[0]), float(betas[1])), eps=float(eps)))

    def _update(self, at, g, p, lr, betas, eps):
        b1, b2 = betas
        m, v = self._buffer("m"), self._buffer("v")
        m[at] = b1 * m[at] + (1 - b1) * g
        v[at] = b2 * v[at] + (1 - b2) * g * g
        t = self.steps
        step = lr * (m[at] / (1 - b1 ** t)) / (np.sqrt(v[at] / (1 - b2 ** t)) + eps)
        return (p - step).astype(np.float32)
