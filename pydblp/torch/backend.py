"""The ``dblp`` torch.distributed backend: ``init_process_group("dblp")`` is the whole integration.

Importing :mod:`pydblp.torch` registers it (``torch.distributed.Backend.register_backend``,
devices ``cpu`` and ``cuda``).  DDP, FSDP2 (``fully_shard``) and plain ``dist.all_reduce`` then
run over pydblp's bounded-loss collective::

    import pydblp.torch
    dist.init_process_group("dblp")                   # options from DBLP_* variables (torchrun)
    dist.init_process_group("dblp", pg_options=pydblp.torch.BackendOptions(
        transport="xsk", iface="eth0", config=Config(phase="dblp")))

What tolerates loss and what is exact (``BackendOptions.tolerate``):

* ``"backward"`` (default): a floating-point (float32, float16, bfloat16) SUM or AVG
  ``allreduce`` or ``reduce_scatter`` issued while autograd runs a backward pass is a gradient
  round: it tolerates the round's loss bound (the phase controller's), and the controller counts
  training steps by backward pass.  DDP's gradient buckets and FSDP2's gradient reduce-scatter
  are such rounds.
* Everything else is exact: the initial broadcast, barriers, object collectives, all-gathers
  (FSDP2's parameters, unless ``BackendOptions.allgather`` is ``"tolerant"``), a user's
  ``all_reduce`` outside backward, any other dtype or op.  A
  float SUM/AVG is then a round with bound 0 (every message repaired whole); other dtypes and
  ops (int, float64, MIN, MAX, PRODUCT, bitwise) gather every rank's bytes exactly and reduce
  them locally, in the tensor's own dtype, in rank order (identical on every rank).
* ``"none"``: everything exact.

Failure semantics: a round whose peer stays silent for ``Config.peer_timeout`` fails its
``Work`` (``wait()`` raises, the future completes with the error) with a
:class:`~pydblp.collective.CollectiveError` naming the silent rank.  A rank busy between
operations (evaluating, writing a checkpoint) is not silent: it tells the ranks waiting for it
that it is alive, and they wait up to ``init_process_group``'s ``timeout`` (default 30 min, as
for Gloo; ``Config.join_timeout``) before the operation fails naming it.  Every later operation on
the group then fails at once with an error naming the first failure; ``destroy_process_group``
waits (at most ``peer_timeout``) until every member closes, answering peers meanwhile, then
closes the data plane (:meth:`ProcessGroupDblp.close`).  An unsupported dtype or op raises
``ValueError`` at the call, before anything is sent.

Mixed use follows torch's rules for a Python backend: it stands for every device of its group,
so with ``"cpu:dblp,cuda:nccl"`` the ``dblp`` group is the group and takes CUDA tensors too: they are staged through pinned host buffers with asynchronous
copies on a side stream (:class:`_Staging`), and the result is on the tensor's device when the
``Work`` completes.  Create an NCCL group beside it (``dist.new_group(backend="nccl")``) for
traffic that should stay on the GPU fabric.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import functools
import difflib
import logging
import operator
import os
import re
import sys
import threading
import weakref

import numpy as np
import torch
import torch.distributed as dist

from pydblp import wire
from pydblp.collective import CollectiveError, Config
from pydblp.collective.config import TENSOR_BACKEND, TIMEOUT_MAX

log = logging.getLogger(__name__)

BACKEND = "dblp"
TOLERATE = ("backward", "none")
ALLGATHERS = ("exact", "tolerant")
GRADIENT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
RESULT_BUFFERS = 8  # allreduce result buffers a group keeps, one per tensor size (ProcessGroupDblp._result)
_R = dist.ReduceOp
# local reductions of the exact path: gathered (world, ...) tensors -> one
_LOCAL = {
    _R.SUM: lambda g: g.sum(0, dtype=g.dtype) if g.dtype != torch.bool else g.any(0),
    _R.AVG: lambda g: g.sum(0, dtype=g.dtype) / g.shape[0],  # (floating or complex: _check_reduce; the survivors')
    _R.PRODUCT: lambda g: g.prod(0, dtype=g.dtype) if g.dtype != torch.bool else g.all(0),
    _R.MIN: lambda g: g.min(0).values,
    _R.MAX: lambda g: g.max(0).values,
    _R.BAND: lambda g: functools.reduce(operator.and_, g.unbind(0)),
    _R.BOR: lambda g: functools.reduce(operator.or_, g.unbind(0)),
    _R.BXOR: lambda g: functools.reduce(operator.xor, g.unbind(0)),
}

__all__ = ["BACKEND", "BackendOptions", "ProcessGroupDblp", "register"]


_CFG = {}  # (marks the Config fields in ENV_OPTIONS)
# variable, where its value goes (BackendOptions or Config), field, conversion
ENV_OPTIONS = (
    ("DBLP_TRANSPORT", None, "transport", str), ("DBLP_IFACE", None, "iface", str),
    ("DBLP_ADDR", None, "addr", str), ("DBLP_TOLERATE", None, "tolerate", str),
    ("DBLP_ALLGATHER", None, "allgather", str), ("DBLP_SURVIVE", None, "survive", "bool"),
    ("DBLP_PORT", None, "port", int), ("DBLP_RATE", None, "rate", "rate"),
    ("DBLP_PHASE", _CFG, "phase", str), ("DBLP_JOB", _CFG, "job", int),
    ("DBLP_PEER_TIMEOUT", _CFG, "peer_timeout", float), ("DBLP_PLAN", _CFG, "plan", str),
    ("DBLP_SPREAD", _CFG, "spread", int),
)
# DBLP_* variables read elsewhere (not a misspelt option): the job key, the native build, state folders
ENV_ELSEWHERE = ("DBLP_KEY", "DBLP_KEY_FILE", "DBLP_NATIVE", "DBLP_BPF_DIR", "DBLP_JOBS_DIR", "DBLP_TESTBED_DIR",
                 "DBLP_XSK_STATUS_DIR")


def _local_iface(names: str, local_rank: str | None) -> str:
    """This rank's interface of ``DBLP_IFACE``'s comma-separated list: the ``LOCAL_RANK``-th."""
    ifaces = [n.strip() for n in names.split(",")]
    if not all(ifaces):
        raise ValueError(f"DBLP_IFACE={names!r}: an empty name in the list; give one interface per local rank")
    if local_rank is None or not local_rank.isdigit():
        raise ValueError(f"DBLP_IFACE={names!r} lists one interface per local rank, and LOCAL_RANK="
                         f"{local_rank!r} is not a rank: launch with torchrun, or set LOCAL_RANK")
    if int(local_rank) >= len(ifaces):
        raise ValueError(f"DBLP_IFACE={names!r} lists {len(ifaces)} interfaces and LOCAL_RANK is {local_rank}: "
                         f"list one per rank on the host (torchrun --nproc-per-node)")
    return ifaces[int(local_rank)]


@dataclasses.dataclass
class BackendOptions:
    """The ``dblp`` backend's options: ``init_process_group("dblp", pg_options=BackendOptions(...))``.

    Without ``pg_options`` they come from the environment (:meth:`from_env`), which is how
    ``torchrun`` jobs set them.

    Args:
        transport: the data-plane kind: ``udp`` (any user), ``xsk`` or ``xsk-ktx`` (AF_XDP, root;
            ``iface`` required).  ``DBLP_TRANSPORT``.
        iface: the data-plane interface (None: ``udp`` on any address, published as 127.0.0.1).
            ``DBLP_IFACE``; a comma-separated list there gives each rank on a host its own,
            the ``LOCAL_RANK``-th (torchrun sets it): the AF_XDP kinds take one rank per
            interface (``DBLP_IFACE=eth1,eth2,eth3,eth4`` for ``--nproc-per-node 4``).
        port: the UDP port (0: ``udp`` picks a free one; the AF_XDP kinds need the host
            program's, ``wire.DEFAULT_PORT`` unless ``dblp load --port`` said otherwise).
            ``DBLP_PORT``.
        addr: the address published to peers (default: ``iface``'s first IPv4 address).
            ``DBLP_ADDR``.
        netns: the interface's network namespace.
        queue: one receive queue for the AF_XDP socket; None (default): one socket on every
            receive queue of ``iface``.
        config: the collective's knobs (:class:`~pydblp.collective.Config`); ``DBLP_PHASE``
            (``static:TOL`` or ``dblp[:P_LOW]``), ``DBLP_JOB``, ``DBLP_PEER_TIMEOUT`` and
            ``DBLP_PLAN`` set its phase controller, job, peer timeout and plans.  ``job`` must differ between groups that
            share an interface and port; each ``new_group`` gets ``job + its group number``.
        rate: bits/s the ``xsk`` transport paces at (0: unpaced).  ``DBLP_RATE`` (e.g. ``10g``).
        key_file: the job key (docs/authentication.md); None: ``DBLP_KEY_FILE`` / ``DBLP_KEY``.
        tolerate: ``"backward"`` (gradient rounds tolerate the bound, see the module docstring)
            or ``"none"`` (every operation exact).  ``DBLP_TOLERATE``.
        allgather: ``"exact"`` (default) or ``"tolerant"``: a floating-point
            ``all_gather_into_tensor`` (FSDP2's parameter all-gather) tolerates the round's bound,
            a value that does not arrive is 0 in that call's output (the owner's copy is
            untouched: nothing drifts).  Needs ``Config(consistent=False)``.  ``DBLP_ALLGATHER``.
        survive: keep the survivors training when a rank dies (``ProcessGroupDblp``'s failure
            semantics): each backward pass ends with one exact one-value round that every rank
            must complete, so a failed step is dropped on every survivor alike.  ``DBLP_SURVIVE=1``.
    """

    transport: str = "udp"
    iface: str | None = None
    port: int | None = None
    addr: str | None = None
    netns: str | None = None
    queue: int | None = None
    config: Config | None = None
    rate: float = 0
    key_file: str | None = None
    tolerate: str = "backward"
    allgather: str = "exact"
    survive: bool = False

    @classmethod
    def from_env(cls, env: dict | None = None) -> "BackendOptions":
        """Options from ``DBLP_*`` environment variables (see the class's Args); unset ones keep
        their defaults.  ``DBLP_ALLGATHER=tolerant`` also sets ``Config(consistent=False)``, which
        it needs.  Raises ValueError in one line naming the variable whose value is wrong (or
        the variables to set together, e.g. ``DBLP_IFACE`` with ``DBLP_TRANSPORT=xsk``).  A
        ``DBLP_*`` name close to one of these that none of pydblp reads (``DBLP_PEER_TIMOUT``) is
        logged as a warning naming the one meant: it is ignored."""
        from pydblp import units

        env = os.environ if env is None else env
        known = [v for v, *_ in ENV_OPTIONS]
        for var in sorted(v for v in env if v.startswith("DBLP_") and v not in known and v not in ENV_ELSEWHERE):
            meant = difflib.get_close_matches(var, known, n=1, cutoff=0.8)
            if meant:
                log.warning("%s is ignored: no such dblp variable; did you mean %s?", var, meant[0])
        kw: dict = {}
        cfg: dict = {}
        survive = {"1": True, "0": False}
        for var, dest, name, conv in ENV_OPTIONS:
            text = env.get(var)
            if not text:
                continue
            try:
                if conv in (int, float):
                    try:
                        value = conv(text)
                    except ValueError:
                        raise ValueError("use an integer" if conv is int else "use a number") from None
                else:
                    value = (units.rate(text) if conv == "rate" else survive[text] if conv == "bool"
                             else conv(text))
                if dest is _CFG:
                    Config(**{name: value}).check()  # (each value alone: the error is its variable's)
            except (ValueError, KeyError) as e:
                why = "use 1 or 0" if isinstance(e, KeyError) else str(e)
                raise ValueError(f"{var}={text!r}: {why}") from None
            (cfg if dest is _CFG else kw)[name] = value
        if "," in kw.get("iface", ""):
            kw["iface"] = _local_iface(kw["iface"], env.get("LOCAL_RANK"))
        if kw.get("allgather") == "tolerant":
            cfg["consistent"] = False
        if cfg:
            kw["config"] = Config(**cfg)
        opts = cls(**kw)
        try:
            opts.check()
        except ValueError as e:
            named = [v for v, _, n, _ in ENV_OPTIONS if re.search(rf"\b{n}\b", str(e))]
            raise ValueError(f"DBLP_* environment: {e}" + (f" (set {', '.join(named)})" if named else "")) from None
        return opts

    def check(self) -> None:
        """Raise ValueError naming the first option that is wrong and how to fix it."""
        from pydblp.dataplane import check_kind

        check_kind(self.transport, self.iface)
        if self.tolerate not in TOLERATE:
            raise ValueError(f"tolerate {self.tolerate!r}: use {' or '.join(TOLERATE)}")
        if self.allgather not in ALLGATHERS:
            raise ValueError(f"allgather {self.allgather!r}: use {' or '.join(ALLGATHERS)}")
        if self.allgather == "tolerant" and (self.config or Config()).consistent:
            raise ValueError("allgather 'tolerant' needs Config(consistent=False): a consistent collective repairs "
                             "every all-gather whole")
        if self.port is not None and not 0 <= self.port <= 0xFFFF:
            raise ValueError(f"port {self.port}: use 0..65535 (0: udp picks a free one)")
        if not isinstance(self.survive, bool):
            raise ValueError(f"survive {self.survive!r}: use True or False")
        if not self.rate >= 0:
            raise ValueError(f"rate {self.rate}: use bits/s >= 0 (0: unpaced)")
        (self.config or Config()).check()


class _Staging:
    """CUDA tensors to and from pinned host buffers, copied on a side stream.

    The copy down waits for the producer's stream (an event), not for the device: the caller
    returns at once and the transport thread waits for the copy's own event, so bucket k+1's copy
    overlaps bucket k's round.  Pinned buffers are kept per (dtype, size) and reused.
    """

    def __init__(self):
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._pinned: dict[tuple, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in self._streams:
            self._streams[idx] = torch.cuda.Stream(device=idx)
        return self._streams[idx]

    def _buffer(self, t: torch.Tensor) -> torch.Tensor:
        with self._lock:
            free = self._pinned.get((t.dtype, t.numel()))
            if free:
                return free.pop()
        return torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)

    def release(self, host: torch.Tensor) -> None:
        with self._lock:
            self._pinned.setdefault((host.dtype, host.numel()), []).append(host)

    def down(self, t: torch.Tensor):
        """Start copying ``t`` (CUDA) to a pinned host buffer; ``(host, event)``, the event
        recorded once the copy is done (wait on it before reading ``host``)."""
        s = self._stream(t.device)
        s.wait_stream(torch.cuda.current_stream(t.device))
        host = self._buffer(t)
        with torch.cuda.stream(s):
            host.copy_(t.reshape(-1), non_blocking=True)
            done = torch.cuda.Event()
            done.record(s)
        t.record_stream(s)  # the caller's allocator must not reuse t's memory before the copy ran
        return host, done

    def up(self, src: torch.Tensor, t: torch.Tensor) -> None:
        """Copy ``src`` (a CPU tensor of ``t``'s size) into ``t`` (CUDA) through a pooled pinned
        buffer on the side stream, and wait for it (called on the transport thread: the Work
        completes with ``t`` current)."""
        host = self._buffer(t)
        host.copy_(src.reshape(-1))
        s = self._stream(t.device)
        with torch.cuda.stream(s):
            t.copy_(host.view(t.shape), non_blocking=True)  # (t may be strided: reshape would copy)
            done = torch.cuda.Event()
            done.record(s)
        done.synchronize()
        self.release(host)


class _Step:
    """The backward pass now running on this group: what closes it (:meth:`ProcessGroupDblp._end_backward`)."""

    def __init__(self, task: int):
        self.task = task
        self.counted = False          # an allreduce counted the controller's step
        self.outputs: list = []       # the gradient rounds' outputs (zeroed if the step is dropped)


_UNSUPPORTED = ("dblp: {op} is not supported: run it on a group of another "
                "backend beside the dblp one, e.g. dist.new_group(backend=\"gloo\")")


class _Work(dist.Work):
    """An operation's ``Work``: its future completes when the operation's rounds have (with their
    error if one failed), ``wait()`` blocks until then and raises that error.

    (torch's own wrapper of a future, ``_create_work_from_future``, returns True from ``wait()``
    whatever the future holds: a failed ``dist.all_reduce`` would return with its tensor
    unchanged.)"""

    def __init__(self, fut: torch.futures.Future) -> None:
        super().__init__()
        self._fut = fut

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Block until the operation completes; raise its error.  ``timeout`` (non-zero): raise
        ``DistError`` if it has not completed by then (it goes on: the group's order is kept)."""
        if timeout and timeout.total_seconds() > 0 and not self._fut.done():
            done = threading.Event()
            self._fut.add_done_callback(lambda _: done.set())
            if not done.wait(timeout.total_seconds()):
                raise dist.DistError(f"dblp: the operation did not complete within {timeout}")
        self._fut.wait()  # (raises the error the future completed with)
        return True

    def get_future(self) -> torch.futures.Future:
        return self._fut

    def is_completed(self) -> bool:
        return self._fut.done()


class ProcessGroupDblp(dist.ProcessGroup):
    """A torch.distributed process group over pydblp's bounded-loss collective.

    Made by ``init_process_group("dblp")`` / ``new_group(backend="dblp")`` (:func:`register`);
    not constructed directly.  Operations run in submission order on the group's
    :class:`~pydblp.torch.State` thread; each returns a ``Work`` whose future completes when its
    round has (``async_op=False`` waits for it).  :attr:`state` is the group's
    :class:`~pydblp.torch.State` (its collective's records, counters, host counters), usable with
    :class:`~pydblp.torch.ShardedSGD` and the DiLoCo exchange as with ``State.from_process_group``.

    Failure (a peer silent for ``Config.peer_timeout``; see the module docstring): an operation
    issued during a backward pass never fails its ``Work`` (DDP's reducer cannot take a failed
    future: torch aborts the process), it completes with its input unchanged and the error is
    raised as the backward pass ends (``loss.backward()`` raises it), or, with
    ``BackendOptions.survive``, the step is dropped on every survivor and the group goes on
    without the dead rank (:meth:`_reform`).  Other operations fail their ``Work``.
    """

    def __init__(self, store, rank: int, size: int, options: BackendOptions, group_id: int = 0,
                 timeout: float | None = None):
        super().__init__(rank, size)
        self.options = options
        cfg = options.config or Config()
        if group_id:  # groups sharing an interface and port: a job each
            cfg = dataclasses.replace(cfg, job=(cfg.job + group_id - 1) % 0xFFFFFFFF + 1)
        if timeout is not None:  # init_process_group's / new_group's: how long an operation waits for a rank
            cfg = dataclasses.replace(cfg, join_timeout=min(timeout, TIMEOUT_MAX))  # busy elsewhere
        self._cfg, self._store = cfg, store
        self.members = list(range(size))  # the torch ranks still in the group (all, until one dies)
        self.generation = 0               # times the group re-formed without a dead rank
        self.state = self._open(store, rank, size, cfg)
        self._ids: dict[tuple, int] = {}
        self._step: _Step | None = None   # the backward pass running, if an operation came from one
        self._failure: BaseException | None = None  # the first round that failed (until re-formed)
        self._staging: _Staging | None = None
        self._results: dict[int, np.ndarray] = {}  # size -> the buffer allreduce writes a result into
        self._closed = False
        _OPEN.add(self)

    def _open(self, store, rank: int, world: int, cfg: Config):
        from pydblp.torch import State

        o = self.options
        port = o.port if o.port is not None else (0 if o.transport == "udp" else wire.DEFAULT_PORT)
        return State.open(store, rank, world, transport=o.transport, iface=o.iface, netns=o.netns, port=port,
                          queue=o.queue, addr=o.addr, config=cfg, rate=o.rate, key_file=o.key_file)

    # ---- torch.distributed's interface -------------------------------------
    def getBackendName(self) -> str:
        return BACKEND

    # torch keeps a group's name on its C++ backends, and a Python group has none: kept here
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        if getattr(self, "_group_name", None) is None:
            raise RuntimeError("ProcessGroup name not set")
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return getattr(self, "_group_desc", "undefined")

    def allreduce(self, tensors, opts=None):
        op = _op(opts)
        for t in tensors:
            _check_reduce(t, op)
        tolerant = self._tolerant(tensors, op, step=True)
        return self._run(tensors, lambda col, t, x: self._allreduce(col, t, x, op, tolerant), gradient=tolerant)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts=None):
        root = _root(opts)
        return self._run(tensors, lambda col, t, x: self._gather_bytes(col, x, root=root)[root])

    def barrier(self, opts=None):
        return self._run([torch.zeros(1)], lambda col, t, x: self._gather_bytes(col, x)[self.rank()])

    def allgather(self, output_tensors, input_tensors, opts=None):
        outs, inp = output_tensors[0], input_tensors[0]
        if len(outs) != self.size():
            raise ValueError(f"allgather: give {self.size()} output tensors (one per rank), not {len(outs)}")
        return self._gather_into(inp, lambda got: [o.copy_(g.view_as(o)) for o, g in zip(outs, got)], outs)

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        works = [self.allgather([o], [i]) for o, i in zip(output_lists, input_tensors)]
        return works[-1]

    def all_gather_single(self, output, input, opts=None):
        if output.numel() != input.numel() * self.size():
            raise ValueError(f"all_gather_into_tensor: output has {output.numel()} elements, "
                             f"give world x input = {input.numel() * self.size()}")
        if self.options.allgather == "tolerant" and input.dtype in GRADIENT_DTYPES and len(self.members) == self.size():
            return self._run([input], lambda col, t, x: col.all_gather(
                x.float().numpy(), tensor=self._id("ag", t.numel()), exact=False), outputs=[output])
        return self._gather_into(input, lambda got: output.copy_(torch.cat([g.reshape(-1) for g in got])
                                                                  .view_as(output)), [output])

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1]

    def reduce_scatter_single(self, output, input, opts=None):
        op = _op(opts)
        _check_reduce(input, op)
        if input.numel() != output.numel() * self.size():
            raise ValueError(f"reduce_scatter_tensor: input has {input.numel()} elements, "
                             f"give world x output = {output.numel() * self.size()}")
        if output.dtype != input.dtype:
            raise ValueError(f"reduce_scatter_tensor: output {output.dtype} and input {input.dtype}: use one dtype")
        tolerant = self._tolerant([input], op, step=True)
        return self._run([input], lambda col, t, x: self._reduce_scatter(col, t, x, op, tolerant), outputs=[output],
                         gradient=tolerant)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        out, pieces = output_tensors[0], input_tensors[0]
        return self.reduce_scatter_single(out, torch.cat([p.reshape(-1) for p in pieces]), opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return works[-1]

    def reduce(self, tensors, opts=None):
        """``dist.reduce``: an exact all_reduce whose result only ``dst`` keeps (the others'
        tensors are left as they were)."""
        op, root = _op(opts), _root(opts)
        for t in tensors:
            _check_reduce(t, op)
        return self._run(tensors, lambda col, t, x: self._allreduce(col, t, x, op, False), write=self.rank() == root)

    def gather(self, output_tensors, input_tensors, opts=None):
        """``dist.gather``: every rank's tensor, exactly (an all-gather of its bytes); ``dst``
        keeps them."""
        root, inp = _root(opts), input_tensors[0]
        if self.rank() != root:
            return self._gather_into(inp, lambda got: None, [inp])
        outs = output_tensors[0]
        if len(outs) != self.size():
            raise ValueError(f"gather: give {self.size()} output tensors (one per rank), not {len(outs)}")
        return self._gather_into(inp, lambda got: [o.copy_(g.view_as(o)) for o, g in zip(outs, got)], outs)

    def scatter(self, output_tensors, input_tensors, opts=None):
        """``dist.scatter``: ``src``'s list, piece ``r`` to rank ``r``, exactly: an all-gather of
        the whole list's bytes (every rank sends as many, zeros but ``src``: world-squared times
        the bytes of one piece; for start-up and checkpoints, not per step)."""
        root, out, me = _root(opts), output_tensors[0], self.rank()
        n = out.numel()
        if me == root:
            pieces = input_tensors[0]
            if len(pieces) != self.size() or any(p.numel() != n for p in pieces):
                raise ValueError(f"scatter: give {self.size()} input tensors of {n} elements (one per rank)")
            whole = torch.cat([p.reshape(-1) for p in pieces])
        else:
            whole = torch.zeros(n * self.size(), dtype=out.dtype, device=out.device)
        return self._run([whole], lambda col, t, x: self._gather_bytes(col, x, root=root)[root][me * n:(me + 1) * n],
                         outputs=[out])

    # torch hands a Python group its all-to-all, send and recv too
    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        raise ValueError(_UNSUPPORTED.format(op="all_to_all"))

    def alltoall(self, output_tensors, input_tensors, opts=None):  # (dist.all_to_all, the list form)
        raise ValueError(_UNSUPPORTED.format(op="all_to_all"))

    def send(self, tensors, dst: int, tag: int = 0):
        raise ValueError(_UNSUPPORTED.format(op="send"))

    def recv(self, tensors, src: int, tag: int = 0):
        raise ValueError(_UNSUPPORTED.format(op="recv"))

    def shutdown(self) -> None:
        self.close()

    def abort(self) -> None:
        self.close(linger=False)

    def close(self, linger: bool = True) -> None:
        """Stop the group's thread and close its data plane (torch calls it from
        ``destroy_process_group``).  Idempotent.

        Args:
            linger: first wait, at most ``Config.peer_timeout``, until every member of the group
                is closing too, answering peers meanwhile (:meth:`pydblp.torch.State.close`):
                this rank's last round may have ended while a peer still needs a
                retransmission of its part, or the STOP it lost.  Skipped after a failure (the
                group is done with), and by ``abort()``.
        """
        if self._closed:
            return
        self._closed = True
        _OPEN.discard(self)
        self.state.close(barrier=linger and self._failure is None)

    # ---- steps and failures --------------------------------------------------
    def _backward(self) -> _Step | None:
        """The backward pass this call comes from (None: not from one); the first call of a pass
        asks autograd to run :meth:`_end_backward` as the pass ends."""
        task = torch._C._current_graph_task_id()
        if task == -1:
            return None
        if self._step is None or self._step.task != task:
            step = self._step = _Step(task)
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._end_backward(step))
        return self._step

    def _tolerant(self, tensors, op, step: bool) -> bool:
        """A gradient round: floating SUM/AVG issued during a backward pass (BackendOptions.tolerate).
        ``step``: the phase controller sees the round: the backward pass is its step, closed as
        the pass ends."""
        bw = self._backward()
        if bw is None or self.options.tolerate != "backward" or op not in (_R.SUM, _R.AVG):
            return False
        if not all(t.dtype in GRADIENT_DTYPES for t in tensors):
            return False
        bw.counted |= step
        return True

    def _end_backward(self, step: _Step) -> None:
        """(Autograd calls it as a backward pass that used this group ends, after the pass's rounds
        were submitted.)  Close the controller's step; settle a failure: raise it, or with
        ``survive`` agree on it with every rank (one exact round), drop the step's gradients on
        every survivor and re-form the group without the dead."""
        if self._step is step:
            self._step = None
        if step.counted:
            self.state.submit(lambda col: None if self._failure else col.end_step())
        if not self.options.survive:
            self.state.submit(lambda col: None).wait()  # the step's rounds have run (failed or not)
            if self._failure is not None:
                raise self._failure
            return

        def commit(col):  # every rank's verdict on the step: it stands only if all ranks kept it
            try:
                return float(col.allreduce(np.array([self._failure is not None], np.float32), op="sum",
                                           tensor=self._id("commit", 1), exact=True)[0])
            except CollectiveError as e:
                self._failure = self._failure or e
                return 1.0

        if self.state.submit(commit).wait() == 0 and self._failure is None:
            return
        for out in step.outputs:  # the step's gradients: zero on every survivor
            with torch.no_grad():
                out.zero_()
        log.warning("dblp: rank %d drops this step: %s", self.rank(), self._failure or "another rank failed it")
        self._reform()

    def _reform(self) -> None:
        """Re-form the group with the ranks still alive: each survivor posts itself under the next
        generation in the store and waits (up to ``2 * peer_timeout``) for every other member;
        those that posted are the group from now on, over a new data plane and a job of their own
        (packets of the old generation are another job's).  The torch rank and size do not change:
        a sum is scaled by ``size / survivors`` (the full group's sum, estimated), an average is
        the survivors', a dead rank's all-gather slot is zeros, a broadcast from it fails."""
        gen = self.generation + 1
        me = self.rank()
        store = self._store
        store.set(f"pydblp/reform/{gen}/{me}", "1")
        wait = datetime.timedelta(seconds=2 * self._cfg.peer_timeout)
        alive = []
        for r in self.members:
            try:
                store.wait([f"pydblp/reform/{gen}/{r}"], wait if r != me else datetime.timedelta(seconds=1))
                alive.append(r)
            except (RuntimeError, dist.DistError):
                wait = datetime.timedelta(seconds=1)  # the wait is spent: the rest posted by now or never
        old, self._failure = self.state, None
        old.close(barrier=False)
        cfg = dataclasses.replace(self._cfg, job=(self._cfg.job + gen * 0x10000 - 1) % 0xFFFFFFFF + 1)
        sub = dist.PrefixStore(f"pydblp/gen{gen}/", store)
        self.members, self.generation = alive, gen
        if me not in alive:  # (this rank's own post is not readable: the store's host is gone)
            raise CollectiveError(f"dblp: rank {me} cannot re-form the group: the rendezvous store is "
                                  f"unreachable (its host, rank 0 under torchrun, died?)")
        self.state = self._open(sub, alive.index(me), len(alive), cfg)
        self._ids.clear()
        log.warning("dblp: rank %d goes on with %d of %d ranks (left out: %s)", me, len(alive), self.size(),
                    sorted(set(range(self.size())) - set(alive)))

    # ---- rounds --------------------------------------------------------------
    def _id(self, kind: str, numel: int) -> int:
        """The collective's tensor id for rounds of ``kind`` on ``numel`` values: one id per shape
        (its buffers are kept across rounds), the same on every rank (ranks make the same calls)."""
        key = (kind, numel)
        if key not in self._ids:
            self._ids[key] = len(self._ids) % TENSOR_BACKEND[1] + TENSOR_BACKEND[0]
        return self._ids[key]

    def _scale(self) -> np.float32:
        """A sum over the survivors, scaled to the full group's (1 until a rank died)."""
        return np.float32(self.size() / len(self.members))

    def _allreduce(self, col, t, x, op, tolerant: bool) -> np.ndarray | torch.Tensor:
        if op in (_R.SUM, _R.AVG) and t.dtype in GRADIENT_DTYPES:
            if tolerant:
                col.controller.count_steps()
            out = col.allreduce(x.float().numpy(), tensor=self._id("ar", t.numel()), op="mean", exact=not tolerant,
                                out=self._result(t.numel()))
            return out, (self.size() if op == _R.SUM else 1)
        return _LOCAL[op](torch.stack(self._gather_bytes(col, x, alive_only=True)))

    def _result(self, n: int) -> np.ndarray:
        """A float32 buffer of ``n`` values an allreduce writes its result into, kept per size (a
        few: DDP's bucket sizes repeat): no fresh array, no page faults, per round.  Safe to reuse:
        the group's rounds run one at a time, and each result is copied into its tensor
        (:meth:`_write`) before the next begins; the tensor itself is not written if the round
        fails."""
        buf = self._results.pop(n, None)
        if buf is None:
            buf = np.empty(n, np.float32)
            while len(self._results) >= RESULT_BUFFERS:  # the least recently used size goes
                self._results.pop(next(iter(self._results)))
        self._results[n] = buf
        return buf

    def _reduce_scatter(self, col, t, x, op, tolerant) -> np.ndarray | torch.Tensor:
        n = t.numel() // self.size()
        me = self.rank()
        if op in (_R.SUM, _R.AVG) and t.dtype in GRADIENT_DTYPES:
            scale = self.size() if op == _R.SUM else 1
            if tolerant:
                col.controller.count_steps()
            if len(self.members) == self.size():
                return col.reduce_scatter(x.float().numpy(), tensor=self._id("rs", t.numel()), op="mean",
                                          exact=not tolerant, observe=tolerant), scale
            # survivors: the dead ranks' pieces have no owner; reduce the whole tensor, keep mine
            whole = col.allreduce(x.float().numpy(), tensor=self._id("rs", t.numel()), op="mean", exact=not tolerant)
            return whole[me * n: (me + 1) * n], scale
        whole = _LOCAL[op](torch.stack(self._gather_bytes(col, x, alive_only=True)))
        return whole.reshape(-1)[me * n: (me + 1) * n]

    def _gather_bytes(self, col, x: torch.Tensor, root: int | None = None,
                      alive_only: bool = False) -> list[torch.Tensor]:
        """Every rank's ``x`` (same dtype and size on all), exactly: its bytes all-gathered as
        float32 words (copied, never computed on); torch rank order, a dead rank's zeros (or,
        ``alive_only``, left out).  Raises CollectiveError if ``root`` is a dead rank."""
        if root is not None and root not in self.members:
            raise CollectiveError(f"broadcast from rank {root}, which died: the group goes on without it")
        raw = x.reshape(-1).contiguous().view(torch.uint8).numpy()
        n = raw.size
        words = np.zeros(-(-n // 4), np.float32)
        words.view(np.uint8)[:n] = raw
        got = col.all_gather(words, tensor=self._id("bytes", words.size), exact=True)
        rows = got.view(np.uint8).reshape(len(self.members), -1)[:, :n]
        by_rank = {r: torch.from_numpy(rows[i].copy()).view(x.dtype).view_as(x) for i, r in enumerate(self.members)}
        if alive_only:
            return list(by_rank.values())
        return [by_rank[r] if r in by_rank else torch.zeros_like(x) for r in range(self.size())]

    def _gather_into(self, inp, place, outputs):
        def job(col, t, x):
            place(self._gather_bytes(col, x))
            return None

        return self._run([inp], job, outputs=outputs, write=False)

    def _run(self, tensors, fn, outputs=None, write: bool = True, gradient: bool = False):
        """Submit ``fn(col, tensor, host_copy) -> result`` for each tensor on the group's thread;
        the result is written into ``outputs`` (default: the tensors, in place).  A Work of it.

        A round that fails during a backward pass leaves its outputs as they are and completes
        (:meth:`_end_backward` settles it); otherwise the Work fails.  After a failure every
        operation fails at once (during backward: completes unchanged) until the group re-forms."""
        if self._closed:
            raise RuntimeError("the dblp process group is closed")
        outputs = tensors if outputs is None else outputs
        bw = self._backward()
        if gradient and bw is not None:
            bw.outputs.extend(outputs)
        staged = [self._down(t) for t in tensors]

        def job(col):
            try:
                if self._failure is not None:
                    raise CollectiveError(f"an earlier round failed: {self._failure}")
                for (host, ev), t, out in zip(staged, tensors, outputs):
                    if ev is not None:
                        ev.synchronize()
                    res = fn(col, t, host)
                    if write:
                        self._write(res, out)
                    if ev is not None:
                        self._staging.release(host)
            except CollectiveError as e:
                if self._failure is None:
                    self._failure = e
                    log.error("dblp: %s", e)
                    if not self.options.survive:  # failed for good: no more rounds to say HELLO for
                        col.hello = False
                if bw is None:
                    raise
            return list(outputs)

        return _Work(self.state.submit(job))

    def _down(self, t: torch.Tensor):
        """``t``'s values where the transport thread can read them: ``(cpu tensor, event)``."""
        if t.device.type == "cuda":
            if self._staging is None:
                self._staging = _Staging()
            host, ev = self._staging.down(t)
            return host.view(t.dtype), ev
        if t.device.type != "cpu":
            raise ValueError(f"dblp: tensors on {t.device.type} are not supported: use cpu or cuda tensors")
        return t.detach().reshape(-1).contiguous(), None

    def _write(self, res, out: torch.Tensor) -> None:
        """Put a round's result into ``out``: an array or tensor, or ``(mean, scale)`` for a sum
        (scaled as it is copied: no pass of its own)."""
        res, scale = res if isinstance(res, tuple) else (res, 1)
        res = (torch.from_numpy(res) if isinstance(res, np.ndarray) else res).reshape(out.shape)
        if out.device.type == "cuda":
            self._staging.up(res * scale if scale != 1 else res, out)
            return
        with torch.no_grad():
            if scale == 1:
                out.copy_(res)
            elif res.dtype == out.dtype:
                torch.mul(res, scale, out=out)
            else:
                out.copy_(res).mul_(scale)


def _op(opts):
    op = getattr(opts, "reduceOp", _R.SUM)
    op = getattr(op, "op", op)  # a ReduceOp wraps its RedOpType
    return op


def _root(opts) -> int:
    return getattr(opts, "rootRank", 0)


def _check_reduce(t: torch.Tensor, op) -> None:
    """Raise ValueError for a reduction the backend cannot make exactly or without loss of meaning."""
    if op == _R.AVG:
        if not (t.is_floating_point() or t.is_complex()):
            raise ValueError(f"dblp: ReduceOp.AVG of {t.dtype}: use a floating-point tensor, or SUM and divide")
        return
    if op not in _LOCAL:
        raise ValueError(f"dblp: {op} is not supported: use SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR or BXOR")
    if op in (_R.BAND, _R.BOR, _R.BXOR) and (t.is_floating_point() or t.is_complex()):
        raise ValueError(f"dblp: bitwise {op} of {t.dtype}: use an integer or bool tensor")
    if op in (_R.MIN, _R.MAX) and t.is_complex():
        raise ValueError(f"dblp: {op} of {t.dtype}: complex numbers have no order")


def _create(backend_opts, options) -> ProcessGroupDblp:
    """What torch calls to make a ``dblp`` group (its extended API): ``backend_opts`` holds the
    group's store, rank and size; ``options`` is ``init_process_group``'s / ``new_group``'s
    ``pg_options`` (a :class:`BackendOptions`; None: the environment's).  Raises ValueError (or
    the key's ``KeyLoadError``) in one line before anything is opened."""
    if options is not None and not isinstance(options, BackendOptions):
        raise ValueError(f"pg_options {type(options).__name__}: give pydblp.torch.BackendOptions(...) for 'dblp'")
    options = options if options is not None else BackendOptions.from_env()
    options.check()
    gid = str(backend_opts.group_id)
    number = int(gid) if gid.isdigit() else 0  # (a hashed group name: the same job, another socket)
    timeout = backend_opts.timeout.total_seconds() if backend_opts.timeout is not None else None
    return ProcessGroupDblp(backend_opts.store, backend_opts.group_rank, backend_opts.group_size, options, number,
                            timeout if timeout and timeout > 0 else None)


_OPEN: "weakref.WeakSet[ProcessGroupDblp]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """A script that exits without ``destroy_process_group`` still closes its groups' threads and
    data planes before the interpreter tears torch down: after its last line, as
    ``destroy_process_group`` does (waiting for every member); after an uncaught exception
    (the interpreter sets ``sys.last_value``), at once: its peers learn of it by their
    ``peer_timeout``, and nothing of this rank's is to be waited for."""
    crashed = getattr(sys, "last_value", None) is not None
    for pg in list(_OPEN):
        pg.close(linger=not crashed)


def register() -> None:
    """Register the ``dblp`` backend with torch.distributed (idempotent; importing
    :mod:`pydblp.torch` does it)."""
    if BACKEND.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
